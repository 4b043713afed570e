"""The decoder LM: every parameter gradient against finite differences for each block variant,
the KV cache against the uncached forward, sampling, configs and their errors (float64)."""
from __future__ import annotations

import itertools
from dataclasses import replace
import math

import numpy as np
import pytest

from tfcore import backend
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close
from tfcore.models import DecoderConfig, DecoderLM, sample_next, swiglu_width

from _model_checks import directional_errors, randomize

V, D, H, L, S, B = 11, 8, 2, 2, 5, 2
FD_TOL = 1e-7          # central differences, h = 1e-5, on a smooth float64 loss of order 1


def tiny(**overrides):
    settings = dict(vocab_size=V, max_seq_len=7, d_model=D, n_layers=L, n_heads=H)
    settings.update(overrides)
    return DecoderConfig(**settings)


def batch(rng, ignore=True):
    ids = rng.integers(0, V, (B, S))
    targets = rng.integers(0, V, (B, S))
    if ignore:
        targets[0, 1] = targets[1, 4] = -100
    return asarray(ids, "int64"), asarray(targets, "int64")


# Every pair of (placement, norm, mlp, position, head, dropout) appears in at least one row.
VARIANTS = [
    dict(norm_placement="pre", norm="layernorm", mlp="gelu", position="learned"),
    dict(norm_placement="post", norm="layernorm", mlp="relu", position="sinusoidal",
         tied_head=False),
    dict(norm_placement="pre", norm="rmsnorm", mlp="swiglu", position="rotary",
         tied_head=False, bias=False, d_ff=12),
    dict(norm_placement="post", norm="rmsnorm", mlp="gelu", position="rotary", dropout=0.2),
    dict(norm_placement="pre", norm="layernorm", mlp="relu", position="rotary", dropout=0.2,
         tied_head=False),
    dict(norm_placement="post", norm="layernorm", mlp="swiglu", position="learned",
         dropout=0.2, d_ff=12),
    dict(norm_placement="pre", norm="rmsnorm", mlp="gelu", position="sinusoidal",
         head_bias=True, dropout=0.2, gelu_approximate="none"),
    dict(norm_placement="post", norm="rmsnorm", mlp="relu", position="learned",
         tied_head=False, bias=False),
    dict(norm_placement="pre", norm="layernorm", mlp="swiglu", position="sinusoidal",
         tied_head=False, d_ff=12),
    dict(norm_placement="post", norm="layernorm", mlp="gelu", position="sinusoidal",
         tied_head=True, bias=False),
]


def _variant_id(v):
    return "-".join(str(v.get(k, "")) for k in ("norm_placement", "norm", "mlp", "position")) + (
        "-untied" if v.get("tied_head") is False else "-tied") + (
        "-drop" if v.get("dropout") else "")


def _loss_fn(model, ids, targets, training, seed=5):
    def loss():
        rng = backend.default_rng(seed) if training else None
        return model.forward(ids, targets, training=training, rng=rng)[1]
    return loss


def _check_every_tensor(variant, rng, names=None):
    model = DecoderLM(tiny(**variant)).init(seed=1)
    randomize(model.params, rng)
    ids, targets = batch(rng)
    training = variant.get("dropout", 0.0) > 0
    loss_fn = _loss_fn(model, ids, targets, training)
    model.params.zero_grad()
    loss_fn()
    model.backward()
    names = model.params.names if names is None else [model.params.names[i] for i in names]
    errors = directional_errors(model.params, loss_fn, rng, names=names)
    assert set(errors) == set(names) | {"*"}
    worst = max(errors, key=errors.get)
    assert errors[worst] < FD_TOL, f"{worst}: {errors[worst]:.2e}"
    return errors


@pytest.mark.parametrize("variant", VARIANTS, ids=[_variant_id(v) for v in VARIANTS])
def test_every_parameter_gradient_matches_finite_differences(variant, rng):
    _check_every_tensor(variant, rng)


