"""Tiled ("flash") attention on the CPU: online softmax over key blocks, blocked BLAS matmuls.

    tiled_attention_forward(q, k, v, causal, scale) -> (out, lse)
    tiled_attention_backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)

q, dout, out [B, H, S_q, D_h]; k, v [B, H, S_k, D_h] (v may have another width D_v);
lse [B, H, S_q] = log sum_j exp(scale * q_i k_j) over the keys query i sees (the row
log-sum-exp of the scaled scores). Causal: query i sees key j when j <= i + S_k - S_q, as in
tfcore.functional.attention_forward.

The forward visits the keys in blocks of `BLOCK` and keeps, per query row, the running
maximum m, the running sum l of exp(s - m) and the running output acc = sum exp(s - m) v,
rescaling both by exp(m_old - m_new) when the maximum grows; out = acc / l, lse = m + log l.
The backward recomputes each block of probabilities p = exp(s - lse) from q, k and lse, so
nothing of size [S_q, S_k] is kept between the two passes (the largest temporary is one
[B', H, BLOCK, BLOCK] block). Blocks wholly above the causal diagonal are never computed:
a causal step makes about half the matmul FLOPs of the dense attention.

The work is split over the batch (or, with a batch smaller than the thread count, the heads):
each thread runs the whole blocked loop on its share with a single-threaded BLAS, so there is
one fork/join per call rather than one per small product, and none for a call too small to
pay for it (see the thread policy of tfcore.kernels). Every product is counted by
tfcore.backend.count_matmuls under the label "tiled attention".
"""
from __future__ import annotations

import numpy as np

from ..backend import record_matmul

BLOCK = 64          # rows of a query block and of a key block
_LABEL = "tiled attention"


def _check(name, x, ndim=4):
    if type(x) is not np.ndarray or x.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be a NumPy float32 or float64 array, got "
                        f"{type(x).__name__} {getattr(x, 'dtype', '')}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _check_qkv(q, k, v, causal):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x)
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


def _mm(a, b, out=None):
    """a [..., m, k] @ b [..., k, n], counted (transposed views go to BLAS as flags)."""
    record_matmul(_LABEL, a.shape, b.shape)
    return np.matmul(a, b, out=out)


def _key_stop(i1, offset, s_k, causal):
    """One past the last key any query of the block ending at row i1 sees."""
    return min(s_k, i1 + offset) if causal else s_k


# The boolean masks of the blocks that straddle the causal diagonal, by (bq, bk, shift): a
# block of queries i0.. and keys j0.. hides key j0 + c from query i0 + r when
# c > r + shift, shift = i0 + offset - j0. A handful of shapes per model, made once.
_MASKS: dict[tuple[int, int, int], np.ndarray] = {}


def _causal_mask(bq, bk, shift):
    """[bq, bk] bool, True where the key is hidden (c > r + shift)."""
    key = (bq, bk, shift)
    mask = _MASKS.get(key)
    if mask is None:
        if len(_MASKS) > 256:            # a bound, for a long run of many sequence lengths
            _MASKS.clear()
        mask = np.arange(bk)[None, :] > np.arange(bq)[:, None] + shift
        _MASKS[key] = mask
    return mask


def _mask_block(s, i0, j0, offset):
    """s [..., bq, bk] scores of queries i0.. and keys j0..: -inf where key > query + offset.

    One masked copy broadcast over the leading axes (a boolean index s[..., mask] would
    gather the positions into index arrays first: about 9 times slower on [16, 4, 64, 64]).
    """
    bq, bk = s.shape[-2:]
    if j0 + bk - 1 <= i0 + offset:          # the whole block is on or below the diagonal
        return
    np.copyto(s, -np.inf, where=_causal_mask(bq, bk, i0 + offset - j0))


