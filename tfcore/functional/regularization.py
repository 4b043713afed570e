"""Dropout and the residual connection: forward/backward pairs."""
from __future__ import annotations

from .. import backend, checks
from ..backend import namespace
from ._caches import DropoutCache, Spec


def dropout_forward(x, p: float, rng=None, training: bool = True):
    """Inverted dropout: keep each entry with probability 1 - p and scale it by 1 / (1 - p).

    E[y] = x, so evaluation needs no rescaling: with training=False (or p == 0) it is the
    identity and returns x itself (not a copy).
    `rng` is a generator from tfcore.backend.default_rng(seed); the same seed gives the same
    mask. An int seed is rejected, not taken as a convenience: re-seeding at every call would
    drop the same entries at every step.
    x [...]  ->  y [...]; the cache: the boolean keep-mask (None at eval), the scale, and
    x's shape, dtype and library for the backward's check.
    """
    xp, p, training = _check_dropout_forward(x, p, training)
    like = Spec(tuple(x.shape), x.dtype, xp)
    if not training or p == 0.0:
        return x, DropoutCache(None, 1.0, like)
    checks.generator("rng", rng)
    keep = backend.uniform(rng, tuple(x.shape), like=x) >= p
    scale = 1.0 / (1.0 - p)
    y = xp.astype(keep, x.dtype)
    y *= x * scale
    return y, DropoutCache(keep, scale, like)


def dropout_backward(dy, cache):
    """dx = dy * keep / (1 - p): the same mask and scale as the forward pass.

    At eval (or p == 0) the identity: returns dy itself (not a copy).
    """
    keep, scale, xp = _check_dropout_backward(dy, cache)
    if keep is None:
        return dy
    dx = xp.astype(keep, dy.dtype)
    dx *= dy * scale
    return dx


def _check_dropout_forward(x, p, training):
    """dropout_forward's checks (tfcore.ops makes them before a kernel's work): x a float
    array, p a probability in [0, 1), training a bool -> (xp, p, training)."""
    xp = checks.float_inputs(x=x)
    p = checks.probability("p", p)
    training = checks.boolean("training", training)
    return xp, p, training


def _check_dropout_backward(dy, cache):
    """dropout_backward's check: dy like the forward's x -> (keep, scale, xp)."""
    keep, scale, (shape, dtype, xp) = cache
    checks.upstream("dy", dy, shape, dtype, xp)
    return keep, scale, xp


def residual_forward(x, fx):
    """y = x + f(x): the skip connection.   x [...], fx [...] (same shape)  ->  y [...]

    The cache records y's shape, dtype and library, for the backward's check.
    """
    xp = _check_residual_forward(x, fx)
    y = x + fx
    return y, Spec(tuple(y.shape), y.dtype, xp)


def _check_residual_forward(x, fx):
    """residual_forward's checks (tfcore.ops makes them before a kernel's sum): x, fx float
    arrays of one shape, dtype and library -> the namespace."""
    xp = checks.float_inputs(x=x, fx=fx)
    checks.shape("fx", fx, tuple(x.shape))
    return xp


def residual_backward(dy, cache=None):
    """The sum copies its gradient to both branches: dx = dy (the skip), dfx = dy (into f).

    Both are `dy` itself, not copies (the sum costs no memory): add them into other
    gradients out of place, never with an in-place update of one branch.
    With the forward's cache, dy is checked against y; without one (cache=None), only that
    dy is a float array.
    """
    _check_residual_backward(dy, cache)
    return dy, dy


def _check_residual_backward(dy, cache):
    """residual_backward's check: dy like the forward's y (or a float array, cache=None)."""
    if cache is None:
        checks.float_inputs(dy=dy)
    else:
        checks.upstream("dy", dy, *cache)
