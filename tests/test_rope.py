"""Rotary position embeddings: tables, rotation, inverse-rotation backward (float64)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close, check_gradients, random_upstream

pytestmark = pytest.mark.usefixtures("backend_name")


def _reference(x, base=10000.0, offset=0):
    """Pair (x[2i], x[2i+1]) as the complex number x[2i] + i x[2i+1], times exp(i p theta_i)."""
    seq, d_h = x.shape[-2], x.shape[-1]
    theta = base ** (-np.arange(0, d_h, 2) / d_h)                      # [D_h/2]
    angle = (offset + np.arange(seq))[:, None] * theta[None, :]        # [S, D_h/2]
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
    y = np.empty_like(x)
    y[..., 0::2], y[..., 1::2] = z.real, z.imag
    return y


def test_tables_and_offset():
    cos, sin = F.rope_tables(7, 6, base=100.0)
    i = np.arange(3)
    angle = np.arange(7)[:, None] * 100.0 ** (-2 * i / 6)[None, :]
    assert_close("cos", cos, np.cos(angle))
    assert_close("sin", sin, np.sin(angle))
    cos3, sin3 = F.rope_tables(2, 6, base=100.0, offset=3)
    assert_close("cos offset", cos3, to_numpy(cos)[3:5])
    assert_close("sin offset", sin3, to_numpy(sin)[3:5])
    cos32, _ = F.rope_tables(2, 6, dtype="float32")
    assert str(cos32.dtype).endswith("float32")


def test_forward_matches_complex_reference(rng):
    x = rng.standard_normal((2, 3, 5, 8))
    cos, sin = F.rope_tables(9, 8)  # longer than S: the first 5 rows are used
    y, _ = F.rope_forward(asarray(x), cos, sin)
    assert_close("y", y, _reference(x))


def test_backward_is_inverse_rotation_and_matches_finite_differences(rng):
    x = rng.standard_normal((2, 2, 4, 6))
    cos, sin = F.rope_tables(4, 6, base=50.0)
    y, cache = F.rope_forward(asarray(x), cos, sin)
    assert_close("|y| = |x| per pair", np.linalg.norm(to_numpy(y), axis=-1),
                 np.linalg.norm(x, axis=-1))
    assert_close("inverse", F.rope_backward(y, cache), x)
    G = random_upstream(x.shape, rng)
    dx = F.rope_backward(asarray(G), cache)
    check_gradients(lambda x: F.rope_forward(x, cos, sin)[0], {"x": x}, {"x": dx}, G, tol=1e-9)


def test_scores_depend_only_on_relative_position(rng):
    """<rope(q, m), rope(k, n)> is the same for (m, n) and (m + t, n + t)."""
    q, k = rng.standard_normal((2, 8))
    cos, sin = F.rope_tables(12, 8)

    def at(vec, position):
        x = np.zeros((12, 8))
        x[position] = vec
        return to_numpy(F.rope_forward(asarray(x), cos, sin)[0])[position]

    for m, n, t in [(3, 1, 4), (0, 5, 6), (7, 7, 2)]:
        assert_close("score", at(q, m + t) @ at(k, n + t), at(q, m) @ at(k, n))


def test_cached_step_with_offset_matches_full_sequence(rng):
    x = rng.standard_normal((1, 2, 6, 4))
    full, _ = F.rope_forward(asarray(x), *F.rope_tables(6, 4))
    step, _ = F.rope_forward(asarray(x[:, :, 5:]), *F.rope_tables(1, 4, offset=5))
    assert_close("step", step, to_numpy(full)[:, :, 5:])


def test_float32_path(rng):
    x = rng.standard_normal((2, 2, 3, 4))
    G = random_upstream(x.shape, rng)
    out = {}
    for dtype in ("float32", "float64"):
        y, cache = F.rope_forward(asarray(x, dtype), *F.rope_tables(3, 4, dtype=dtype))
        dx = F.rope_backward(asarray(G, dtype), cache)
        assert str(y.dtype).endswith(dtype) and str(dx.dtype).endswith(dtype)
        out[dtype] = (y, dx)
    for a, b in zip(out["float32"], out["float64"]):
        assert_close("float32", a, b, tol=1e-5)


def m(text: str) -> str:
    return re.escape(text)


def test_errors():
    cos, sin = F.rope_tables(4, 6)
    with pytest.raises(ValueError, match=m("even head_dim >= 2, got length=4, head_dim=5")):
        F.rope_tables(4, 5)
    with pytest.raises(ValueError, match=m("x's last axis (D_h) must be even")):
        F.rope_forward(asarray(np.zeros((1, 1, 4, 5))), cos, sin)
    with pytest.raises(ValueError, match=m("cos must have shape (S_t >= 5, 3)")):
        F.rope_forward(asarray(np.zeros((1, 1, 5, 6))), cos, sin)
    with pytest.raises(TypeError, match=m("inputs must share one float dtype")):
        F.rope_forward(asarray(np.zeros((1, 1, 4, 6)), "float32"), cos, sin)
    _, cache = F.rope_forward(asarray(np.zeros((1, 1, 4, 6))), cos, sin)
    with pytest.raises(ValueError, match=m("dy must have the forward output's shape (1, 1, 4, 6)")):
        F.rope_backward(asarray(np.zeros((1, 4, 6))), cache)
