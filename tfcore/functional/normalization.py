"""Normalization (chapter 5): forward/backward pairs."""
from __future__ import annotations

import math

from .. import backend, checks
from ..backend import namespace
from ._caches import NormCache
from ._common import _sum_over_leading


def _check_finite(name, x):
    """A non-finite row statistic comes either from a non-finite x (an error) or from overflow."""
    xp = namespace(x)
    if not bool(xp.all(xp.isfinite(x))):
        raise ValueError(f"{name} has inf or nan entries: its normalization is undefined")


def _scaled_rows(x):
    """x / s, s = max |x| per row (1 for an all-zero row): [..., D] -> ([..., D], s [..., 1])."""
    xp = namespace(x)
    s = xp.max(xp.abs(x), axis=-1, keepdims=True)
    s = xp.where(s > 0, s, xp.ones((), dtype=x.dtype))
    return x / s, s


def layernorm_forward(x, gamma, beta, eps: float = 1e-5):
    """y = gamma * (x - mu) / sqrt(var + eps) + beta, mu and var (biased) over the last axis.

    x [..., D], gamma [D], beta [D]  ->  y [..., D]; cache: xhat [..., D], rstd [..., 1], gamma.
    D >= 1 (an empty batch gives an empty y); eps a finite number > 0; x must be finite.

    Large rows: where (x - mu)^2 overflows (|x| near 1e154 in float64, 1e19 in float32), the
    rows are divided by s = max |x| first and normalized with eps / s^2, which is the same
    function: (x - mu) / sqrt(var + eps) = (x/s - mu/s) / sqrt(var/s^2 + eps/s^2). So the
    result is right (and never beta by overflow) for any finite x.
    """
    xp, eps = _check_layernorm_forward(x, gamma, beta, eps)
    with backend.expected_overflow():                                           # repaired below
        centered = x - xp.mean(x, axis=-1, keepdims=True)
        var = xp.mean(centered * centered, axis=-1, keepdims=True)              # [..., 1]
    if bool(xp.all(xp.isfinite(var))):
        rstd = 1.0 / xp.sqrt(var + eps)                                         # [..., 1]
        xhat = centered * rstd
    else:
        _check_finite("x", x)
        xs, s = _scaled_rows(x)                                                 # x = s * xs
        cs = xs - xp.mean(xs, axis=-1, keepdims=True)
        with backend.expected_overflow():                                       # s * s may be inf
            t = xp.mean(cs * cs, axis=-1, keepdims=True) + eps / (s * s)        # (var + eps) / s^2
        positive = t > 0                # t == 0 only for a constant row whose eps / s^2 underflows
        t = xp.where(positive, t, xp.ones((), dtype=x.dtype))
        xhat = cs / xp.sqrt(t)                                                  # 0 on such a row
        at_eps = xp.full((), 1.0 / math.sqrt(eps), dtype=x.dtype)              # 1/sqrt(0 + eps)
        rstd = xp.where(positive, (1.0 / s) / xp.sqrt(t), at_eps)
    return xhat * gamma + beta, NormCache(xhat, rstd, gamma)


def layernorm_backward(dy, cache):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma, row by row.

    dy [..., D]  ->  dx [..., D], dgamma [D] = sum(dy * xhat), dbeta [D] = sum(dy)
    """
    xhat, rstd, gamma = _check_norm_backward(dy, cache)
    xp = namespace(dy)
    g = dy * gamma
    dx = rstd * (g - xp.mean(g, axis=-1, keepdims=True) - xhat * xp.mean(g * xhat, axis=-1, keepdims=True))
    return dx, _sum_over_leading(dy * xhat), _sum_over_leading(dy)


def rmsnorm_forward(x, gain, eps: float = 1e-6):
    """y = gain * x / sqrt(mean(x^2) + eps) over the last axis; eps keeps an all-zero row finite.

    x [..., D], gain [D]  ->  y [..., D]; cache: xhat [..., D], rrms [..., 1], gain.
    D >= 1 (an empty batch gives an empty y); eps a finite number > 0; x must be finite.
    Where mean(x^2) overflows, rows are divided by max |x| first and normalized with
    eps / s^2: the same function, computed without overflow (see layernorm_forward).
    """
    xp, eps = _check_rmsnorm_forward(x, gain, eps)
    with backend.expected_overflow():                                           # repaired below
        mean_square = xp.mean(x * x, axis=-1, keepdims=True)                    # [..., 1]
    if bool(xp.all(xp.isfinite(mean_square))):
        rrms = 1.0 / xp.sqrt(mean_square + eps)                                 # [..., 1]
        xhat = x * rrms
    else:
        _check_finite("x", x)
        xs, s = _scaled_rows(x)
        with backend.expected_overflow():
            t = xp.mean(xs * xs, axis=-1, keepdims=True) + eps / (s * s)  # > 0: some |xs| is 1
        xhat = xs / xp.sqrt(t)
        rrms = (1.0 / s) / xp.sqrt(t)
    return xhat * gain, NormCache(xhat, rrms, gain)


def rmsnorm_backward(dy, cache):
    """dx = rrms * (g - xhat * mean(g * xhat)) with g = dy * gain, row by row.

    dy [..., D]  ->  dx [..., D], dgain [D] = sum(dy * xhat)
    """
    xhat, rrms, gain = _check_norm_backward(dy, cache)
    xp = namespace(dy)
    g = dy * gain
    dx = rrms * (g - xhat * xp.mean(g * xhat, axis=-1, keepdims=True))
    return dx, _sum_over_leading(dy * xhat)


# -- the checks each op makes before its work (tfcore.ops makes them before a kernel's) --------

def _check_layernorm_forward(x, gamma, beta, eps):
    """layernorm_forward's checks: x [..., D], gamma [D], beta [D] of one float dtype and
    library, D >= 1, eps a finite number > 0 -> (xp, eps as a float)."""
    xp = checks.float_inputs(x=x, gamma=gamma, beta=beta)
    eps = checks.positive("eps", eps)
    width = checks.width("x", x, "D")
    checks.shape("gamma", gamma, (width,))
    checks.shape("beta", beta, (width,))
    return xp, eps


def _check_rmsnorm_forward(x, gain, eps):
    """rmsnorm_forward's checks: x [..., D], gain [D], D >= 1, eps > 0 -> (xp, eps)."""
    xp = checks.float_inputs(x=x, gain=gain)
    eps = checks.positive("eps", eps)
    checks.shape("gain", gain, (checks.width("x", x, "D"),))
    return xp, eps


def _check_norm_backward(dy, cache):
    """The backwards' check: dy like the forward's output -> (xhat, the rows' scale, gain)."""
    xhat, scale, gain = cache
    checks.upstream_like("dy", dy, xhat)
    return xhat, scale, gain
