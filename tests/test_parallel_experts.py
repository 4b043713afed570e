"""The all-to-all and expert parallelism: all_to_all / all_to_allv against a direct NumPy
permutation, their bytes against the closed forms (tfcore.parallel.volume) per rank and in
total, the adjoint identities of the mappings and of the expert-parallel dispatch and
combine, the expert-parallel MoE layer against one device's MoE ops (float64, 1e-12), and
each bad input refused before anything moves."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore import backend
from tfcore.functional import moe as M
from tfcore.parallel import SimulatedGroup
from tfcore.parallel import experts as EP
from tfcore.parallel import mappings
from tfcore.parallel.volume import (
    all_to_all_bytes,
    collective_bytes,
    expert_parallel_bytes,
    expert_send_counts,
)

ALGORITHMS = ["ring", "naive"]


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = np.max(np.abs(b)) if b.size else 0.0
    return float(np.max(np.abs(a - b)) / scale) if scale else float(np.max(np.abs(a), initial=0))


def _counts(rng, n, high=5, skew=None):
    """S[i][j] rows from rank i to rank j (zeros included); skew: rank that gets most."""
    S = rng.integers(0, high, size=(n, n))
    S[rng.random((n, n)) < 0.2] = 0
    if skew is not None:
        S[:, skew] += 4 * high
    return S


def _expected_all_to_allv(xs, S):
    """What rank j must hold: the block each rank i addressed to j, in rank order."""
    n = len(xs)
    offsets = [np.concatenate([[0], np.cumsum(S[i])]) for i in range(n)]
    return [np.concatenate([xs[i][offsets[i][j]:offsets[i][j + 1]] for i in range(n)])
            for j in range(n)]


# ---------------------------------------------------------------------------------------
# The collectives


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_to_allv_is_the_permutation_it_says(backend_name, algorithm, n, rng):
    S = _counts(rng, n)
    xs = [rng.standard_normal((int(S[i].sum()), 3, 2)) for i in range(n)]

    def body(comm):
        x = backend.asarray(xs[comm.rank])
        return backend.to_numpy(comm.all_to_allv(x, S[comm.rank], S[:, comm.rank]))

    for got, want in zip(SimulatedGroup(n, algorithm).run(body), _expected_all_to_allv(xs, S)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("split_axis,concat_axis", [(0, 0), (0, 1), (1, 0), (2, 1), (-1, -2)])
def test_all_to_all_is_the_permutation_it_says(backend_name, algorithm, n, split_axis,
                                               concat_axis, rng):
    shape = (2 * n, 3 * n, n)
    xs = [rng.standard_normal(shape) for _ in range(n)]

    def body(comm):
        x = backend.asarray(xs[comm.rank])
        return backend.to_numpy(comm.all_to_all(x, split_axis, concat_axis))

    out = SimulatedGroup(n, algorithm).run(body)
    for j in range(n):   # block j of every rank, concatenated in rank order
        want = np.concatenate([np.array_split(xs[i], n, axis=split_axis)[j] for i in range(n)],
                              axis=concat_axis)
        np.testing.assert_array_equal(out[j], want)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("skew", [None, 0, 2])
def test_all_to_allv_bytes_equal_the_formula(algorithm, n, skew, rng):
    """Per rank (sent and received), per link and in total; a skewed count matrix makes one
    rank receive most of the rows, and the formula says how much."""
    skew = None if skew is None else skew % n
    S = _counts(rng, n, skew=skew)
    row = (3, 2)
    xs = [rng.standard_normal((int(S[i].sum()),) + row) for i in range(n)]
    group = SimulatedGroup(n, algorithm)
    group.run(lambda c: c.all_to_allv(xs[c.rank], S[c.rank], S[:, c.rank]))
    want = all_to_all_bytes(S, row_elements=6, itemsize=8)
    assert [t.sent for t in group.traffic] == want["sent"]
    assert [t.received for t in group.traffic] == want["received"]
    assert group.total()["sent"] == want["total"] == 48 * int(S.sum() - np.trace(S))
    links = {(i, j): 48 * int(S[i, j]) for i in range(n) for j in range(n)
             if i != j and S[i, j]}
    assert group.total()["links"] == links
    for t in group.traffic:     # one record, the pairwise schedule, a message per non-empty block
        (record,) = t.calls
        assert (record.op, record.algorithm) == ("all_to_allv", "pairwise")
        assert record.sent == t.sent and record.received == t.received
    assert [t.calls[0].messages for t in group.traffic] == [
        int(np.count_nonzero(np.delete(S[i], i))) for i in range(n)]
    if skew is not None:
        busiest = int(np.argmax(want["received"]))
        assert busiest == skew
        assert want["received"][skew] == 48 * int(S[:, skew].sum() - S[skew, skew])
        assert want["received"][skew] > max(want["received"][j] for j in range(n) if j != skew)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("M", [12, 60])
def test_even_all_to_all_bytes(n, M, rng):
    """M elements a rank in N equal blocks: (N-1)/N M b per rank, (N-1) M b in total, half a
    ring all-reduce of the same tensor per rank."""
    size = M * n
    xs = [rng.standard_normal(size) for _ in range(n)]
    group = SimulatedGroup(n)
    group.run(lambda c: c.all_to_all(xs[c.rank]))
    per_rank = (n - 1) * M * 8                      # (N-1)/N of the N M elements, 8 bytes
    assert [t.sent for t in group.traffic] == [per_rank] * n
    assert [t.received for t in group.traffic] == [per_rank] * n
    assert group.total()["sent"] == (n - 1) * size * 8
    ring = collective_bytes("all_reduce", "ring", size, n)["sent"]
    assert [2 * per_rank] * n == ring


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_mappings_are_adjoint_pairs(n, rng):
    """<A x, y> = <x, A* y> summed over the ranks, for all_to_all with its axes swapped and
    all_to_allv with its counts transposed; and A* A = identity (a permutation)."""
    S = _counts(rng, n)
    xs = [rng.standard_normal((int(S[i].sum()), 4)) for i in range(n)]
    ys = [rng.standard_normal((int(S[:, j].sum()), 4)) for j in range(n)]
    shape = (3, 2 * n, 5)
    us = [rng.standard_normal(shape) for _ in range(n)]
    vs = [rng.standard_normal((3, 2, 5 * n)) for _ in range(n)]

    def body(comm):
        r = comm.rank
        ax, cache = mappings.all_to_allv_forward(xs[r], comm, S[r], S[:, r])
        aty = mappings.all_to_allv_backward(ys[r], cache)
        back = mappings.all_to_allv_backward(ax, cache)
        au, cache2 = mappings.all_to_all_forward(us[r], comm, split_axis=1, concat_axis=2)
        atv = mappings.all_to_all_backward(vs[r], cache2)
        return (np.vdot(ax, ys[r]), np.vdot(xs[r], aty), back,
                np.vdot(au, vs[r]), np.vdot(us[r], atv), mappings.all_to_all_backward(au, cache2))

    out = SimulatedGroup(n).run(body)
    lhs, rhs = sum(o[0] for o in out), sum(o[1] for o in out)
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0)
    lhs, rhs = sum(o[3] for o in out), sum(o[4] for o in out)
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0)
    for r, o in enumerate(out):
        np.testing.assert_array_equal(o[2], xs[r])
        np.testing.assert_array_equal(o[5], us[r])


# ---------------------------------------------------------------------------------------
# Bad input: a clear error on every rank, before any byte moves


def _refused(n, body, error=ValueError, match=None, **kwargs):
    group = SimulatedGroup(n, timeout=5, **kwargs)
    with pytest.raises(error, match=match) as caught:
        group.run(body)
    assert [t.sent for t in group.traffic] == [0] * n, "bytes moved before the refusal"
    return str(caught.value)


def test_mismatched_counts_are_refused_on_every_rank():
    S = np.array([[1, 2, 0], [0, 1, 3], [2, 2, 1]])

    def body(comm):
        recv = S[:, comm.rank].copy()
        if comm.rank == 1:
            recv[0] += 1              # rank 1 expects 3 rows from rank 0, which sends 2
        try:
            comm.all_to_allv(np.ones((int(S[comm.rank].sum()), 2)), S[comm.rank], recv)
        except ValueError as err:
            return str(err)

    group = SimulatedGroup(3)
    messages = group.run(body)
    assert len(set(messages)) == 1 and messages[0] is not None
    assert ("group rank 0 sends 2 rows to group rank 1, which expects 3 rows from it"
            in messages[0])
    assert [t.sent for t in group.traffic] == [0] * 3, "bytes moved before the refusal"


def test_mismatched_counts_without_the_call_check_fail_instead_of_hanging():
    """With check_calls off the message sizes still disagree: an error, not a wait."""
    def body(comm):
        recv = [2, 2] if comm.rank == 0 else [1, 2]
        comm.all_to_allv(np.ones((4, 2)), [2, 2], recv)

    with pytest.raises(RuntimeError, match="expected 2 elements|expected 4 elements"):
        SimulatedGroup(2, check_calls=False, timeout=5).run(body)


@pytest.mark.parametrize("body,match", [
    (lambda c: c.all_to_allv(np.ones((3, 2)), [1, 1], [1, 1]),
     r"send_counts \[1, 1\] add up to 2 rows, but x has 3 rows"),
    (lambda c: c.all_to_allv(np.ones((2, 2)), [1, 1, 0], [1, 1]),
     "send_counts must be 2 non-negative integers"),
    (lambda c: c.all_to_allv(np.ones((2, 2)), [1, 1], [2, -1]),
     "recv_counts must be 2 non-negative integers"),
    (lambda c: c.all_to_allv(np.ones((2, 2)), [1.0, 1.0], [1, 1]),
     "send_counts must be 2 non-negative integers"),
    (lambda c: c.all_to_allv(np.ones(()), [0, 0], [0, 0]), "at least one axis"),
    (lambda c: c.all_to_all(np.ones((3, 2))), "size 3 along split_axis 0 must be a multiple"),
    (lambda c: c.all_to_all(np.ones((2, 2)), split_axis=2), "split_axis must be an axis"),
    (lambda c: c.all_to_allv(np.ones((2, 2 + c.rank)), [1, 1], [1, 1]),
     r"called different collectives.*all_to_allv\(rows of shape \(2,\), float64\).*"
     r"all_to_allv\(rows of shape \(3,\), float64\)"),
    (lambda c: c.all_to_allv(np.ones((2, 2), dtype="float32" if c.rank else "float64"),
                             [1, 1], [1, 1]), "called different collectives"),
    (lambda c: c.all_to_all(np.ones((2, 2)), concat_axis=c.rank),
     r"all_to_all\(shape \(2, 2\), float64, axes split 0, concat 0\).*"
     r"all_to_all\(shape \(2, 2\), float64, axes split 0, concat 1\)"),
    (lambda c: c.all_to_all(np.ones((2, 2))) if c.rank else c.all_reduce(np.ones((2, 2))),
     "called different collectives"),
])
def test_bad_all_to_all_calls_are_refused(body, match):
    _refused(2, body, match=match)


# ---------------------------------------------------------------------------------------
# Expert parallelism: the dispatch and combine


def _routing(rng, n_tokens, n_experts, top_k, skew=None):
    """Each rank's selection [T_r, K] (distinct experts per row); skew: an expert list that
    most tokens choose first."""
    out = []
    for t in n_tokens:
        scores = rng.random((t, n_experts))
        if skew is not None:
            scores[:, skew] += 1.0 + 0.1 * rng.random((t, len(skew)))
        out.append(np.argsort(-scores, axis=1, kind="stable")[:, :top_k].astype(np.int64))
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_dispatch_and_combine_are_adjoint(n, capacity_factor, rng):
    """<dispatch x, y> = <x, combine y> (gates 1) summed over ranks, and the backward of
    each is the other: dispatch_backward(y) = combine(y, 1), combine_backward(dy) gives
    dye = dispatch(dy) on its gate-one part."""
    n_experts, top_k, width = 2 * n, 2, 3
    n_tokens = [int(t) for t in rng.integers(0, 7, size=n)]
    chosen = _routing(rng, n_tokens, n_experts, top_k)
    xs = [rng.standard_normal((t, width)) for t in n_tokens]

    def body(comm):
        r = comm.rank
        plan = EP.ep_plan(chosen[r], comm, n_experts, capacity_factor)
        ys = np.random.default_rng(r).standard_normal((plan.n_local, plan.capacity, width))
        xe, c_d = EP.ep_dispatch_forward(xs[r], plan)
        ones = np.ones((n_tokens[r], top_k))
        cy, c_c = EP.ep_combine_forward(ys, ones, plan)
        dx = EP.ep_dispatch_backward(ys, c_d)
        dye, dgates = EP.ep_combine_backward(xs[r], c_c)
        return np.vdot(xe, ys), np.vdot(xs[r], cy), cy, dx, dye, xe

    out = SimulatedGroup(n).run(body)
    lhs, rhs = sum(o[0] for o in out), sum(o[1] for o in out)
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0)
    for o in out:
        np.testing.assert_array_equal(o[3], o[2])      # dispatch* = combine with gates 1
        np.testing.assert_array_equal(o[4], o[5])      # combine* (gates 1) = dispatch


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("capacity_factor", [None, 0.5, 1.0])
def test_dispatch_holds_the_one_devices_rows(n, capacity_factor, rng):
    """Rank j's expert buffer is rows j E_l .. (j+1) E_l - 1 of one device's, bit for bit,
    with its capacity and drops (first C in global token order)."""
    n_experts, top_k, width = 4 * n, 3, 5
    n_tokens = [int(t) for t in rng.integers(1, 9, size=n)]
    chosen = _routing(rng, n_tokens, n_experts, top_k, skew=[1, 2])
    xs = [rng.standard_normal((t, width)) for t in n_tokens]
    plan = M.moe_plan(np.concatenate(chosen), n_experts, capacity_factor)
    xe_one, _ = M.moe_dispatch_forward(np.concatenate(xs), plan)

    def body(comm):
        p = EP.ep_plan(chosen[comm.rank], comm, n_experts, capacity_factor)
        return EP.ep_dispatch_forward(xs[comm.rank], p)[0], p

    out = SimulatedGroup(n).run(body)
    n_local = n_experts // n
    for j, (xe, p) in enumerate(out):
        assert p.capacity == plan.capacity
        np.testing.assert_array_equal(xe, xe_one[j * n_local:(j + 1) * n_local])
        np.testing.assert_array_equal(p.kept.sum(axis=0), np.asarray(plan.kept_load))
        np.testing.assert_array_equal(p.load.sum(axis=0), np.asarray(plan.load))


# ---------------------------------------------------------------------------------------
# The expert-parallel MoE layer against one device


def _weights(rng, n_experts, width, hidden, activation, bias):
    W = dict(W_fc=rng.standard_normal((n_experts, width, hidden)) / np.sqrt(width),
             W_proj=rng.standard_normal((n_experts, hidden, width)) / np.sqrt(hidden))
    if activation == "swiglu":
        W["W_gate"] = rng.standard_normal((n_experts, width, hidden)) / np.sqrt(width)
    if bias:
        W["b_fc"] = 0.1 * rng.standard_normal((n_experts, hidden))
        W["b_proj"] = 0.1 * rng.standard_normal((n_experts, width))
        if activation == "swiglu":
            W["b_gate"] = 0.1 * rng.standard_normal((n_experts, hidden))
    return W


def _one_device(x, dy, W_router, W, top_k, score, bias, capacity_factor, activation):
    """The single-device MoE ops on all ranks' tokens: y and every gradient."""
    z = x @ W_router
    routed, c_router = M.router_forward(z, top_k, score, None, bias)
    plan = M.moe_plan(routed.experts, W_router.shape[1], capacity_factor)
    xe, c_d = M.moe_dispatch_forward(x, plan)
    ye, c_e = M.expert_mlp_forward(xe, W["W_fc"], W.get("b_fc"), W["W_proj"], W.get("b_proj"),
                                   activation, W.get("W_gate"), W.get("b_gate"))
    y, c_c = M.moe_combine_forward(ye, routed.gates, plan)
    dye, dgates = M.moe_combine_backward(dy, c_c)
    grads = dict(zip(("xe",) + EP.EXPERT_NAMES, M.expert_mlp_backward(dye, c_e)))
    dz = M.router_backward(dgates, c_router)
    grads["x"] = M.moe_dispatch_backward(grads.pop("xe"), c_d) + dz @ W_router.T
    grads["W_router"] = x.T @ dz
    return y, grads, plan


