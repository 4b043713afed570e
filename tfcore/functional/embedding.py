"""Embedding lookup and positions (chapter 2): forward/backward pairs."""
from __future__ import annotations

from .. import backend, checks
from ..backend import namespace
from ._caches import EmbeddingCache, PositionalCache
from ._common import _flat_rows


def embedding_forward(ids, W):
    """x[b, s] = W[ids[b, s]]: a gather, the same as one_hot(ids) @ W without building the one-hot.

    ids [...] integers in [0, V), W [V, D]  ->  x [..., D]
    V and D must be at least 1; empty ids give an empty x.
    """
    checks.float_inputs(W=W)
    checks.ndim("W", W, 2)
    vocab, width = W.shape
    checks.width("W", W, "D")
    if vocab == 0:
        raise ValueError(f"W must have at least one row (V >= 1), got shape {tuple(W.shape)}")
    checks.integer_ids("ids", ids, vocab)
    xp = checks.same_library(ids=ids, W=W)
    flat_ids = xp.astype(xp.reshape(ids, (-1,)), xp.int64, copy=False)  # [N]; in range, so exact
    x = xp.reshape(xp.take(W, flat_ids, axis=0), tuple(ids.shape) + (width,))
    return x, EmbeddingCache(flat_ids, tuple(x.shape), W.dtype, tuple(W.shape))


def embedding_backward(dx, cache):
    """dW[v] = sum of dx over every position whose id is v (a scatter-add; ids may repeat).

    dx [..., D]  ->  dW [V, D]   (integer ids have no gradient)
    """
    flat_ids, w_shape = _check_embedding_backward(dx, cache)
    xp = namespace(dx)
    dW = xp.zeros(w_shape, dtype=dx.dtype)
    return backend.scatter_add(dW, flat_ids, _flat_rows(dx, w_shape[1]))


def _check_embedding_backward(dx, cache):
    """embedding_backward's check (tfcore.ops makes it before a kernel's work): dx like the
    forward's output x -> (the flat ids [N], W's shape)."""
    flat_ids, x_shape, w_dtype, w_shape = cache
    checks.upstream("dx", dx, x_shape, w_dtype, namespace(flat_ids))
    return flat_ids, w_shape


def sinusoidal_positions(length: int, width: int, dtype="float64", base: float = 10000.0):
    """The fixed table P[p, 2i] = sin(p / base^(2i/D)), P[p, 2i+1] = cos(p / base^(2i/D)).

    -> P [length, width] on the selected backend. An odd width keeps its last sine column.
    length and width are integers >= 1, base a finite number > 0, dtype 'float32' / 'float64'
    (or the backend's float dtype object).
    """
    length = checks.integer("length", length)
    width = checks.integer("width", width)
    if length < 1 or width < 1:
        raise ValueError(f"length and width must be at least 1, got length={length}, width={width}")
    base = checks.positive("base", base)
    xp = backend.xp()
    dt = checks.float_dtype("dtype", dtype, xp)
    pos = xp.astype(xp.arange(length), xp.float64)[:, None]             # [length, 1]
    even = xp.astype(xp.arange(0, width, 2), xp.float64)                # [ceil(width/2)]
    angle = pos / (base ** (even / width))                              # [length, ceil(width/2)]
    table = xp.stack([xp.sin(angle), xp.cos(angle)], axis=-1)           # [length, ceil(width/2), 2]
    table = xp.reshape(table, (length, 2 * even.shape[0]))[:, :width]    # interleave sin, cos
    return xp.astype(table, dt)


def positional_forward(x, P):
    """y = x + P[:S], broadcast over the batch (P learned, or the fixed sinusoidal table).

    x [B, S, D], P [S_max, D] with S <= S_max  ->  y [B, S, D]
    D must be at least 1; B = 0 or S = 0 gives an empty y.
    """
    xp = checks.float_inputs(x=x, P=P)
    checks.ndim("x", x, 3)
    checks.ndim("P", P, 2)
    checks.width("x", x, "D")
    seq, width = x.shape[1], x.shape[2]
    if P.shape[1] != width or P.shape[0] < seq:
        raise ValueError(
            f"P must have shape (S_max >= {seq}, {width}) to cover x of shape {tuple(x.shape)}, "
            f"got {tuple(P.shape)}"
        )
    y = x + P[:seq, :]
    return y, PositionalCache(tuple(y.shape), y.dtype, xp, tuple(P.shape))


def positional_backward(dy, cache):
    """dx = dy;  dP[:S] = sum over the batch of dy, zero beyond S.

    dy [B, S, D]  ->  dx [B, S, D] (dy itself, not a copy), dP [S_max, D]
    """
    y_shape, y_dtype, y_xp, p_shape = cache
    checks.upstream("dy", dy, y_shape, y_dtype, y_xp)
    seq = y_shape[1]
    xp = namespace(dy)
    summed = xp.sum(dy, axis=0)                                         # [S, D]
    if p_shape[0] == seq:
        return dy, summed
    pad = xp.zeros((p_shape[0] - seq, p_shape[1]), dtype=dy.dtype)
    return dy, xp.concat([summed, pad], axis=0)
