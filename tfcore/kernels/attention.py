"""Attention kernels. The dense op: its products stay BLAS (split over the pool's threads) and
scale, causal mask and softmax become one in-place pass over the scores. The tiled op (an
online softmax over blocks of keys, see _tiled): its forward and backward entry points."""
from __future__ import annotations

import numpy as np

from ..backend import namespace
from ._tiled import (  # noqa: F401  (the tiled op's entry points)
    as_rows_apart,
    rows_apart,
    tiled_attention_backward,
    tiled_attention_forward,
)
from .blas import batched_matmul
from .pool import _split_matrices
from .switch import _k


# -- the dense op: scale, causal mask and softmax in place over the scores -------------------

def attention_softmax_(z, scale, causal):
    """In place: scores z [B, H, S_q, S_k] -> A = softmax(scale * z + causal mask)."""
    s_q, s_k = z.shape[-2:]
    offset = s_k - s_q if causal else s_k
    _split_matrices(_k().causal_softmax_inplace, (z.reshape(-1, s_q, s_k),), (float(scale),),
                    offset)
    return z


def attention_softmax_backward_(dA, A, scale, causal):
    """In place: dA [B, H, S_q, S_k] -> dZ = scale * A * (dA - rowsum(dA * A))."""
    s_q, s_k = A.shape[-2:]
    offset = s_k - s_q if causal else s_k
    _split_matrices(_k().causal_softmax_backward_inplace,
                    (dA.reshape(-1, s_q, s_k), A.reshape(-1, s_q, s_k)), (float(scale),), offset)
    return dA


# -- the dense op: the products on BLAS, the softmax above in place -------------------------

def attention_forward(q, k, v, causal, scale, dropout_p, rng, training):
    """attention_forward of tfcore.functional without key_padding or mask (same cache).

    The output is written straight into the layout [B, S_q, H, D_v] that merge_heads reads,
    so merging the heads afterwards is a view, not a copy.
    """
    from ..functional.regularization import dropout_forward

    z = batched_matmul(q, np.swapaxes(k, -1, -2))                # [B, H, S_q, S_k]
    A = attention_softmax_(z, scale, causal)                     # in place: z is now A
    A_dropped, drop = dropout_forward(A, dropout_p, rng=rng, training=training)
    batch, heads, s_q, _ = A.shape
    merged = np.empty((batch, s_q, heads, v.shape[-1]), dtype=A.dtype)
    out = batched_matmul(A_dropped, v, out=np.swapaxes(merged, 1, 2))   # [B, H, S_q, D_v]
    return out, (q, k, v, A, drop, scale, (tuple(out.shape), out.dtype, namespace(q)))


def attention_backward(dout, cache):
    """attention_backward of tfcore.functional for a cache whose A is a contiguous array."""
    from ..functional.regularization import dropout_backward

    q, k, v, A, drop, scale, _ = cache
    batch, heads, s_q, d_h = q.shape
    s_k, d_v = k.shape[2], v.shape[3]
    if s_q == s_k and d_v == d_h:
        # dq, dk, dv are written into one [B, S, 3, H, D_h] buffer, the layout of the fused
        # qkv projection's gradient: qkv_merge_grads then returns it without a copy
        dqkv = np.empty((batch, s_q, 3, heads, d_h), dtype=q.dtype)
        outs = [np.swapaxes(dqkv[:, :, i], 1, 2) for i in range(3)]
    else:
        outs = [np.empty((batch, heads, s_q, d_h), dtype=q.dtype),
                np.empty((batch, heads, s_k, d_h), dtype=q.dtype),
                np.empty((batch, heads, s_k, d_v), dtype=q.dtype)]
    dq, dk, dv = outs
    # The [S_q, S_k] gradients are made for a quarter of the batch at a time, so that the
    # temporary dA is a quarter of A's size (the peak memory of a step is reached here).
    step = max(1, batch // 4)
    for lo in range(0, batch, step):
        b = slice(lo, min(lo + step, batch))
        keep = _batch_slice_of_dropout(drop, b)
        A_dropped = dropout_backward(A[b], keep)
        batched_matmul(np.swapaxes(A_dropped, -1, -2), dout[b], out=dv[b])   # [b, H, S_k, D_v]
        del A_dropped
        dA = dropout_backward(batched_matmul(dout[b], np.swapaxes(v[b], -1, -2)), keep)
        dz = attention_softmax_backward_(dA, A[b], scale, False)             # in place
        batched_matmul(dz, k[b], out=dq[b])                                  # [b, H, S_q, D_h]
        batched_matmul(np.swapaxes(dz, -1, -2), q[b], out=dk[b])             # [b, H, S_k, D_h]
        del dA, dz
    return dq, dk, dv


def _batch_slice_of_dropout(drop, b):
    """dropout_forward's cache (keep [B, ...] or None, scale, (shape, dtype, xp)) for the
    batch rows `b`."""
    if drop is None:
        return None
    keep, scale, (shape, dtype, xp) = drop
    rows = len(range(*b.indices(shape[0])))
    return (None if keep is None else keep[b], scale, ((rows,) + tuple(shape[1:]), dtype, xp))


def fused_qkv_grads(dq, dk, dv):
    """dqkv [B, S, 3D] when dq, dk, dv are the three views attention_backward wrote into one
    [B, S, 3, H, D_h] buffer (then no copy is needed), else None."""
    base = dq.base
    if base is None or dk.base is not base or dv.base is not base:
        return None
    batch, heads, seq, d_h = dq.shape
    if base.shape != (batch, seq, 3, heads, d_h) or not base.flags.c_contiguous:
        return None
    for i, grad in enumerate((dq, dk, dv)):
        view = np.swapaxes(base[:, :, i], 1, 2)
        if (grad.shape != view.shape or grad.strides != view.strides
                or grad.ctypes.data != view.ctypes.data):
            return None
    return base.reshape(batch, seq, 3 * heads * d_h)