@pytest.mark.parametrize("variant", [VARIANTS[2], VARIANTS[5]], ids=["llama", "post-drop"])
def test_gradients_on_each_backend(variant, rng, backend_name):
    """The same checks on every backend, for the first and the last few tensors and one
    direction over all of them (the full per-tensor check above runs on the default one)."""
    _check_every_tensor(variant, rng, names=[0, 1, 2, -3, -2, -1])


@pytest.mark.parametrize(
    "placement,norm,mlp,position,tied,dropout",
    list(itertools.product(("pre", "post"), ("layernorm", "rmsnorm"), ("gelu", "relu", "swiglu"),
                           ("learned", "sinusoidal", "rotary"), (True, False), (0.0, 0.25))))
def test_whole_gradient_every_combination(placement, norm, mlp, position, tied, dropout, rng):
    """One random direction over all parameters, for all 144 combinations (NumPy)."""
    cfg = tiny(norm_placement=placement, norm=norm, mlp=mlp, position=position,
               tied_head=tied, dropout=dropout, d_ff=12)
    model = DecoderLM(cfg).init(seed=2)
    randomize(model.params, rng)
    ids, targets = batch(rng)
    loss_fn = _loss_fn(model, ids, targets, dropout > 0)
    model.params.zero_grad()
    loss_fn()
    model.backward()
    errors = directional_errors(model.params, loss_fn, rng, names=[])
    assert errors["*"] < FD_TOL, errors


def test_gradient_with_respect_to_embedding_rows(rng):
    """d loss / d wte[v] row by row: rows of unseen tokens get exactly zero (untied head),
    and with a tied head every row receives the head's share."""
    for tied in (False, True):
        model = DecoderLM(tiny(tied_head=tied)).init(seed=3)
        randomize(model.params, rng)
        ids = np.array([[0, 1, 2, 1, 0], [2, 2, 3, 0, 1]])
        targets = rng.integers(0, V, (B, S))
        loss_fn = lambda: model.forward(asarray(ids), asarray(targets))[1]  # noqa: E731
        model.params.zero_grad()
        loss_fn()
        model.backward()
        grad_wte = to_numpy(model.params.grad_of("wte"))
        unseen = sorted(set(range(V)) - set(ids.ravel().tolist()))
        if tied:
            assert np.all(np.abs(grad_wte[unseen]).sum(axis=1) > 0)
        else:
            assert np.all(grad_wte[unseen] == 0.0)
        base = np.array(to_numpy(model.params.data))
        start, _ = model.params.offsets["wte"]
        h = 1e-5
        for row in range(V):
            u = np.zeros_like(base)
            direction = rng.standard_normal(D)
            u[start + row * D:start + (row + 1) * D] = direction
            model.params.load_flat(base + h * u)
            plus = float(loss_fn())
            model.params.load_flat(base - h * u)
            minus = float(loss_fn())
            model.params.load_flat(base)
            numeric = (plus - minus) / (2 * h)
            analytic = float(grad_wte[row] @ direction)
            assert abs(numeric - analytic) <= FD_TOL * max(abs(numeric), 1e-8), (tied, row)


def test_backward_with_an_upstream_on_the_logits(rng):
    """backward(dlogits) is the VJP of the logits: the gradient of sum(G * logits)."""
    model = DecoderLM(tiny(position="rotary", tied_head=False)).init(seed=4)
    randomize(model.params, rng)
    ids, _ = batch(rng)
    G = rng.standard_normal((B, S, V))
    loss_fn = lambda: np.sum(G * to_numpy(model.forward(ids)[0]))  # noqa: E731
    model.params.zero_grad()
    model.forward(ids)
    model.backward(asarray(G))
    errors = directional_errors(model.params, loss_fn, rng)
    assert max(errors.values()) < FD_TOL, errors


def test_gradients_accumulate_and_backward_needs_forward(rng):
    model = DecoderLM(tiny()).init(seed=0)
    ids, targets = batch(rng)
    model.forward(ids, targets)
    model.backward()
    once = np.array(to_numpy(model.params.grad))
    model.forward(ids, targets)
    model.backward()
    assert_close("accumulated", to_numpy(model.params.grad), 2 * once)
    with pytest.raises(RuntimeError, match="needs a forward"):
        model.backward()
    model.forward(ids)
    with pytest.raises(RuntimeError, match="needs a forward with targets"):
        model.backward()
    model.forward(ids)
    with pytest.raises(ValueError, match="dlogits must have shape"):
        model.backward(asarray(np.zeros((B, S, V + 1))))


