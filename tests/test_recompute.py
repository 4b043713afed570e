"""Activation recomputation (chapter 17): DecoderConfig(recompute="full" | "selective").

The gradients are the stored-activation run's bit for bit (np.array_equal: the same ops on
the same inputs in the same order, dropout's masks replayed from a copy of the generator);
the bytes the caches keep equal the size table and what tracemalloc sees; the matmuls the
recomputation adds equal `recompute_flops`.
"""
from __future__ import annotations

import itertools
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest

from tfcore import backend
from tfcore.backend import asarray, to_numpy
from tfcore.models import DecoderConfig, DecoderLM, decoder_sizes, held_bytes
from tfcore.models.sizes import recompute_flops

MODES = ("none", "full", "selective")
V, B, S = 23, 3, 10


def _config(make, recompute, attention="dense", dtype="float64", **extra):
    settings = dict(multiple_of=16) if make is DecoderConfig.llama else {}
    settings.update(extra)
    return make(vocab_size=V, max_seq_len=S, d_model=16, n_layers=3, n_heads=4, dropout=0.1,
                dtype=dtype, attention=attention, attention_block_size=4, recompute=recompute,
                **settings)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    ids = asarray(rng.integers(0, V, (B, S)), "int64")
    targets = asarray(rng.integers(0, V, (B, S)), "int64")
    return ids, targets


def _held(model, ids, targets):
    constants = [model.params.data, model.params.grad, ids, targets, model._sinusoidal]
    return held_bytes(model._cache, constants + list(model._rope or ()))


def _step(cfg, ids, targets, training=True):
    """(loss, a copy of every gradient, the bytes the caches held after the forward)."""
    model = DecoderLM(cfg).init(1)
    model.params.zero_grad()
    _, loss = model.forward(ids, targets, training=training,
                            rng=backend.default_rng(5) if training else None)
    held = _held(model, ids, targets)
    model.backward()
    return to_numpy(loss), np.array(to_numpy(model.params.grad)), held


CASES = [(make, attention, dtype, placement)
         for make, attention, dtype, placement in itertools.product(
             (DecoderConfig, DecoderConfig.llama), ("dense", "tiled"), ("float32", "float64"),
             ("pre", "post"))
         if not (make is DecoderConfig.llama and placement == "post")]


@pytest.mark.parametrize("make,attention,dtype,placement", CASES)
def test_gradients_are_bit_identical_and_bytes_match_the_table(make, attention, dtype,
                                                              placement):
    ids, targets = _batch()
    runs = {}
    for mode in MODES:
        if attention == "tiled" and mode == "selective":
            continue                      # refused: see test_tiled_with_selective_is_refused
        cfg = _config(make, mode, attention, dtype, norm_placement=placement)
        runs[mode] = _step(cfg, ids, targets)
        assert runs[mode][2] == decoder_sizes(cfg, B, S)["activation_bytes"]
    loss, grad, held = runs["none"]
    assert np.all(np.isfinite(grad)) and np.any(grad != 0)
    for mode, (loss_m, grad_m, held_m) in runs.items():
        assert np.array_equal(loss_m, loss), mode
        assert np.array_equal(grad_m, grad), mode          # bit for bit, not allclose
        if mode != "none":
            assert held_m < held, mode


def test_gradients_bit_identical_with_gqa_and_without_kernels():
    from tfcore import kernels

    ids, targets = _batch(1)
    with kernels.disabled():
        runs = {mode: _step(_config(DecoderConfig, mode, n_kv_heads=2), ids, targets)
                for mode in MODES}
    for mode in MODES:
        assert np.array_equal(runs[mode][1], runs["none"][1]), mode
        cfg = _config(DecoderConfig, mode, n_kv_heads=2)
        assert runs[mode][2] == decoder_sizes(cfg, B, S)["activation_bytes"]


def test_evaluation_forward_recomputes_without_dropout():
    ids, targets = _batch(2)
    runs = {mode: _step(_config(DecoderConfig, mode), ids, targets, training=False)
            for mode in MODES}
    for mode in MODES:
        assert np.array_equal(runs[mode][1], runs["none"][1]), mode
        cfg = _config(DecoderConfig, mode)
        assert runs[mode][2] == decoder_sizes(cfg, B, S, training=False)["activation_bytes"]


def test_the_generator_goes_on_as_without_recomputation():
    """A copy replays the masks: the caller's generator ends where the stored run's ends."""
    ids, targets = _batch(3)
    states = {}
    for mode in MODES:
        model = DecoderLM(_config(DecoderConfig, mode)).init(1)
        rng = backend.default_rng(7)
        model.forward(ids, targets, training=True, rng=rng)
        model.backward()
        states[mode] = rng.random(4)
    for mode in MODES:
        assert np.array_equal(states[mode], states["none"]), mode


