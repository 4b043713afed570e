"""Seed 001's encoder classifier and 2-layer ReLU network, seed 002's post-norm autoencoder:
forward against direct NumPy transcriptions of the seeds, every gradient against finite
differences (float64)."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import backend
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close, check_gradients
from tfcore.models import (
    Autoencoder,
    AutoencoderConfig,
    EncoderClassifier,
    EncoderClassifierConfig,
    MLPClassifier,
    MLPConfig,
)

from _model_checks import directional_errors, randomize

FD_TOL = 1e-7
B, n, m, k = 3, 4, 5, 3


def _standardize(x, eps=1e-5):
    mu = x.mean(axis=(1, 2), keepdims=True)
    return (x - mu) / np.sqrt(x.var(axis=(1, 2), keepdims=True) + eps)


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _data(rng):
    x = 2.0 * rng.standard_normal((B, n, m)) + 0.5
    labels = rng.integers(0, k, B)
    return x, labels


# ---------------------------------------------------------------------------------------
# Encoder classifier


def _encoder_reference(p, x, labels, cfg):
    """Seed 001 eqs. (1)-(9) for one example at a time, the CLS token appended LAST as the
    seed writes it, one head."""
    losses, logits = [], []
    for X, y in zip(x, labels):
        h1 = _standardize(X[None])[0] @ p["proj.W"]                       # [n, d1]
        hpre2 = np.concatenate([h1, p["cls"][None, :]], axis=0)            # [n+1, d1]
        Wq, Wk, Wv = np.split(p["attn.qkv.W"], 3, axis=1)
        Q, K, Vv, T = hpre2 @ Wq, hpre2 @ Wk, hpre2 @ Wv, hpre2 @ p["attn.skip.W"]
        S = _softmax(Q @ K.T / np.sqrt(cfg.d_attn))
        h2 = S @ Vv + T
        z = h2[-1] @ p["head.W"]                                            # row n+1
        logits.append(z)
        losses.append(-np.log(_softmax(z)[y]))
    return np.array(logits), np.mean(losses)


def test_encoder_classifier_matches_the_seed_with_cls_appended(rng, backend_name):
    cfg = EncoderClassifierConfig(n_features=m, seq_len=n, d_model=6, n_classes=k, d_attn=4)
    model = EncoderClassifier(cfg).init(seed=0)
    randomize(model.params, rng, scale=0.5)
    x, labels = _data(rng)
    logits, loss = model.forward(asarray(x), asarray(labels, "int64"))
    host = {name: to_numpy(model.params[name]) for name in model.params.names}
    ref_logits, ref_loss = _encoder_reference(host, x, labels, cfg)
    assert_close("logits", to_numpy(logits), ref_logits)
    assert_close("loss", to_numpy(loss), np.asarray(ref_loss))


def test_encoder_classifier_seed_gradients_w2_wt_wv(rng):
    """The seed's closed forms (1)-(3) for one example: dW2 = h2_cls^T (s - y),
    dW_T = hpre2_cls^T (s - y) W2^T, dW_V = hpre2^T S_cls^T (s - y) W2^T."""
    cfg = EncoderClassifierConfig(n_features=m, seq_len=n, d_model=6, n_classes=k, d_attn=4)
    model = EncoderClassifier(cfg).init(seed=0)
    randomize(model.params, rng, scale=0.5)
    x, labels = _data(rng)
    x, labels = x[:1], labels[:1]
    model.params.zero_grad()
    model.forward(asarray(x), asarray(labels, "int64"))
    model.backward()
    p = {name: to_numpy(model.params[name]) for name in model.params.names}
    hpre2 = np.concatenate([p["cls"][None, :], _standardize(x)[0] @ p["proj.W"]], axis=0)
    Wq, Wk, Wv = np.split(p["attn.qkv.W"], 3, axis=1)
    S = _softmax((hpre2 @ Wq) @ (hpre2 @ Wk).T / np.sqrt(cfg.d_attn))
    h2_cls = S[0] @ (hpre2 @ Wv) + hpre2[0] @ p["attn.skip.W"]
    delta = _softmax(h2_cls @ p["head.W"]) - np.eye(k)[labels[0]]          # s - y  [k]
    grad = model.params.grad_of
    assert_close("dW2", to_numpy(grad("head.W")), np.outer(h2_cls, delta))
    assert_close("dWT", to_numpy(grad("attn.skip.W")), np.outer(hpre2[0], delta @ p["head.W"].T))
    dWv = hpre2.T @ np.outer(S[0], delta @ p["head.W"].T)
    assert_close("dWV", to_numpy(grad("attn.qkv.W"))[:, 2 * cfg.d_attn:], dWv)


@pytest.mark.parametrize("heads,bias", [(1, False), (2, True)])
def test_encoder_classifier_gradients(heads, bias, rng, backend_name):
    cfg = EncoderClassifierConfig(n_features=m, seq_len=n, d_model=6, n_classes=k, d_attn=4,
                                  n_heads=heads, bias=bias)
    model = EncoderClassifier(cfg).init(seed=1)
    randomize(model.params, rng, scale=0.5)
    x, labels = _data(rng)
    labels[1] = -100
    loss_fn = lambda: model.forward(asarray(x), asarray(labels, "int64"))[1]  # noqa: E731
    model.params.zero_grad()
    loss_fn()
    model.backward()
    errors = directional_errors(model.params, loss_fn, rng)
    assert max(errors.values()) < FD_TOL, errors


def test_encoder_classifier_errors():
    with pytest.raises(ValueError, match=r"d_attn \(6\) must be divisible by n_heads \(4\)"):
        EncoderClassifier(EncoderClassifierConfig(m, n, 6, k, n_heads=4))
    model = EncoderClassifier(EncoderClassifierConfig(m, n, 6, k)).init()
    with pytest.raises(ValueError, match=r"x must have shape \(\*, 4, 5\)"):
        model.forward(asarray(np.zeros((2, n, m + 1))))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        model.forward(asarray(np.ones((2, n, m))), asarray(np.array([0, 3])))
    with pytest.raises(RuntimeError, match="needs a forward with labels"):
        model.forward(asarray(np.ones((2, n, m))))
        model.backward()


# ---------------------------------------------------------------------------------------
# The 2-layer ReLU network


def test_mlp_matches_the_seed(rng, backend_name):
    """Seed 001 part 2 per example: a1 = W1 pre^T + B1 [d, n]; flatten; a2 = W2 flat + B2."""
    cfg = MLPConfig(n_features=m, seq_len=n, d_hidden=6, n_classes=k)
    model = MLPClassifier(cfg).init(seed=0)
    randomize(model.params, rng, scale=0.5)
    x, labels = _data(rng)
    logits, loss = model.forward(asarray(x), asarray(labels, "int64"))
    p = {name: to_numpy(model.params[name]) for name in model.params.names}
    ref, losses = [], []
    for X, y in zip(x, labels):
        pre = _standardize(X[None])[0]                                     # [n, m]
        a1 = p["fc1.W"].T @ pre.T + p["fc1.b"].T                           # [d, n] (seed layout)
        flat = np.maximum(a1, 0).T.reshape(-1)                             # row-major over (n, d)
        z = flat @ p["fc2.W"] + p["fc2.b"]
        ref.append(z)
        losses.append(-np.log(_softmax(z)[y]))
    assert_close("logits", to_numpy(logits), np.array(ref))
    assert_close("loss", to_numpy(loss), np.asarray(np.mean(losses)))
    # seed eq. (3) and (6): dW2 = flat^T (s - y), dB2 = s - y (here averaged over the batch)
    model.params.zero_grad()
    model.backward()
    flat = np.maximum(_standardize(x) @ p["fc1.W"] + p["fc1.b"], 0).reshape(B, -1)
    delta = (_softmax(np.array(ref)) - np.eye(k)[labels]) / B
    assert_close("dW2", to_numpy(model.params.grad_of("fc2.W")), flat.T @ delta)
    assert_close("dB2", to_numpy(model.params.grad_of("fc2.b")), delta.sum(0))


def test_mlp_gradients(rng, backend_name):
    model = MLPClassifier(MLPConfig(n_features=m, seq_len=n, d_hidden=6, n_classes=k)).init(2)
    randomize(model.params, rng, scale=0.5)
    x, labels = _data(rng)
    loss_fn = lambda: model.forward(asarray(x), asarray(labels, "int64"))[1]  # noqa: E731
    model.params.zero_grad()
    loss_fn()
    model.backward()
    errors = directional_errors(model.params, loss_fn, rng)
    assert max(errors.values()) < FD_TOL, errors


def test_mlp_errors():
    with pytest.raises(ValueError, match="d_hidden must be a positive integer"):
        MLPClassifier(MLPConfig(m, n, 0, k))
    model = MLPClassifier(MLPConfig(m, n, 6, k))
    with pytest.raises(ValueError, match=r"labels must have shape \(2,\)"):
        model.forward(asarray(np.ones((2, n, m))), asarray(np.zeros(3, dtype=np.int64)))
    with pytest.raises(RuntimeError, match="needs a forward"):
        model.backward()


# ---------------------------------------------------------------------------------------
# The post-norm autoencoder


def _autoencoder_reference(model, x):
    """Seed 002's equations in plain NumPy (post-LayerNorm, biases, ReLU, sinusoidal)."""
    cfg = model.config
    p = {name: to_numpy(model.params[name]) for name in model.params.names}

    def ln(z, name):
        return (p[name + ".g"] * (z - z.mean(-1, keepdims=True))
                / np.sqrt(z.var(-1, keepdims=True) + cfg.eps) + p[name + ".b"])

    T = x.shape[1]
    pos = np.arange(T)[:, None] / 10000 ** (np.arange(0, cfg.d_model, 2) / cfg.d_model)
    pe = np.stack([np.sin(pos), np.cos(pos)], -1).reshape(T, -1)
    h = (x @ p["in.W"] + p["in.b"] if cfg.d_input else x) + pe
    H, Dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    for i in range(cfg.n_layers):
        qkv = h @ p[f"h{i}.attn.qkv.W"] + p[f"h{i}.attn.qkv.b"]
        q, k_, v = (a.reshape(*h.shape[:2], H, Dh).transpose(0, 2, 1, 3)
                    for a in np.split(qkv, 3, -1))
        heads = _softmax(q @ k_.transpose(0, 1, 3, 2) / np.sqrt(Dh)) @ v
        mh = heads.transpose(0, 2, 1, 3).reshape(h.shape) @ p[f"h{i}.attn.proj.W"]
        z = ln(h + mh + p[f"h{i}.attn.proj.b"], f"h{i}.ln1")
        ffn = np.maximum(z @ p[f"h{i}.mlp.fc.W"] + p[f"h{i}.mlp.fc.b"], 0)
        h = ln(z + ffn @ p[f"h{i}.mlp.proj.W"] + p[f"h{i}.mlp.proj.b"], f"h{i}.ln2")
    y = h @ p["out.W"] + p["out.b"] if cfg.d_input else h
    return y, np.mean((y - x) ** 2)


