"""ZeRO-2 and ZeRO-3 (FSDP) equal one device in float64 after several AdamW steps, alone and
with tensor parallelism; every byte they move equals the closed form of volume.py (ring and
naive, exact chunking); every array a rank holds, at the peak of the step, equals the memory
formula; the calculator (plan) gives the same numbers as the simulated runs for every stage
and tensor-parallel size, and refuses impossible layouts before any work."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import SimulatedGroup, plan
from tfcore.parallel.fsdp import Ledger, ShardedDecoder
from tfcore.parallel.harness import CONFIGS, train_parallel, train_sharded, train_single
from tfcore.parallel.volume import (
    collective_bytes,
    local_parameters,
    shard_elements,
    step_traffic,
    unit_elements,
    zero_collectives,
    zero_memory,
)

STEPS, SEQ = 3, 8
TOL = 1e-12
CASES = {
    "gpt": CONFIGS["tiny"](),                      # tied head: the embed unit is used twice
    "llama": CONFIGS["tiny-llama"](),              # untied, RMSNorm, SwiGLU, rotary
    "post-dropout": DecoderConfig(vocab_size=23, max_seq_len=16, d_model=16, n_layers=2,
                                  n_heads=4, d_ff=32, norm_placement="post",
                                  position="sinusoidal", mlp="relu", tied_head=False,
                                  dropout=0.1),
}
_reference = {}


def _single(name, batch):
    if (name, batch) not in _reference:
        _reference[name, batch] = train_single(CASES[name], STEPS, batch, SEQ)
    return _reference[name, batch]


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tp,dp,stage", [(1, 1, 3), (1, 2, 2), (1, 2, 3), (1, 3, 3),
                                         (1, 4, 2), (2, 2, 2), (2, 2, 3)])
def test_zero_equals_one_device(name, tp, dp, stage):
    batch = 6 if dp == 3 else 4                   # dp = 3: chunks of unequal sizes
    ref = _single(name, batch)
    out = SimulatedGroup(tp * dp).run(train_sharded, CASES[name], STEPS, batch, SEQ, tp=tp,
                                      dp=dp, stage=stage)
    for rank in out:
        assert _rel(rank["losses"], ref["losses"]) < TOL
        assert _rel(rank["params"], ref["params"]) < TOL
    assert all(np.array_equal(o["params"], out[0]["params"]) for o in out)


@pytest.mark.parametrize("algorithm", ["ring", "naive"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("tp,dp,stage", [(1, 2, 2), (1, 3, 3), (1, 4, 3), (2, 2, 2),
                                         (2, 2, 3)])
def test_bytes_and_held_memory_equal_the_formulas(name, algorithm, tp, dp, stage):
    config, batch = CASES[name], 12
    out = SimulatedGroup(tp * dp, algorithm).run(train_sharded, config, 2, batch, SEQ, tp=tp,
                                                 dp=dp, stage=stage, gather=False)
    formula = step_traffic(config, batch // dp, SEQ, tp, dp, False, stage, algorithm)
    for step in range(2):
        by_op = [{} for _ in out]
        for w, o in enumerate(out):
            for c in o["step_calls"][step]:
                by_op[w][(c.group, c.op)] = by_op[w].get((c.group, c.op), 0) + c.sent
        assert by_op == formula
    for w, o in enumerate(out):
        t, d = w % tp, w // tp
        peak = o["ledger"].peak()
        memory = zero_memory(config, tp, t, dp, d, stage)
        assert {k: peak[k] for k in ("params", "grads", "optimizer")} == {
            k: memory[k] for k in ("params", "grads", "optimizer")}
        assert o["shard_size"] == shard_elements(config, tp, t, dp, d)
        assert o["local_params"] == local_parameters(config, tp, t)


def test_units_tile_the_parameters_and_traffic_is_2_or_3_psi():
    """Mean over the dp ranks: exactly k (N_D - 1)/N_D Psi per rank-step, k = 2 for DP,
    ZeRO-1, ZeRO-2 and 3 for ZeRO-3 (untied head), whatever the chunking."""
    config, dp = CASES["llama"], 3
    units = unit_elements(config)
    P = local_parameters(config, 1, 0)
    assert sum(M for _, M, _ in units) == P
    psi = 8 * P
    for stage, k in [(0, 2), (1, 2), (2, 2), (3, 3)]:
        sent = [sum(collective_bytes(op, "ring", M, dp)["sent"][d]
                    for op, M in zero_collectives(config, 1, 0, dp, stage))
                for d in range(dp)]
        assert sum(sent) == k * (dp - 1) * psi                     # mean: k (N_D-1)/N_D Psi
        assert len(set(sent)) > 1                                  # ranks differ by chunks
    tied = CASES["gpt"]                                            # the embed unit twice
    embed = unit_elements(tied)[0][1]
    for stage, k in [(2, 2), (3, 3)]:
        extra = {2: 1, 3: 3}[stage]
        sent = sum(collective_bytes(op, "ring", M, dp)["sent"][d]
                   for d in range(dp) for op, M in zero_collectives(tied, 1, 0, dp, stage))
        assert sent == (k * local_parameters(tied, 1, 0) + extra * embed) * 8 * (dp - 1)


def test_dp_and_zero1_hold_what_the_formula_says():
    config, dp = CASES["gpt"], 3
    for zero in (False, True):
        out = SimulatedGroup(dp).run(train_parallel, config, 1, 6, SEQ, dp=dp, zero=zero,
                                     gather=False)
        for d, o in enumerate(out):
            memory = zero_memory(config, 1, 0, dp, d, int(zero))
            assert o["held"] == {k: memory[k] for k in ("params", "grads", "optimizer")}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("tp,dp", [(1, 2), (2, 2), (1, 3)])
def test_plan_equals_the_simulation(zero, tp, dp):
    config, batch = CASES["gpt"], 6 if dp == 3 else 4
    if zero >= 2:
        out = SimulatedGroup(tp * dp).run(train_sharded, config, 1, batch, SEQ, tp=tp, dp=dp,
                                          stage=zero, gather=False)
        held = [{k: o["ledger"].peak()[k] for k in ("params", "grads", "optimizer")}
                for o in out]
    else:
        out = SimulatedGroup(tp * dp).run(train_parallel, config, 1, batch, SEQ, tp=tp,
                                          dp=dp, zero=bool(zero), gather=False)
        held = [o["held"] for o in out]
    p = plan(config, dp=dp, tp=tp, zero=zero, batch=batch, seq=SEQ)
    counted = [sum(c.sent for c in o["step_calls"][0]) for o in out]
    assert p.sent == counted
    assert [{k: m[k] for k in ("params", "grads", "optimizer")}
            for m in p.memory_per_rank] == held
    assert p.memory["activations"] > 0       # each rank's caches: test_layout_matrix.py
    assert p.bubble == 0


def test_plan_bubble_and_ordering():
    config = CASES["llama"]
    assert plan(config, pp=2, microbatches=4, batch=8, seq=8).bubble == 1 / 4
    assert plan(config, pp=2, virtual=1, microbatches=2, batch=8, seq=8).bubble == 1 / 2
    stages = [plan(config, dp=4, zero=z, batch=8, seq=8).memory for z in range(4)]
    totals = [m["params"] + m["grads"] + m["optimizer"] for m in stages]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(dp=3), "divisible by dp"),
    (dict(zero=4), "zero must be one of"),
    (dict(zero=True), "zero must be one of"),
    (dict(dp=0), "dp must be a positive integer"),
    (dict(tp=-2), "tp must be a positive integer"),
    (dict(tp=3), "n_heads"),
    (dict(pp=3), "n_layers"),
    (dict(virtual=2), "virtual stages"),
    (dict(microbatches=3), "microbatches"),
    (dict(seq=99), "max_seq_len"),
    (dict(batch=0), "batch must be a positive integer"),
    (dict(dtype="int8"), "dtype must be one of"),
])
def test_plan_refuses_bad_layouts(kwargs, match):
    args = dict(dict(batch=4, seq=8), **kwargs)
    with pytest.raises(ValueError, match=match):
        plan(CASES["gpt"], **args)


def test_train_sharded_refuses_a_bad_stage():
    with pytest.raises(ValueError, match="stage must be one of"):
        SimulatedGroup(2).run(train_sharded, CASES["gpt"], 1, 4, SEQ, dp=2, stage=1)


def test_ledger_catches_an_array_still_referenced():
    ledger = Ledger()
    kept = np.zeros(10)
    key = ledger.hold("params", kept, "h0")
    with pytest.raises(RuntimeError, match="still referenced"):
        ledger.release(key)


def test_sharded_decoder_refuses_stage_1():
    from tfcore.parallel.comm import SimulatedGroup as G

    with pytest.raises(ValueError, match="stage must be one of"):
        G(1).run(lambda comm: ShardedDecoder(CASES["gpt"], comm, comm, stage=1))
