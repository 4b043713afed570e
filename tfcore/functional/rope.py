"""Rotary position embeddings, RoPE (chapter 7): a forward/backward pair and its tables.

Each pair of features (x[2i], x[2i+1]) of a query or key at position p is rotated by the
angle p * theta_i, theta_i = base^(-2i/D_h). A rotation is orthogonal, so the backward is
the inverse rotation (by -p * theta_i), and the dot product of a query rotated to m with a
key rotated to n depends on the positions only through m - n.
"""
from __future__ import annotations

from .. import backend, checks
from ..backend import namespace
from ._caches import RopeCache, Spec


def rope_tables(
    length: int, head_dim: int, base: float = 10000.0, dtype: str = "float64", offset: int = 0
):
    """cos and sin of the angles (offset + p) * base^(-2i / D_h), on the selected backend.

    -> cos [length, head_dim / 2], sin [length, head_dim / 2]; row p is position offset + p
    (a KV-cached step at position t uses offset=t). Angles are computed in float64, then cast.
    """
    length = checks.integer("length", length, least=1)
    head_dim = checks.integer("head_dim", head_dim, least=2)
    offset = checks.integer("offset", offset, least=0)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (pairs of features), got {head_dim}")
    base = checks.positive("base", base)
    xp = backend.xp()
    dt = checks.float_dtype("dtype", dtype, xp)
    pos = xp.astype(xp.arange(offset, offset + length), xp.float64)[:, None]   # [length, 1]
    pair = xp.astype(xp.arange(0, head_dim, 2), xp.float64)[None, :]            # [1, D_h/2]
    angle = pos * (base ** (-pair / head_dim))                                   # [length, D_h/2]
    return xp.astype(xp.cos(angle), dt), xp.astype(xp.sin(angle), dt)


def _rotate(x, cos, sin):
    """Rotate each pair (x[2i], x[2i+1]) by the angle whose cos and sin are given.

    x [..., S, D_h], cos and sin [S, D_h/2]  ->  [..., S, D_h] (a new array)
    """
    xp = namespace(x, cos, sin)
    even, odd = x[..., 0::2], x[..., 1::2]                                       # [..., S, D_h/2]
    rotated = xp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return xp.reshape(rotated, tuple(x.shape))                                  # interleave


def rope_forward(x, cos, sin):
    """y[2i] = x[2i] cos - x[2i+1] sin,  y[2i+1] = x[2i] sin + x[2i+1] cos, per position.

    x [B, H, S, D_h] (any leading axes: [..., S, D_h]); cos, sin [S_t, D_h/2] with S_t >= S,
    from rope_tables: the first S rows are used (build them with offset for a cached step).
    ->  y [..., S, D_h]; the cache holds the S rows of cos and sin, nothing of x.
    """
    xp = checks.float_inputs(x=x, cos=cos, sin=sin)
    checks.min_ndim("x", x, 2)
    seq, d_h = x.shape[-2], x.shape[-1]
    if d_h % 2:
        raise ValueError(f"x's last axis (D_h) must be even to form pairs, got {d_h}")
    for name, table in (("cos", cos), ("sin", sin)):
        checks.ndim(name, table, 2)
        if table.shape[1] != d_h // 2 or table.shape[0] < seq:
            raise ValueError(
                f"{name} must have shape (S_t >= {seq}, {d_h // 2}) to rotate x of shape "
                f"{tuple(x.shape)}, got {tuple(table.shape)}"
            )
    cos, sin = cos[:seq, :], sin[:seq, :]
    y = _rotate(x, cos, sin)
    return y, RopeCache(cos, sin, Spec(tuple(y.shape), y.dtype, xp))


def rope_backward(dy, cache):
    """dx = the inverse rotation of dy: by -angle, i.e. with sin negated (R^T = R^-1).

    dy [..., S, D_h]  ->  dx [..., S, D_h]
    """
    cos, sin, (shape, dtype, xp) = cache
    checks.upstream("dy", dy, shape, dtype, xp)
    return _rotate(dy, cos, -sin)
