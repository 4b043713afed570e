"""A run's state moves between layouts: saved under one (gather_state: every tensor and both
AdamW moments under their one-device names) and loaded under another (load_state), it goes
on as the uninterrupted one-device run does (float64, 1e-12), and bit for bit when the
layout stays the same; pipeline stages included (runner.build and train_step run them)."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore.models.decoder import DecoderConfig, DecoderLM
from tfcore.parallel import Layout, SimulatedGroup
from tfcore.parallel.checkpoint import check_state, gather_state, load_state
from tfcore.parallel.runner import build, train_step
from tfcore.parallel.harness import HYPER, make_batches, train_single

BATCH, SEQ = 4, 8
CONFIG = DecoderConfig(vocab_size=31, max_seq_len=16, d_model=16, n_layers=2, n_heads=4,
                       d_ff=32, dtype="float64", n_kv_heads=2)


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _leg(layout, state, first, last, total):
    """Steps first..last-1 under `layout`, from `state` (None: the initialisation) ->
    (losses, the state after them) of rank 0, and every rank's state equal."""
    ids, targets = make_batches(CONFIG, total, BATCH, SEQ)

    def body(world):
        run = build(world, CONFIG, layout, HYPER)
        if state is None:
            run.model.load_full(DecoderLM(CONFIG).init(0).params)
        else:
            load_state(run, state)
        losses = [train_step(run, ids[t], targets[t], BATCH)[0] for t in range(first, last)]
        return losses, gather_state(run)

    out = SimulatedGroup(layout.world_size).run(body)
    for _, other in out[1:]:
        for key in ("params", "m", "v"):
            assert np.array_equal(other[key], out[0][1][key])
    return out[0]


CHAINS = {
    "DP 2 x TP 2 -> ZeRO-3 over 4 -> one device -> CP 2 x TP 2, ZeRO-1": [
        Layout(dp=2, tp=2), Layout(dp=4, zero=3), Layout(), Layout(cp=2, tp=2, zero=1)],
    "TP 2 with SP, ZeRO-1 -> DP 2 x CP 2, ZeRO-2 -> TP 4 (shared KV heads)": [
        Layout(tp=2, dp=2, sp=True, zero=1), Layout(dp=2, cp=2, zero=2), Layout(tp=4)],
    # pipeline stages: each holds its block, the first wte and wpe, the last the final
    # norm, the head and its copy of the tied wte (the one-device state holds it once)
    "DP 2 x TP 2 -> PP 2 x DP 2, ZeRO-1, 2 micro-batches -> one device -> PP 2 x TP 2": [
        Layout(dp=2, tp=2), Layout(pp=2, dp=2, zero=1, micro_batches=2), Layout(),
        Layout(pp=2, tp=2, schedule="gpipe")],
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_a_run_resumes_under_other_layouts_as_one_device(name):
    layouts = CHAINS[name]
    total = 2 * len(layouts)
    reference = train_single(CONFIG, total, BATCH, SEQ)
    state, losses = None, []
    for k, layout in enumerate(layouts):
        leg_losses, state = _leg(layout, state, 2 * k, 2 * k + 2, total)
        losses += leg_losses
        assert state["t"] == 2 * k + 2
    assert _rel(losses, reference["losses"]) < 1e-12
    assert _rel(state["params"], reference["params"]) < 1e-12


@pytest.mark.parametrize("layout", [Layout(dp=2, tp=2, zero=1), Layout(pp=2, dp=2)],
                         ids=["dp2 x tp2, zero1", "pp2 x dp2"])
def test_the_same_layout_resumes_bit_for_bit(layout):
    straight_losses, straight = _leg(layout, None, 0, 4, 4)
    first, state = _leg(layout, None, 0, 2, 4)
    second, resumed = _leg(layout, state, 2, 4, 4)
    assert first + second == straight_losses
    for key in ("params", "m", "v"):
        assert np.array_equal(resumed[key], straight[key])


def test_a_state_that_does_not_fit_is_refused_before_anything_changes():
    _, state = _leg(Layout(), None, 0, 1, 1)

    def body(world):
        run = build(world, CONFIG, Layout(tp=2), HYPER)
        before = np.array(run.model.params.data, copy=True)
        for bad, match in ((dict(state, m=state["m"][:-1]), "m has shape"),
                           (dict(state, t=-1), "t must be an integer"),
                           (dict(state, v=np.full_like(state["v"], np.nan)), "v holds nan")):
            with pytest.raises(ValueError, match=match):
                load_state(run, bad)
        assert np.array_equal(run.model.params.data, before)
        check_state(run.model, state)

    SimulatedGroup(2).run(body)
