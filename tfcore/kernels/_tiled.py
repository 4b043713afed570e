"""Tiled ("flash") attention on the CPU: online softmax over key blocks, blocked BLAS matmuls.

    tiled_attention_forward(q, k, v, causal, scale) -> (out, lse)
    tiled_attention_backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)

q, dout, out [B, H, S_q, D_h]; k, v [B, H, S_k, D_h] (v may have another width D_v);
lse [B, H, S_q] = log sum_j exp(scale * q_i k_j) over the keys query i sees (the row
log-sum-exp of the scaled scores). Causal: query i sees key j when j <= i + S_k - S_q, as in
tfcore.functional.attention_forward. q, k, v, dout and out need only have their rows apart
(rows_apart): the [B, H, S, D_h] views of a fused qkv projection [B, S, 3, H, D_h] are read
as they lie, with their row stride, as BLAS reads a matrix (except by the compiled backward
of a long sequence, which packs each head's rows first: see PACK_FROM).

The forward takes the queries in blocks of BLOCK rows; each meets the keys it sees in blocks
of up to SPAN columns, and keeps, per query row, the running maximum m, the running sum l of
exp(s - m) and the running output acc = sum exp(s - m) v, rescaling both by
exp(m_old - m_new) when the maximum grows; out = acc / l, lse = m + log l. The backward takes
the keys in blocks of BLOCK columns; each meets the queries that see it in blocks of up to
BACKWARD_SPAN rows, recomputing the probabilities p = exp(s - lse) from q, k and lse. So
nothing of size [S_q, S_k] is made: the largest temporaries are two blocks of scores of at
most SCRATCH elements (as many batch rows at a time as fit: 512 KiB in float32, about the
core's cache), reused from block to block. Keys a whole block of queries cannot see (above
the causal diagonal) are never computed: a causal step makes about half the matmul FLOPs of
the dense attention.

Wide spans make fewer, larger BLAS calls (in the backward, a key block's dk and dv are one
product each when its queries fit one span). k^T and v^T are laid out contiguously for the
products that read them: OpenBLAS multiplies by a transposed view at 60-70% of its speed on
these shapes. The scores' softmax, its exp included, runs in the Numba loops of _numba
(attention_forward_block, attention_backward_block), one pass per block.

The work is split over the batch (or, with a batch smaller than the thread count, the heads):
each thread runs the whole blocked loop on its share with a single-threaded BLAS, so there is
one fork/join per call rather than one per small product, and none for a call too small to
pay for it (see the thread policy of tfcore.kernels). A share's loops run compiled
(_numba.tiled_forward_share, tiled_backward_share: the gemm NumPy calls, called with
np.matmul's arguments, one (batch row, head) at a time), so a share takes Python's lock once;
the Python loops below, batch rows at a time through np.matmul, are the fallback where that
gemm cannot be called (COMPILED) and make the same bits. Every product is counted by
tfcore.backend.count_matmuls under the label "tiled attention".
"""
from __future__ import annotations

import math

import numpy as np

from ..backend import record_matmul, record_products
from . import pool
from .blas import single_threaded_blas
from .pool import _bounds, _gemm_address, _parts
from .switch import _k

BLOCK = 64          # rows of a forward query block, columns of a backward key block
# the most keys a forward query block meets at once: against 256, a forward at S = 1024-2048
# ran 3-8% faster (fewer rescales of the running sums, longer rows for the exp), the same
# below (a short sequence meets its keys in one span either way)
SPAN = 1024
# the most queries a backward key block meets at once: its probabilities and their gradient
# [BACKWARD_SPAN, BLOCK] stay in the core's cache between the five products that read them
# (against 256, the backward of a 1024-2048-token step ran 3-18% faster, float64 most)
BACKWARD_SPAN = 128
# from this many queries on, the compiled backward reads each head's q, dout and k packed
# into contiguous rows (_numba._pack): per call, 1.27 times faster at S = 2048, 1.16 at
# 1024, 1.03 at 256 (float32, the heads of a fused projection); slower below 256
PACK_FROM = 256
SCRATCH = 2 ** 17   # the most elements of one scratch block of scores: batch rows at a time
_LABEL = "tiled attention"
# True: each share's loops run compiled, in one call without Python's lock (where the BLAS
# NumPy calls has a C interface _spin can call); False: the Python loops below, which make
# the same products through np.matmul (same arguments to the same gemm: the same bits).
COMPILED = True


