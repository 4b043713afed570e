"""Extreme but finite inputs: GELU at |x| up to the largest float, and the fused
cross-entropy with a one-word vocabulary, on the reference path and on the kernel path."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from tfcore import functional as F
from tfcore import kernels

PATHS = ["reference", "kernel"]


def _path(name):
    if name == "kernel":
        assert kernels.enabled(), "the kernel path needs Numba and TFCORE_KERNELS unset"
        return contextlib.nullcontext()
    return kernels.disabled()


def _extremes(dtype):
    """Symmetric finite inputs from 0 to the dtype's largest value, through the points where
    x^2 overflows (about 1.8e19 in float32, 1.3e154 in float64)."""
    big = np.finfo(dtype).max
    magnitudes = [0.0, 1e-3, 1.0, 3.0, 10.0, 1e3, 2.0 ** 31, 1e10, 1.8e19, 2e19, 1e30, big]
    if dtype == "float64":
        magnitudes += [1.3e154, 1.4e154, 1e200]
    x = np.array(sorted({m for m in magnitudes} | {-m for m in magnitudes}), dtype=dtype)
    return x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["tanh", "none"])
def test_gelu_is_finite_and_saturates_at_extreme_x(path, dtype, form):
    x = _extremes(dtype)
    with _path(path), np.errstate(over="raise", invalid="raise"):
        y, cache = F.gelu_forward(x, form)
        dx = F.gelu_backward(np.ones_like(x), cache)
    assert y.dtype == dx.dtype == x.dtype
    assert np.isfinite(y).all() and np.isfinite(dx).all()
    high, low = x >= 10, x <= -10
    # GELU(x) = x Phi(x): Phi is 1 to the last bit past 10 and below 1e-23 before -10
    np.testing.assert_array_equal(y[high], x[high])
    np.testing.assert_array_equal(dx[high], 1.0)
    assert np.all(np.abs(y[low]) <= 1e-20) and np.all(np.abs(dx[low]) <= 1e-20)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("form", ["tanh", "none"])
def test_gelu_paths_agree_where_both_are_finite(dtype, form):
    x = _extremes(dtype)
    if dtype == "float64":
        x = x[np.abs(x) < 1e150]
    out = {}
    for path in PATHS:
        with _path(path):
            y, cache = F.gelu_forward(x, form)
            out[path] = (y, F.gelu_backward(np.ones_like(x), cache))
    # the float32 reference rounds 1 + t in float32, a cancellation near x = -3 (t = -0.996)
    # that costs up to eps_32 / 0.004 = 3e-5 relative; the kernel computes in float64
    tol = 1e-4 if dtype == "float32" else 1e-14
    for a, b in zip(out["reference"], out["kernel"]):
        np.testing.assert_allclose(a, b, rtol=tol, atol=1e-30)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cross_entropy_with_one_word_is_exactly_zero(path, dtype):
    """With V = 1 the only class has probability 1: the loss and its gradient are exactly 0."""
    logits = np.random.default_rng(0).standard_normal((6, 1)).astype(dtype) * 30
    labels = np.zeros(6, dtype=np.int64)
    labels[2] = -100
    with _path(path):
        loss, cache = F.cross_entropy_forward(logits, labels)
        dlogits = F.cross_entropy_backward(1.0, cache)
    assert float(loss) == 0.0
    assert dlogits.dtype == logits.dtype
    np.testing.assert_array_equal(dlogits, np.zeros_like(logits))


def test_float32_cross_entropy_gradient_paths_agree_to_rounding():
    """Every entry, the label's included, within a few float32 units of the mean's scale."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((40, 7)).astype("float32")
    labels = rng.integers(0, 7, 40)
    labels[::5] = -100
    grads = {}
    for path in PATHS:
        with _path(path):
            grads[path] = F.cross_entropy_backward(1.0, F.cross_entropy_forward(logits, labels)[1])
    scale = 1.0 / int(np.sum(labels != -100))
    gap = np.max(np.abs(grads["kernel"].astype(np.float64) - grads["reference"]))
    assert gap <= 4 * np.finfo(np.float32).eps * scale