def test_loss_matches_a_direct_computation(rng, backend_name):
    model = DecoderLM(tiny()).init(seed=0)
    ids, targets = batch(rng)
    logits, loss = model.forward(ids, targets)
    z = to_numpy(logits)
    t = to_numpy(targets)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    keep = t != -100
    expected = -np.mean(np.take_along_axis(logp, np.where(keep, t, 0)[..., None], -1)[..., 0][keep])
    assert_close("loss", to_numpy(loss), np.asarray(expected))
    assert tuple(logits.shape) == (B, S, V)
    assert abs(float(loss) - math.log(V)) < 0.05          # small init: nearly uniform


def test_dropout_is_seeded_and_off_in_evaluation(rng):
    model = DecoderLM(tiny(dropout=0.3)).init(seed=0)
    ids, targets = batch(rng)
    a = model.forward(ids, targets, training=True, rng=backend.default_rng(1))[1]
    b = model.forward(ids, targets, training=True, rng=backend.default_rng(1))[1]
    c = model.forward(ids, targets, training=True, rng=backend.default_rng(2))[1]
    e1 = model.forward(ids, targets)[1]
    e2 = model.forward(ids, targets, training=False, rng=backend.default_rng(2))[1]
    assert float(a) == float(b) and float(a) != float(c) and float(e1) == float(e2)
    with pytest.raises(ValueError, match="needs rng"):
        model.forward(ids, targets, training=True)


# ---------------------------------------------------------------------------------------
# KV cache and generation

CACHE_VARIANTS = [dict(position="learned"), dict(position="sinusoidal", norm_placement="post"),
                  dict(position="rotary", norm="rmsnorm", mlp="swiglu", tied_head=False, d_ff=12)]


@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=lambda v: v["position"])
def test_kv_cache_logits_equal_the_uncached_forward(variant, rng, backend_name):
    model = DecoderLM(tiny(**variant)).init(seed=0)
    randomize(model.params, rng)
    ids = asarray(rng.integers(0, V, (B, 7)), "int64")
    full, _ = model.forward(ids)                                          # [B, 7, V]
    cache = model.new_kv_cache(B)
    pieces = [model.forward_with_cache(ids[:, :3], cache)]                # a prompt of 3
    for t in range(3, 7):                                                 # then one at a time
        pieces.append(model.forward_with_cache(ids[:, t:t + 1], cache))
    cached = np.concatenate([to_numpy(p) for p in pieces], axis=1)
    assert cache.length == 7
    assert_close("cached logits", cached, to_numpy(full), tol=1e-12)
    with pytest.raises(ValueError, match="exceeds max_seq_len=7"):
        model.forward_with_cache(ids[:, :1], cache)


@pytest.mark.parametrize("variant", CACHE_VARIANTS, ids=lambda v: v["position"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8),
                                      dict(temperature=1.0, top_k=3),
                                      dict(temperature=1.3, top_p=0.7)])
def test_generate_with_and_without_cache_agree(variant, sampling, rng):
    model = DecoderLM(tiny(**variant)).init(seed=0)
    randomize(model.params, rng, scale=0.5)
    prompt = rng.integers(0, V, (B, 3))
    # 9 new tokens: past max_seq_len = 7, so the window slides (and the cache is rebuilt)
    cached = to_numpy(model.generate(asarray(prompt), 9, seed=7, **sampling))
    plain = to_numpy(model.generate(asarray(prompt), 9, seed=7, use_cache=False, **sampling))
    assert cached.shape == (B, 12) and np.array_equal(cached[:, :3], prompt)
    assert np.array_equal(cached, plain)
    again = to_numpy(model.generate(prompt[0], 9, seed=7, **sampling))   # 1-D prompt
    assert again.shape == (1, 12)


