"""Scaled dot-product attention and the head reshapes (chapter 6): forward/backward pairs.

Shape letters: B batch, H heads, S_q queries, S_k keys (S_k > S_q for a step that attends to
a KV cache), D_h the width of one head, D = H * D_h the model width. Heads are a batched
axis: every product below is one batched matmul over [B, H], never a loop.
"""
from __future__ import annotations

import math

from .. import checks
from ..backend import matmul, namespace
from ._caches import AttentionCache, Spec
from .regularization import dropout_backward, dropout_forward
from .softmax import _check_mask, softmax_backward


def _float_table(xp, masked, dtype):
    """A boolean table -> the additive mask: -inf where masked, 0 elsewhere (same shape)."""
    return xp.where(
        masked, xp.asarray(-math.inf, dtype=dtype), xp.asarray(0.0, dtype=dtype)
    )


def _causal_table(xp, s_q: int, s_k: int, dtype):
    """[S_q, S_k] additive: query i sees key j when j <= i + (S_k - S_q).

    The queries are the last S_q of the S_k positions, so with S_q == S_k this is the usual
    lower triangle, and a cached step (S_q == 1) sees every key. One table, broadcast over
    batch and heads.
    """
    rows = xp.arange(s_q)[:, None]
    cols = xp.arange(s_k)[None, :]
    return _float_table(xp, cols > rows + (s_k - s_q), dtype)


def _check_settings(q, k, v, causal, dropout_p, training):
    """q [B, H, S_q, D_h], k [B, H, S_k, D_h], v [B, H, S_k, D_v] of one float dtype and
    library, and the settings -> (the namespace, causal, dropout_p, training)."""
    xp = checks.float_inputs(q=q, k=k, v=v)
    causal = checks.boolean("causal", causal)
    dropout_p = checks.probability("dropout_p", dropout_p)
    training = checks.boolean("training", training)
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.ndim(name, x, 4)
    batch, heads, _, d_h = q.shape
    checks.shape("k", k, (batch, heads, None, d_h))
    checks.shape("v", v, (batch, heads, k.shape[2], None))
    return xp, causal, dropout_p, training


def _check_every_query_keeps_a_key(xp, row_max) -> None:
    """row_max [B, H, S_q, 1], each query's largest masked score: -inf means every key of
    that query is masked, and such a row has no softmax."""
    if bool(xp.any(row_max == -math.inf)):
        b, h, i = _first_masked_row(xp, row_max)
        raise ValueError(
            f"query {i} of batch element {b}, head {h} has every key masked "
            "(causal, key_padding and mask together): a fully masked row has no softmax"
        )


def _check_causal_lengths(s_q: int, s_k: int) -> None:
    if s_q > s_k:
        raise ValueError(
            f"causal attention needs S_k >= S_q (the queries are the last S_q of the "
            f"keys' positions), got S_q={s_q}, S_k={s_k}"
        )


def _key_padding_table(xp, q, key_padding, batch: int, s_k: int):
    """key_padding [B, S_k] bool (True = padded) -> [B, 1, 1, S_k]: -inf where padded, else 0,
    in q's dtype; checked to be a bool array of q's library and shape."""
    checks.array("key_padding", key_padding)
    checks.same_library(q=q, key_padding=key_padding)
    if not xp.isdtype(key_padding.dtype, "bool"):
        raise TypeError(
            f"key_padding must be a bool array (True = padded key), "
            f"got {checks.dtype_name(key_padding)}"
        )
    checks.shape("key_padding", key_padding, (batch, s_k))
    return xp.reshape(_float_table(xp, key_padding, q.dtype), (batch, 1, 1, s_k))


def _first_masked_row(xp, row_max):
    """(b, h, i) of the first query with no key left, for the error message."""
    flat = xp.reshape(row_max == -math.inf, (-1,))
    index = int(xp.argmax(xp.astype(flat, xp.int8)))
    b_h_i = []
    for size in reversed(row_max.shape[:3]):
        b_h_i.append(index % size)
        index //= size
    return tuple(reversed(b_h_i))


