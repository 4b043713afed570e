"""What a real run needs, in the simulation: accumulation over micro-batches equals the
large batch, the bucketed all-reduce that overlaps the backward equals the blocking one,
clipping by the global norm over TP, DP and ZeRO-1 equals one device's clip, and bad
options are refused before any work."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

from tfcore import nn
from tfcore.optim import clip_grad_norm
from tfcore.parallel import SimulatedGroup
from tfcore.parallel.grads import (
    GradientBuckets,
    GradPiece,
    accumulation_weights,
    backward_units,
    global_grad_norm,
    global_sum_of_squares,
    make_buckets,
    overlap_timeline,
    split_micro_batches,
)
from tfcore.parallel.harness import CONFIGS, make_batches, train_parallel, train_single

STEPS, BATCH, SEQ = 2, 8, 8
U = np.finfo(np.float64).eps / 2             # unit roundoff


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def config():
    return CONFIGS["tiny"]()


@pytest.fixture(scope="module")
def large(config):
    return train_single(config, STEPS, BATCH, SEQ)


# -- accumulation -------------------------------------------------------------------------------
def test_micro_batches_count_different_tokens(config):
    """The weights c_k / T_c are not 1 / K here: the micro-batches hold different counts."""
    ids, targets = make_batches(config, 1, BATCH, SEQ)
    weights, counts = accumulation_weights(split_micro_batches(ids[0], targets[0], 4))
    assert len(set(counts)) > 1
    assert math.isclose(sum(weights), 1.0, rel_tol=1e-15)
    assert max(abs(w - 0.25) for w in weights) > 0.01


@pytest.mark.parametrize("k", [2, 4, 8])
def test_accumulation_equals_the_large_batch(config, large, k):
    """The same parameters after two AdamW steps: the micro-batch sums add in another
    order, so equal to rounding (the gradients to 1e-12 relative, the losses too)."""
    acc = train_single(config, STEPS, BATCH, SEQ, micro_batches=k)
    assert rel(acc["grads"], large["grads"]) < 1e-12
    assert rel(acc["losses"], large["losses"]) < 1e-12
    assert rel(acc["params"], large["params"]) < 1e-12


def test_equal_weights_would_be_wrong(config, large):
    """The planted error: weighting each micro-batch's mean by 1 / K (mean of means)."""
    from tfcore import backend
    from tfcore import functional as F
    from tfcore.models.decoder import IGNORE_INDEX, DecoderLM

    model = DecoderLM(config).init(0)
    ids, targets = make_batches(config, 1, BATCH, SEQ)
    for ids_k, targets_k in split_micro_batches(ids[0], targets[0], 4):
        logits, _ = model.forward(backend.asarray(ids_k))
        _, cache = F.cross_entropy_forward(logits, backend.asarray(targets_k), IGNORE_INDEX)
        model.backward(F.cross_entropy_backward(0.25, cache))
    right = train_single(config, 1, BATCH, SEQ)["grads"]
    assert rel(model.params.grad, right) > 1e-3


@pytest.mark.parametrize("tp,dp,k,zero", [(1, 2, 2, False), (2, 2, 2, True), (1, 4, 2, False)])
def test_accumulation_with_data_parallelism(config, large, tp, dp, k, zero):
    out = SimulatedGroup(tp * dp).run(train_parallel, config, STEPS, BATCH, SEQ, tp=tp, dp=dp,
                                      micro_batches=k, zero=zero)[0]
    assert rel(out["losses"], large["losses"]) < 1e-12
    assert rel(out["params"], large["params"]) < 1e-12


# -- buckets and overlap --------------------------------------------------------------------------
def _random_grads(config, dp_size, seed=3):
    params = nn.Parameters(config.param_shapes(), "float64")
    rng = np.random.default_rng(seed)
    return params, [rng.standard_normal(params.size) for _ in range(dp_size)]


def _bucketed(comm, config, grads, bucket_bytes, blocking):
    params = nn.Parameters(config.param_shapes(), "float64")
    params.grad[...] = grads[comm.rank]
    buckets = GradientBuckets(params, comm, config.n_layers, bucket_bytes, blocking=blocking)
    for label, _ in buckets.units:               # the order in which the backward ends them
        buckets.unit_done(label)
    buckets.finish()
    return np.array(params.grad), buckets.buckets, comm.traffic.overlaps()


