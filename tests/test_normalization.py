"""LayerNorm and RMSNorm: forward values, gradients, and the rows where eps matters (float64)."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close, check_gradients, random_upstream

pytestmark = pytest.mark.usefixtures("backend_name")


def _shape(rng):
    return tuple(int(n) for n in rng.integers(1, 5, size=2)) + (int(rng.integers(2, 6)),)


def _layernorm_ref(x, gamma, beta, eps):
    return gamma * (x - x.mean(axis=-1, keepdims=True)) / np.sqrt(x.var(axis=-1, keepdims=True) + eps) + beta


def _rmsnorm_ref(x, gain, eps):
    return gain * x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)


def _finite(*arrays):
    return all(np.all(np.isfinite(to_numpy(a))) for a in arrays)


# --------------------------------------------------------------------------------------
# LayerNorm


@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_layernorm_forward_matches_reference(rng, eps):
    shape = _shape(rng)
    x = 3.0 * rng.standard_normal(shape) + 1.0
    gamma, beta = rng.standard_normal(shape[-1]), rng.standard_normal(shape[-1])
    y, _ = F.layernorm_forward(asarray(x), asarray(gamma), asarray(beta), eps=eps)
    assert_close("y", y, _layernorm_ref(x, gamma, beta, eps))


def _layernorm_check(rng, x, eps=1e-5):
    D = x.shape[-1]
    gamma, beta = rng.standard_normal(D), rng.standard_normal(D)
    y, cache = F.layernorm_forward(asarray(x), asarray(gamma), asarray(beta), eps=eps)
    G = random_upstream(x.shape, rng)
    dx, dgamma, dbeta = F.layernorm_backward(asarray(G), cache)
    assert tuple(dgamma.shape) == (D,) and tuple(dbeta.shape) == (D,)
    check_gradients(
        lambda x, gamma, beta: F.layernorm_forward(x, gamma, beta, eps=eps)[0],
        {"x": x, "gamma": gamma, "beta": beta},
        {"x": dx, "gamma": dgamma, "beta": dbeta},
        G,
    )
    return y, dx, dgamma, dbeta


def test_layernorm_gradients(rng):
    _layernorm_check(rng, rng.standard_normal(_shape(rng)))


# With D <= 2 the normalized output hardly depends on x (x_hat is +-1 up to eps), so the true
# gradient is O(eps): a larger eps keeps finite differences well conditioned there.
@pytest.mark.parametrize("shape, eps", [((2, 1, 4), 1e-5), ((1, 3, 2), 0.5)], ids=["S=1", "D=2"])
def test_layernorm_gradients_edge_shapes(rng, shape, eps):
    _layernorm_check(rng, rng.standard_normal(shape), eps)


def test_layernorm_width_one(rng):
    """D = 1: every row is its own mean, so y = beta exactly and dx = 0 exactly."""
    x = rng.standard_normal((2, 3, 1))
    gamma, beta = rng.standard_normal(1), rng.standard_normal(1)
    y, cache = F.layernorm_forward(asarray(x), asarray(gamma), asarray(beta))
    assert np.all(to_numpy(y) == beta[0])
    dx, _, _ = F.layernorm_backward(asarray(random_upstream(x.shape, rng)), cache)
    assert np.all(to_numpy(dx) == 0.0)
    _layernorm_check(rng, x)


def test_layernorm_constant_row(rng):
    """A constant row has variance 0: eps keeps the output (= beta) and every gradient finite."""
    x = rng.standard_normal((2, 3, 4))
    x[0, 1, :] = 2.5
    x[1, 2, :] = 0.0
    D = x.shape[-1]
    gamma, beta = rng.standard_normal(D), rng.standard_normal(D)
    with np.errstate(divide="raise", invalid="raise"):
        y, cache = F.layernorm_forward(asarray(x), asarray(gamma), asarray(beta))
        G = random_upstream(x.shape, rng)
        dx, dgamma, dbeta = F.layernorm_backward(asarray(G), cache)
    assert _finite(y, dx, dgamma, dbeta)
    assert_close("y[0, 1]", to_numpy(y)[0, 1], beta)
    assert_close("y[1, 2]", to_numpy(y)[1, 2], beta)
    check_gradients(
        lambda x, gamma, beta: F.layernorm_forward(x, gamma, beta)[0],
        {"x": x, "gamma": gamma, "beta": beta},
        {"x": dx, "gamma": dgamma, "beta": dbeta},
        G,
    )


def test_layernorm_backward_closed_form(rng):
    """dx = rstd (g - mean g - xhat mean(g xhat)) with g = G gamma, written out in NumPy."""
    x = rng.standard_normal((2, 3, 5))
    gamma, beta = rng.standard_normal(5), rng.standard_normal(5)
    eps = 1e-5
    _, cache = F.layernorm_forward(asarray(x), asarray(gamma), asarray(beta), eps=eps)
    G = random_upstream(x.shape, rng)
    dx, dgamma, dbeta = F.layernorm_backward(asarray(G), cache)
    rstd = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + eps)
    xhat = (x - x.mean(axis=-1, keepdims=True)) * rstd
    g = G * gamma
    assert_close("dx", dx, rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)))
    assert_close("dgamma", dgamma, (G * xhat).sum(axis=(0, 1)))
    assert_close("dbeta", dbeta, G.sum(axis=(0, 1)))


# --------------------------------------------------------------------------------------
# RMSNorm


@pytest.mark.parametrize("eps", [1e-6, 0.1])
def test_rmsnorm_forward_matches_reference(rng, eps):
    shape = _shape(rng)
    x = rng.standard_normal(shape)
    gain = rng.standard_normal(shape[-1])
    y, _ = F.rmsnorm_forward(asarray(x), asarray(gain), eps=eps)
    assert_close("y", y, _rmsnorm_ref(x, gain, eps))


def _rmsnorm_check(rng, x, eps=1e-6):
    gain = rng.standard_normal(x.shape[-1])
    y, cache = F.rmsnorm_forward(asarray(x), asarray(gain), eps=eps)
    G = random_upstream(x.shape, rng)
    dx, dgain = F.rmsnorm_backward(asarray(G), cache)
    assert tuple(dgain.shape) == gain.shape
    check_gradients(lambda x, gain: F.rmsnorm_forward(x, gain, eps=eps)[0],
                    {"x": x, "gain": gain}, {"x": dx, "gain": dgain}, G)
    return y, dx, dgain


def test_rmsnorm_gradients(rng):
    _rmsnorm_check(rng, rng.standard_normal(_shape(rng)))


# D = 1: y = gain x / sqrt(x^2 + eps) is about gain * sign(x), its derivative O(eps): see above.
@pytest.mark.parametrize("shape, eps", [((2, 1, 4), 1e-6), ((2, 3, 1), 0.5)], ids=["S=1", "D=1"])
def test_rmsnorm_gradients_edge_shapes(rng, shape, eps):
    _rmsnorm_check(rng, rng.standard_normal(shape), eps)


@pytest.mark.parametrize("width", [1, 5])
def test_rmsnorm_backward_against_jacobian(rng, width):
    """dy_i/dx_j = gain_i (r delta_ij - x_i x_j r^3 / D), r = 1/sqrt(mean(x^2) + eps): dx = J^T G per row."""
    eps = 1e-6
    x = rng.standard_normal((2, 3, width))
    gain = rng.standard_normal(width)
    _, cache = F.rmsnorm_forward(asarray(x), asarray(gain), eps=eps)
    G = random_upstream(x.shape, rng)
    dx, dgain = F.rmsnorm_backward(asarray(G), cache)
    r = 1.0 / np.sqrt(np.mean(x**2, axis=-1) + eps)                                  # [B, S]
    J = gain[:, None] * (r[..., None, None] * np.eye(width)
                         - np.einsum("bsi,bsj->bsij", x, x) * (r**3)[..., None, None] / width)
    # both sides cancel 1 - x_hat^2 = O(eps) when D = 1: compare to 1e-8 rather than 1e-12
    assert_close("dx", dx, np.einsum("bsi,bsij->bsj", G, J), tol=1e-8)
    assert_close("dgain", dgain, np.einsum("bsi,bsi->i", G, x * r[..., None]))


def test_rmsnorm_all_zero_row(rng):
    """mean(x^2) = 0: without eps this divides by zero; with it the output is exactly 0 and finite."""
    x = rng.standard_normal((2, 3, 4))
    x[1, 0, :] = 0.0
    gain = rng.standard_normal(4)
    with np.errstate(divide="raise", invalid="raise"):
        y, cache = F.rmsnorm_forward(asarray(x), asarray(gain))
        G = random_upstream(x.shape, rng)
        dx, dgain = F.rmsnorm_backward(asarray(G), cache)
    yn = to_numpy(y)
    assert np.all(yn[1, 0] == 0.0)
    assert _finite(yn, dx, dgain)
    check_gradients(lambda x, gain: F.rmsnorm_forward(x, gain)[0], {"x": x, "gain": gain}, {"x": dx, "gain": dgain}, G)