def attention_forward(
    q, k, v, mask=None, key_padding=None, causal=False, dropout_p=0.0, rng=None, training=True
):
    """out = dropout(A) @ v with A = softmax(q k^T / sqrt(D_h) + M) over the keys.

    q [B, H, S_q, D_h], k [B, H, S_k, D_h], v [B, H, S_k, D_v] (D_v is usually D_h)
    mask         additive float broadcastable to [B, H, S_q, S_k]: 0 keeps, -inf masks
    key_padding  bool [B, S_k], True marks a padded key (masked for every query)
    causal       query i sees key j <= i + (S_k - S_q) (one [S_q, S_k] table)
    dropout_p    inverted dropout on A (seeded by `rng` as dropout_forward takes it;
                 the identity when training=False or dropout_p == 0)
    ->  out [B, H, S_q, D_v]

    The masks are added to the scores one after another, each broadcast from its own shape
    ([S_q, S_k], [B, 1, 1, S_k], the mask's): none is expanded to a per-batch [S, S] table.
    A query whose keys are all masked has no softmax and raises ValueError.

    The cache keeps q, k, v, the probabilities A [B, H, S_q, S_k] and dropout's boolean
    keep-mask with its scale (the mask None without dropout), and the output's shape,
    dtype and library for the backward's check of dout. The backward recomputes the dropped
    probabilities A' = A * keep / (1 - p); the scores themselves are never needed again.
    Masks are constants: they get no gradient.
    """
    xp, causal, dropout_p, training, scale = _check_attention_forward(q, k, v, causal,
                                                                      dropout_p, training)
    batch, heads, s_q, d_h = q.shape
    s_k = k.shape[2]
    dtype = q.dtype

    z = matmul(q, xp.matrix_transpose(k), "attention")              # [B, H, S_q, S_k]
    z *= scale
    if causal:
        _check_causal_lengths(s_q, s_k)
        z += _causal_table(xp, s_q, s_k, dtype)                    # [S_q, S_k]
    if key_padding is not None:
        z += _key_padding_table(xp, q, key_padding, batch, s_k)    # [B, 1, 1, S_k]
    if mask is not None:
        _check_mask(mask, z)
        z += mask
    # the softmax of softmax_forward, shifted by the row maximum, which doubles as the check
    # that every query keeps a key (a row of -inf would give exp(-inf + inf) = nan)
    row_max = xp.max(z, axis=-1, keepdims=True)                     # [B, H, S_q, 1]
    if causal or key_padding is not None or mask is not None:
        _check_every_query_keeps_a_key(xp, row_max)
    z -= row_max
    A = xp.exp(z)                                                   # [B, H, S_q, S_k]
    del z
    A /= xp.sum(A, axis=-1, keepdims=True)
    A_dropped, drop = dropout_forward(A, dropout_p, rng=rng, training=training)
    out = matmul(A_dropped, v, "attention")                         # [B, H, S_q, D_v]
    cache = AttentionCache(q, k, v, A, drop, scale, Spec(tuple(out.shape), out.dtype, xp))
    return out, cache


def attention_backward(dout, cache):
    """The VJP of attention_forward, one batched matmul per product:

    dV  = A'^T dout                    A' = dropout(A), recomputed from A and the keep-mask
    dA' = dout V^T,   dA = dropout_backward(dA')
    dZ  = A * (dA - rowsum(dA * A))    softmax_backward; masked entries get 0 (A is 0 there)
    dQ  = dZ K / sqrt(D_h),   dK = dZ^T Q / sqrt(D_h)

    dout [B, H, S_q, D_v]  ->  dq [B, H, S_q, D_h], dk [B, H, S_k, D_h], dv [B, H, S_k, D_v]
    """
    q, k, v, A, drop, scale, xp = _check_attention_backward(dout, cache)
    A_dropped = dropout_backward(A, drop)                           # [B, H, S_q, S_k]
    dv = matmul(xp.matrix_transpose(A_dropped), dout, "attention")  # [B, H, S_k, D_v]
    del A_dropped
    dA = dropout_backward(matmul(dout, xp.matrix_transpose(v), "attention"), drop)
    dz = softmax_backward(dA, A)                                    # [B, H, S_q, S_k]
    del dA
    dz *= scale
    dq = matmul(dz, k, "attention")                                 # [B, H, S_q, D_h]
    dk = matmul(xp.matrix_transpose(dz), q, "attention")            # [B, H, S_k, D_h]
    return dq, dk, dv


