"""Activations (chapter 4): forward/backward pairs."""
from __future__ import annotations

import math

from .. import backend, checks
from ..backend import namespace
from ._caches import GeluCache, ReluCache, SiluCache, Spec, SwigluCache


def relu_forward(x):
    """y = max(x, 0).   x [...]  ->  y [...]; the cache is the boolean mask x > 0 and x's dtype."""
    xp = checks.float_inputs(x=x)
    return xp.maximum(x, 0.0), ReluCache(x > 0, x.dtype)


def relu_backward(dy, cache):
    """dx = dy where x > 0, else exactly 0, even where dy is inf or nan (the slope at 0 is 0)."""
    positive, dtype = cache
    checks.upstream("dy", dy, tuple(positive.shape), dtype, namespace(positive))
    xp = namespace(dy)
    dx = xp.astype(positive, dy.dtype)  # multiplying by the 0/1 mask is much faster than where()
    with backend.expected_overflow():
        dx *= dy
    # ... but 0 * inf and 0 * nan are nan: only then (one sum tells) take the exact, slower where()
    if bool(xp.isnan(xp.sum(dx))):
        dx = xp.where(positive, dy, xp.zeros((), dtype=dy.dtype))
    return dx


_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
GELU_APPROXIMATIONS = ("none", "tanh")

# GELU runs on the widest activation of the block ([B, S, D_ff]): its forms below update one
# buffer in place instead of allocating a temporary per arithmetic operation.


def _normal_cdf(x):
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2, in one new buffer."""
    cdf = backend.erf(x * _INV_SQRT_2)
    cdf += 1.0
    cdf *= 0.5
    return cdf


def _gelu_tanh_t(x):
    """t = tanh(sqrt(2/pi) (x + 0.044715 x^3)), with the argument as sqrt(2/pi) x (1 + 0.044715 x^2).

    For |x| beyond about 1e19 (float32) or 1e154 (float64) the argument overflows to +-inf,
    whose tanh is exactly +-1: the overflow is harmless, so it is not reported.
    """
    with backend.expected_overflow():
        u = x * x
        u *= _GELU_CUBIC
        u += 1.0
        u *= x
        u *= _SQRT_2_OVER_PI
        return namespace(x).tanh(u)


# Where |x| exceeds this, 1 - t^2 is exactly 0 in every float dtype (t rounds to +-1 once
# |x| passes about 6), so the backward's term x (1 - t^2) du/dx is 0; clipping x to it inside
# du/dx keeps du/dx finite (x^2 would overflow, and 0 * inf is nan) without changing a bit
# of the result anywhere else.
_GELU_CLIP = 2.0 ** 31


def gelu_forward(x, approximate: str = "none"):
    """GELU(x) = x * Phi(x), exactly (erf) or with the tanh approximation.

    exact: Phi(x) = (1 + erf(x / sqrt 2)) / 2
    tanh:  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    x [...]  ->  y [...]; the cache is x itself (not a copy) and the form.
    """
    _check_gelu_forward(x, approximate)
    if approximate == "none":
        y = _normal_cdf(x)                  # Phi(x)
        y *= x
    elif approximate == "tanh":
        y = _gelu_tanh_t(x)                 # t
        y += 1.0
        y *= 0.5                            # exact, and (1 + t) x would overflow near max
        y *= x                              # 0.5 (1 + t) x
    else:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    return y, GeluCache(x, approximate)


def gelu_backward(dy, cache, out=None):
    """dx = dy * GELU'(x).

    exact: GELU'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi) the normal density
    tanh:  0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(...)
    dy [...]  ->  dx [...]; with `out` (an array like dy, which may be dy itself when the
    caller has no further use for it) dx is written into out and out is returned.
    """
    x, approximate = _check_gelu_backward(dy, cache, out)
    xp = namespace(dy, x)
    if approximate == "none":
        with backend.expected_overflow():   # x^2 = inf for huge |x|: exp(-inf) = 0, as it should
            grad = x * x
        grad *= -0.5
        grad = xp.exp(grad)
        grad *= _INV_SQRT_2PI
        grad *= x                           # x phi(x)
        grad += _normal_cdf(x)              # Phi(x) + x phi(x)
    else:
        t = _gelu_tanh_t(x)
        du = xp.clip(x, -_GELU_CLIP, _GELU_CLIP)
        du *= du
        du *= 3.0 * _GELU_CUBIC
        du += 1.0
        du *= _SQRT_2_OVER_PI               # du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
        grad = t * t
        grad *= -1.0
        grad += 1.0                         # 1 - t^2
        grad *= x
        grad *= du
        grad *= 0.5                         # 0.5 x (1 - t^2) du/dx
        t += 1.0
        t *= 0.5                            # 0.5 (1 + t)
        grad += t
    grad *= dy
    if out is not None:
        out[...] = grad
        return out
    return grad


# the checks of the GELU pair (tfcore.ops makes them before a kernel's work)

def _check_gelu_forward(x, approximate):
    """gelu_forward's checks: x a float array, approximate one of GELU_APPROXIMATIONS."""
    checks.float_inputs(x=x)
    checks.choice("approximate", approximate, GELU_APPROXIMATIONS)


