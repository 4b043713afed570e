"""Context parallelism, simulated: ring attention equals one device's dense attention
(forward and backward, causal or not, plain or load-balanced layouts, S a multiple of N_C
or not), the causal work per rank equals its closed form, the bytes each rank sends equal
the formula, and a decoder trained with the sequence split over the ranks ends where one
device ends."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import functional as F
from tfcore.models import DecoderConfig
from tfcore.parallel import SimulatedGroup
from tfcore.parallel.context import (
    ContextLayout,
    ContextParallelDecoder,
    merge_partials,
    ring_attention_backward,
    ring_attention_bytes,
    ring_attention_forward,
    ring_work,
    ring_work_formula,
)
from tfcore.parallel.harness import CONFIGS, train_context_parallel, train_single
from tfcore.parallel.volume import collective_bytes

TOL = 1e-12


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


def run_ring(n, seq, balanced, causal, batch=2, heads=3, d_h=4, block_size=3, seed=0):
    """Ring attention on n simulated ranks -> (out, dq, dk, dv unsharded, the dense
    reference's four, the group, the logs)."""
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((batch, heads, seq, d_h)) for _ in range(4))
    ref, cache = F.attention_forward(q, k, v, causal=causal)
    dense = (ref, *F.attention_backward(g, cache))
    layout = ContextLayout(seq, n, balanced)
    logs = [[] for _ in range(n)]

    def body(comm):
        shard = lambda x: layout.shard(x, comm.rank, axis=2)  # noqa: E731
        out, c = ring_attention_forward(shard(q), shard(k), shard(v), comm, layout,
                                        causal=causal, block_size=block_size,
                                        log=logs[comm.rank])
        return (out, *ring_attention_backward(shard(g), c))

    group = SimulatedGroup(n)
    results = group.run(body)
    ring = [layout.unshard([r[i] for r in results], axis=2) for i in range(4)]
    return ring, dense, group, logs, layout


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [16, 19])
def test_ring_attention_equals_dense_attention(n, balanced, causal, seq):
    ring, dense, _, _, _ = run_ring(n, seq, balanced, causal)
    for name, got, want in zip(("out", "dq", "dk", "dv"), ring, dense):
        assert rel(got, want) < TOL, (name, rel(got, want))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("seq", [16, 19])
def test_bytes_sent_equal_the_formula(n, balanced, seq):
    batch, heads, d_h = 2, 3, 4
    _, _, group, _, layout = run_ring(n, seq, balanced, True, batch, heads, d_h)
    formula = ring_attention_bytes(layout, batch, heads, d_h)
    sent = [t.sent for t in group.traffic]
    assert sent == [f + b for f, b in zip(formula["forward"], formula["backward"])]
    assert group.total()["sent"] == sum(sent)
    if seq % n == 0:                       # the closed form with m = S / N_C
        c = seq // n
        assert formula["forward"] == [2 * (n - 1) * batch * heads * c * d_h * 8] * n
        assert formula["backward"] == [4 * (n - 1) * batch * heads * c * d_h * 8] * n
    # the forward alone moves what an all-gather of K and V moves, the backward what an
    # all-reduce moves (volume.py's ring formulas, with chunks c_r)
    if seq % n == 0:
        M = seq * batch * heads * 2 * d_h
        assert formula["forward"] == collective_bytes("all_gather", "ring", M, n)["sent"]
        assert formula["backward"] == [
            f + a for f, a in zip(formula["forward"],
                                  collective_bytes("reduce_scatter", "ring", M, n)["sent"])]


