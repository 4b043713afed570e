"""DecoderLM against an independent forward pass, and every DecoderConfig field against the
effect it documents.

`reference_forward` below is written from the documented semantics of DecoderLM (its module
docstring, blocks.py's, and each op's formula) as plain loops over positions, heads, queries
and keys. It imports nothing from tfcore.functional, so a wrong op pair, a setting that does
not reach the blocks, or a table built with the wrong base shows up as a difference in the
logits, not as the same mistake on both sides.
"""
from __future__ import annotations

import math
from dataclasses import fields, replace

import numpy as np
import pytest

from tfcore.backend import asarray, default_rng, to_numpy
from tfcore.models import DecoderConfig, DecoderLM

from _model_checks import randomize

TOL = 1e-12        # float64: max |difference| / max |reference logit|


# ---------------------------------------------------------------------------------------
# The reference: one sequence at a time, one position at a time


def _norm(v, p, name, cfg):
    """LayerNorm (biased variance, eps inside the root, gain and shift) or RMSNorm (gain only)
    of one row v [D]."""
    if cfg.norm == "layernorm":
        mean = sum(v) / len(v)
        var = sum((a - mean) ** 2 for a in v) / len(v)
        return (v - mean) / math.sqrt(var + cfg.eps) * p[name + ".g"] + p[name + ".b"]
    mean_square = sum(a * a for a in v) / len(v)
    return v / math.sqrt(mean_square + cfg.eps) * p[name + ".g"]


def _linear(v, p, name):
    """v [D_in] @ W [D_in, D_out] (+ b)."""
    out = v @ p[name + ".W"]
    return out + p[name + ".b"] if name + ".b" in p else out


