"""Normalization (chapter 5): forward/backward pairs."""
from __future__ import annotations

from .. import checks
from ..backend import namespace
from ._common import _sum_over_leading


def layernorm_forward(x, gamma, beta, eps: float = 1e-5):
    """y = gamma * (x - mu) / sqrt(var + eps) + beta, mu and var (biased) over the last axis.

    x [..., D], gamma [D], beta [D]  ->  y [..., D]; cache: xhat [..., D], rstd [..., 1], gamma.
    """
    checks.float_inputs(x=x, gamma=gamma, beta=beta)
    checks.positive("eps", eps)
    width = x.shape[-1]
    checks.shape("gamma", gamma, (width,))
    checks.shape("beta", beta, (width,))
    xp = namespace(x)
    centered = x - xp.mean(x, axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(xp.mean(centered * centered, axis=-1, keepdims=True) + eps)  # [..., 1]
    xhat = centered * rstd
    return xhat * gamma + beta, (xhat, rstd, gamma)


def layernorm_backward(dy, cache):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma, row by row.

    dy [..., D]  ->  dx [..., D], dgamma [D] = sum(dy * xhat), dbeta [D] = sum(dy)
    """
    xhat, rstd, gamma = cache
    xp = namespace(dy)
    g = dy * gamma
    dx = rstd * (g - xp.mean(g, axis=-1, keepdims=True) - xhat * xp.mean(g * xhat, axis=-1, keepdims=True))
    return dx, _sum_over_leading(dy * xhat), _sum_over_leading(dy)


def rmsnorm_forward(x, gain, eps: float = 1e-6):
    """y = gain * x / sqrt(mean(x^2) + eps) over the last axis; eps keeps an all-zero row finite.

    x [..., D], gain [D]  ->  y [..., D]; cache: xhat [..., D], rrms [..., 1], gain.
    """
    checks.float_inputs(x=x, gain=gain)
    checks.positive("eps", eps)
    checks.shape("gain", gain, (x.shape[-1],))
    xp = namespace(x)
    rrms = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)          # [..., 1]
    xhat = x * rrms
    return xhat * gain, (xhat, rrms, gain)


def rmsnorm_backward(dy, cache):
    """dx = rrms * (g - xhat * mean(g * xhat)) with g = dy * gain, row by row.

    dy [..., D]  ->  dx [..., D], dgain [D] = sum(dy * xhat)
    """
    xhat, rrms, gain = cache
    xp = namespace(dy)
    g = dy * gain
    dx = rrms * (g - xhat * xp.mean(g * xhat, axis=-1, keepdims=True))
    return dx, _sum_over_leading(dy * xhat)