def rows_apart(x) -> bool:
    """Whether x's rows (its last axis) are each contiguous and lie apart, in order: the
    layout BLAS reads with a leading dimension (the [B, H, S, D] views of a [B, S, 3, H, D]
    projection are; a view with a strided last axis, or rows that overlap, is not)."""
    if x.ndim < 2:
        return x.ndim == 1 and (x.shape[0] <= 1 or x.strides[0] == x.itemsize)
    width = x.shape[-1]
    return ((width <= 1 or x.strides[-1] == x.itemsize) and min(x.strides) >= 0
            and (x.shape[-2] <= 1 or x.strides[-2] >= width * x.itemsize))


def as_rows_apart(*arrays) -> list:
    """Each array as it is where its rows lie apart (see rows_apart), else a C-contiguous
    copy: what the tiled kernels read."""
    return [a if rows_apart(a) else np.ascontiguousarray(a) for a in arrays]


def _check(name, x, ndim=4, rows=False):
    """x a NumPy float array of `ndim` dimensions, C-contiguous (rows=True: rows apart, see
    rows_apart: as the [B, H, S, D] view of a [B, S, H, D] array)."""
    if type(x) is not np.ndarray or x.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be a NumPy float32 or float64 array, got "
                        f"{type(x).__name__} {getattr(x, 'dtype', '')}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}")
    if rows and not rows_apart(x):
        raise ValueError(f"{name} must be contiguous along its last axis, its rows apart "
                         f"(strides {x.strides})")
    if not rows and not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _check_qkv(q, k, v, causal):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x, rows=True)
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, expected q's {q.dtype}")
    b, h, s_q, d_h = q.shape
    if k.shape[:2] != (b, h) or k.shape[3] != d_h:
        raise ValueError(f"k must have shape ({b}, {h}, S_k, {d_h}), got {k.shape}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have shape ({b}, {h}, {k.shape[2]}, D_v), got {v.shape}")
    if causal and s_q > k.shape[2]:
        raise ValueError(f"causal attention needs S_k >= S_q, got S_q={s_q}, "
                         f"S_k={k.shape[2]}")


def _compiled(dtype) -> int:
    """The gemm address for the compiled shares (tfcore.kernels._numba.tiled_*_share), or 0:
    COMPILED off, or no gemm found (then the Python loops below run)."""
    return _gemm_address(dtype) if COMPILED else 0


def _mm(a, b, out=None):
    """a [..., m, k] @ b [..., k, n], counted (transposed views go to BLAS as flags)."""
    record_matmul(_LABEL, a.shape, b.shape)
    return np.matmul(a, b, out=out)


def _key_stop(i1, offset, s_k, causal):
    """One past the last key any query of the block ending at row i1 sees."""
    return min(s_k, i1 + offset) if causal else s_k


def _block(buffer, shape):
    """A C-contiguous [shape] array on the first elements of a flat scratch buffer."""
    return buffer[:math.prod(shape)].reshape(shape)


