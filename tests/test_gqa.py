"""Grouped-query and multi-query attention in the decoder (float64).

A GQA model equals the multi-head model whose key/value weights are copied to every query
head of a group; its gradients are that model's, summed over each group's copies; they pass
finite differences; the KV cache and the size table shrink as their formulas say.
"""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import backend
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close
from tfcore.models import DecoderConfig, DecoderLM
from tfcore.models.blocks import repeat_kv_heads, sum_kv_groups
from tfcore.models.sizes import decoder_sizes, held_bytes

from _model_checks import directional_errors, randomize

V, S, B = 13, 6, 2


def _config(n_kv_heads, llama=True, **overrides):
    if llama:
        return DecoderConfig.llama(vocab_size=V, max_seq_len=S, d_model=16, n_layers=2,
                                   n_heads=4, d_ff=24, n_kv_heads=n_kv_heads, **overrides)
    return DecoderConfig(vocab_size=V, max_seq_len=S, d_model=16, n_layers=2, n_heads=4,
                         n_kv_heads=n_kv_heads, **overrides)


def _widen(gqa, mha, n_heads=4, d_h=4):
    """Copy gqa's parameters into mha, each key/value head's columns to every query head of
    its group: the multi-head model that computes what the GQA model computes."""
    kv_heads = gqa.config.n_kv_heads
    groups = n_heads // kv_heads
    d = n_heads * d_h
    for name in mha.params.names:
        src = to_numpy(gqa.params[name])
        if not name.endswith(("attn.qkv.W", "attn.qkv.b")):
            mha.params[name][...] = asarray(src)
            continue
        cols = [np.arange(d)]                                       # q: unchanged
        for block in (0, 1):                                        # k, then v
            start = d + block * kv_heads * d_h
            cols.append(np.concatenate([start + (h // groups) * d_h + np.arange(d_h)
                                        for h in range(n_heads)]))
        mha.params[name][...] = asarray(src[..., np.concatenate(cols)])
    return cols


def _narrow(grad_mha, cols, kv_heads, n_heads=4, d_h=4):
    """The MHA gradient of a widened qkv tensor -> the GQA layout: sum each group's copies."""
    d = n_heads * d_h
    out = np.zeros(grad_mha.shape[:-1] + (d + 2 * kv_heads * d_h,))
    wide = grad_mha
    out[..., :d] = wide[..., :d]
    for block in (0, 1):
        for h in range(n_heads):
            dst = d + block * kv_heads * d_h + (h // (n_heads // kv_heads)) * d_h
            src = d + block * d + h * d_h
            out[..., dst:dst + d_h] += wide[..., src:src + d_h]
    return out


@pytest.mark.parametrize("n_kv_heads", [1, 2])
@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("attention", ["dense", "tiled"])
def test_gqa_equals_multi_head_with_shared_weights(rng, n_kv_heads, llama, attention):
    gqa = DecoderLM(_config(n_kv_heads, llama, attention=attention,
                            attention_block_size=4)).init(seed=2)
    randomize(gqa.params, rng)
    mha = DecoderLM(_config(4, llama)).init(seed=2)
    cols = _widen(gqa, mha)
    ids = asarray(rng.integers(0, V, (B, S)))
    targets = asarray(rng.integers(0, V, (B, S)))
    results = {}
    for label, model in (("gqa", gqa), ("mha", mha)):
        model.params.zero_grad()
        logits, loss = model.forward(ids, targets)
        model.backward()
        results[label] = to_numpy(logits)
    assert_close("logits", results["gqa"], results["mha"])
    for name in gqa.params.names:
        got = to_numpy(gqa.params.grad_of(name))
        want = to_numpy(mha.params.grad_of(name))
        if name.endswith(("attn.qkv.W", "attn.qkv.b")):
            want = _narrow(want, cols, n_kv_heads)
        assert_close(name, got, want)


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_gradients_match_finite_differences(rng, n_kv_heads):
    model = DecoderLM(_config(n_kv_heads)).init(seed=1)
    randomize(model.params, rng)
    ids = asarray(rng.integers(0, V, (B, S)))
    targets = asarray(rng.integers(0, V, (B, S)))
    model.params.zero_grad()
    model.forward(ids, targets)
    model.backward()

    def loss_fn():
        return model.forward(ids, targets)[1]

    names = [n for n in model.params.names if "attn" in n]
    errors = directional_errors(model.params, loss_fn, rng, names=names)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-7, f"{worst}: {errors[worst]:.2e}"


def test_repeat_and_group_sum_are_adjoint(rng):
    """<repeat(x), y> = <x, sum_groups(y)>: the group sum is the repeat's backward."""
    x = rng.standard_normal((2, 2, 3, 4))
    y = rng.standard_normal((2, 6, 3, 4))
    wide = to_numpy(repeat_kv_heads(asarray(x), 3))
    assert np.array_equal(wide[:, 4], x[:, 1])                 # query head 4 reads kv head 1
    lhs = float(np.sum(wide * y))
    rhs = float(np.sum(x * to_numpy(sum_kv_groups(asarray(y), 3))))
    assert abs(lhs - rhs) <= 1e-12 * abs(lhs)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("llama", [False, True])
def test_size_table_and_kv_cache(rng, n_kv_heads, llama):
    cfg = _config(n_kv_heads, llama, dropout=0.1)
    model = DecoderLM(cfg).init(0)
    table = decoder_sizes(cfg, B, S)
    assert table["parameters"] == model.num_parameters()
    ids = asarray(rng.integers(0, V, (B, S)), "int64")
    model.forward(ids, ids, training=True, rng=backend.default_rng(0))
    constants = [model.params.data, model.params.grad, ids, model._sinusoidal]
    held = held_bytes(model._cache, constants + list(model._rope or ()))
    assert held == table["activation_bytes"]
    cache = model.new_kv_cache(B)
    measured = sum(int(to_numpy(a).nbytes) for a in cache.k + cache.v)
    assert measured == table["kv_cache_bytes"] == 2 * 2 * B * S * n_kv_heads * 4 * 8


def test_generation_with_a_shared_kv_cache(rng):
    """Step-by-step logits through the GQA KV cache equal the full forward's."""
    model = DecoderLM(_config(2)).init(seed=5)
    randomize(model.params, rng)
    ids = asarray(rng.integers(0, V, (B, S)))
    full, _ = model.forward(ids)
    cache = model.new_kv_cache(B)
    first = model.forward_with_cache(ids[:, :3], cache)
    steps = [to_numpy(first)] + [to_numpy(model.forward_with_cache(ids[:, i:i + 1], cache))
                                 for i in range(3, S)]
    assert_close("cached logits", np.concatenate(steps, axis=1), full)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 3), (4, 8), (6, 4)])
def test_refuses_heads_not_a_multiple(n_heads, n_kv_heads):
    with pytest.raises(ValueError, match=r"n_heads \(\d+\) must be a multiple of n_kv_heads"):
        DecoderLM(DecoderConfig(V, S, 24, 1, n_heads, n_kv_heads=n_kv_heads))
    with pytest.raises(ValueError, match="n_kv_heads must be a positive integer"):
        DecoderLM(DecoderConfig(V, S, 24, 1, 4, n_kv_heads=0))