def _forward_part(q, k, v, out, lse, causal, scale, block):
    """The forward for one share of the batch (arrays are views [b, H, ...] of the caller's)."""
    s_q, s_k = q.shape[2], k.shape[2]
    offset = s_k - s_q
    for i0 in range(0, s_q, block):
        i1 = min(i0 + block, s_q)
        qi = q[:, :, i0:i1]                                          # [b, H, bq, D_h]
        m = np.full(qi.shape[:3] + (1,), -np.inf, dtype=q.dtype)     # running max
        l = np.zeros_like(m)                                         # running sum
        acc = out[:, :, i0:i1]                                       # [b, H, bq, D_v]
        for j0 in range(0, _key_stop(i1, offset, s_k, causal), block):
            j1 = min(j0 + block, s_k)
            s = _mm(qi, np.swapaxes(k[:, :, j0:j1], -1, -2))          # [b, H, bq, bk]
            s *= scale
            if causal:
                _mask_block(s, i0, j0, offset)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            s -= m_new
            np.exp(s, out=s)                                         # p = exp(s - m_new)
            alpha = np.exp(m - m_new)                                # rescales the old sums
            l *= alpha
            l += s.sum(axis=-1, keepdims=True)
            if j0 == 0:                      # the first block: written in place, no rescale
                _mm(s, v[:, :, j0:j1], out=acc)
            else:
                acc *= alpha
                acc += _mm(s, v[:, :, j0:j1])
            m = m_new
        acc /= l
        lse[:, :, i0:i1] = (m + np.log(l))[..., 0]