CASES = {   # name: (score, selection bias, capacity factor, activation, expert biases)
    "softmax-gelu-dropless": ("softmax", False, None, "gelu", True),
    "softmax-swiglu-capacity": ("softmax", False, 0.75, "swiglu", False),
    "sigmoid-bias-relu-capacity": ("sigmoid", True, 1.0, "relu", True),
}


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_layer_equals_one_device(ep, case, rng):
    score, use_bias, capacity_factor, activation, expert_bias = CASES[case]
    n_experts, top_k, width, hidden = 8, 2, 6, 5
    n_tokens = [int(t) for t in rng.integers(3, 10, size=ep)]
    n_tokens[-1] = 0 if ep == 4 else n_tokens[-1]          # a rank with no tokens at all
    xs = [rng.standard_normal((t, width)) for t in n_tokens]
    dys = [rng.standard_normal((t, width)) for t in n_tokens]
    W_router = rng.standard_normal((width, n_experts))
    bias = 0.3 * rng.standard_normal(n_experts) if use_bias else None
    W = _weights(rng, n_experts, width, hidden, activation, expert_bias)
    y1, g1, _ = _one_device(np.concatenate(xs), np.concatenate(dys), W_router, W, top_k,
                            score, bias, capacity_factor, activation)
    n_local = n_experts // ep

    def body(comm):
        r = comm.rank
        mine = {k: v[r * n_local:(r + 1) * n_local] for k, v in W.items()}
        y, cache = EP.ep_moe_forward(xs[r], W_router, mine, comm, top_k, score=score,
                                     bias=bias, capacity_factor=capacity_factor,
                                     activation=activation)
        return y, EP.ep_moe_backward(dys[r], cache)

    out = SimulatedGroup(ep).run(body)
    assert _rel(np.concatenate([o[0] for o in out]), y1) < 1e-12
    assert _rel(np.concatenate([o[1]["x"] for o in out]), g1["x"]) < 1e-12
    for o in out:   # the router's gradient, all-reduced: the same on every rank
        assert _rel(o[1]["W_router"], g1["W_router"]) < 1e-12
    names = [k for k in EP.EXPERT_NAMES if g1[k] is not None]
    assert set(names) == set(W)
    for name in names:
        assert _rel(np.concatenate([o[1][name] for o in out]), g1[name]) < 1e-12, name
    for name in set(EP.EXPERT_NAMES) - set(names):
        assert all(o[1][name] is None for o in out)


