"""ReLU, GELU (exact and tanh), dropout and the residual connection (float64)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tfcore import backend
from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close, check_gradients, random_upstream

pytestmark = pytest.mark.usefixtures("backend_name")


def _shape(rng):
    return tuple(int(n) for n in rng.integers(1, 5, size=3))


# --------------------------------------------------------------------------------------
# ReLU


def test_relu_forward_and_gradient(rng):
    x = rng.standard_normal(_shape(rng))
    x = np.where(np.abs(x) < 1e-3, 0.5, x)  # keep finite differences away from the kink at 0
    y, cache = F.relu_forward(asarray(x))
    assert_close("y", y, np.maximum(x, 0.0), tol=0.0)
    G = random_upstream(x.shape, rng)
    dx = F.relu_backward(asarray(G), cache)
    assert_close("dx", dx, G * (x > 0), tol=0.0)
    check_gradients(lambda x: F.relu_forward(x)[0], {"x": x}, {"x": dx}, G)


def test_relu_derivative_at_zero_is_zero(rng):
    x = np.array([-1.0, 0.0, 2.0])
    _, cache = F.relu_forward(asarray(x))
    dx = F.relu_backward(asarray(np.array([3.0, 5.0, 7.0])), cache)
    assert np.array_equal(to_numpy(dx), [0.0, 0.0, 7.0])


# --------------------------------------------------------------------------------------
# GELU


def _gelu_exact_ref(x):
    return np.vectorize(lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))))(x)


def _gelu_tanh_ref(x):
    c = math.sqrt(2.0 / math.pi)
    return np.vectorize(lambda v: 0.5 * v * (1.0 + math.tanh(c * (v + 0.044715 * v**3))))(x)


@pytest.mark.parametrize("approximate, reference", [("none", _gelu_exact_ref), ("tanh", _gelu_tanh_ref)])
def test_gelu_forward_and_gradient(rng, approximate, reference):
    x = 2.0 * rng.standard_normal(_shape(rng))
    y, cache = F.gelu_forward(asarray(x), approximate=approximate)
    assert_close("y", y, reference(x))
    G = random_upstream(x.shape, rng)
    dx = F.gelu_backward(asarray(G), cache)
    check_gradients(lambda x: F.gelu_forward(x, approximate=approximate)[0], {"x": x}, {"x": dx}, G)


def test_gelu_exact_derivative_closed_form(rng):
    """GELU'(x) = Phi(x) + x phi(x), evaluated with math.erf / math.exp."""
    x = np.linspace(-4.0, 4.0, 17)
    _, cache = F.gelu_forward(asarray(x))
    G = random_upstream(x.shape, rng)
    dx = F.gelu_backward(asarray(G), cache)
    phi = np.exp(-0.5 * x**2) / math.sqrt(2.0 * math.pi)
    Phi = np.vectorize(lambda v: 0.5 * (1.0 + math.erf(v / math.sqrt(2.0))))(x)
    assert_close("dx", dx, G * (Phi + x * phi))


def test_gelu_tanh_is_close_to_exact(rng):
    x = rng.uniform(-5.0, 5.0, size=200)
    exact, _ = F.gelu_forward(asarray(x), approximate="none")
    approx, _ = F.gelu_forward(asarray(x), approximate="tanh")
    gap = np.max(np.abs(to_numpy(exact) - to_numpy(approx)))
    assert 0.0 < gap < 1e-3


# --------------------------------------------------------------------------------------
# Dropout