def test_greedy_generation_is_the_argmax_of_the_forward(rng):
    model = DecoderLM(tiny()).init(seed=0)
    randomize(model.params, rng, scale=0.5)
    prompt = rng.integers(0, V, (B, 2))
    out = to_numpy(model.generate(asarray(prompt), 4, temperature=0))
    for t in range(2, 6):
        logits, _ = model.forward(asarray(out[:, :t]))
        assert np.array_equal(np.argmax(to_numpy(logits)[:, -1], -1), out[:, t])


def test_sample_next_top_k_top_p_and_seed():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    draws = np.stack([sample_next(logits, 1.0, 2, None, np.random.default_rng(s))
                      for s in range(400)])
    assert set(draws[:, 0]) == {0, 1} and set(draws[:, 1]) == {2, 3}
    assert abs(np.mean(draws[:, 0] == 0) - 0.5 / 0.8) < 0.08
    draws = np.stack([sample_next(logits, 1.0, None, 0.75, np.random.default_rng(s))
                      for s in range(400)])
    assert set(draws[:, 0]) == {0, 1} and set(draws[:, 1]) == {3, 2}   # 0.5 + 0.3 >= 0.75
    only_best = sample_next(logits, 1.0, None, 0.4, np.random.default_rng(0))
    assert np.array_equal(only_best, [0, 3])
    assert np.array_equal(sample_next(logits, 0.0, None, None, None), [0, 3])
    a = sample_next(logits, 1.0, None, None, np.random.default_rng(9))
    b = sample_next(logits, 1.0, None, None, np.random.default_rng(9))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
])
def test_generate_rejects_bad_sampling_arguments(kwargs, message):
    model = DecoderLM(tiny()).init(seed=0)
    with pytest.raises(ValueError, match=message):
        model.generate(np.zeros((1, 2), dtype=np.int64), 1, **kwargs)
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative integer"):
        model.generate(np.zeros((1, 2), dtype=np.int64), -1)
    with pytest.raises(ValueError, match=r"prompt_ids must lie in \[0, 11\)"):
        model.generate(np.full((1, 2), 11), 1)


# ---------------------------------------------------------------------------------------
# Configs


def test_llama_config_has_no_biases_and_the_right_count():
    cfg = DecoderConfig.llama(vocab_size=V, max_seq_len=7, d_model=D, n_layers=L, n_heads=H,
                              d_ff=12)
    assert (cfg.norm, cfg.position, cfg.mlp, cfg.bias, cfg.tied_head) == (
        "rmsnorm", "rotary", "swiglu", False, False)
    model = DecoderLM(cfg)
    names = model.params.names
    assert not [n for n in names if n.endswith(".b")]
    per_layer = 2 * D + 3 * D * D + D * D + 3 * D * 12                   # 2 gains, qkv, proj, mlp
    assert model.num_parameters() == V * D + L * per_layer + D + D * V
    # Llama 2 7B: V = 32000, D = 4096, 32 layers, 32 heads, SwiGLU width 11008 -> 6,738,415,616
    big = DecoderConfig.llama(32000, 4096, 4096, 32, 32)
    assert big.d_ff == 11008
    assert sum(math.prod(s) for s in big.param_shapes().values()) == 6_738_415_616


def test_gpt2_small_parameter_count():
    cfg = DecoderConfig(vocab_size=50257, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12)
    assert sum(math.prod(s) for s in cfg.param_shapes().values()) == 124_439_808


def test_parameter_names_follow_the_interface():
    model = DecoderLM(tiny(tied_head=False, mlp="swiglu", d_ff=12))
    p = model.params
    assert p.shapes["wte"] == (V, D) and p.shapes["wpe"] == (7, D)
    assert p.shapes["h1.attn.qkv.W"] == (D, 3 * D) and p.shapes["h1.attn.qkv.b"] == (3 * D,)
    assert p.shapes["h0.mlp.gate.W"] == (D, 12) and p.shapes["h0.mlp.proj.W"] == (12, D)
    assert p.shapes["head.W"] == (D, V) and p.shapes["head.b"] == (V,)
    assert p.shapes["lnf.g"] == (D,) and p.shapes["lnf.b"] == (D,)
    post = DecoderLM(tiny(norm_placement="post", position="rotary"))
    assert "lnf.g" not in post.params and "wpe" not in post.params and "head.W" not in post.params