def test_the_layer_is_written_in_the_array_api(backend_name, rng):
    """The same layer on every backend (array-api-strict keeps the CuPy path honest) equals
    the NumPy run."""
    n_experts, top_k, width, hidden, ep = 4, 2, 4, 3, 2
    xs = [rng.standard_normal((5 + r, width)) for r in range(ep)]
    W_router = rng.standard_normal((width, n_experts))
    W = _weights(rng, n_experts, width, hidden, "swiglu", True)

    def body(comm):
        r, A = comm.rank, backend.asarray
        mine = {k: A(v[r * 2:(r + 1) * 2]) for k, v in W.items()}
        y, cache = EP.ep_moe_forward(A(xs[r]), A(W_router), mine, comm, top_k,
                                     capacity_factor=0.8, activation="swiglu")
        grads = EP.ep_moe_backward(A(np.cos(xs[r])), cache)
        return [backend.to_numpy(a) for a in (y, grads["x"], grads["W_router"],
                                              grads["W_gate"], grads["b_fc"])]

    got = SimulatedGroup(ep).run(body)
    previous = backend.get_backend()
    backend.set_backend("numpy")
    try:
        want = SimulatedGroup(ep).run(body)
    finally:
        backend.set_backend(previous)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert _rel(a, b) < 1e-12