def split_heads(x, n_heads: int):
    """[B, S, D] -> [B, H, S, D_h] with D_h = D / H: head h takes columns h*D_h .. (h+1)*D_h.

    A reshape then a permute_dims: a view, no copy (the heads become a strided batch axis).
    Its backward is merge_heads.
    """
    checks.array("x", x)
    checks.ndim("x", x, 3)
    batch, seq, width = x.shape
    n_heads = _check_heads(width, n_heads)
    xp = namespace(x)
    return xp.permute_dims(xp.reshape(x, (batch, seq, n_heads, width // n_heads)), (0, 2, 1, 3))


def merge_heads(x):
    """[B, H, S, D_h] -> [B, S, H * D_h], the inverse of split_heads (and its backward).

    The permute_dims is a view; the reshape that joins H and D_h copies once, because after
    the permute the heads are no longer adjacent in memory (unless x came from split_heads
    and was never copied, when the reshape is a view again).
    """
    checks.array("x", x)
    checks.ndim("x", x, 4)
    batch, heads, seq, d_h = x.shape
    xp = namespace(x)
    return xp.reshape(xp.permute_dims(x, (0, 2, 1, 3)), (batch, seq, heads * d_h))


def _check_heads(width: int, n_heads: int) -> int:
    n_heads = checks.integer("n_heads", n_heads, least=1)
    if width % n_heads:
        raise ValueError(
            f"n_heads must be a positive integer dividing the width {width}, got {n_heads!r}"
        )
    return n_heads


def qkv_split(qkv, n_heads: int):
    """The fused projection's output -> q, k, v, each [B, H, S, D_h]; views, no copy.

    qkv [B, S, 3D], columns q | k | v, each block of D = H * D_h columns head-major (head h
    owns columns h*D_h .. (h+1)*D_h of its block). Its backward is qkv_merge_grads.
    """
    checks.array("qkv", qkv)
    checks.ndim("qkv", qkv, 3)
    batch, seq, width3 = qkv.shape
    if width3 % 3:
        raise ValueError(f"qkv must have 3 * D columns (q | k | v), got {width3}")
    n_heads = _check_heads(width3 // 3, n_heads)
    xp = namespace(qkv)
    d_h = width3 // 3 // n_heads
    parts = xp.permute_dims(
        xp.reshape(qkv, (batch, seq, 3, n_heads, d_h)), (2, 0, 3, 1, 4)
    )                                                               # [3, B, H, S, D_h]
    return parts[0, ...], parts[1, ...], parts[2, ...]


def qkv_merge_grads(dq, dk, dv):
    """dq, dk, dv [B, H, S, D_h] -> dqkv [B, S, 3D], the layout qkv_split reads.

    One copy: the three gradients are written into one [B, S, 3, H, D_h] buffer, which is
    then reshaped (a view) to [B, S, 3D].
    """
    _check_qkv_merge_grads(dq, dk, dv)
    batch, heads, seq, d_h = dq.shape
    xp = namespace(dq, dk, dv)
    dqkv = xp.empty((batch, seq, 3, heads, d_h), dtype=dq.dtype)
    for index, grad in enumerate((dq, dk, dv)):
        dqkv[:, :, index, :, :] = xp.permute_dims(grad, (0, 2, 1, 3))
    return xp.reshape(dqkv, (batch, seq, 3 * heads * d_h))


# -- the checks each op makes before its work (tfcore.ops makes them before a kernel's) --------

def _check_attention_forward(q, k, v, causal, dropout_p, training):
    """attention_forward's checks of q, k, v and the settings -> (xp, causal, dropout_p,
    training, the scores' scale 1 / sqrt(D_h))."""
    xp, causal, dropout_p, training = _check_settings(q, k, v, causal, dropout_p, training)
    return xp, causal, dropout_p, training, 1.0 / math.sqrt(q.shape[3])


def _check_attention_backward(dout, cache):
    """attention_backward's check: dout like the forward's output -> (q, k, v, A, drop,
    scale, xp)."""
    q, k, v, A, drop, scale, (out_shape, out_dtype, xp) = cache
    checks.upstream("dout", dout, out_shape, out_dtype, xp)
    return q, k, v, A, drop, scale, xp


def _check_qkv_merge_grads(dq, dk, dv):
    """qkv_merge_grads' checks: dq, dk, dv [B, H, S, D_h] of one float dtype and library."""
    checks.float_inputs(dq=dq, dk=dk, dv=dv)
    checks.ndim("dq", dq, 4)
    checks.shape("dk", dk, tuple(dq.shape))
    checks.shape("dv", dv, tuple(dq.shape))