@pytest.mark.parametrize("overrides,message", [
    (dict(n_heads=3), r"d_model \(8\) must be divisible by n_heads \(3\)"),
    (dict(d_model=12, n_heads=4, position="rotary"), "head dimension .* must be even, got 3"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(norm_placement="sandwich"), "norm_placement must be one of"),
    (dict(position="alibi"), "position must be one of"),
    (dict(mlp="tanh"), "mlp must be one of"),
    (dict(dropout=1.0), r"dropout must lie in \[0, 1\)"),
    (dict(eps=0.0), "eps must be positive"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(n_layers=2.5), "n_layers must be a positive integer"),
    (dict(dtype="float16"), "dtype must be one of"),
    (dict(tied_head="no"), "tied_head must be True or False, got 'no'"),
    (dict(bias=1), "bias must be True or False, got 1"),
    (dict(head_bias="yes"), "head_bias must be True, False or None, got 'yes'"),
])
def test_config_errors_are_clear(overrides, message):
    with pytest.raises(ValueError, match=message):
        DecoderLM(tiny(**overrides))


def test_float_prompt_ids_are_refused_not_truncated():
    model = DecoderLM(tiny()).init(seed=0)
    with pytest.raises(ValueError, match="prompt_ids must be integers, got dtype float64"):
        model.generate(np.array([[1.7, 2.0]]), max_new_tokens=1)


def test_sequence_longer_than_max_seq_len_is_refused(rng):
    model = DecoderLM(tiny())
    with pytest.raises(ValueError, match="sequence of length 8 exceeds max_seq_len=7"):
        model.forward(asarray(np.zeros((1, 8), dtype=np.int64)))
    with pytest.raises(ValueError, match="targets must have shape"):
        model.forward(asarray(np.zeros((1, 3), dtype=np.int64)),
                      asarray(np.zeros((1, 4), dtype=np.int64)))


def test_float32_model_runs_and_stays_float32(rng):
    model = DecoderLM(tiny(dtype="float32", position="rotary")).init(seed=0)
    ids, targets = batch(rng)
    logits, loss = model.forward(ids, targets)
    model.backward()
    assert "float32" in str(logits.dtype) and "float32" in str(model.params.grad.dtype)
    ref = DecoderLM(tiny(position="rotary")).init(seed=0)
    logits64, _ = ref.forward(ids, targets)
    assert np.max(np.abs(to_numpy(logits) - to_numpy(logits64))) < 1e-5


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_blocks_without_residuals_have_correct_gradients(placement, rng):
    """The experiment of the block chapter (skips removed) is differentiated correctly too."""
    model = DecoderLM(tiny(norm_placement=placement))
    model.spec = replace(model.spec, residual=False)
    model.init(seed=0)
    randomize(model.params, rng)
    ids, targets = batch(rng)
    loss_fn = _loss_fn(model, ids, targets, False)
    model.params.zero_grad()
    loss_fn()
    model.backward()
    errors = directional_errors(model.params, loss_fn, rng)
    assert max(errors.values()) < FD_TOL, errors
    with_skips = DecoderLM(tiny(norm_placement=placement))
    with_skips.params.load_flat(model.params.data)
    assert float(with_skips.forward(ids, targets)[1]) != float(loss_fn())


def test_config_round_trip_and_decay_mask():
    cfg = tiny(position="rotary", tied_head=False, mlp="swiglu")
    again = DecoderConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.d_ff == swiglu_width(D)
    with pytest.raises(ValueError, match=r"unknown DecoderConfig field\(s\): \['colour'\]"):
        DecoderConfig.from_dict({**cfg.to_dict(), "colour": "red"})
    model = DecoderLM(cfg)
    mask = to_numpy(model.params.decay_mask())
    for name in model.params.names:
        start, stop = model.params.offsets[name]
        decayed = name.endswith(".W")             # qkv, proj, fc, gate, head: not wte, gains
        assert np.all(mask[start:stop] == float(decayed)), name
    assert "wte" in model.params.names and not np.any(mask[:V * D])