def test_without_the_router_all_reduce_the_router_gradient_is_wrong(rng):
    """The loss (and every other gradient) is right and the router's is a part of it: the
    check catches the missing all-reduce."""
    n_experts, top_k, width, hidden, ep = 4, 2, 4, 3, 2
    xs = [rng.standard_normal((5, width)) for _ in range(ep)]
    dys = [rng.standard_normal((5, width)) for _ in range(ep)]
    W_router = rng.standard_normal((width, n_experts))
    W = _weights(rng, n_experts, width, hidden, "gelu", True)
    y1, g1, _ = _one_device(np.concatenate(xs), np.concatenate(dys), W_router, W, top_k,
                            "softmax", None, None, "gelu")

    def body(comm):
        r = comm.rank
        mine = {k: v[r * 2:(r + 1) * 2] for k, v in W.items()}
        y, cache = EP.ep_moe_forward(xs[r], W_router, mine, comm, top_k)
        return y, EP.ep_moe_backward(dys[r], cache, reduce_router=False)

    out = SimulatedGroup(ep).run(body)
    assert _rel(np.concatenate([o[0] for o in out]), y1) < 1e-12
    assert all(_rel(o[1]["W_router"], g1["W_router"]) > 1e-3 for o in out)
    assert _rel(sum(o[1]["W_router"] for o in out), g1["W_router"]) < 1e-12