def test_forward_bytes_alone():
    n, seq, batch, heads, d_h = 3, 12, 1, 2, 4
    layout = ContextLayout(seq, n, True)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((batch, heads, seq, d_h))

    def body(comm):
        x = layout.shard(q, comm.rank, axis=2)
        ring_attention_forward(x, x, x, comm, layout, causal=True)

    group = SimulatedGroup(n)
    group.run(body)
    assert [t.sent for t in group.traffic] == ring_attention_bytes(layout, batch, heads,
                                                                   d_h)["forward"]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_causal_work_per_rank(n):
    seq = 8 * n
    for balanced in (False, True):
        layout = ContextLayout(seq, n, balanced)
        counted = ring_work(layout, causal=True)
        assert counted == ring_work_formula(seq, n, balanced)
        _, _, _, logs, _ = run_ring(n, seq, balanced, True, block_size=seq)
        from_run = [sum(rows * cols for step in log for _, _, kind, rows, cols in step["pairs"]
                        if kind != "skip") for log in logs]
        assert from_run == counted
    plain = ring_work(ContextLayout(seq, n, False))
    balanced = ring_work(ContextLayout(seq, n, True))
    assert max(plain) / (sum(plain) / n) == pytest.approx(2 * n / (n + 1), rel=1e-15)
    assert max(balanced) == min(balanced)
    assert ring_work(ContextLayout(seq, n, False), causal=False) == [seq * seq // n] * n


def test_balanced_layout_holds_mirrored_chunks():
    layout = ContextLayout(19, 3, balanced=True)
    assert [layout.chunks_of(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert sorted(np.concatenate([layout.positions(r) for r in range(3)])) == list(range(19))
    x = np.arange(2 * 19).reshape(2, 19)
    pieces = [layout.shard(x, r) for r in range(3)]
    assert np.array_equal(layout.unshard(pieces), x)
    assert [p.shape[1] for p in pieces] == [layout.local_len(r) for r in range(3)]


def test_merge_partials_is_the_softmax_of_the_union():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((1, 1, 3, 7)) * 4
    v = rng.standard_normal((1, 1, 7, 2))

    def summary(cols):
        zz = z[..., cols]
        lse = np.log(np.exp(zz).sum(-1))
        return np.exp(zz - lse[..., None]) @ v[:, :, cols], lse

    out, lse = merge_partials(*summary(slice(0, 3)), *summary(slice(3, 7)))
    whole_out, whole_lse = summary(slice(0, 7))
    assert rel(out, whole_out) < TOL and rel(lse, whole_lse) < TOL


@pytest.mark.parametrize("name,n,balanced", [("tiny", 2, True), ("tiny", 3, False),
                                             ("tiny-llama", 4, True)])
def test_decoder_equals_one_device_after_adamw_steps(name, n, balanced):
    config = CONFIGS[name]()
    steps, batch, seq = 3, 2, 13 if n < 4 else 16
    ref = train_single(config, steps, batch, seq)
    group = SimulatedGroup(n)
    results = group.run(train_context_parallel, config, steps, batch, seq, balanced=balanced)
    for res in results:
        assert rel(res["losses"], ref["losses"]) < TOL
        assert rel(res["grads"], ref["grads"]) < TOL
        assert rel(res["params"], ref["params"]) < TOL
    # bytes: per layer one ring attention forward and backward; per step the loss's two
    # numbers and the gradient buffer, each a ring all-reduce
    layout = ContextLayout(seq, n, balanced)
    ring = ring_attention_bytes(layout, batch, config.n_heads, config.head_dim)
    P = results[0]["params"].size
    for r, t in enumerate(group.traffic):
        per_step = (config.n_layers * (ring["forward"][r] + ring["backward"][r])
                    + collective_bytes("all_reduce", "ring", 2, n)["sent"][r]
                    + collective_bytes("all_reduce", "ring", P, n)["sent"][r])
        assert t.sent == steps * per_step


def test_decoder_positions_are_global():
    """Post-norm with the sinusoidal table and an untied head: positions enter as the
    table's rows of each chunk's global positions."""
    config = DecoderConfig(vocab_size=31, max_seq_len=16, d_model=16, n_layers=1, n_heads=4,
                           d_ff=32, norm_placement="post", position="sinusoidal",
                           tied_head=False)
    ref = train_single(config, 2, 2, 11)
    res = SimulatedGroup(2).run(train_context_parallel, config, 2, 2, 11, balanced=True)[0]
    assert rel(res["params"], ref["params"]) < TOL


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="seq_len .5. must be at least the number of chunks"):
        ContextLayout(5, 3, balanced=True)
    with pytest.raises(ValueError, match="size must be"):
        ContextLayout(8, 0)
    with pytest.raises(ValueError, match="divisible by 6"):
        ring_work_formula(13, 3, True)
    layout = ContextLayout(12, 2)
    x = np.zeros((1, 2, 5, 4))

    def wrong_rows(comm):
        ring_attention_forward(x, x, x, comm, layout)

    with pytest.raises(ValueError, match="q must have shape"):
        SimulatedGroup(2).run(wrong_rows)

    def wrong_kv_heads(comm):
        y = np.zeros((1, 3, 6, 4))
        ring_attention_forward(y, np.zeros((1, 2, 6, 4)), y, comm, layout)

    with pytest.raises(ValueError, match="k must have a number of heads dividing q's 3"):
        SimulatedGroup(2).run(wrong_kv_heads)

    def wrong_group(comm):
        ring_attention_forward(x, x, x, comm, ContextLayout(12, 3))

    with pytest.raises(ValueError, match="layout is for 3 ranks but the group has 2"):
        SimulatedGroup(2).run(wrong_group)

    def wrong_upstream(comm):
        y = np.zeros((1, 2, 6, 4))
        out, cache = ring_attention_forward(y, y, y, comm, layout)
        ring_attention_backward(np.zeros((1, 2, 6, 3)), cache)

    with pytest.raises(ValueError, match="dout"):
        SimulatedGroup(2).run(wrong_upstream)
    config = CONFIGS["tiny"]()
    config.dropout = 0.1
    with pytest.raises(ValueError, match="context parallelism with dropout on dense "
                                         "attention .cp=1, dropout=0.1, "
                                         "attention='dense'.: ring attention is the tiled"):
        SimulatedGroup(1).run(lambda comm: ContextParallelDecoder(config, comm))
    config = CONFIGS["tiny"]()
    config.recompute = "selective"
    with pytest.raises(ValueError, match="context parallelism with selective recomputation "
                                         ".cp=1, recompute='selective'.: ring attention "
                                         "keeps no"):
        SimulatedGroup(1).run(lambda comm: ContextParallelDecoder(config, comm))


def test_recorded_rotation_and_its_pictures():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tfcore.viz.parallel import draw_causal_tiles, draw_ring_rotation, ring_rotation_data

    for balanced in (False, True):
        data = ring_rotation_data(3, 12, balanced)
        assert data["error"] < TOL
        assert data["owner"].tolist() == [[(r - t) % 3 for t in range(3)] for r in range(3)]
        assert data["work"] == ring_work(data["layout"])
        assert data["sent"] == ring_attention_bytes(data["layout"], 1, 1, 2)["forward"]
        fig, axes = plt.subplots(1, 2)
        draw_ring_rotation(axes[0], data)
        draw_causal_tiles(axes[1], data)
        assert len(axes[0].patches) >= 9 and len(axes[1].patches) == 9 * (4 if balanced
                                                                          else 1)
        plt.close(fig)


@pytest.mark.parametrize("n,balanced", [(2, True), (3, False), (4, True)])
def test_grouped_query_heads_travel_as_they_are_stored(n, balanced):
    """k, v with H_kv = H / 3 heads: the ring moves H_kv heads (a third of the bytes) and
    equals dense attention on the repeated heads, the gradients summed over each group."""
    from tfcore.models.blocks import repeat_kv_heads, sum_kv_groups

    batch, heads, kv_heads, seq, d_h = 2, 6, 2, 17, 4
    rng = np.random.default_rng(3)
    q, g = (rng.standard_normal((batch, heads, seq, d_h)) for _ in range(2))
    k, v = (rng.standard_normal((batch, kv_heads, seq, d_h)) for _ in range(2))
    ref, cache = F.attention_forward(q, repeat_kv_heads(k, 3), repeat_kv_heads(v, 3),
                                     causal=True)
    dq, dk, dv = F.attention_backward(g, cache)
    dense = (ref, dq, sum_kv_groups(dk, 3), sum_kv_groups(dv, 3))
    layout = ContextLayout(seq, n, balanced)

    def body(comm):
        shard = lambda x: layout.shard(x, comm.rank, axis=2)  # noqa: E731
        out, c = ring_attention_forward(shard(q), shard(k), shard(v), comm, layout,
                                        causal=True, block_size=4)
        return (out, *ring_attention_backward(shard(g), c))

    group = SimulatedGroup(n)
    results = group.run(body)
    for i, want in enumerate(dense):
        assert rel(layout.unshard([r[i] for r in results], axis=2), want) < TOL
    formula = ring_attention_bytes(layout, batch, kv_heads, d_h)
    assert [t.sent for t in group.traffic] == [f + b for f, b in zip(formula["forward"],
                                                                     formula["backward"])]
    full_heads = ring_attention_bytes(layout, batch, heads, d_h)
    assert [3 * f for f in formula["forward"]] == full_heads["forward"]


def test_grouped_query_decoder_equals_one_device():
    config = DecoderConfig.llama(vocab_size=29, max_seq_len=16, d_model=24, n_layers=2,
                                 n_heads=6, d_ff=32, n_kv_heads=2, dtype="float64")
    ref = train_single(config, 3, 2, 14)
    for res in SimulatedGroup(3).run(train_context_parallel, config, 3, 2, 14,
                                     balanced=True):
        assert rel(res["params"], ref["params"]) < TOL
        assert rel(res["grads"], ref["grads"]) < TOL