def _autoencoder(d_input, rng):
    cfg = AutoencoderConfig(d_model=8, n_heads=2, d_ff=12, n_layers=2, max_seq_len=6,
                            d_input=d_input)
    model = Autoencoder(cfg).init(seed=0)
    randomize(model.params, rng)
    return model, rng.standard_normal((2, 5, cfg.width))


@pytest.mark.parametrize("d_input", [None, 3])
def test_autoencoder_matches_the_seed(d_input, rng, backend_name):
    model, x = _autoencoder(d_input, rng)
    y, loss = model.forward(asarray(x))
    ref_y, ref_loss = _autoencoder_reference(model, x)
    assert_close("y", to_numpy(y), ref_y)
    assert_close("loss", to_numpy(loss), np.asarray(ref_loss))


@pytest.mark.parametrize("d_input", [None, 3])
def test_autoencoder_gradients(d_input, rng):
    model, x = _autoencoder(d_input, rng)
    target = rng.standard_normal(x.shape)
    loss_fn = lambda: model.forward(asarray(x), asarray(target))[1]  # noqa: E731
    model.params.zero_grad()
    loss_fn()
    dx = model.backward()
    errors = directional_errors(model.params, loss_fn, rng)
    assert max(errors.values()) < FD_TOL, errors
    # the input's gradient, with the target held fixed
    check_gradients(lambda x: model.forward(x, asarray(target))[1], {"x": x}, {"x": dx},
                    np.ones(()), tol=1e-7)