def test_expert_parallel_groups_inside_a_larger_world(rng):
    """World of 4, ep = 2: two groups of consecutive ranks, each equal to one device on its
    own tokens (the replicas hold the same experts)."""
    n_experts, top_k, width, hidden, ep = 4, 2, 4, 3, 2
    xs = [rng.standard_normal((4 + r, width)) for r in range(4)]
    dys = [rng.standard_normal((4 + r, width)) for r in range(4)]
    W_router = rng.standard_normal((width, n_experts))
    W = _weights(rng, n_experts, width, hidden, "gelu", False)

    def body(world):
        comm = EP.expert_parallel_group(world, ep)
        r = comm.rank
        mine = {k: v[r * 2:(r + 1) * 2] for k, v in W.items()}
        y, cache = EP.ep_moe_forward(xs[world.rank], W_router, mine, comm, top_k)
        return comm.ranks, y, EP.ep_moe_backward(dys[world.rank], cache)

    out = SimulatedGroup(4).run(body)
    for members in ((0, 1), (2, 3)):
        assert all(out[w][0] == members for w in members)
        y1, g1, _ = _one_device(np.concatenate([xs[w] for w in members]),
                                np.concatenate([dys[w] for w in members]), W_router, W,
                                top_k, "softmax", None, None, "gelu")
        assert _rel(np.concatenate([out[w][1] for w in members]), y1) < 1e-12
        assert _rel(np.concatenate([out[w][2]["W_fc"] for w in members]), g1["W_fc"]) < 1e-12
        assert _rel(out[members[0]][2]["W_router"], g1["W_router"]) < 1e-12


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_expert_parallel_bytes_equal_the_formula(ep, skewed, algorithm, rng):
    """A layer's forward and backward: every rank's bytes (sent and received, by collective)
    and the total equal volume.expert_parallel_bytes of the gathered load plus the router's
    all-reduce; under a skewed router the busiest rank is named, with its rows and bytes."""
    n_experts, top_k, width, hidden = 8, 2, 6, 4
    n_tokens = [16] * ep
    xs = [rng.standard_normal((t, width)) for t in n_tokens]
    W_router = rng.standard_normal((width, n_experts))
    W = _weights(rng, n_experts, width, hidden, "gelu", True)
    # skewed: a selection bias makes experts 0 and 1 (rank 0's) every token's two choices
    bias = np.array([50.0, 50.0] + [0.0] * (n_experts - 2)) if skewed else None
    n_local = n_experts // ep
    group = SimulatedGroup(ep, algorithm)

    def body(comm):
        r = comm.rank
        mine = {k: v[r * n_local:(r + 1) * n_local] for k, v in W.items()}
        score = "sigmoid" if skewed else "softmax"
        y, cache = EP.ep_moe_forward(xs[r], W_router, mine, comm, top_k, score=score,
                                     bias=bias)
        EP.ep_moe_backward(np.ones_like(y), cache)
        return cache.plan.load

    load = group.run(body)[0]
    want = expert_parallel_bytes(load, ep, width, 8, algorithm)
    router = collective_bytes("all_reduce", algorithm, width * n_experts, ep)
    for key in ("sent", "received"):
        got = [getattr(t, key) for t in group.traffic]
        assert got == [a + b for a, b in zip(want["step"][key], router[key])]
    assert group.total()["sent"] == want["step"]["total"] + router["total"]
    for r, t in enumerate(group.traffic):   # by collective, in call order
        ops = [(c.op, c.sent) for c in t.calls]
        assert ops == [("all_gather", want["counts"]["sent"][r]),
                       ("all_to_allv", want["dispatch"]["sent"][r]),
                       ("all_to_allv", want["combine"]["sent"][r]),
                       ("all_to_allv", want["dispatch"]["sent"][r]),   # combine's adjoint
                       ("all_to_allv", want["combine"]["sent"][r]),    # dispatch's adjoint
                       ("all_reduce", router["sent"][r])]
    S = np.array(expert_send_counts(load, ep))
    assert S.sum() == sum(n_tokens) * top_k                      # dropless: every assignment
    if skewed:
        assert want["busiest"] == 0
        assert want["rows"][0] == sum(n_tokens) * top_k         # both choices on rank 0
        assert want["dispatch"]["received"][0] == (sum(n_tokens) - n_tokens[0]) * top_k * 48
        assert all(rows == 0 for rows in want["rows"][1:])
    else:
        assert max(want["rows"]) < sum(n_tokens) * top_k


