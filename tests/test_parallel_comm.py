"""The communicators: every collective's result, and every byte it moves against its closed
form (tfcore.parallel.volume), for the ring and the naive algorithm."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import backend
from tfcore.parallel import SimulatedGroup, chunk_bounds
from tfcore.parallel.volume import collective_bytes


def _inputs(n, shape, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(n)]


@pytest.mark.parametrize("algorithm", ["ring", "naive"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives_compute_what_they_say(backend_name, algorithm, n):
    xs = _inputs(n, (n * 2, 3), seed=n)

    def body(comm):
        x = backend.asarray(xs[comm.rank])
        sub = comm.split(comm.rank % 2, name="parity")
        return [backend.to_numpy(a) for a in (
            comm.all_reduce(x), comm.all_reduce(x, op="max"), comm.all_gather(x, axis=1),
            comm.reduce_scatter(x, axis=0), comm.broadcast(x, root=n - 1), sub.all_reduce(x))]

    total = sum(xs)
    for r, (s, m, g, rs, b, sub) in enumerate(SimulatedGroup(n, algorithm).run(body)):
        np.testing.assert_allclose(s, total, rtol=1e-14, atol=1e-14)
        np.testing.assert_array_equal(m, np.max(xs, axis=0))
        np.testing.assert_array_equal(g, np.concatenate(xs, axis=1))
        np.testing.assert_allclose(rs, total[2 * r:2 * r + 2], rtol=1e-14, atol=1e-14)
        np.testing.assert_array_equal(b, xs[n - 1])
        np.testing.assert_allclose(sub, sum(xs[i] for i in range(n) if i % 2 == r % 2),
                                   rtol=1e-14, atol=1e-14)


def test_every_rank_gets_the_same_bits():
    xs = _inputs(4, (37,))
    out = SimulatedGroup(4, "ring").run(lambda c: c.all_reduce(xs[c.rank]))
    assert all(np.array_equal(o, out[0]) for o in out)


@pytest.mark.parametrize("algorithm", ["ring", "naive"])
@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("M", [60, 61, 7])       # divisible by every n or not, tiny
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
def test_measured_bytes_equal_the_closed_form(algorithm, n, M, op):
    """Per rank (sent and received), per link and in total, one call at a time."""
    bounds = chunk_bounds(M, n)
    xs = _inputs(n, (M,), seed=M)

    def body(comm):
        x = xs[comm.rank]
        if op == "all_reduce":
            comm.all_reduce(x)
        elif op == "reduce_scatter":
            comm.reduce_scatter_flat(x, bounds)
        elif op == "all_gather":
            a, b = bounds[comm.rank]
            comm.all_gather_flat(x[a:b], bounds)
        else:
            comm.broadcast(x, root=0)
        return comm.traffic.calls[-1]

    group = SimulatedGroup(n, algorithm)
    records = group.run(body)
    formula = collective_bytes(op, algorithm, M, n, itemsize=8)
    assert [r.sent for r in records] == formula["sent"]
    assert [r.received for r in records] == formula["received"]
    assert group.total()["sent"] == formula["total"]
    links = group.total()["links"]
    if algorithm == "ring" and op != "broadcast":
        assert set(links) <= {(r, (r + 1) % n) for r in range(n)}   # neighbours only
    if algorithm == "naive":
        assert all(0 in link for link in links)                      # through the root only


def test_ring_and_naive_totals_per_rank_and_in_total():
    """Seed 003's two figures, with what each counts: in total both all-reduces move
    2 (N-1) M b; per rank the ring moves 2 (N-1)/N M b and the naive root 2 (N-1) M b."""
    for n in (2, 4, 8):
        M = 8 * 9 * 10
        ring = collective_bytes("all_reduce", "ring", M, n)
        naive = collective_bytes("all_reduce", "naive", M, n)
        assert ring["total"] == naive["total"] == 2 * (n - 1) * M * 8
        assert ring["sent"] == [2 * (n - 1) * M * 8 // n] * n
        assert naive["sent"][0] + naive["received"][0] == 2 * (n - 1) * M * 8


def test_subgroups_and_errors():
    def body(comm):
        pair = comm.subgroup([0, 1]) if comm.rank < 2 else comm.subgroup([2, 3])
        return pair.ranks, pair.rank, backend.to_numpy(pair.all_reduce(np.ones(2) * comm.rank))

    out = SimulatedGroup(4).run(body)
    assert out[3][0] == (2, 3) and out[3][1] == 1 and out[3][2].tolist() == [5.0, 5.0]
    with pytest.raises(ValueError, match="not a member"):
        SimulatedGroup(2).run(lambda c: c.subgroup([1 - c.rank]))
    with pytest.raises(ValueError, match="multiple of the group size 3"):
        SimulatedGroup(3).run(lambda c: c.reduce_scatter(np.ones((4, 2)), axis=0))
    with pytest.raises(ValueError, match="op must be one of"):
        SimulatedGroup(2).run(lambda c: c.all_reduce(np.ones(2), op="min"))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        SimulatedGroup(2, "tree")
    with pytest.raises(RuntimeError, match="did not call the same collectives"):
        SimulatedGroup(2, timeout=0.5).run(
            lambda c: c.all_reduce(np.ones(3)) if c.rank == 0 else None)
    with pytest.raises(ValueError, match="differs across ranks"):
        SimulatedGroup(2).run(lambda c: c.check_same(f"cfg{c.rank}", "the configuration"))


@pytest.mark.parametrize("body,first,second", [
    (lambda c: c.all_reduce(np.ones((2, 3 + c.rank))),
     "all_reduce(shape (2, 3), float64, op sum)", "all_reduce(shape (2, 4), float64, op sum)"),
    (lambda c: c.all_reduce(np.ones(3), op="max" if c.rank else "sum"),
     "all_reduce(shape (3,), float64, op sum)", "all_reduce(shape (3,), float64, op max)"),
    (lambda c: c.all_reduce(np.ones(3, dtype="float32" if c.rank else "float64")),
     "float64", "all_reduce(shape (3,), float32, op sum)"),
    (lambda c: c.broadcast(np.ones(3), root=c.rank),
     "broadcast(shape (3,), float64, root 0)", "broadcast(shape (3,), float64, root 1)"),
    (lambda c: c.all_gather(np.ones(3)) if c.rank else c.all_reduce(np.ones(3)),
     "all_reduce(shape (3,), float64, op sum)", "all_gather(shape (3,), float64, axis 0)"),
    (lambda c: c.all_gather_flat(np.ones(2), [(0, 2), (2, 4)] if c.rank else [(0, 2), (2, 5)]),
     "all_gather_flat(shape (5,)", "all_gather_flat(shape (4,)"),
    (lambda c: c.all_gather_object(1) if c.rank else c.reduce_scatter(np.ones(4)),
     "reduce_scatter(shape (4,), float64, axis 0)", "called all_gather_object"),
])
def test_disagreeing_calls_fail_on_every_rank_naming_both(body, first, second):
    """With check_calls (on by default under MPI) the ranks compare call headers first."""
    with pytest.raises(ValueError, match="called different collectives") as caught:
        SimulatedGroup(2, check_calls=True, timeout=5).run(body)
    message = str(caught.value)
    assert "group rank 0 (world rank 0) called" in message and first in message
    assert "group rank 1 (world rank 1) called" in message and second in message


def test_every_rank_raises_the_same_disagreement():
    def body(comm):
        try:
            comm.all_reduce(np.ones(3 + (comm.rank == 2)))
        except ValueError as err:
            return str(err)

    messages = SimulatedGroup(3, check_calls=True, timeout=5).run(body)
    assert len(set(messages)) == 1 and "world rank 2" in messages[0]


def test_agreement_headers_are_not_counted_and_change_nothing():
    from tfcore.parallel.harness import CONFIGS, train_parallel

    runs = []
    for check in (False, True):
        group = SimulatedGroup(4, check_calls=check)
        out = group.run(train_parallel, CONFIGS["tiny"](), 2, 4, 8, tp=2, dp=2, zero=True)
        runs.append((out[0], [t.sent for t in group.traffic]))
    (plain, sent_plain), (checked, sent_checked) = runs
    np.testing.assert_array_equal(plain["params"], checked["params"])
    assert sent_plain == sent_checked


def test_the_simulation_checks_call_headers_by_default():
    """As under MPI: an all_reduce of shape (4,) on one rank and (2, 2) on another (the
    same number of elements, so the messages alone would fit) is refused on every rank."""
    def body(comm):
        comm.all_reduce(np.ones((4,) if comm.rank else (2, 2)))

    with pytest.raises(ValueError, match="called different collectives") as caught:
        SimulatedGroup(2).run(body)
    assert "called all_reduce(shape (2, 2), float64, op sum)" in str(caught.value)
    assert "called all_reduce(shape (4,), float64, op sum)" in str(caught.value)
    assert SimulatedGroup(2, check_calls=False).run(lambda c: c.check_calls) == [False] * 2


@pytest.mark.parametrize("kind", ["dp", "zero3", "pipeline", "context"])
def test_replicas_from_different_seeds_are_refused_before_step_1(kind):
    """Each rank given its own seed: every training function compares the initial
    parameters and batches first (the all-reduced loss would not show replicas that differ),
    and fails on every rank before any step."""
    from tfcore.parallel import context, fsdp, harness, pipeline

    config = harness.CONFIGS["tiny"]()
    calls = {"dp": lambda c: harness.train_parallel(c, config, 2, 4, 8, dp=2, seed=c.rank),
             "zero3": lambda c: harness.train_sharded(c, config, 2, 4, 8, dp=2, seed=c.rank),
             "pipeline": lambda c: harness.train_pipeline(c, config, 2, 4, 8, pp=2,
                                                           n_microbatches=2, seed=c.rank),
             "context": lambda c: harness.train_context_parallel(c, config, 2, 4, 8,
                                                                 seed=c.rank)}
    def body(comm):
        try:
            calls[kind](comm)
        except ValueError as err:
            return str(err)

    messages = SimulatedGroup(2).run(body)
    assert messages == ["the initial parameters differ across ranks: world rank(s) [1] do "
                        "not hold rank 0's (give every rank the same seed, config, steps, "
                        "batch and seq)"] * 2
    same = SimulatedGroup(2).run(lambda c: harness.check_same_start(c, *_start(config, 0)))
    assert same == [None, None]
    with pytest.raises(ValueError, match="the training batches differ across ranks: world "
                                         r"rank\(s\) \[1\]"):
        SimulatedGroup(2).run(lambda c: harness.check_same_start(c, *_start(config, 0,
                                                                          c.rank)))


def _start(config, seed, batch_seed=0):
    from tfcore.models.decoder import DecoderLM
    from tfcore.parallel.harness import make_batches

    ids, targets = make_batches(config, 2, 4, 8, batch_seed)
    return DecoderLM(config).init(seed).params, ids, targets