def test_autoencoder_with_dropout_gradients(rng):
    cfg = AutoencoderConfig(d_model=8, n_heads=2, d_ff=12, n_layers=2, max_seq_len=6,
                            dropout=0.2)
    model = Autoencoder(cfg).init(seed=0)
    randomize(model.params, rng)
    x = asarray(rng.standard_normal((2, 5, 8)))

    def loss_fn():
        return model.forward(x, training=True, rng=backend.default_rng(3))[1]

    model.params.zero_grad()
    loss_fn()
    model.backward()
    errors = directional_errors(model.params, loss_fn, rng)
    assert max(errors.values()) < FD_TOL, errors
    with pytest.raises(ValueError, match="needs rng"):
        model.forward(x, training=True)


def test_autoencoder_errors():
    with pytest.raises(ValueError, match=r"d_model \(8\) must be divisible by n_heads \(3\)"):
        Autoencoder(AutoencoderConfig(8, 3, 12, 1, 6))
    for flag in (True, "yes", 0):  # a bool is an int to Python, but never a width
        with pytest.raises(ValueError, match="d_input must be a positive integer or None"):
            Autoencoder(AutoencoderConfig(8, 2, 12, 1, 6, d_input=flag))
    model = Autoencoder(AutoencoderConfig(8, 2, 12, 1, 6))
    with pytest.raises(ValueError, match="exceeds max_seq_len=6"):
        model.forward(asarray(np.zeros((1, 7, 8))))
    with pytest.raises(ValueError, match=r"x must have shape \(\*, \*, 8\)"):
        model.forward(asarray(np.zeros((1, 5, 3))))