def _whole(comm, grads):
    return np.array(comm.all_reduce(grads[comm.rank]))


def test_buckets_tile_the_buffer_from_its_end(config):
    params, _ = _random_grads(config, 1)
    units = backward_units(params, config.n_layers)
    assert [u for u, _ in units] == ["head", "h1", "h0", "embed"]
    for cap in (8, 2048, 10**9):
        buckets = make_buckets(params, units, cap)
        ranges = [b["range"] for b in buckets]
        assert ranges[0][1] == params.size and ranges[-1][0] == 0
        assert all(ranges[i][0] == ranges[i + 1][1] for i in range(len(ranges) - 1))
        for b in buckets:                        # at most cap, unless a single tensor
            assert (b["range"][1] - b["range"][0]) * 8 <= cap or len(b["names"]) == 1
    assert len(make_buckets(params, units, 10**9)) == 1


@pytest.mark.parametrize("bucket_bytes", [64, 4096, 10**9])
@pytest.mark.parametrize("algorithm", ["ring", "naive"])
def test_overlapped_buckets_equal_the_blocking_all_reduce(config, bucket_bytes, algorithm):
    """Overlapped == blocking buckets bit for bit (the same collectives on the same slices);
    == the whole-buffer all-reduce bit for bit with the naive algorithm (rank order), and
    with the ring (whose chunks, hence order of addition, depend on the bucket) to the
    bound of a reordered sum of N terms: (N - 1) u sum_j |g_j| per element, doubled."""
    n = 4
    _, grads = _random_grads(config, n)
    group = SimulatedGroup(n, algorithm=algorithm)
    over = group.run(_bucketed, config, grads, bucket_bytes, False)
    block = SimulatedGroup(n, algorithm=algorithm).run(_bucketed, config, grads,
                                                      bucket_bytes, True)
    whole = SimulatedGroup(n, algorithm=algorithm).run(_whole, grads)
    bound = 2 * (n - 1) * U * np.sum(np.abs(grads), axis=0)
    for r in range(n):
        np.testing.assert_array_equal(over[r][0], block[r][0])
        if algorithm == "naive":
            np.testing.assert_array_equal(over[r][0], whole[r])
        assert np.all(np.abs(over[r][0] - whole[r]) <= bound)
        np.testing.assert_array_equal(over[r][0], over[0][0])   # every rank the same sum


def test_the_simulation_records_what_overlapped(config):
    """With one bucket per unit, bucket i (launched after unit i) was in flight while every
    later unit's backward ran; the last bucket overlapped nothing; blocking, nothing did."""
    _, grads = _random_grads(config, 2)
    over = SimulatedGroup(2).run(_bucketed, config, grads, 8, False)[0]
    buckets, overlaps = over[1], over[2]
    units = ["head", "h1", "h0", "embed"]
    for i, bucket in enumerate(buckets):
        later = units[units.index(bucket["ready"]) + 1:]
        assert overlaps[f"bucket {i}"] == [f"backward {u}" for u in later]
    assert overlaps[f"bucket {len(buckets) - 1}"] == []
    assert any(overlaps.values())
    blocking = SimulatedGroup(2).run(_bucketed, config, grads, 8, True)[0]
    assert blocking[2] == {}


def test_timeline_from_the_recorded_events(config):
    """Unit costs: each unit's backward 1, each bucket's all-reduce 1.5. The timeline built
    from the recorded events equals the one derived from the buckets: bucket i starts when
    its ready unit ends or when bucket i - 1 ends, whichever is later."""
    _, grads = _random_grads(config, 2)

    def body(comm):
        _, buckets, _ = _bucketed(comm, config, grads, 2048, False)
        return buckets, comm.traffic.events

    buckets, events = SimulatedGroup(2).run(body)[0]
    units = ["head", "h1", "h0", "embed"]
    line = overlap_timeline(events, {f"backward {u}": 1.0 for u in units},
                            {f"bucket {i}": 1.5 for i in range(len(buckets))})
    free, starts = 0.0, []
    for bucket in buckets:
        starts.append(max(units.index(bucket["ready"]) + 1.0, free))
        free = starts[-1] + 1.5
    assert [c[1] for c in line["comm"]] == starts
    assert line["compute_end"] == 4.0 and line["exposed"] == free - 4.0
    assert 0 < line["exposed"] < 1.5 * len(buckets)      # some, not all, hidden


