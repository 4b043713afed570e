"""Clipping by the global norm in the pipeline (1F1B and interleaved, with and without
tensor parallelism inside the stages, the tied head's copy of wte counted once) and in
ZeRO-2/3 (each rank's shard of each unit, over dp and tp): the norms and the parameters
after three AdamW steps equal one device's clip in float64; a planted double count
(the tied wte counted on both stages, or a ZeRO shard counted as replicated over dp)
changes them."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tfcore.parallel import SimulatedGroup, optimizer, pipeline
from tfcore.parallel.harness import CONFIGS, train_pipeline, train_sharded, train_single
from tfcore.parallel.grads import parallel_pieces

STEPS, BATCH, SEQ = 3, 8, 8
MAX_NORM = 0.1      # below the gradient norms of these steps (0.6 to 1.9): the clip acts


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def config():
    """tiny with 4 blocks (the interleaved schedule needs L divisible by p v = 4); tied."""
    return dataclasses.replace(CONFIGS["tiny"](), n_layers=4)


@pytest.fixture(scope="module")
def clipped(config):
    out = train_single(config, STEPS, BATCH, SEQ, clip=MAX_NORM)
    assert config.tied_head
    assert min(out["norms"]) > 5 * MAX_NORM           # the clip acts at every step
    return out


PIPELINES = [dict(schedule="1f1b"), dict(schedule="1f1b", tp=2),
             dict(schedule="interleaved", n_virtual=2),
             dict(schedule="interleaved", n_virtual=2, tp=2), dict(schedule="1f1b", dp=2)]


@pytest.mark.parametrize("layout", PIPELINES)
def test_pipeline_clip_equals_one_device(config, clipped, layout):
    world = 2 * layout.get("tp", 1) * layout.get("dp", 1)
    outs = SimulatedGroup(world).run(train_pipeline, config, STEPS, BATCH, SEQ, pp=2,
                                     n_microbatches=2, clip=MAX_NORM, **layout)
    for out in outs:                                  # every rank knows the global norm
        assert rel(out["norms"], clipped["norms"]) < 1e-12
    assert rel(outs[0]["params"], clipped["params"]) < 1e-12


def test_pipeline_clip_with_an_untied_head_equals_one_device():
    """tiny-llama: the head has its own head.W on the last stage, nothing is masked."""
    config = dataclasses.replace(CONFIGS["tiny-llama"](), n_layers=4)
    assert not config.tied_head
    ref = train_single(config, STEPS, BATCH, SEQ, clip=MAX_NORM)
    assert min(ref["norms"]) > 5 * MAX_NORM
    out = SimulatedGroup(4).run(train_pipeline, config, STEPS, BATCH, SEQ, pp=2, tp=2,
                                n_microbatches=2, clip=MAX_NORM)[0]
    assert rel(out["norms"], ref["norms"]) < 1e-12
    assert rel(out["params"], ref["params"]) < 1e-12


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("tp", [1, 2])
def test_zero_clip_equals_one_device(config, clipped, stage, tp):
    outs = SimulatedGroup(2 * tp).run(train_sharded, config, STEPS, BATCH, SEQ, tp=tp, dp=2,
                                      stage=stage, clip=MAX_NORM)
    for out in outs:
        assert rel(out["norms"], clipped["norms"]) < 1e-12
    assert rel(outs[0]["params"], clipped["params"]) < 1e-12


def test_the_tied_wte_counted_twice_is_caught(config, clipped, monkeypatch):
    """Planted: the last stage counts its copy of wte too. The first step's norm then
    exceeds one device's by the wte gradient's share, and the parameters differ."""
    def every_element(stage):
        return np.ones(stage.params.size, dtype=bool)

    monkeypatch.setattr(pipeline, "counted_mask", every_element)
    out = SimulatedGroup(2).run(train_pipeline, config, STEPS, BATCH, SEQ, pp=2,
                                n_microbatches=2, clip=MAX_NORM)[0]
    assert out["norms"][0] > clipped["norms"][0] * (1 + 1e-3)
    assert rel(out["params"], clipped["params"]) > 1e-6


def test_a_zero_shard_counted_as_replicated_is_caught(config, clipped, monkeypatch):
    """Planted: the ZeRO-3 shards leave dp out of their groups, so each rank's norm
    counts its own shard only: the norms differ from one device's (and between ranks)."""
    def without_dp(grad, mask, tp, dp=None, pp=None, counted=None):
        return parallel_pieces(grad, mask, tp, None, pp, counted)

    monkeypatch.setattr(optimizer, "parallel_pieces", without_dp)
    outs = SimulatedGroup(2).run(train_sharded, config, STEPS, BATCH, SEQ, dp=2, stage=3,
                                 clip=MAX_NORM)
    assert all(rel(out["norms"], clipped["norms"]) > 1e-3 for out in outs)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_clip_is_refused_before_any_work(config, value):
    with pytest.raises(ValueError, match="clip must be"):
        SimulatedGroup(2).run(train_pipeline, config, 1, 4, 8, pp=2, n_microbatches=2,
                              clip=value)
    with pytest.raises(ValueError, match="clip must be"):
        SimulatedGroup(2).run(train_sharded, config, 1, 4, 8, dp=2, stage=3, clip=value)