def _backward_part(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, block):
    s_q, s_k = q.shape[2], k.shape[2]
    offset = s_k - s_q
    # delta_i = sum_d dout_id out_id = rowsum(dA * A) of the dense backward    [b, H, S_q, 1]
    delta = np.einsum("bhsd,bhsd->bhs", dout, out)[..., None]
    lse4 = lse[..., None]
    dq_written = np.zeros(-(-s_q // block), dtype=bool)  # has a query block had a product yet
    for j0 in range(0, s_k, block):
        j1 = min(j0 + block, s_k)
        kj, vj = k[:, :, j0:j1], v[:, :, j0:j1]                      # [b, H, bk, D]
        dkj, dvj = dk[:, :, j0:j1], dv[:, :, j0:j1]
        # the first query block that sees key j0: query i sees j0 when i >= j0 - offset
        first = max(0, j0 - offset) // block * block if causal else 0
        if first >= s_q:                  # no query sees these keys (S_q < S_k, causal)
            dkj[...] = 0.0
            dvj[...] = 0.0
            continue
        for i0 in range(first, s_q, block):
            i1 = min(i0 + block, s_q)
            qi, doi = q[:, :, i0:i1], dout[:, :, i0:i1]
            p = _mm(qi, np.swapaxes(kj, -1, -2))                      # [b, H, bq, bk]
            p *= scale
            if causal:
                _mask_block(p, i0, j0, offset)
            p -= lse4[:, :, i0:i1]
            np.exp(p, out=p)                                         # probabilities
            # the first product of a block is written in place (no zeroing, no temporary)
            if i0 == first:
                _mm(np.swapaxes(p, -1, -2), doi, out=dvj)            # p^T dout
            else:
                dvj += _mm(np.swapaxes(p, -1, -2), doi)
            dp = _mm(doi, np.swapaxes(vj, -1, -2))                    # dout v^T [b, H, bq, bk]
            dp -= delta[:, :, i0:i1]
            dp *= p
            dp *= scale                                              # dZ of the block
            if dq_written[i0 // block]:
                dq[:, :, i0:i1] += _mm(dp, kj)
            else:
                _mm(dp, kj, out=dq[:, :, i0:i1])
                dq_written[i0 // block] = True
            if i0 == first:
                _mm(np.swapaxes(dp, -1, -2), qi, out=dkj)
            else:
                dkj += _mm(np.swapaxes(dp, -1, -2), qi)
    for blk in np.flatnonzero(~dq_written):   # query blocks that saw no key (none, today)
        dq[:, :, blk * block:(blk + 1) * block] = 0.0


def _shares(batch, heads, parts):
    """Slices of the batch (or of the heads) for each share: [(axis-0 slice, axis-1 slice)]."""
    from . import _bounds

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
    from . import MIN_GEMM_FLOPS_PER_THREAD, _on_threads, _parts, single_threaded_blas

    batch, heads = arrays[0].shape[:2]
    parts = _parts(flops, MIN_GEMM_FLOPS_PER_THREAD, batch * heads, threads)
    with single_threaded_blas():
        if parts == 1:
            fn(*arrays, *extra)
            return
        _on_threads([(fn, tuple(a[p] for a in arrays) + tuple(extra))
                     for p in _shares(batch, heads, parts)])


def _flops(q, k, causal, widths):
    """Matmul flops of block products whose inner widths add up to `widths`, over the whole
    score matrix (half of it when causal): what decides whether a call is worth splitting."""
    b, h, s_q, _ = q.shape
    full = 2 * b * h * s_q * k.shape[2] * widths
    return full // 2 if causal else full


def tiled_attention_forward(q, k, v, causal, scale, block=BLOCK, threads=None):
    """q [B, H, S_q, D_h], k [B, H, S_k, D_h], v [B, H, S_k, D_v] -> out [B, H, S_q, D_v],
    lse [B, H, S_q]. Without dropout, masks other than causal, or padding."""
    _check_qkv(q, k, v, causal)
    from . import _threads

    out = np.empty(q.shape[:3] + v.shape[3:], dtype=q.dtype)
    lse = np.empty(q.shape[:3], dtype=q.dtype)
    _run(_forward_part, (q, k, v, out, lse), threads or _threads(),
         (bool(causal), float(scale), int(block)), _flops(q, k, causal, q.shape[3] + v.shape[3]))
    return out, lse


def tiled_attention_backward(dout, q, k, v, out, lse, causal, scale, block=BLOCK, threads=None):
    """dout [B, H, S_q, D_v] and the forward's q, k, v, out, lse -> dq, dk, dv (shapes of
    q, k, v; views of one [B, S, 3, H, D_h] buffer when the three shapes are equal).
    Recomputes the probabilities block by block from lse."""
    _check_qkv(q, k, v, causal)
    _check("out", out)
    _check("dout", dout)
    _check("lse", lse, 3)
    if dout.shape != out.shape or out.shape != q.shape[:3] + v.shape[3:]:
        raise ValueError(f"dout and out must have shape {q.shape[:3] + v.shape[3:]}, "
                         f"got {dout.shape} and {out.shape}")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse must have shape {q.shape[:3]}, got {lse.shape}")
    for name, x in (("dout", dout), ("out", out), ("lse", lse)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, expected q's {q.dtype}")
    from . import _threads

    batch, heads, s_q, d_h = q.shape
    if k.shape == q.shape and v.shape == q.shape:
        # dq, dk, dv are written into one [B, S, 3, H, D_h] buffer, the layout of the fused
        # qkv projection's gradient: qkv_merge_grads then returns it without a copy
        dqkv = np.empty((batch, s_q, 3, heads, d_h), dtype=q.dtype)
        dq, dk, dv = (np.swapaxes(dqkv[:, :, i], 1, 2) for i in range(3))
    else:
        dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    _run(_backward_part, (dout, q, k, v, out, lse, dq, dk, dv), threads or _threads(),
         (bool(causal), float(scale), int(block)),
         _flops(q, k, causal, 3 * q.shape[3] + 2 * v.shape[3]))
    return dq, dk, dv


def dense_flops(b, h, s_q, s_k, d_h, d_v=None) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of the dense attention: 2 and 4 products of the whole
    [S_q, S_k] score matrix per (batch, head)."""
    d_v = d_h if d_v is None else d_v
    one = b * h * s_q * s_k
    return 2 * one * (d_h + d_v), 2 * one * (d_h + d_v) * 2

