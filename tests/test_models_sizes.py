"""The size tables against what is allocated: the parameter and gradient buffers, and the
bytes of every buffer the forward's caches keep alive (tfcore.models.sizes.held_bytes)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tfcore import backend
from tfcore.backend import asarray, to_numpy
from tfcore.models import (
    Autoencoder,
    AutoencoderConfig,
    DecoderConfig,
    DecoderLM,
    EncoderClassifier,
    EncoderClassifierConfig,
    MLPClassifier,
    MLPConfig,
    decoder_sizes,
    held_bytes,
)


def _nbytes(array) -> int:
    return int(to_numpy(array).nbytes)


def _check_buffers(model, table):
    assert table["parameters"] == model.num_parameters() == model.params.size
    assert table["parameter_bytes"] == _nbytes(model.params.data)
    assert table["gradient_bytes"] == _nbytes(model.params.grad)
    assert table["optimizer_bytes"] == 2 * table["parameter_bytes"]
    assert table["total_training_bytes"] == (table["parameter_bytes"] + table["gradient_bytes"]
                                             + table["optimizer_bytes"]
                                             + table["activation_bytes"])


def _decoder_held(model, ids, targets):
    constants = [model.params.data, model.params.grad, ids, targets, model._sinusoidal]
    return held_bytes(model._cache, constants + list(model._rope or ()))


@pytest.mark.parametrize(
    "placement,norm,mlp,position,tied",
    list(itertools.product(("pre", "post"), ("layernorm", "rmsnorm"), ("gelu", "relu", "swiglu"),
                           ("learned", "sinusoidal", "rotary"), (True, False))))
def test_decoder_size_table_matches_allocation(placement, norm, mlp, position, tied, rng):
    cfg = DecoderConfig(vocab_size=11, max_seq_len=7, d_model=8, n_layers=2, n_heads=2,
                        d_ff=12, norm_placement=placement, norm=norm, mlp=mlp,
                        position=position, tied_head=tied, dropout=0.1)
    model = DecoderLM(cfg).init(0)
    B, S = 3, 5
    ids = asarray(rng.integers(0, 11, (B, S)), "int64")
    targets = asarray(rng.integers(0, 11, (B, S)), "int64")
    table = model.size_table(B, S)
    _check_buffers(model, table)
    model.forward(ids, targets, training=True, rng=backend.default_rng(0))
    assert _decoder_held(model, ids, targets) == table["activation_bytes"]
    model.forward(ids, targets)                                     # evaluation: no masks
    assert _decoder_held(model, ids, targets) == decoder_sizes(cfg, B, S, training=False)[
        "activation_bytes"]
    model.forward(ids)                                              # no targets: no loss cache
    assert _decoder_held(model, ids, None) == decoder_sizes(
        cfg, B, S, training=False, targets=False)["activation_bytes"]
    cache = model.new_kv_cache(B)
    assert sum(_nbytes(a) for a in cache.k + cache.v) == table["kv_cache_bytes"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decoder_sizes_on_each_backend(dtype, rng, backend_name):
    cfg = DecoderConfig.llama(vocab_size=13, max_seq_len=6, d_model=8, n_layers=2, n_heads=2,
                              d_ff=12, dtype=dtype, dropout=0.2)
    model = DecoderLM(cfg).init(0)
    ids = asarray(rng.integers(0, 13, (2, 6)), "int64")
    model.forward(ids, ids, training=True, rng=backend.default_rng(1))
    table = model.size_table(2, 6)
    _check_buffers(model, table)
    assert _decoder_held(model, ids, ids) == table["activation_bytes"]


def test_decoder_size_formula_at_gpt2_scale():
    """GPT-2 small, batch 4 x 1024 in float32: the table by hand, to the byte."""
    cfg = DecoderConfig(vocab_size=50257, max_seq_len=1024, d_model=768, n_layers=12,
                        n_heads=12, dtype="float32")
    t = decoder_sizes(cfg, 4, 1024, training=False)
    assert t["parameters"] == 124_439_808 and t["parameter_bytes"] == 4 * 124_439_808
    N, D, F_, V = 4096, 768, 3072, 50257
    per_layer = 4 * (8 * N * D + 2 * N + 4 * 12 * 1024 * 1024 + 2 * N * F_)
    assert t["activation_bytes_per_layer"] == per_layer
    assert t["activation_bytes"] == 12 * per_layer + 4 * (2 * N * D + N) + 4 * N * V + 9 * N


@pytest.mark.parametrize("heads,bias", [(1, False), (2, True)])
def test_encoder_classifier_size_table(heads, bias, rng, backend_name):
    cfg = EncoderClassifierConfig(n_features=5, seq_len=4, d_model=6, n_classes=3, d_attn=4,
                                  n_heads=heads, bias=bias)
    model = EncoderClassifier(cfg).init(0)
    x = asarray(rng.standard_normal((3, 4, 5)))
    labels = asarray(np.array([0, 2, 1]), "int64")
    model.forward(x, labels)
    table = model.size_table(3)
    _check_buffers(model, table)
    assert held_bytes(model._cache, [model.params.data, x, labels]) == table["activation_bytes"]


def test_mlp_size_table(rng, backend_name):
    model = MLPClassifier(MLPConfig(n_features=5, seq_len=4, d_hidden=6, n_classes=3)).init(0)
    x = asarray(rng.standard_normal((3, 4, 5)))
    labels = asarray(np.array([0, 2, 1]), "int64")
    model.forward(x, labels)
    table = model.size_table(3)
    _check_buffers(model, table)
    assert table["parameters"] == 5 * 6 + 4 * 6 + 24 * 3 + 3
    assert held_bytes(model._cache, [model.params.data, x, labels]) == table["activation_bytes"]


@pytest.mark.parametrize("d_input,dropout", [(None, 0.0), (3, 0.2)])
def test_autoencoder_size_table(d_input, dropout, rng, backend_name):
    cfg = AutoencoderConfig(d_model=8, n_heads=2, d_ff=12, n_layers=2, max_seq_len=6,
                            d_input=d_input, dropout=dropout)
    model = Autoencoder(cfg).init(0)
    x = asarray(rng.standard_normal((2, 5, cfg.width)))
    model.forward(x, training=True, rng=backend.default_rng(0))
    table = model.size_table(2, 5)
    _check_buffers(model, table)
    held = held_bytes(model._cache, [model.params.data, x, model._positions])
    assert held == table["activation_bytes"]


def test_seed_002_experiment_parameter_count():
    """d_model 64, 4 heads, d_ff 256, 2 layers (seed 002's reported run)."""
    cfg = AutoencoderConfig(d_model=64, n_heads=4, d_ff=256, n_layers=2, max_seq_len=32)
    per_layer = (4 * 64 * 64 + 4 * 64) + (2 * 64 * 256 + 256 + 64) + 4 * 64
    assert Autoencoder(cfg).num_parameters() == 2 * per_layer == 99_968


@pytest.mark.parametrize("changes", [
    dict(), dict(n_kv_heads=2), dict(attention="tiled", attention_block_size=3),
    dict(recompute="full"), dict(recompute="selective"),
    dict(recompute="full", attention="tiled", attention_block_size=4),
])
@pytest.mark.parametrize("preset", ["gpt", "llama"])
def test_step_flops_is_every_product_a_step_runs(preset, changes):
    """sizes.step_flops (the planner's compute term) equals the matmul FLOPs counted as a
    forward and backward run them, for GQA, SwiGLU, the tiled op and recomputation."""
    from tfcore import bench
    from tfcore.models import DecoderLM, sizes

    base = dict(vocab_size=23, max_seq_len=12, d_model=16, n_layers=2, n_heads=4, d_ff=24,
                dtype="float64")
    import dataclasses

    config = dataclasses.replace(DecoderConfig.llama(**base) if preset == "llama"
                                 else DecoderConfig(**base), **changes)
    ids = np.random.default_rng(0).integers(0, 23, size=(2, 10))
    model = DecoderLM(config).init(0)
    count = bench.count_step_flops(model, ids, ids)
    assert count.flops == sizes.step_flops(config, 2, 10) > 0
