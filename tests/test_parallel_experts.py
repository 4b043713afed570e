"""The all-to-all: all_to_all / all_to_allv against a direct NumPy permutation, their bytes
against the closed forms (tfcore.parallel.volume) per rank and in total, the adjoint
identities of the mappings, and each bad input refused before anything moves."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import backend
from tfcore.parallel import SimulatedGroup
from tfcore.parallel import mappings
from tfcore.parallel.volume import all_to_all_bytes, collective_bytes

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