# ---------------------------------------------------------------------------------------
# Bad input to the expert-parallel parts


def test_experts_not_divisible_by_the_degree_are_refused():
    chosen = np.zeros((3, 1), dtype=np.int64)
    msg = _refused(4, lambda c: EP.ep_plan(chosen, c, 6),
                   match=r"N_E = 6 must be divisible by the expert-parallel degree 4")
    assert "rank" in msg

    def layer(comm):
        W = dict(W_fc=np.ones((1, 2, 3)), W_proj=np.ones((1, 3, 2)))
        EP.ep_moe_forward(np.ones((3, 2)), np.ones((2, 6)), W, comm, 2)

    _refused(4, layer, match="N_E = 6 must be divisible")


def test_a_degree_that_does_not_divide_the_world_is_refused():
    _refused(4, lambda c: EP.expert_parallel_group(c, 3),
             match=r"expert-parallel degree ep = 3 must divide the number of ranks 4")
    _refused(2, lambda c: EP.expert_parallel_group(c, 0), match="ep must be at least 1")


@pytest.mark.parametrize("body,error,match", [
    (lambda c: EP.ep_plan(np.array([[0, 0]]), c, 4), ValueError, "distinct experts"),
    (lambda c: EP.ep_plan(np.array([[0, 1]])[:, :1 + c.rank], c, 4), ValueError,
     "the number of experts per token K differs across ranks"),
    (lambda c: EP.ep_plan(np.array([[0, 4]]), c, 4), ValueError, r"lie in \[0, 4\)"),
    (lambda c: EP.ep_plan(np.array([[0.0, 1.0]]), c, 4), TypeError, "integer array"),
    (lambda c: EP.ep_plan(np.array([[0, 1]]), c, 4, capacity_factor=0), ValueError,
     "capacity_factor must be positive"),
    (lambda c: EP.ep_moe_forward(np.ones((3, 2)), np.ones((2, 4)),
                                 dict(W_fc=np.ones((4, 2, 3)), W_proj=np.ones((4, 3, 2))),
                                 c, 2), ValueError, r"this rank's experts, got \(4, 2, 3\)"),
    (lambda c: EP.ep_moe_forward(np.ones((3, 2)), np.ones((2, 4)),
                                 dict(W_fc=np.ones((2, 2, 3)), W_proj=np.ones((2, 3, 2))),
                                 c, 5), ValueError, "top_k must be at most"),
    (lambda c: EP.ep_moe_forward(np.ones((3, 2)), np.ones((2, 4)),
                                 dict(W_fc=np.ones((2, 2, 3)), W_proj=np.ones((2, 3, 3))),
                                 c, 2), ValueError, r"experts\['W_proj'\] must have shape"),
    (lambda c: EP.ep_moe_forward(np.ones((3, 2)), np.ones((2, 4)),
                                 dict(W_fc=np.ones((2, 2, 3)), W_proj=np.ones((2, 3, 2))),
                                 c, 2, activation="swiglu"), ValueError, "W_gate"),
    (lambda c: EP.ep_moe_forward(np.ones((3, 2)), np.ones((2, 4)),
                                 dict(W_fc=np.ones((2, 2, 3)), W_up=np.ones((2, 3, 2))),
                                 c, 2), ValueError, "experts must hold W_fc and W_proj"),
])
def test_bad_expert_parallel_input_is_refused_before_anything_moves(body, error, match):
    _refused(2, body, error, match=match)


