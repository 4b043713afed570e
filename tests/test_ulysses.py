"""DeepSpeed-Ulysses attention (tfcore.parallel.ulysses): the sequence-sharded forward and
its gradients equal one device's dense attention on the whole sequence (float64, 1e-12)
for N = 1..4 ranks, dense and tiled, causal or not, multi-head, grouped-query (kv heads sent
as stored, or repeated first) and multi-query; the two all-to-alls are adjoint; the bytes
each rank sends equal ulysses_attention_bytes (per rank, per link and in total, and the
ratio to DeepSpeed's 4Nh/P); every bad input is refused before a byte moves; planted
mistakes (a wrong exchange, a wrong kv repeat) fail the check; and real processes under
`mpiexec -n 4` (tests/mpi_ulysses.py) equal the simulation and one device."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore import backend
from tfcore import functional as F
from tfcore.models.blocks import repeat_kv_heads, sum_kv_groups
from tfcore.parallel import SimulatedGroup
from tfcore.parallel import mappings
from tfcore.parallel import ulysses as U
from tfcore.parallel.ulysses import (
    KVHeads,
    ulysses_attention_backward,
    ulysses_attention_bytes,
    ulysses_attention_forward,
    ulysses_kv_heads,
)

TOL = 1e-12


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def shard(x, rank, n):
    """Rank `rank`'s contiguous chunk of the positions (axis 2) of x [B, H, S, D]."""
    m = x.shape[2] // n
    return np.ascontiguousarray(x[:, :, rank * m:(rank + 1) * m])


def one_device(q, k, v, g, causal):
    """Dense attention on the whole sequence, the kv heads repeated to H and their
    gradients summed back: (out, dq, dk, dv)."""
    groups = q.shape[1] // k.shape[1]
    out, cache = F.attention_forward(q, repeat_kv_heads(k, groups), repeat_kv_heads(v, groups),
                                     causal=causal)
    dq, dk, dv = F.attention_backward(g, cache)
    return out, dq, sum_kv_groups(dk, groups), sum_kv_groups(dv, groups)


def draw(rng, batch, heads, kv_heads, seq, d_h, d_v=None):
    d_v = d_h if d_v is None else d_v
    q = rng.standard_normal((batch, heads, seq, d_h))
    k = rng.standard_normal((batch, kv_heads, seq, d_h))
    v = rng.standard_normal((batch, kv_heads, seq, d_v))
    g = rng.standard_normal((batch, heads, seq, d_v))
    return q, k, v, g


def run_ulysses(n, q, k, v, g, causal, attention="dense", block_size=None, forward=None):
    """Ulysses on n simulated ranks -> ([out, dq, dk, dv] of the whole sequence, group)."""
    forward = forward or ulysses_attention_forward

    def body(comm):
        mine = [shard(x, comm.rank, n) for x in (q, k, v, g)]
        out, cache = forward(*mine[:3], comm, causal, attention=attention,
                             block_size=block_size)
        return (out, *ulysses_attention_backward(mine[3], cache))

    group = SimulatedGroup(n)
    results = group.run(body)
    whole = [np.concatenate([r[i] for r in results], axis=2) for i in range(4)]
    return whole, group


# (n, H, H_kv): multi-head, grouped-query with N | H_kv (sent as stored), grouped-query with
# N not dividing H_kv (repeated first: to H, or to fewer heads), multi-query
HEADS = [(1, 4, 2), (1, 3, 1),
         (2, 4, 4), (2, 8, 4), (2, 6, 3), (2, 8, 1),
         (3, 6, 6), (3, 6, 3), (3, 12, 2), (3, 6, 1),
         (4, 8, 8), (4, 8, 4), (4, 4, 2), (4, 8, 2), (4, 8, 1)]


@pytest.mark.parametrize("n,heads,kv_heads", HEADS)
@pytest.mark.parametrize("attention", ["dense", "tiled"])
@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_equals_one_device(n, heads, kv_heads, attention, causal, rng):
    batch, seq, d_h = 2, 12, 3
    q, k, v, g = draw(rng, batch, heads, kv_heads, seq, d_h)
    want = one_device(q, k, v, g, causal)
    got, _ = run_ulysses(n, q, k, v, g, causal, attention,
                         block_size=5 if attention == "tiled" else None)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel(a, b) < TOL, (name, rel(a, b))


