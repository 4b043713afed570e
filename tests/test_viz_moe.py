"""The data behind chapter 24's pictures: the routing and dispatch buffer that
tfcore.viz.moe reads from moe_plan, the all-to-all's send matrix, and that each drawing
function runs on them."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tfcore.viz import moe as vm  # noqa: E402


def _routing(rng, n_tokens, n_experts, top_k, skew=0.0):
    scores = rng.random((n_tokens, n_experts))
    scores[:, 0] += skew
    chosen = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]
    gates = rng.random((n_tokens, top_k))
    return chosen, gates


@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0, 2.0])
def test_routing_data_follows_the_drop_rule(capacity_factor, rng):
    chosen, gates = _routing(rng, 11, 4, 2, skew=0.7)
    data = vm.routing_data(chosen, gates, 4, capacity_factor)
    cap = data["capacity"]
    taken = [0] * 4
    for t in range(11):              # each expert keeps its first C in token order
        for k in range(2):
            e = chosen[t, k]
            assert data["kept"][t, k] == (taken[e] < cap)
            if data["kept"][t, k]:
                assert data["slot"][t, k] == taken[e] and data["buffer"][e, taken[e]] == t
            else:
                assert data["slot"][t, k] == -1 and t in data["overflow"][e]
            taken[e] += 1
    assert list(data["load"]) == taken
    assert (data["buffer"] >= 0).sum() == data["kept"].sum()
    if capacity_factor is None:
        assert cap == max(taken) and not any(data["overflow"].values())


def test_routing_data_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        vm.routing_data(np.zeros((3, 2), int), np.zeros((3, 1)), 4)


@pytest.mark.parametrize("n", [2, 4])
def test_send_matrix_counts_rows_per_rank(n, rng):
    load = rng.integers(0, 6, size=(n, 2 * n))
    load[:, :2] += 20                                   # rank 0's experts: the busiest
    data = vm.send_matrix_data(load, n)
    S = data["S"]
    for i in range(n):
        for j in range(n):
            assert S[i, j] == load[i, 2 * j:2 * j + 2].sum()
    assert list(data["rows"]) == list(S.sum(axis=0))
    assert list(data["received"]) == [S[:, j].sum() - S[j, j] for j in range(n)]
    assert data["busiest"] == 0


def test_every_drawing_runs(rng):
    chosen, gates = _routing(rng, 8, 4, 2, skew=0.5)
    data = vm.routing_data(chosen, gates, 4, 1.0)
    fig, axes = plt.subplots(1, 4)
    vm.draw_routing(axes[0], data)
    vm.draw_dispatch(axes[1], data)
    vm.draw_send_matrix(axes[2], vm.send_matrix_data(rng.integers(0, 5, (2, 4)), 2), "S")
    vm.draw_expert_load(axes[3], rng.integers(0, 9, (10, 4)), "load")
    assert len(axes[0].lines) == 16                     # one line per assignment
    assert axes[3].get_ylim() == (0.0, 1.0)
    with pytest.raises(ValueError, match="steps, N_E"):
        vm.draw_expert_load(axes[3], np.ones(4))
    plt.close(fig)