def test_a_plan_from_another_routing_is_refused(rng):
    def body(comm):
        plan = EP.ep_plan(np.array([[0, 1], [2, 3]]), comm, 4)
        with pytest.raises(ValueError, match=r"x must have shape \(2, 3\)"):
            EP.ep_dispatch_forward(np.ones((3, 3)), plan)
        xe, cache = EP.ep_dispatch_forward(np.ones((2, 3)), plan)
        with pytest.raises(ValueError, match="dxe must have shape"):
            EP.ep_dispatch_backward(np.ones((2, plan.capacity + 1, 3)), cache)
        with pytest.raises(TypeError, match="plan must be an EPPlan"):
            EP.ep_combine_forward(xe, np.ones((2, 2)), M.moe_plan(np.array([[0, 1]]), 4))
        return True

    assert SimulatedGroup(2).run(body) == [True, True]


# ---------------------------------------------------------------------------------------
# Real processes: `mpiexec -n 4` (tests/mpi_experts.py)

MPI_SCRIPT = Path(__file__).with_name("mpi_experts.py")
sys.path.insert(0, str(MPI_SCRIPT.parent))
import mpi_experts  # noqa: E402

from mpi_tools import needs_mpi, run_mpi  # noqa: E402

MPI_TIMEOUT = 90      # seconds for one mpiexec (a healthy run takes a few)