@pytest.mark.parametrize("attention", ["dense", "tiled"])
def test_value_heads_of_another_width(attention, rng):
    """D_v != D_h: the output and dv keep the values' width."""
    q, k, v, g = draw(rng, 1, 6, 2, 9, 4, d_v=5)
    want = one_device(q, k, v, g, True)
    got, group = run_ulysses(3, q, k, v, g, True, attention,
                             block_size=2 if attention == "tiled" else None)
    for a, b in zip(got, want):
        assert rel(a, b) < TOL
    formula = ulysses_attention_bytes(1, 9, 6, 2, 4, 3, d_v=5)
    assert [t.sent for t in group.traffic] == [f + b for f, b in zip(formula["forward"],
                                                                     formula["backward"])]


def test_the_layer_is_written_in_the_array_api(backend_name, rng):
    """Every backend (array-api-strict keeps the CuPy path honest) equals one device."""
    q, k, v, g = draw(rng, 1, 4, 1, 8, 3)
    want = one_device(q, k, v, g, True)

    def body(comm):
        A = backend.asarray
        mine = [A(shard(x, comm.rank, 2)) for x in (q, k, v, g)]
        out, cache = ulysses_attention_forward(*mine[:3], comm, True, attention="tiled",
                                               block_size=3)
        return [backend.to_numpy(a) for a in (out, *ulysses_attention_backward(mine[3],
                                                                              cache))]

    results = SimulatedGroup(2).run(body)
    for i, b in enumerate(want):
        assert rel(np.concatenate([r[i] for r in results], axis=2), b) < TOL


def test_the_sequence_length_may_be_stated(rng):
    """seq_len = S checks S / N on each rank alone (no exchange of shapes): same result."""
    q, k, v, g = draw(rng, 1, 4, 2, 8, 3)
    want = one_device(q, k, v, g, True)

    def body(comm):
        mine = [shard(x, comm.rank, 4) for x in (q, k, v, g)]
        out, cache = ulysses_attention_forward(*mine[:3], comm, seq_len=8)
        return (out, *ulysses_attention_backward(mine[3], cache))

    results = SimulatedGroup(4).run(body)
    for i, b in enumerate(want):
        assert rel(np.concatenate([r[i] for r in results], axis=2), b) < TOL


# ---------------------------------------------------------------------------------------
# Which kv heads travel


