"""SiLU and SwiGLU: stable forward for large |x|, gradients (float64)."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close, check_gradients, random_upstream

pytestmark = pytest.mark.usefixtures("backend_name")


def _silu_ref(x):
    return np.vectorize(lambda v: v / (1.0 + math.exp(-v)) if v > -700 else 0.0)(x)


def test_silu_forward_and_gradient(rng):
    x = 3.0 * rng.standard_normal((2, 3, 4))
    y, cache = F.silu_forward(asarray(x))
    assert_close("y", y, _silu_ref(x))
    G = random_upstream(x.shape, rng)
    dx = F.silu_backward(asarray(G), cache)
    sig = 1.0 / (1.0 + np.exp(-x))
    assert_close("dx", dx, G * sig * (1.0 + x * (1.0 - sig)))
    check_gradients(lambda x: F.silu_forward(x)[0], {"x": x}, {"x": dx}, G, tol=1e-8)


def test_silu_is_finite_for_large_inputs():
    x = np.array([-1e4, -800.0, -40.0, 0.0, 40.0, 800.0, 1e4])
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # no overflow, no nan
        y, cache = F.silu_forward(asarray(x))
        dx = F.silu_backward(asarray(np.ones(7)), cache)
    y, dx = to_numpy(y), to_numpy(dx)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
    assert np.array_equal(y[[0, 1, 3]], [0.0, 0.0, 0.0]) and np.array_equal(y[-2:], x[-2:])
    assert_close("silu'(-40)", dx[2], math.exp(-40) * (1 - 40), tol=1e-12)
    assert np.array_equal(dx[-2:], [1.0, 1.0])


def test_swiglu_forward_and_gradients(rng):
    a = 2.0 * rng.standard_normal((2, 3, 5))
    b = rng.standard_normal((2, 3, 5))
    y, cache = F.swiglu_forward(asarray(a), asarray(b))
    assert_close("y", y, _silu_ref(a) * b)
    G = random_upstream(a.shape, rng)
    da, db = F.swiglu_backward(asarray(G), cache)
    assert_close("db", db, G * _silu_ref(a))
    check_gradients(
        lambda a, b: F.swiglu_forward(a, b)[0], {"a": a, "b": b}, {"a": da, "b": db}, G, tol=1e-8
    )


def test_float32_path(rng):
    a, b = rng.standard_normal((2, 4, 6))
    G = random_upstream(a.shape, rng)
    out = {}
    for dtype in ("float32", "float64"):
        y, cache = F.swiglu_forward(asarray(a, dtype), asarray(b, dtype))
        da, db = F.swiglu_backward(asarray(G, dtype), cache)
        assert all(str(t.dtype).endswith(dtype) for t in (y, da, db))
        out[dtype] = (y, da, db)
    for x32, x64 in zip(out["float32"], out["float64"]):
        assert_close("float32", x32, x64, tol=1e-5)


def m(text: str) -> str:
    return re.escape(text)


def test_errors():
    with pytest.raises(ValueError, match=m("b must have shape (2, 3), got (2, 4)")):
        F.swiglu_forward(asarray(np.zeros((2, 3))), asarray(np.zeros((2, 4))))
    with pytest.raises(TypeError, match=m("x must be float32 or float64, got int64")):
        F.silu_forward(asarray(np.zeros(3), "int64"))
    _, cache = F.swiglu_forward(asarray(np.zeros((2, 3))), asarray(np.zeros((2, 3))))
    with pytest.raises(ValueError, match=m("dy must have the forward output's shape (2, 3)")):
        F.swiglu_backward(asarray(np.zeros((3, 2))), cache)
    _, cache = F.silu_forward(asarray(np.zeros(3)))
    with pytest.raises(ValueError, match=m("and dtype float64, got shape (3,) and dtype float32")):
        F.silu_backward(asarray(np.zeros(3), "float32"), cache)