def test_dropout_same_seed_same_mask(rng):
    x = rng.standard_normal((3, 4, 5))
    y1, c1 = F.dropout_forward(asarray(x), 0.5, backend.default_rng(7))
    y2, c2 = F.dropout_forward(asarray(x), 0.5, backend.default_rng(7))
    y3, _ = F.dropout_forward(asarray(x), 0.5, backend.default_rng(8))
    assert np.array_equal(to_numpy(y1), to_numpy(y2))
    assert np.array_equal(to_numpy(c1[0]), to_numpy(c2[0]))
    assert not np.array_equal(to_numpy(y1), to_numpy(y3))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_inverted_scaling(rng, p):
    """Kept entries are x / (1 - p), dropped ones exactly 0; the backward uses the same mask and scale."""
    x = rng.standard_normal((4, 5, 6))
    y, cache = F.dropout_forward(asarray(x), p, backend.default_rng(3))
    yn = to_numpy(y)
    keep = to_numpy(cache[0])
    assert keep.dtype == np.bool_ and keep.shape == x.shape
    assert 0 < keep.sum() < keep.size
    assert_close("kept", yn[keep], x[keep] / (1.0 - p))
    assert np.all(yn[~keep] == 0.0)
    G = random_upstream(x.shape, rng)
    dx = F.dropout_backward(asarray(G), cache)
    assert_close("dx", dx, np.where(keep, G / (1.0 - p), 0.0))
    # The same seed reproduces the mask, so finite differences see one fixed function.
    check_gradients(lambda x: F.dropout_forward(x, p, backend.default_rng(3))[0], {"x": x}, {"x": dx}, G)


def test_dropout_identity_at_eval_and_p_zero(rng):
    x = rng.standard_normal((2, 3, 4))
    G = random_upstream(x.shape, rng)
    for kwargs in ({"p": 0.5, "training": False}, {"p": 0.0, "rng": backend.default_rng(0)}, {"p": 0.0}):
        y, cache = F.dropout_forward(asarray(x), **kwargs)
        assert np.array_equal(to_numpy(y), x), kwargs
        assert np.array_equal(to_numpy(F.dropout_backward(asarray(G), cache)), G), kwargs


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_preserves_the_mean(p):
    """E[y] = x. For x = 1 the sample mean is K / (n (1 - p)), K ~ Binomial(n, 1 - p),
    whose standard deviation is sqrt(p / ((1 - p) n)); allow 5 of them."""
    n = 1_000_000
    y, _ = F.dropout_forward(asarray(np.ones(n)), p, backend.default_rng(2024))
    std = math.sqrt(p / ((1.0 - p) * n))
    mean = float(np.mean(to_numpy(y)))
    assert abs(mean - 1.0) < 5.0 * std
    # and the fraction dropped is p, within 5 binomial standard deviations
    dropped = float(np.mean(to_numpy(y) == 0.0))
    assert abs(dropped - p) < 5.0 * math.sqrt(p * (1.0 - p) / n)


# --------------------------------------------------------------------------------------
# Residual


def test_residual_forward_and_gradients(rng):
    shape = _shape(rng)
    x = rng.standard_normal(shape)
    fx = rng.standard_normal(shape)
    y, cache = F.residual_forward(asarray(x), asarray(fx))
    assert_close("y", y, x + fx, tol=0.0)
    G = random_upstream(shape, rng)
    dx, dfx = F.residual_backward(asarray(G), cache)
    check_gradients(lambda x, fx: F.residual_forward(x, fx)[0], {"x": x, "fx": fx}, {"x": dx, "fx": dfx}, G)


def test_residual_around_a_linear_adds_both_paths(rng):
    """y = x + x W: dx = G + G W^T, the skip and the branch add (nothing is averaged)."""
    x = rng.standard_normal((2, 3, 4))
    W = rng.standard_normal((4, 4))

    def forward(x, W):
        fx, _ = F.linear_forward(x, W)
        return F.residual_forward(x, fx)[0]

    fx, lin_cache = F.linear_forward(asarray(x), asarray(W))
    _, res_cache = F.residual_forward(asarray(x), fx)
    G = random_upstream(x.shape, rng)
    d_skip, d_branch = F.residual_backward(asarray(G), res_cache)
    d_from_linear, dW, _ = F.linear_backward(d_branch, lin_cache)
    dx = to_numpy(d_skip) + to_numpy(d_from_linear)
    assert_close("dx", dx, G + G @ W.T)
    check_gradients(forward, {"x": x, "W": W}, {"x": dx, "W": dW}, G)