def _mpiexec(*args):
    return run_mpi(4, MPI_SCRIPT, args, MPI_TIMEOUT)


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("experts") / "runs.npz"
    done = _mpiexec(str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "expert-parallel runs: all_to_allv, ep 4, ep 2" in done.stdout
    return np.load(out)


@needs_mpi
def test_mpi_all_to_allv_is_the_permutation_and_moves_the_counted_bytes(mpi_run):
    S = mpi_experts.counts()
    xs = [mpi_experts.rows(r) for r in range(4)]
    want = _expected_all_to_allv(xs, S)
    group = SimulatedGroup(4)
    group.run(mpi_experts.collectives)
    formula = all_to_all_bytes(S, row_elements=3)
    for r in range(4):
        np.testing.assert_array_equal(mpi_run[f"a2av_{r}"], want[r])
        np.testing.assert_array_equal(mpi_run[f"a2av_native_{r}"], want[r])
        assert mpi_run[f"a2av_bytes_{r}"].tolist() == [formula["sent"][r],
                                                       formula["received"][r]]
        assert [group.traffic[r].sent, group.traffic[r].received] == [
            formula["sent"][r], formula["received"][r]]


@needs_mpi
@pytest.mark.parametrize("ep", [4, 2])
def test_mpi_expert_parallel_layer_equals_one_device_and_the_simulation(mpi_run, ep):
    xs, dys, W_router, W = mpi_experts.layer_inputs()
    group = SimulatedGroup(4)
    sim = group.run(mpi_experts.layer, ep)
    n_local = mpi_experts.N_EXPERTS // ep
    for members in [tuple(range(g, g + ep)) for g in range(0, 4, ep)]:
        y1, g1, _ = _one_device(np.concatenate([xs[w] for w in members]),
                                np.concatenate([dys[w] for w in members]), W_router, W,
                                mpi_experts.TOP_K, "softmax", None, 1.0, "gelu")
        got = lambda key: np.concatenate([mpi_run[f"ep{ep}_{key}_{w}"]  # noqa: E731
                                          for w in members])
        assert _rel(got("y"), y1) < 1e-12
        assert _rel(got("dx"), g1["x"]) < 1e-12
        for name in W:
            assert _rel(got(f"d{name}"), g1[name]) < 1e-12, name
        for w in members:
            assert _rel(mpi_run[f"ep{ep}_dW_router_{w}"], g1["W_router"]) < 1e-12
            assert mpi_run[f"ep{ep}_dW_fc_{w}"].shape[0] == n_local
    for w in range(4):   # the same algorithm moving the same chunks: the same bits and bytes
        for key, value in sim[w].items():
            np.testing.assert_array_equal(mpi_run[f"ep{ep}_{key}_{w}"], value)
        assert mpi_run[f"ep{ep}_bytes_{w}"].tolist() == [group.traffic[w].sent,
                                                         group.traffic[w].received]


@needs_mpi
def test_mpi_mismatched_counts_end_the_job_with_the_message():
    done = _mpiexec("--mismatch")
    assert done.returncode != 0
    assert ("all_to_allv counts do not match in group 'world': group rank 0 sends"
            in done.stderr)