@pytest.mark.parametrize("tp,dp", [(1, 4), (2, 2)])
def test_training_with_overlapped_buckets_equals_one_device(config, large, tp, dp):
    runs = {}
    for overlap in (True, False):
        runs[overlap] = SimulatedGroup(tp * dp).run(
            train_parallel, config, STEPS, BATCH, SEQ, tp=tp, dp=dp, micro_batches=2,
            bucket_bytes=1024, overlap=overlap)[0]
    np.testing.assert_array_equal(runs[True]["params"], runs[False]["params"])
    assert rel(runs[True]["params"], large["params"]) < 1e-12
    assert len(runs[True]["exposed"]) == STEPS


@pytest.mark.parametrize("finished_first", [False, True])
def test_a_blocking_call_during_a_request_is_refused(finished_first):
    """In flight means started and not yet waited on, whether or not the progress thread
    has finished the collective: the refusal does not depend on timing (with
    finished_first, the blocking call comes after the collective is certainly done)."""
    def body(comm):
        request = comm.iall_reduce(np.ones(3))
        while finished_first and not request.test():
            time.sleep(1e-3)
        with pytest.raises(RuntimeError, match="in flight"):
            comm.all_reduce(np.ones(3))
        out = request.wait()
        np.testing.assert_array_equal(comm.all_reduce(np.ones(3)), [2.0, 2.0, 2.0])
        with pytest.raises(RuntimeError, match="waited on already"):
            request.wait()
        return out

    assert SimulatedGroup(2).run(body)[0].tolist() == [2.0, 2.0, 2.0]


# -- clipping --------------------------------------------------------------------------------------
MAX_NORM = 0.1      # below the gradient norms of these steps (about 1): the clip acts


@pytest.fixture(scope="module")
def clipped(config):
    return train_single(config, STEPS, BATCH, SEQ, clip=MAX_NORM)


def test_the_clip_acts_on_one_device(config, clipped, large):
    assert min(clipped["norms"]) > 5 * MAX_NORM
    assert np.linalg.norm(clipped["grads"]) == pytest.approx(MAX_NORM, rel=1e-5)
    assert rel(clipped["params"], large["params"]) > 1e-3


@pytest.mark.parametrize("tp,dp,zero,sp", [(2, 2, False, False), (2, 2, True, False),
                                           (4, 1, False, True), (1, 4, True, False),
                                           (4, 1, False, False)])
def test_clipping_over_every_sharding_equals_one_device(config, clipped, tp, dp, zero, sp):
    out = SimulatedGroup(tp * dp).run(train_parallel, config, STEPS, BATCH, SEQ, tp=tp, dp=dp,
                                      zero=zero, sequence_parallel=sp, clip=MAX_NORM)[0]
    assert rel(out["norms"], clipped["norms"]) < 1e-12
    assert rel(out["params"], clipped["params"]) < 1e-12


def test_global_norm_counts_shards_once_and_replicas_once():
    """A vector split over 2 x 2 ranks (tp x dp), plus a piece replicated over tp: the norm
    equals the whole vector's; counting the replicated piece as a shard (the planted
    error) counts it N_T times."""
    rng = np.random.default_rng(0)
    full, shared = rng.standard_normal(40), rng.standard_normal(5)
    truth = math.sqrt(float(full @ full + shared @ shared))

    def body(comm, wrong):
        tp = comm.split(color=comm.rank // 2, key=comm.rank % 2, name="tp")
        dp = comm.split(color=comm.rank % 2, key=comm.rank // 2, name="dp")
        mine = np.array_split(full, 4)[2 * dp.rank + tp.rank]
        pieces = [GradPiece(mine, (tp, dp)), GradPiece(shared.copy(), (tp,) if wrong else ())]
        return global_grad_norm(pieces)

    norms = SimulatedGroup(4).run(body, False)
    assert all(abs(n - truth) <= 1e-14 * truth for n in norms)
    wrong = SimulatedGroup(4).run(body, True)[0]
    assert wrong == pytest.approx(math.sqrt(truth**2 + float(shared @ shared)), rel=1e-14)


def test_clip_scales_a_shared_buffer_once():
    g = np.full(4, 3.0)
    mask = np.array([True, True, False, False])
    norm = clip_grad_norm([GradPiece(g, (), mask), GradPiece(g, (), ~mask)], 1.0,
                          global_sum_of_squares)
    assert norm == pytest.approx(6.0, rel=1e-15)
    assert np.linalg.norm(g) == pytest.approx(6.0 / (6.0 + 1e-6), rel=1e-15)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -5])