@pytest.mark.parametrize("heads,kv_heads,n,want", [
    (8, 8, 4, (2, False)),       # multi-head
    (8, 4, 4, (1, False)),       # N | H_kv: as stored
    (12, 6, 3, (2, False)),
    (6, 3, 3, (1, False)),
    (4, 2, 4, (1, True)),        # repeated to H
    (6, 3, 2, (3, True)),        # repeated to H = 6
    (8, 2, 4, (1, True)),        # repeated to 4 heads, not 8
    (12, 2, 3, (2, True)),       # repeated to 6 heads, not 12
    (8, 1, 4, (1, True)),        # multi-query: 4 copies, not 8
    (8, 1, 8, (1, True)),        # multi-query at N = H: every query head its own copy
    (5, 5, 1, (5, False)),       # one rank
])
def test_ulysses_kv_heads(heads, kv_heads, n, want):
    got = ulysses_kv_heads(heads, kv_heads, n)
    assert isinstance(got, KVHeads) and tuple(got) == want
    K = got.per_rank * n
    assert K % kv_heads == 0 and (heads // kv_heads) % (K // kv_heads) == 0
    # rank r's query heads read exactly the kv heads it holds (query h -> kv h // (H / K))
    for r in range(n):
        mine = range(r * heads // n, (r + 1) * heads // n)
        held = range(r * got.per_rank, (r + 1) * got.per_rank)
        assert {h // (heads // K) for h in mine} == set(held)


# ---------------------------------------------------------------------------------------
# The two all-to-alls are adjoint


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_exchanges_are_adjoint(n, rng):
    """<A x, y> = <x, A^T y> summed over the ranks, for the exchange to the heads layout
    (split heads, concat positions) and the one back; A^T A = identity, bit for bit."""
    batch, heads, m, d = 2, 2 * n, 3, 4
    xs = [rng.standard_normal((batch, heads, m, d)) for _ in range(n)]      # sequence layout
    ys = [rng.standard_normal((batch, heads // n, n * m, d)) for _ in range(n)]   # heads

    def body(comm):
        r = comm.rank
        ax, to_heads = mappings.all_to_all_forward(xs[r], comm, U.HEAD_AXIS, U.SEQ_AXIS)
        aty = mappings.all_to_all_backward(ys[r], to_heads)
        by, to_seq = mappings.all_to_all_forward(ys[r], comm, U.SEQ_AXIS, U.HEAD_AXIS)
        btx = mappings.all_to_all_backward(xs[r], to_seq)
        return (np.vdot(ax, ys[r]), np.vdot(xs[r], aty), np.vdot(by, xs[r]),
                np.vdot(ys[r], btx), mappings.all_to_all_backward(ax, to_heads), ax)

    out = SimulatedGroup(n).run(body)
    for i in (0, 2):
        lhs, rhs = sum(o[i] for o in out), sum(o[i + 1] for o in out)
        assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0)
    whole = np.concatenate(xs, axis=2)                                   # [B, H, S, D]
    for r, o in enumerate(out):
        np.testing.assert_array_equal(o[4], xs[r])
        # rank r holds heads r H/N .. of the whole sequence, positions in order
        np.testing.assert_array_equal(o[5], whole[:, r * heads // n:(r + 1) * heads // n])


# ---------------------------------------------------------------------------------------
# Bytes


@pytest.mark.parametrize("n,heads,kv_heads", [(1, 4, 2), (2, 4, 4), (2, 8, 1), (3, 6, 3),
                                              (3, 12, 2), (4, 8, 8), (4, 8, 2), (4, 4, 2)])
@pytest.mark.parametrize("algorithm", ["ring", "naive"])
def test_bytes_equal_the_formula(n, heads, kv_heads, algorithm, rng):
    batch, seq, d_h = 2, 12, 3
    q, k, v, g = draw(rng, batch, heads, kv_heads, seq, d_h)
    f_sent = []

    def body(comm):
        mine = [shard(x, comm.rank, n) for x in (q, k, v, g)]
        out, cache = ulysses_attention_forward(*mine[:3], comm)
        f_sent.append((comm.rank, comm.traffic.sent))
        ulysses_attention_backward(mine[3], cache)
        return [c.op for c in comm.traffic.calls]

    group = SimulatedGroup(n, algorithm=algorithm)
    calls = group.run(body)
    formula = ulysses_attention_bytes(batch, seq, heads, kv_heads, d_h, n)
    assert sorted(f_sent) == list(enumerate(formula["forward"]))
    sent = [t.sent for t in group.traffic]
    assert sent == [f + b for f, b in zip(formula["forward"], formula["backward"])]
    assert [t.received for t in group.traffic] == sent
    total = group.total()
    assert total["sent"] == formula["forward_total"] + formula["backward_total"]
    assert total["sent"] == formula["total"]
    assert calls == [["all_to_all"] * 8] * n      # the shape check's exchange is uncounted
    if n > 1:   # the pairwise exchange: every directed link the same, 1 / (N - 1) of a rank's
        assert set(total["links"].values()) == {formula["total"] // (n * (n - 1))}
        assert len(total["links"]) == n * (n - 1)


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_bytes_against_deepspeeds_4Nh_over_P(n):
    """MHA, B = 1, D_v = D_h: DeepSpeed-Ulysses counts 4Nh/P per link for one forward
    (N the sequence, h = H D_h, P the degree). A rank sends (P - 1)/P of that: it keeps its
    own block of each of the four tensors; each directed link carries 4Nh/P^2; the backward
    as much again."""
    seq, heads, d_h, b = 24, 12, 4, 8
    h = heads * d_h
    formula = ulysses_attention_bytes(1, seq, heads, heads, d_h, n, itemsize=b)
    deepspeed = 4 * seq * h // n * b                                    # bytes, per rank
    assert formula["forward"] == [deepspeed * (n - 1) // n] * n
    assert formula["backward"] == formula["forward"]
    assert formula["forward_total"] == (n - 1) * 4 * seq * h // n * b
    q, k, v, g = draw(np.random.default_rng(n), 1, heads, heads, seq, d_h)

    def body(comm):
        mine = [shard(x, comm.rank, n) for x in (q, k, v)]
        ulysses_attention_forward(*mine, comm)

    group = SimulatedGroup(n)
    group.run(body)
    assert [t.sent for t in group.traffic] == formula["forward"]
    assert set(group.total()["links"].values()) == {4 * seq * h // (n * n) * b}


def test_fewest_repeats_send_fewer_bytes_than_repeating_to_H():
    """N not dividing H_kv: K = f H_kv with the smallest f, not H, goes over the wire; and
    grouped-query bytes fall below multi-head ones by the k, v terms."""
    mha = ulysses_attention_bytes(2, 16, 8, 8, 4, 4)
    gqa = ulysses_attention_bytes(2, 16, 8, 2, 4, 4)             # K = 4
    mqa = ulysses_attention_bytes(2, 16, 8, 1, 4, 4)             # K = 4
    stored = ulysses_attention_bytes(2, 16, 8, 4, 4, 4)          # K = 4, as stored
    assert gqa["kv_heads_sent"] == mqa["kv_heads_sent"] == stored["kv_heads_sent"] == 4
    assert gqa["forward"] == mqa["forward"] == stored["forward"]
    # q and out 8 heads, k and v 4 heads: 3/4 of the multi-head count
    assert [4 * x for x in gqa["forward"]] == [3 * x for x in mha["forward"]]


def test_a_group_of_one_sends_nothing(rng):
    q, k, v, g = draw(rng, 1, 2, 1, 5, 3)
    got, group = run_ulysses(1, q, k, v, g, True)
    assert group.traffic[0].sent == 0
    assert ulysses_attention_bytes(1, 5, 2, 1, 3, 1)["total"] == 0
    for a, b in zip(got, one_device(q, k, v, g, True)):
        assert rel(a, b) < TOL


# ---------------------------------------------------------------------------------------
# Refusals: a clear error on every rank, before any byte moves


def _refused(n, body, error=ValueError, match=None):
    group = SimulatedGroup(n, timeout=5)
    with pytest.raises(error, match=match) as caught:
        group.run(body)
    assert [t.sent for t in group.traffic] == [0] * n, "bytes moved before the refusal"
    return str(caught.value)


def _qkv(heads=4, kv_heads=2, local=3, d_h=2, batch=1, **shapes):
    q = np.ones(shapes.get("q", (batch, heads, local, d_h)))
    k = np.ones(shapes.get("k", (batch, kv_heads, local, d_h)))
    v = np.ones(shapes.get("v", (batch, kv_heads, local, d_h)))
    return q, k, v


@pytest.mark.parametrize("n,inputs,kwargs,error,match", [
    (3, _qkv(heads=4, kv_heads=2), {}, ValueError,
     r"heads H = 4 must be divisible by the group size N = 3"),
    (2, _qkv(heads=6, kv_heads=4), {}, ValueError,
     r"number of heads dividing q's 6"),
    (2, _qkv(), dict(dropout_p=0.1), ValueError,
     r"does not support dropout \(dropout_p = 0.1\)"),
    (2, _qkv(), dict(seq_len=7), ValueError, r"S = 7 divisible by the group size N = 2"),
    (2, _qkv(), dict(seq_len=8), ValueError, r"q holds 3 positions, but S = 8 over N = 2"),
    (2, _qkv(k=(1, 2, 4, 2)), {}, ValueError, r"k must have shape \(1, 2, 3, 2\)"),
    (2, _qkv(v=(2, 2, 3, 2)), {}, ValueError, r"v must have shape \(1, 2, 3, \*\)"),
    (2, _qkv(k=(1, 2, 3, 5)), {}, ValueError, r"k must have shape \(1, 2, 3, 2\)"),
    (2, _qkv(q=(4, 3, 2)), {}, ValueError, r"q must have 4 dimensions, got shape \(4, 3, 2\)"),
    (2, _qkv(), dict(attention="flash"), ValueError, r"attention must be one of"),
    (2, _qkv(), dict(block_size=4), ValueError, r"block_size \(4\) is a setting of"),
    (2, _qkv(), dict(attention="tiled", block_size=0), ValueError,
     "block_size must be at least 1"),
])
def test_bad_input_is_refused_before_anything_moves(n, inputs, kwargs, error, match):
    _refused(n, lambda c: ulysses_attention_forward(*inputs, c, **kwargs), error, match)


def test_a_sequence_length_not_divisible_by_N_is_refused_on_every_rank():
    """S = 10 over N = 4: ranks hold 3, 3, 2, 2 positions; the refusal names S and N on
    each rank that gets past the exchange of shapes before the first refusal ends the
    simulated group (under MPI every rank raises it)."""
    lengths = [3, 3, 2, 2]
    seen = []

    def body(comm):
        try:
            ulysses_attention_forward(*_qkv(local=lengths[comm.rank]), comm)
        except ValueError as err:
            seen.append(str(err))
            raise

    message = _refused(4, body, match=r"S = 10 divisible by the group size N = 4")
    assert "[3, 3, 2, 2]" in message
    assert seen and all("S = 10" in m and "N = 4" in m for m in seen)


def test_uneven_chunks_of_a_divisible_sequence_are_refused():
    _refused(2, lambda c: ulysses_attention_forward(*_qkv(local=1 + 2 * c.rank), c),
             match=r"every rank must hold S / N = 2 positions \(S = 4, N = 2\); the ranks "
                   r"hold \[1, 3\]")


def test_ranks_with_different_shapes_are_refused():
    _refused(2, lambda c: ulysses_attention_forward(*_qkv(d_h=2 + c.rank), c),
             match=r"the ranks' q, k, v differ: .* is \(1, 4, 3, 2, 2, 2, 'float64'\) on "
                   r"rank 0 and \(1, 4, 3, 3, 2, 3, 'float64'\) on rank 1")


def test_mixed_dtypes_and_bad_upstream_are_refused(rng):
    q, k, v = _qkv()
    _refused(2, lambda c: ulysses_attention_forward(q, k, v.astype(np.float32), c),
             TypeError, "inputs must share one float dtype")

    def body(comm):
        out, cache = ulysses_attention_forward(q, k, v, comm)
        with pytest.raises(ValueError, match=r"dout must have shape \(1, 4, 3, 2\)"):
            ulysses_attention_backward(np.ones((1, 4, 2, 2)), cache)
        with pytest.raises(TypeError, match="dout must have dtype float64"):
            ulysses_attention_backward(out.astype(np.float32), cache)
        with pytest.raises(TypeError, match="cache must be the UlyssesCache"):
            ulysses_attention_backward(out, tuple(cache))
        return True

    assert SimulatedGroup(2).run(body) == [True, True]


@pytest.mark.parametrize("heads,kv_heads,n,seq,match", [
    (6, 3, 4, 8, "H = 6 must be divisible by the group size N = 4"),
    (8, 3, 4, 8, "H_kv = 3 must divide"),
    (8, 2, 4, 10, "S = 10 divisible by the group size N = 4"),
])
def test_the_byte_formula_refuses_what_the_op_refuses(heads, kv_heads, n, seq, match):
    with pytest.raises(ValueError, match=match):
        ulysses_attention_bytes(1, seq, heads, kv_heads, 2, n)


# ---------------------------------------------------------------------------------------
# Planted mistakes: the equality check can fail


def _wrong_exchange(mistake):
    """Ulysses with one exchange written wrongly (no kv repeat needed: H_kv = H)."""

    def forward(q, k, v, comm, causal, attention="dense", block_size=None):
        concat = U.HEAD_AXIS if mistake == "concat heads" else U.SEQ_AXIS
        a2a = lambda x: mappings.all_to_all_forward(x, comm, U.HEAD_AXIS, concat)  # noqa: E731
        (q_h, cq), (k_h, ck), (v_h, cv) = a2a(q), a2a(k), a2a(v)
        if mistake == "queries in the wrong rank order":
            m = q.shape[2]
            q_h = np.concatenate([q_h[:, :, i * m:(i + 1) * m]
                                  for i in reversed(range(comm.size))], axis=2)
        out_h, inner = F.attention_forward(q_h, k_h, v_h, causal=causal)
        out, co = mappings.all_to_all_forward(out_h, comm, concat, U.HEAD_AXIS)
        return out, U.UlyssesCache("dense", inner, cq, ck, cv, co, 1, 1, out)

    return forward


@pytest.mark.parametrize("mistake", ["concat heads", "queries in the wrong rank order"])
def test_a_wrong_exchange_fails_the_check(mistake, rng):
    """Concatenating the arrivals along the heads (each rank then attends within the
    positions of one chunk), or the queries' chunks in the wrong rank order, gives another
    output: the check catches it, where the right exchange passes it."""
    q, k, v, g = draw(rng, 1, 4, 4, 8, 3)
    want = one_device(q, k, v, g, False)
    got, _ = run_ulysses(2, q, k, v, g, False, forward=_wrong_exchange(mistake))
    assert rel(got[0], want[0]) > 1e-2
    right, _ = run_ulysses(2, q, k, v, g, False)
    assert rel(right[0], want[0]) < TOL


def test_a_wrong_kv_repeat_fails_the_check(monkeypatch, rng):
    """Repeating the kv heads as a tile (heads 0, 1, 0, 1) instead of a repeat (0, 0, 1, 1)
    hands query heads the wrong kv heads: the check catches it."""
    q, k, v, g = draw(rng, 1, 8, 2, 8, 3)
    want = one_device(q, k, v, g, True)
    monkeypatch.setattr(U, "repeat_kv_heads",
                        lambda x, groups: np.tile(x, (1, groups, 1, 1)) if groups > 1 else x)
    got, _ = run_ulysses(4, q, k, v, g, True)
    assert rel(got[0], want[0]) > 1e-2


# ---------------------------------------------------------------------------------------
# Real processes: `mpiexec -n 4` (tests/mpi_ulysses.py)

MPI_SCRIPT = Path(__file__).with_name("mpi_ulysses.py")
sys.path.insert(0, str(MPI_SCRIPT.parent))
import mpi_ulysses  # noqa: E402
from mpi_tools import needs_mpi, run_mpi  # noqa: E402

MPI_TIMEOUT = 90      # seconds for one mpiexec (a healthy run takes a few)


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ulysses") / "runs.npz"
    done = run_mpi(4, MPI_SCRIPT, [str(out)], MPI_TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ulysses runs: " + ", ".join(mpi_ulysses.CASES) in done.stdout
    return np.load(out)


@needs_mpi
@pytest.mark.parametrize("name", list(mpi_ulysses.CASES))
def test_mpi_ulysses_equals_one_device_and_the_simulation(mpi_run, name):
    n = mpi_ulysses.WORLD
    heads, kv_heads, _, causal = mpi_ulysses.CASES[name]
    q, k, v, g = mpi_ulysses.inputs(name)
    want = dict(zip(("out", "dq", "dk", "dv"), one_device(q, k, v, g, causal)))
    group = SimulatedGroup(n)
    sim = group.run(mpi_ulysses.run_case, name)
    formula = ulysses_attention_bytes(mpi_ulysses.BATCH, mpi_ulysses.SEQ, heads, kv_heads,
                                      mpi_ulysses.D_H, n)
    for key, value in want.items():
        got = np.concatenate([mpi_run[f"{name}_{key}_{r}"] for r in range(n)], axis=2)
        assert rel(got, value) < TOL, key
        for r in range(n):
            assert rel(mpi_run[f"{name}_{key}_{r}"], sim[r][key]) < TOL, (key, r)
    for r in range(n):
        sent = formula["forward"][r] + formula["backward"][r]
        assert mpi_run[f"{name}_bytes_{r}"].tolist() == [sent, sent]
        assert sim[r]["bytes"].tolist() == [sent, sent]