def test_byte_formulas_by_hand():
    """The per-block bytes of each mode, written out for one GPT-style config."""
    cfg = _config(DecoderConfig, "none")
    T, D, F_, H, f = B * S, 16, 64, 4, 8
    stored = f * (8 * T * D + 2 * T + B * H * S * S + 2 * T * F_) + B * H * S * S + 2 * T * D
    per = {}
    for mode in MODES:
        cfg = _config(DecoderConfig, mode)
        per[mode] = decoder_sizes(cfg, B, S)["activation_bytes_per_layer"]
    assert per["none"] == stored
    assert per["full"] == f * T * D
    assert per["none"] - per["selective"] == (f + 1) * B * H * S * S
    whole = {mode: decoder_sizes(_config(DecoderConfig, mode), B, S)["activation_bytes"]
             for mode in MODES}
    assert whole["none"] - whole["full"] == 3 * (stored - f * T * D)


@pytest.mark.parametrize("bad", ["all", "", "Full", None, True, 1])
def test_bad_recompute_is_refused(bad):
    with pytest.raises(ValueError, match="recompute must be one of"):
        DecoderLM(_config(DecoderConfig, bad))


def test_tiled_with_selective_is_refused():
    with pytest.raises(ValueError, match="attention='tiled' keeps none"):
        DecoderLM(_config(DecoderConfig, "selective", attention="tiled"))


@pytest.mark.parametrize("attention", ["dense", "tiled"])
def test_counted_matmuls_equal_the_formula(attention):
    ids, targets = _batch(4)
    counted = {}
    for mode in MODES:
        if attention == "tiled" and mode == "selective":
            continue
        cfg = _config(DecoderConfig, mode, attention)
        model = DecoderLM(cfg).init(1)
        with backend.count_matmuls() as count:
            count.phase = "forward"
            model.forward(ids, targets, training=True, rng=backend.default_rng(5))
            count.phase = "backward"
            model.backward()
        counted[mode] = count
        assert count.total("forward") == counted["none"].total("forward")
        extra = count.total("backward") - counted["none"].total("backward")
        assert extra == recompute_flops(cfg, B, S), mode
    model_flops = counted["none"].flops
    if attention == "dense":
        T, D, F_, L = B * S, 16, 64, 3
        n_mm = L * (4 * D * D + 2 * D * F_) + D * V
        assert model_flops == 6 * n_mm * T + 12 * L * S * S * D * B
        # a step is three forwards (chapter 11); full recomputation runs the blocks' forward
        # once more, selective attention's two products: HFU / MFU = 1 + extra / (3 forward)
        blocks_forward = L * (2 * T * (4 * D * D + 2 * D * F_) + 4 * B * S * S * D)
        head_forward = 2 * T * D * V
        assert Fraction(counted["full"].flops, model_flops) == 1 + Fraction(
            blocks_forward, 3 * (blocks_forward + head_forward))
        assert Fraction(counted["selective"].flops, model_flops) == 1 + Fraction(
            L * 4 * B * S * S * D, 3 * (blocks_forward + head_forward))


def test_peak_memory_follows_the_kept_bytes():
    """tracemalloc: after the forward it holds the kept bytes (plus a few Python objects);
    the peak of forward + backward saves the kept bytes' saving to within one block's
    stored bytes below and two above (see chapter 17 for why)."""
    rng = np.random.default_rng(5)
    b, s, v = 4, 64, 32
    ids = asarray(rng.integers(0, v, (b, s)), "int64")
    targets = asarray(rng.integers(0, v, (b, s)), "int64")
    kept, peak, after = {}, {}, {}
    for mode in MODES:
        cfg = DecoderConfig(vocab_size=v, max_seq_len=s, d_model=32, n_layers=6, n_heads=4,
                            dropout=0.1, recompute=mode)
        model = DecoderLM(cfg).init(0)
        model.forward(ids, targets, training=True, rng=backend.default_rng(0))   # warm-up
        model.backward()
        table = decoder_sizes(cfg, b, s)
        kept[mode], block = table["activation_bytes"], table["activation_bytes_per_layer"]
        if mode == "none":
            a_block = block
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            model.forward(ids, targets, training=True, rng=backend.default_rng(0))
            after[mode] = tracemalloc.get_traced_memory()[0] - base
            model.backward()
            peak[mode] = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        # what is traced beyond the arrays: the caches' tuples and the generators' copies
        assert 0 <= after[mode] - kept[mode] <= 64 * 1024, mode
    for mode in ("full", "selective"):
        saved_kept = kept["none"] - kept[mode]
        saved_peak = peak["none"] - peak[mode]
        assert saved_kept - 2 * a_block <= saved_peak <= saved_kept + a_block, mode
        assert saved_peak > 0