def _batch_chunks(batch, per_item, limit=SCRATCH):
    """Slices of the batch whose score blocks (per_item elements for each batch row) hold at
    most `limit` elements together (at least one row each) -> (slices, the largest length)."""
    step = max(1, min(batch, limit // max(per_item, 1)))
    return [slice(b0, min(b0 + step, batch)) for b0 in range(0, batch, step)], step


def _forward_part(q, k, v, out, lse, causal, scale, block, span):
    """The forward for one share of the batch (arrays are views [b, H, ...] of the caller's):
    compiled (see COMPILED), or a few batch rows at a time (see SCRATCH)."""
    batch, heads, s_q, _ = q.shape
    rows, cols = min(block, s_q), min(span, k.shape[2])
    function = _compiled(q.dtype)
    if function:
        counted = np.zeros(2, dtype=np.int64)
        _k().tiled_forward_share(q, np.ascontiguousarray(np.swapaxes(k, -1, -2)), v, out, lse,
                                 causal, q.dtype.type(scale), block, span,
                                 np.empty(rows * cols, dtype=q.dtype),
                                 np.empty(rows * v.shape[3], dtype=q.dtype),
                                 np.empty((3, 1, 1, rows), dtype=q.dtype), function, counted)
        record_products(_LABEL, *counted)
        return
    chunks, step = _batch_chunks(batch, heads * rows * cols)
    scores = np.empty(step * heads * rows * cols, dtype=q.dtype)
    product = np.empty(step * heads * rows * v.shape[3], dtype=q.dtype)
    running = np.empty((3, step, heads, rows), dtype=q.dtype)
    for b in chunks:
        _forward_rows(q[b], k[b], v[b], out[b], lse[b], causal, scale, block, span, scores,
                      product, running)


def _forward_rows(q, k, v, out, lse, causal, scale, block, span, scores, product, running):
    """Query blocks of `block` rows, each against its keys in blocks of up to `span` columns;
    scores, product: flat scratch; running [3, >= b, H, block]: m, l and alpha."""
    kern = _k()
    scale = q.dtype.type(scale)
    batch, heads, s_q, _ = q.shape
    s_k, d_v = k.shape[2], v.shape[3]
    offset = s_k - s_q
    # k^T laid out as [b, H, D_h, S_k]: BLAS multiplies by a transposed view 1.4 times slower
    k_t = np.ascontiguousarray(np.swapaxes(k, -1, -2))
    m, l, alpha = running[:, :batch]            # running max, running sum, rescaling factor
    for i0 in range(0, s_q, block):
        i1 = min(i0 + block, s_q)
        bq = i1 - i0
        qi, acc = q[:, :, i0:i1], out[:, :, i0:i1]                # [b, H, bq, D_h | D_v]
        m_i, l_i, alpha_i = m[:, :, :bq], l[:, :, :bq], alpha[:, :, :bq]
        m_i[...] = -np.inf
        l_i[...] = 0.0
        stop = _key_stop(i1, offset, s_k, causal)
        for j0 in range(0, stop, span):
            j1 = min(j0 + span, stop)
            s = _mm(qi, k_t[..., j0:j1], out=_block(scores, (batch, heads, bq, j1 - j0)))
            shift = i0 + offset - j0 if causal else j1 - j0
            kern.attention_forward_block(s, scale, shift, m_i, l_i, alpha_i)  # s is now p
            if j0 == 0:                      # the first block: written in place, no rescale
                _mm(s, v[:, :, j0:j1], out=acc)
            else:
                pv = _mm(s, v[:, :, j0:j1], out=_block(product, (batch, heads, bq, d_v)))
                kern.attention_rescale_add(acc, alpha_i, pv)
        kern.attention_forward_finish(acc, m_i, l_i, lse[:, :, i0:i1])


def _backward_part(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, block, span):
    """The backward for one share: compiled, or a few batch rows at a time (see SCRATCH)."""
    batch, heads, s_q, d_h = q.shape
    cols, rows = min(block, k.shape[2]), min(span, s_q)
    function = _compiled(q.dtype)
    if function:
        counted = np.zeros(2, dtype=np.int64)
        _k().tiled_backward_share(dout, q, k, v, lse, _row_dots(dout, out), dq, dk, dv, causal,
                                  q.dtype.type(scale), block, span,
                                  np.empty(rows * cols, dtype=q.dtype),
                                  np.empty(rows * cols, dtype=q.dtype),
                                  np.empty(cols * (d_h + v.shape[3]), dtype=q.dtype),
                                  np.empty(s_q * (d_h + v.shape[3]) + k.shape[2] * d_h
                                           if _worth_packing(q, dout, k) else 0,
                                           dtype=q.dtype), function, counted)
        record_products(_LABEL, *counted)
        return
    chunks, step = _batch_chunks(batch, heads * rows * cols)
    probs = np.empty(step * heads * rows * cols, dtype=q.dtype)
    dscores = np.empty_like(probs)
    product = np.empty(step * heads * max(rows, cols) * max(d_h, v.shape[3]), dtype=q.dtype)
    for b in chunks:
        _backward_rows(dout[b], q[b], k[b], v[b], out[b], lse[b], dq[b], dk[b], dv[b], causal,
                       scale, block, span, probs, dscores, product)


def _backward_rows(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, block, span, probs,
                   dscores, product):
    """Key blocks of `block` columns, each against the queries that see it in blocks of up
    to `span` rows (then dk and dv of a key block are one product each when its queries fit
    one span; dq adds up over the key blocks); probs, dscores, product: flat scratch."""
    kern = _k()
    scale = q.dtype.type(scale)
    batch, heads, s_q, _ = q.shape
    s_k = k.shape[2]
    offset = s_k - s_q
    delta = _row_dots(dout, out)                                     # [b, H, S_q]
    for j0 in range(0, s_k, block):
        j1 = min(j0 + block, s_k)
        bk = j1 - j0
        kj = k[:, :, j0:j1]                                          # [b, H, bk, D_h]
        # k_j^T and v_j^T laid out as [b, H, D, bk] (see the forward)
        kj_t = np.ascontiguousarray(np.swapaxes(kj, -1, -2))
        vj_t = np.ascontiguousarray(np.swapaxes(v[:, :, j0:j1], -1, -2))
        dkj, dvj = dk[:, :, j0:j1], dv[:, :, j0:j1]
        first = max(0, j0 - offset) if causal else 0   # the first query that sees key j0
        if first >= s_q:                  # no query sees these keys (S_q < S_k, causal)
            dkj[...] = 0.0
            dvj[...] = 0.0
            continue
        for i0 in range(first, s_q, span):
            i1 = min(i0 + span, s_q)
            shape = (batch, heads, i1 - i0, bk)
            qi, doi = q[:, :, i0:i1], dout[:, :, i0:i1]
            p = _mm(qi, kj_t, out=_block(probs, shape))                     # [b, H, bq, bk]
            dp = _mm(doi, vj_t, out=_block(dscores, shape))                 # dout v^T
            shift = i0 + offset - j0 if causal else bk
            kern.attention_backward_block(p, dp, lse[:, :, i0:i1], delta[:, :, i0:i1], scale,
                                          shift)          # p: probabilities; dp: dZ
            _accumulate(np.swapaxes(p, -1, -2), doi, dvj, i0 == first, product)   # p^T dout
            _accumulate(np.swapaxes(dp, -1, -2), qi, dkj, i0 == first, product)   # dZ^T q
            _accumulate(dp, kj, dq[:, :, i0:i1], j0 == 0, product)               # dZ k


def _worth_packing(*arrays) -> bool:
    """Whether the compiled backward should read each head's rows packed (see PACK_FROM):
    from PACK_FROM queries on, where some rows lie apart rather than one after the other."""
    return arrays[0].shape[2] >= PACK_FROM and any(
        x.shape[2] > 1 and x.strides[2] != x.shape[3] * x.itemsize for x in arrays)


def _row_dots(dout, out):
    """delta [b, H, S_q], delta_i = sum_d dout_id out_id = rowsum(dA * A) of the dense
    backward."""
    return np.einsum("bhsd,bhsd->bhs", dout, out)


def _accumulate(a, b, out, first, scratch):
    """out = a @ b when first, else out += a @ b (through the scratch buffer)."""
    if first:
        _mm(a, b, out=out)
    else:
        out += _mm(a, b, out=_block(scratch, out.shape))


def _shares(batch, heads, parts):
    """Slices of the batch (or of the heads) for each share: [(axis-0 slice, axis-1 slice)]."""
    if batch >= parts or heads < 2:
        n, axis = min(parts, batch), 0
    else:
        n, axis = min(parts, heads), 1
    full = slice(None)
    return [(slice(lo, hi), full) if axis == 0 else (full, slice(lo, hi))
            for lo, hi in _bounds(batch if axis == 0 else heads, n)]


def _run(fn, arrays, threads, extra, flops):
    """fn(*[a[share] for a in arrays], *extra) for each share of the batch (or heads), the
    shares on up to `threads` threads, each share at least MIN_GEMM_FLOPS_PER_THREAD of the
    call's `flops` (a smaller call runs on this thread alone), each on a single-threaded BLAS."""
    batch, heads = arrays[0].shape[:2]
    parts = _parts(flops, pool.MIN_GEMM_FLOPS_PER_THREAD, batch * heads, threads)
    with single_threaded_blas():
        if parts == 1:
            fn(*arrays, *extra)
            return
        pool._on_threads([(fn, tuple(a[p] for a in arrays) + tuple(extra))
                          for p in _shares(batch, heads, parts)])


def _flops(q, k, causal, widths):
    """Matmul flops of block products whose inner widths add up to `widths`, over the whole
    score matrix (half of it when causal): what decides whether a call is worth splitting."""
    b, h, s_q, _ = q.shape
    full = 2 * b * h * s_q * k.shape[2] * widths
    return full // 2 if causal else full


def tiled_attention_forward(q, k, v, causal, scale, block=BLOCK, threads=None, span=SPAN):
    """q [B, H, S_q, D_h], k [B, H, S_k, D_h], v [B, H, S_k, D_v] -> out [B, H, S_q, D_v]
    (a view of a [B, S_q, H, D_v] array), lse [B, H, S_q]. Without dropout, masks other
    than causal, or padding."""
    _check_qkv(q, k, v, causal)
    # out is written in the layout [B, S_q, H, D_v] that merging the heads reads (then the
    # merged [B, S_q, H D_v] is a view of it, not a second copy kept for the backward)
    batch, heads, s_q, _ = q.shape
    out = np.swapaxes(np.empty((batch, s_q, heads, v.shape[3]), dtype=q.dtype), 1, 2)
    lse = np.empty(q.shape[:3], dtype=q.dtype)
    _run(_forward_part, (q, k, v, out, lse), threads or pool._threads(),
         (bool(causal), float(scale), int(block), int(span)),
         _flops(q, k, causal, q.shape[3] + v.shape[3]))
    return out, lse


def tiled_attention_backward(dout, q, k, v, out, lse, causal, scale, block=BLOCK, threads=None,
                             span=BACKWARD_SPAN):
    """dout [B, H, S_q, D_v] and the forward's q, k, v, out, lse -> dq, dk, dv (shapes of
    q, k, v; views of one [B, S, 3, H, D_h] buffer when the three shapes are equal). dout and
    out need only be contiguous along their last axis (views of [B, S_q, H, D_v] arrays).
    Recomputes the probabilities block by block from lse."""
    _check_qkv(q, k, v, causal)
    _check("out", out, rows=True)
    _check("dout", dout, rows=True)
    _check("lse", lse, 3)
    if dout.shape != out.shape or out.shape != q.shape[:3] + v.shape[3:]:
        raise ValueError(f"dout and out must have shape {q.shape[:3] + v.shape[3:]}, "
                         f"got {dout.shape} and {out.shape}")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse must have shape {q.shape[:3]}, got {lse.shape}")
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, expected q's {q.dtype}")
    batch, heads, s_q, d_h = q.shape
    if k.shape == q.shape and v.shape == q.shape:
        # dq, dk, dv are written into one [B, S, 3, H, D_h] buffer, the layout of the fused
        # qkv projection's gradient: qkv_merge_grads then returns it without a copy
        dqkv = np.empty((batch, s_q, 3, heads, d_h), dtype=q.dtype)
        dq, dk, dv = (np.swapaxes(dqkv[:, :, i], 1, 2) for i in range(3))
    else:
        dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    _run(_backward_part, (dout, q, k, v, out, lse, dq, dk, dv), threads or pool._threads(),
         (bool(causal), float(scale), int(block), int(span)),
         _flops(q, k, causal, 3 * q.shape[3] + 2 * v.shape[3]))
    return dq, dk, dv


def dense_flops(b, h, s_q, s_k, d_h, d_v=None) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of the dense attention: 2 and 4 products of the whole
    [S_q, S_k] score matrix per (batch, head)."""
    d_v = d_h if d_v is None else d_v
    one = b * h * s_q * s_k
    return 2 * one * (d_h + d_v), 2 * one * (d_h + d_v) * 2