def test_bucket_bytes_must_be_positive(config, value):
    with pytest.raises(ValueError, match="bucket_bytes must be a positive"):
        SimulatedGroup(2).run(train_parallel, config, 1, 4, 8, dp=2, bucket_bytes=value)


def test_bucket_bytes_must_be_an_integer(config):
    params, _ = _random_grads(config, 1)
    with pytest.raises(TypeError, match="bucket_bytes must be an integer"):
        make_buckets(params, backward_units(params, config.n_layers), 1.5)


def test_buckets_refuse_zero_and_sequence_parallelism(config):
    for kwargs, match in ((dict(zero=2, dp=2), "gradient buckets with ZeRO-2/3.*: ZeRO-2/3 "
                           "reduce-scatter each unit's gradient"),
                          (dict(tp=2, sequence_parallel=True),
                           "gradient buckets with sequence parallelism.*: the buckets "
                           "all-reduce a replicated gradient as the backward goes")):
        with pytest.raises(ValueError, match=match):
            SimulatedGroup(2).run(train_parallel, config, 1, 4, 8, bucket_bytes=1024,
                                  **kwargs)


@pytest.mark.parametrize("value,match", [(0, "positive"), (-1.0, "positive"),
                                         (float("inf"), "finite"), (float("nan"), "positive")])
def test_max_norm_must_be_positive_and_finite(config, value, match):
    with pytest.raises(ValueError, match=f"clip must be {match}"):
        train_single(config, 1, 4, 8, clip=value)
    with pytest.raises(ValueError, match=f"max_norm must be {match}"):
        clip_grad_norm([GradPiece(np.ones(3))], value, global_sum_of_squares)


def test_micro_batches_must_divide(config):
    with pytest.raises(ValueError, match=r"micro_batches \(3\) must divide the batch rows"):
        train_single(config, 1, 8, 8, micro_batches=3)
    with pytest.raises(ValueError, match=r"micro_batches \(4\) must divide the rows of each"):
        SimulatedGroup(2).run(train_parallel, config, 1, 4, 8, dp=2, micro_batches=4)
    with pytest.raises(ValueError, match="micro_batches must be at least 1"):
        train_single(config, 1, 8, 8, micro_batches=0)
    with pytest.raises(TypeError, match="micro_batches must be an integer"):
        train_single(config, 1, 8, 8, micro_batches=2.0)


def test_pieces_must_be_grad_pieces():
    with pytest.raises(TypeError, match="GradPiece"):
        global_grad_norm([np.ones(3)])


def test_the_model_checks_its_upstream_weight(config):
    from tfcore.parallel.model import TensorParallelDecoder

    def body(comm):
        model = TensorParallelDecoder(config, comm)
        ids, targets = make_batches(config, 1, 2, 4)
        model.forward(ids[0], targets[0])
        model.backward(dloss="0.5")

    with pytest.raises(TypeError, match="dloss"):
        SimulatedGroup(1).run(body)


def test_the_command_line_options(capsys):
    from tfcore.parallel.__main__ import main_simulated

    assert main_simulated(["--simulate", "--tp", "2", "--dp", "2", "--batch", "8",
                           "--micro-batches", "2", "--clip", "0.1", "--bucket-bytes", "1024",
                           "--check", "--quiet-times"]) == 0
    assert "one device: max relative difference" in capsys.readouterr().out
    for argv, message in ((["--micro-batches", "3"], "--micro-batches 3 must divide"),
                          (["--clip", "nan"], "--clip must be a positive finite"),
                          (["--bucket-bytes", "0"], "--bucket-bytes must be a positive"),
                          (["--bucket-bytes", "64", "--zero", "2"],
                           "--bucket-bytes 64 --zero 2: gradient buckets with ZeRO-2/3")):
        assert main_simulated(["--simulate", "--dp", "2", "--batch", "8", *argv]) == 2
        assert message in capsys.readouterr().err