def _check_gelu_backward(dy, cache, out):
    """gelu_backward's checks: dy (and out) like the forward's x -> (x, approximate)."""
    x, approximate = cache
    checks.upstream_like("dy", dy, x)
    if out is not None:
        checks.upstream_like("out", out, x)
    return x, approximate


# --------------------------------------------------------------------------------------
# SiLU and SwiGLU (the gated feed-forward of a Llama-style block)


def _sigmoid(x):
    """1 / (1 + exp(-x)) without overflow: exp only ever sees -|x| <= 0.

    For x >= 0 it is 1 / (1 + e), for x < 0 it is e / (1 + e), with e = exp(-|x|) in (0, 1].
    x [...]  ->  [...] (a new array)
    """
    xp = namespace(x)
    e = xp.exp(-xp.abs(x))
    denominator = e + 1.0
    return xp.where(x >= 0, 1.0 / denominator, e / denominator)


def _silu_derivative(x, sig):
    """silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x))), in the buffer of a new array."""
    grad = 1.0 - sig
    grad *= x
    grad += 1.0
    grad *= sig
    return grad


def silu_forward(x):
    """silu(x) = x * sigmoid(x) (also called swish).   x [...]  ->  y [...]; the cache is x."""
    xp = checks.float_inputs(x=x)
    y = _sigmoid(x)
    y *= x
    return y, SiluCache(x, Spec(tuple(y.shape), y.dtype, xp))


def silu_backward(dy, cache):
    """dx = dy * sigmoid(x) (1 + x (1 - sigmoid(x))); the sigmoid is recomputed from x.

    dy [...]  ->  dx [...]
    """
    x, (shape, dtype, xp) = cache
    checks.upstream("dy", dy, shape, dtype, xp)
    grad = _silu_derivative(x, _sigmoid(x))
    grad *= dy
    return grad


def swiglu_forward(a, b):
    """y = silu(a) * b: the gated unit of a SwiGLU feed-forward (a = x W_gate, b = x W_fc).

    a [..., F], b [..., F]  ->  y [..., F]; the cache is (a, b).
    """
    xp = checks.float_inputs(a=a, b=b)
    checks.shape("b", b, tuple(a.shape))
    y = _sigmoid(a)
    y *= a
    y *= b
    return y, SwigluCache(a, b, Spec(tuple(y.shape), y.dtype, xp))


def swiglu_backward(dy, cache):
    """da = dy * b * silu'(a),  db = dy * silu(a); the sigmoid of a is recomputed.

    dy [..., F]  ->  da [..., F], db [..., F]
    """
    a, b, (shape, dtype, xp) = cache
    checks.upstream("dy", dy, shape, dtype, xp)
    sig = _sigmoid(a)
    db = sig * a
    db *= dy                        # dy * silu(a)
    da = _silu_derivative(a, sig)
    da *= b
    da *= dy
    return da, db
