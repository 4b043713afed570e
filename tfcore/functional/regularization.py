"""Dropout and the residual connection: forward/backward pairs."""
from __future__ import annotations

from .. import backend, checks
from ..backend import namespace


def dropout_forward(x, p: float, rng=None, training: bool = True):
    """Inverted dropout: keep each entry with probability 1 - p and scale it by 1 / (1 - p).

    E[y] = x, so evaluation needs no rescaling: with training=False (or p == 0) it is the identity.
    `rng` comes from tfcore.backend.default_rng(seed); the same seed gives the same mask.
    x [...]  ->  y [...]; the cache is the boolean keep-mask and the scale (None at eval).
    """
    checks.float_inputs(x=x)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must lie in [0, 1), got {p}")
    if not training or p == 0.0:
        return x, None
    if rng is None:
        raise ValueError("dropout in training needs an rng: pass tfcore.backend.default_rng(seed)")
    xp = namespace(x)
    keep = backend.uniform(rng, tuple(x.shape), like=x) >= p
    scale = 1.0 / (1.0 - p)
    y = xp.astype(keep, x.dtype)
    y *= x * scale
    return y, (keep, scale)


def dropout_backward(dy, cache):
    """dx = dy * keep / (1 - p): the same mask and scale as the forward pass (identity at eval)."""
    if cache is None:
        return dy
    keep, scale = cache
    xp = namespace(dy)
    dx = xp.astype(keep, dy.dtype)
    dx *= dy * scale
    return dx


def residual_forward(x, fx):
    """y = x + f(x): the skip connection.   x [...], fx [...] (same shape)  ->  y [...]"""
    checks.float_inputs(x=x, fx=fx)
    checks.shape("fx", fx, tuple(x.shape))
    return x + fx, None


def residual_backward(dy, cache=None):
    """The sum copies its gradient to both branches: dx = dy (the skip), dfx = dy (into f).

    Both are `dy` itself, not copies (the sum costs no memory): add them into other
    gradients out of place, never with an in-place update of one branch.
    """
    return dy, dy