def _rotate(vec, position, cfg):
    """RoPE on one head's vector [D_h]: pair (2i, 2i+1) turned by position * base^(-2i/D_h)."""
    out = vec.copy()
    d_h = len(vec)
    for i in range(d_h // 2):
        angle = position * cfg.rope_base ** (-2 * i / d_h)
        c, s = math.cos(angle), math.sin(angle)
        out[2 * i] = vec[2 * i] * c - vec[2 * i + 1] * s
        out[2 * i + 1] = vec[2 * i] * s + vec[2 * i + 1] * c
    return out


def _attention(xs, p, prefix, cfg, drop=None):
    """Causal multi-head self-attention of one sequence xs [S, D] -> [S, D]; with
    n_kv_heads < n_heads, query head h reads key/value head h // (n_heads / n_kv_heads).
    drop [H, S, S]: dropout's factors (0 or 1 / (1 - p)) on the probabilities, or None."""
    S, D, H, H_kv = len(xs), cfg.d_model, cfg.n_heads, cfg.n_kv_heads
    d_h, group = D // H, H // H_kv
    W_kv = H_kv * d_h
    qkv = [_linear(x, p, prefix + ".qkv") for x in xs]     # S rows of [D + 2 W_kv]: q | k | v
    merged = np.zeros((S, D))
    for h in range(H):
        cols = slice(h * d_h, (h + 1) * d_h)
        kv_cols = slice((h // group) * d_h, (h // group + 1) * d_h)
        q = [row[:D][cols] for row in qkv]
        k = [row[D:D + W_kv][kv_cols] for row in qkv]
        v = [row[D + W_kv:][kv_cols] for row in qkv]
        if cfg.position == "rotary":
            q = [_rotate(q[t], t, cfg) for t in range(S)]
            k = [_rotate(k[t], t, cfg) for t in range(S)]
        for i in range(S):
            scores = [sum(q[i][c] * k[j][c] for c in range(d_h)) / math.sqrt(d_h)
                      for j in range(i + 1)]                      # keys 0..i only (causal)
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for j in range(i + 1):
                factor = 1.0 if drop is None else drop[h, i, j]
                merged[i, cols] += weights[j] / total * factor * v[j]
    return [_linear(row, p, prefix + ".proj") for row in merged]


def _activation(u, cfg):
    if cfg.mlp == "relu":
        return np.array([max(a, 0.0) for a in u])
    if cfg.gelu_approximate == "tanh":
        return np.array([0.5 * a * (1 + math.tanh(math.sqrt(2 / math.pi)
                                                  * (a + 0.044715 * a ** 3))) for a in u])
    return np.array([0.5 * a * (1 + math.erf(a / math.sqrt(2))) for a in u])


def _mlp(x, p, prefix, cfg):
    """act(x W_fc + b) W_proj + b, or (silu(x W_gate + b) * (x W_fc + b)) W_proj + b."""
    up = _linear(x, p, prefix + ".fc")
    if cfg.mlp == "swiglu":
        gate = _linear(x, p, prefix + ".gate")
        hidden = np.array([g / (1 + math.exp(-g)) for g in gate]) * up
    else:
        hidden = _activation(up, cfg)
    return _linear(hidden, p, prefix + ".proj")


def _sinusoidal(position, width):
    """P[p, 2i] = sin(p / 10000^(2i/D)), P[p, 2i+1] = cos(the same angle)."""
    row = np.zeros(width)
    for c in range(width):
        angle = position / 10000.0 ** ((c - c % 2) / width)
        row[c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    return row


def reference_forward(cfg: DecoderConfig, p: dict, ids, targets=None, drops=None):
    """logits [B, S, V] (and the mean cross-entropy over targets that are not -100).

    drops: dropout's factors (0 or 1 / (1 - p)) for a training forward, or None:
    drops["embedding"] [B, S, D] and, for block i, drops["probabilities", i] [B, H, S, S],
    drops["attention output", i] [B, S, D], drops["mlp output", i] [B, S, D]."""
    B, S = ids.shape
    logits = np.zeros((B, S, cfg.vocab_size))

    def dropped(rows, key, b):                  # rows [S] of [D] times their factors
        return rows if drops is None else [r * f for r, f in zip(rows, drops[key][b])]

    for b in range(B):
        xs = []
        for t in range(S):
            x = p["wte"][ids[b, t]].copy()
            if cfg.position == "learned":
                x = x + p["wpe"][t]
            elif cfg.position == "sinusoidal":
                x = x + _sinusoidal(t, cfg.d_model)
            xs.append(x)
        xs = dropped(xs, "embedding", b)
        for i in range(cfg.n_layers):
            pre = f"h{i}"
            drop = None if drops is None else drops["probabilities", i][b]
            if cfg.norm_placement == "pre":
                a = _attention([_norm(x, p, pre + ".ln1", cfg) for x in xs], p, pre + ".attn",
                               cfg, drop)
                xs = [x + a_t for x, a_t in zip(xs, dropped(a, ("attention output", i), b))]
                m = [_mlp(_norm(x, p, pre + ".ln2", cfg), p, pre + ".mlp", cfg) for x in xs]
                xs = [x + m_t for x, m_t in zip(xs, dropped(m, ("mlp output", i), b))]
            else:
                a = dropped(_attention(xs, p, pre + ".attn", cfg, drop), ("attention output", i),
                            b)
                xs = [_norm(x + a_t, p, pre + ".ln1", cfg) for x, a_t in zip(xs, a)]
                m = dropped([_mlp(x, p, pre + ".mlp", cfg) for x in xs], ("mlp output", i), b)
                xs = [_norm(x + m_t, p, pre + ".ln2", cfg) for x, m_t in zip(xs, m)]
        for t, x in enumerate(xs):
            if cfg.norm_placement == "pre":
                x = _norm(x, p, "lnf", cfg)
            W = p["wte"].T if cfg.tied_head else p["head.W"]
            logits[b, t] = x @ W + (p["head.b"] if "head.b" in p else 0.0)
    if targets is None:
        return logits, None
    nll = [math.log(sum(math.exp(z) for z in logits[b, t])) - logits[b, t, targets[b, t]]
           for b in range(B) for t in range(S) if targets[b, t] != -100]
    return logits, sum(nll) / len(nll)


def _host_params(model):
    return {name: np.array(to_numpy(model.params[name]), dtype=np.float64)
            for name in model.params.names}


def _model(cfg, seed=0):
    """A model whose every parameter is moved off its initial value (gains off 1, biases
    off 0), so that a gain or a shift that is not applied changes the logits."""
    model = DecoderLM(cfg).init(seed)
    randomize(model.params, np.random.default_rng(seed + 1))
    return model


def _data(cfg, B=2, S=6, seed=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (B, S))
    targets = rng.integers(0, cfg.vocab_size, (B, S))
    targets[0, 2] = -100
    return ids, targets


def _relative(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


# ---------------------------------------------------------------------------------------
# The model equals the reference

SMALL = dict(vocab_size=13, max_seq_len=9, d_model=8, n_layers=2, n_heads=2)
CONFIGS = {
    "gpt2": DecoderConfig(**SMALL),
    "gpt2-eps-large": DecoderConfig(**SMALL, eps=0.5),
    "post-relu-sinusoidal-untied": DecoderConfig(**SMALL, norm_placement="post", mlp="relu",
                                                 position="sinusoidal", tied_head=False),
    "rmsnorm-erf-gelu-head-bias": DecoderConfig(**SMALL, norm="rmsnorm", head_bias=True,
                                                gelu_approximate="none", d_ff=12),
    "post-rmsnorm-rotary-swiglu": DecoderConfig(**SMALL, norm="rmsnorm", norm_placement="post",
                                                position="rotary", mlp="swiglu", d_ff=10),
    "llama": DecoderConfig.llama(13, 9, 8, 2, 2, d_ff=12),
    "llama-rope-base-eps": DecoderConfig.llama(13, 9, 8, 2, 2, d_ff=12, rope_base=3.0,
                                               eps=0.25),
    "llama-four-heads": DecoderConfig.llama(13, 9, 16, 1, 4, d_ff=24),
    "llama-grouped-query": DecoderConfig.llama(13, 9, 16, 2, 4, d_ff=24, n_kv_heads=2),
    "gpt2-multi-query-tiled": DecoderConfig(**SMALL, n_kv_heads=1, attention="tiled",
                                            attention_block_size=4),
    "gpt2-dropout-at-eval": DecoderConfig(**SMALL, dropout=0.3),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_loss_equal_the_reference(name):
    cfg = CONFIGS[name]
    model = _model(cfg)
    ids, targets = _data(cfg)
    logits, loss = model.forward(asarray(ids, "int64"), asarray(targets, "int64"))
    ref_logits, ref_loss = reference_forward(cfg, _host_params(model), ids, targets)
    assert _relative(to_numpy(logits), ref_logits) < TOL
    assert abs(float(loss) - ref_loss) < TOL * abs(ref_loss)


# DecoderLM's docstring makes the order of dropout's draws a contract: the embedding's mask,
# then per block the attention probabilities', the attention output's and the MLP output's.
DOCUMENTED_ORDER = ("probabilities", "attention output", "mlp output")


def draw_drops(cfg, seed, B, S, order=DOCUMENTED_ORDER):
    """Dropout's factors drawn from numpy.random.default_rng(seed) as `rng.random(shape) >= p`
    (what dropout_forward draws), the embedding's first, then per block in `order`; returns
    (drops, the generator after the draws)."""
    rng = np.random.default_rng(seed)
    shapes = {"probabilities": (B, cfg.n_heads, S, S), "attention output": (B, S, cfg.d_model),
              "mlp output": (B, S, cfg.d_model)}

    def factors(shape):
        return (rng.random(shape) >= cfg.dropout) / (1.0 - cfg.dropout)

    drops = {"embedding": factors((B, S, cfg.d_model))}
    for i in range(cfg.n_layers):
        for kind in order:
            drops[kind, i] = factors(shapes[kind])
    return drops, rng


@pytest.mark.parametrize("name", ["pre-layernorm", "post-rmsnorm-rotary", "grouped-query"])
def test_dropout_draw_order_is_the_documented_one(name):
    """A training forward equals the reference fed masks drawn in the documented order from a
    generator of the same seed, and leaves its generator where that replay leaves its own
    (nothing else is drawn); masks drawn in another order give other logits."""
    cfg = {"pre-layernorm": DecoderConfig(**SMALL, dropout=0.3),
           "post-rmsnorm-rotary": DecoderConfig(**SMALL, dropout=0.3, norm="rmsnorm",
                                                norm_placement="post", position="rotary"),
           "grouped-query": DecoderConfig.llama(13, 9, 16, 2, 4, d_ff=24, n_kv_heads=2,
                                                dropout=0.3)}[name]
    model = _model(cfg)
    ids, targets = _data(cfg)
    rng = default_rng(11)
    logits, loss = model.forward(asarray(ids, "int64"), asarray(targets, "int64"),
                                 training=True, rng=rng)
    drops, replay = draw_drops(cfg, 11, *ids.shape)
    ref_logits, ref_loss = reference_forward(cfg, _host_params(model), ids, targets, drops)
    assert _relative(to_numpy(logits), ref_logits) < TOL
    assert abs(float(loss) - ref_loss) < TOL * abs(ref_loss)
    assert rng.bit_generator.state == replay.bit_generator.state
    for other in (("probabilities", "mlp output", "attention output"),
                  ("attention output", "probabilities", "mlp output")):
        wrong, _ = draw_drops(cfg, 11, *ids.shape, order=other)
        assert _relative(reference_forward(cfg, _host_params(model), ids, None, wrong)[0],
                         ref_logits) > 1e-3


def test_cached_generation_uses_the_same_settings():
    """forward_with_cache builds its own positions and norms: with eps and rope_base away
    from their defaults, its logits still equal the reference."""
    cfg = CONFIGS["llama-rope-base-eps"]
    model = _model(cfg)
    ids, _ = _data(cfg)
    cache = model.new_kv_cache(ids.shape[0])
    first = to_numpy(model.forward_with_cache(asarray(ids[:, :4], "int64"), cache))
    rest = to_numpy(model.forward_with_cache(asarray(ids[:, 4:], "int64"), cache))
    ref, _ = reference_forward(cfg, _host_params(model), ids)
    assert _relative(np.concatenate([first, rest], axis=1), ref) < TOL


def test_the_reference_is_not_blind():
    """The reference itself tells the settings apart: a default eps or rope_base in place of
    the configured one moves its logits by far more than the tolerance."""
    cfg = CONFIGS["llama-rope-base-eps"]
    model = _model(cfg)
    ids, _ = _data(cfg)
    p = _host_params(model)
    ref, _ = reference_forward(cfg, p, ids)
    for wrong in (replace(cfg, eps=1e-5), replace(cfg, rope_base=10000.0)):
        assert _relative(reference_forward(wrong, p, ids)[0], ref) > 1e-3


# ---------------------------------------------------------------------------------------
# Every field of DecoderConfig changes what it should
#
# Each field has a row: (overrides of the base config under which the field matters, the
# changed value, what it changes). A field added to DecoderConfig without a row fails
# test_every_field_has_a_row.
#   "forward":   the logits of the same parameters change, and still equal the reference
#   "shapes":    the parameters' shapes change (and the logits equal the reference)
#   "eval-only": dropout: documented to leave the evaluation forward unchanged; it changes
#                the training forward
#   "init":      init_std: documented to change the initial parameters only
#   "dtype":     the logits' dtype changes; their values agree to float32 precision
#   "length":    max_seq_len: the longest sequence accepted (and wpe's rows)
#   "same":      attention, attention_block_size, recompute: documented to compute the same
#                function another way (tiled, recomputed): the logits equal the base's to
#                round-off
#   "moe":       the mixture-of-experts fields (tests/test_moe.py compares MoE models with a
#                reference of their own): the parameters' shapes change, or on the same
#                parameters the loss does

FIELD_ROWS = {
    "vocab_size": ({}, 17, "shapes"),
    "max_seq_len": ({}, 12, "length"),
    "d_model": ({}, 12, "shapes"),
    "n_layers": ({}, 3, "shapes"),
    "n_heads": ({}, 4, "forward"),
    "d_ff": ({}, 20, "shapes"),
    "norm": ({}, "rmsnorm", "shapes"),
    "norm_placement": ({}, "post", "shapes"),
    "position": ({"position": "sinusoidal"}, "rotary", "forward"),
    "mlp": ({}, "relu", "forward"),
    "tied_head": ({"head_bias": False}, False, "shapes"),
    "bias": ({}, False, "shapes"),
    "dropout": ({}, 0.3, "eval-only"),
    "eps": ({}, 0.5, "forward"),
    "dtype": ({}, "float32", "dtype"),
    "head_bias": ({"tied_head": False}, False, "shapes"),
    "rope_base": ({"position": "rotary"}, 3.0, "forward"),
    "gelu_approximate": ({}, "none", "forward"),
    "init_std": ({}, 0.5, "init"),
    "n_kv_heads": ({}, 1, "shapes"),
    "attention": ({}, "tiled", "same"),
    "attention_block_size": ({"attention": "tiled"}, 3, "same"),
    "recompute": ({}, "full", "same"),
    "n_experts": ({}, 4, "moe"),
    "top_k": ({"n_experts": 4}, 1, "moe"),
    "moe_every": ({"n_experts": 4}, 2, "moe"),
    "router": ({"n_experts": 4}, "sigmoid", "moe"),
    "renormalize": ({"n_experts": 4}, True, "moe"),
    "n_shared_experts": ({"n_experts": 4}, 1, "moe"),
    "capacity_factor": ({"n_experts": 4}, 0.5, "moe"),
    "aux_loss_coef": ({"n_experts": 4}, 0.5, "moe"),
    "z_loss_coef": ({"n_experts": 4}, 0.5, "moe"),
    "aux_loss": ({"n_experts": 4}, "sequence", "moe"),
    "d_expert": ({"n_experts": 4}, 6, "moe"),
    "expert_groups": ({"n_experts": 4, "top_k": 2, "group_limit": 1}, 2, "moe"),
    "group_limit": ({"n_experts": 4, "top_k": 2, "expert_groups": 2, "group_limit": 2}, 1,
                    "moe"),
}


def test_every_field_has_a_row():
    assert {f.name for f in fields(DecoderConfig)} == set(FIELD_ROWS)


@pytest.mark.parametrize("field", sorted(FIELD_ROWS))
def test_each_field_changes_what_it_should(field):
    overrides, value, effect = FIELD_ROWS[field]
    base_cfg = DecoderConfig(**dict(SMALL, **overrides))
    assert getattr(base_cfg, field) != value
    cfg = replace(base_cfg, **{field: value})
    base, model = _model(base_cfg), _model(cfg)
    ids, _ = _data(base_cfg)
    x = asarray(ids, "int64")
    base_logits = to_numpy(base.forward(x)[0])
    same_shapes = cfg.param_shapes() == base_cfg.param_shapes()
    if effect == "shapes":
        assert not same_shapes
    if effect in ("forward", "eval-only", "init", "dtype", "length", "same", "moe") and same_shapes:
        model.params.load_flat(np.array(to_numpy(base.params.data), dtype=cfg.dtype))
    logits = to_numpy(model.forward(x)[0])
    if effect == "moe":
        targets = asarray(_data(base_cfg)[1], "int64")
        loss, base_loss = float(model.forward(x, targets)[1]), float(base.forward(x, targets)[1])
        assert not same_shapes or abs(loss - base_loss) > 1e-6
    elif effect in ("forward", "shapes"):
        ref, _ = reference_forward(cfg, _host_params(model), ids)
        assert _relative(logits, ref) < TOL
        if logits.shape == base_logits.shape:
            assert _relative(logits, base_logits) > 1e-6
    elif effect == "same":
        assert same_shapes
        assert _relative(logits, base_logits) < TOL
    elif effect == "eval-only":
        np.testing.assert_array_equal(logits, base_logits)
        kw = dict(training=True, rng=default_rng(0))
        assert _relative(to_numpy(model.forward(x, **kw)[0]), base_logits) > 1e-6
    elif effect == "init":
        np.testing.assert_array_equal(logits, base_logits)
        fresh, fresh_base = DecoderLM(cfg).init(0), DecoderLM(base_cfg).init(0)
        ratio = (np.std(to_numpy(fresh.params["wte"]))
                 / np.std(to_numpy(fresh_base.params["wte"])))
        assert abs(ratio - value / base_cfg.init_std) < 1e-12 * ratio
    elif effect == "dtype":
        assert logits.dtype == np.float32 and base_logits.dtype == np.float64
        assert _relative(logits, base_logits) < 1e-4
    else:  # length
        assert cfg.param_shapes()["wpe"] == (value, cfg.d_model)
        longer = asarray(np.zeros((1, value), dtype=np.int64), "int64")
        assert to_numpy(model.forward(longer)[0]).shape == (1, value, cfg.vocab_size)
        with pytest.raises(ValueError, match="exceeds max_seq_len"):
            base.forward(longer)
