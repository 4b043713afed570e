"""Tensor-parallel layers as op pairs: column- and row-parallel linears, the vocab-parallel
embedding and cross-entropy (parts.LayoutDraws makes a sharded run's dropout masks one
device's).

Column-parallel: W = [W_0 | ... | W_{N-1}] split by output columns; rank r computes
y_r = x W_r (+ b_r), its block of the output columns, from the replicated input.
Row-parallel: W split by input rows; rank r computes the partial x_r W_r from its block of
the input columns, and the partials are summed (all-reduce, or reduce-scatter along the
sequence). Column then row (the MLP, attention) needs one reduction per direction.
"""
from __future__ import annotations

from .. import backend, checks, ops
from .. import functional as F
from ..backend import namespace
from ..functional._common import _flat_rows
from . import mappings as M
from .comm import chunk_bounds


def _enter(x, comm, sequence_parallel):
    if sequence_parallel:
        return M.gather_from_sequence_region_forward(x, comm)
    return M.copy_to_tp_region_forward(x, comm)


def _enter_backward(dy, cache, sequence_parallel):
    if sequence_parallel:
        return M.gather_from_sequence_region_backward(dy, cache)
    return M.copy_to_tp_region_backward(dy, cache)


def _exit(x, comm, sequence_parallel):
    if sequence_parallel:
        return M.reduce_scatter_to_sequence_region_forward(x, comm)
    return M.reduce_from_tp_region_forward(x, comm)


def _exit_backward(dy, cache, sequence_parallel):
    if sequence_parallel:
        return M.reduce_scatter_to_sequence_region_backward(dy, cache)
    return M.reduce_from_tp_region_backward(dy, cache)


def column_parallel_linear_forward(x, W, b, comm, sequence_parallel=False):
    """y_r = enter(x) W_r + b_r.  x [B, S, D_in] (or [B, S/N, D_in] with sequence
    parallelism), W_r [D_in, D_out/N], b_r [D_out/N]  ->  y_r [B, S, D_out/N]"""
    xf, c_in = _enter(x, comm, sequence_parallel)
    y, c_lin = ops.linear_forward(xf, W, b)
    return y, (c_in, c_lin, sequence_parallel)


def column_parallel_linear_backward(dy, cache):
    """-> dx (summed over ranks by enter's adjoint), dW_r, db_r (local, no communication)."""
    c_in, c_lin, sp = cache
    dxf, dW, db = ops.linear_backward(dy, c_lin)
    return _enter_backward(dxf, c_in, sp), dW, db


def row_parallel_linear_forward(x, W, b, comm, sequence_parallel=False):
    """y = exit(x_r W_r) + b.  x_r [B, S, D_in/N], W_r [D_in/N, D_out], b [D_out] replicated
    (added once, after the reduction)  ->  y [B, S, D_out] (or [B, S/N, D_out])"""
    part, c_lin = ops.linear_forward(x, W)
    y, c_out = _exit(part, comm, sequence_parallel)
    if b is not None:
        y = y + b
    return y, (c_lin, c_out, b is not None, sequence_parallel)


def row_parallel_linear_backward(dy, cache):
    """-> dx_r, dW_r, db (db from this rank's rows: summed over ranks later under sequence
    parallelism, already whole otherwise)."""
    c_lin, c_out, has_bias, sp = cache
    db = namespace(dy).sum(_flat_rows(dy, dy.shape[-1]), axis=0) if has_bias else None
    dpart = _exit_backward(dy, c_out, sp)
    dx, dW, _ = ops.linear_backward(dpart, c_lin)
    return dx, dW, db


def vocab_partition(vocab_size: int, size: int) -> list[tuple[int, int]]:
    """Rows [start, stop) of the vocabulary held by each rank: sizes ceil/floor(V / N), so a
    vocabulary that does not divide evenly is still split without padding."""
    if vocab_size < size:
        raise ValueError(f"vocab_size ({vocab_size}) must be at least the tensor-parallel "
                         f"degree ({size}): every rank holds at least one row")
    return chunk_bounds(vocab_size, size)


def vocab_parallel_embedding_forward(ids, W, vocab_start, comm, sequence_parallel=False):
    """x = sum over ranks of (rows of W_r for the ids in rank r's range, 0 elsewhere).

    ids [B, S] in [0, V); W_r [V_r, D] rows vocab_start .. vocab_start + V_r
    ->  x [B, S, D] replicated (all-reduce), or [B, S/N, D] (reduce-scatter along S)
    """
    xp = namespace(ids, W)
    local = xp.astype(ids, xp.int64) - vocab_start
    mine = (local >= 0) & (local < W.shape[0])                          # [B, S]
    safe = xp.where(mine, local, xp.zeros_like(local))
    part, c_emb = F.embedding_forward(safe, W)                          # [B, S, D]
    part = part * xp.astype(mine, W.dtype)[..., None]
    x, c_out = _exit(part, comm, sequence_parallel)
    return x, (c_emb, mine, c_out, sequence_parallel)


def vocab_parallel_embedding_backward(dx, cache):
    """dW_r[v] = sum of dx over the positions whose id is vocab_start + v (others: 0)."""
    c_emb, mine, c_out, sp = cache
    dpart = _exit_backward(dx, c_out, sp)                               # [B, S, D]
    dpart = dpart * namespace(dpart).astype(mine, dpart.dtype)[..., None]
    return ops.embedding_backward(dpart, c_emb)                         # [V_r, D]


def vocab_parallel_cross_entropy_forward(logits, targets, vocab_start, comm, dp_comm=None,
                                         ignore_index: int = -100):
    """Mean cross-entropy over every counted token of every data-parallel rank, from logits
    sharded by vocabulary columns, without ever gathering them.

    logits [B, S, V_r] (columns vocab_start ..), targets [B, S] (ignore_index skips).
    Per token n, with the global max m_n = max_r max_v z_r[n, v] (all-reduce max; any shift
    gives the same value, the max keeps exp from overflowing):
        sum_exp_n = sum_r sum_v exp(z_r[n, v] - m_n)           (all-reduce sum)
        picked_n  = z[n, y_n] - m_n, held by the one rank owning y_n (all-reduce sum)
        nll_n     = log(sum_exp_n) - picked_n
    loss = sum of nll over counted tokens / their count, both summed over dp_comm.
    """
    checks.float_inputs(logits=logits)
    checks.ndim("logits", logits, 3)
    checks.shape("targets", targets, tuple(logits.shape[:2]))
    xp = namespace(logits, targets)
    V_r = logits.shape[-1]
    z = _flat_rows(logits, V_r)                                          # [N, V_r]
    y = xp.astype(xp.reshape(targets, (-1,)), xp.int64)                  # [N]
    valid = y != ignore_index
    local = y - vocab_start
    mine = valid & (local >= 0) & (local < V_r)
    safe = xp.where(mine, local, xp.zeros_like(local))
    row_max = comm.all_reduce(xp.max(z, axis=-1), op="max")              # [N]
    shifted = z - row_max[:, None]
    probs = xp.exp(shifted)                                              # [N, V_r]
    sum_exp = comm.all_reduce(xp.sum(probs, axis=-1))                    # [N]
    picked = xp.take_along_axis(shifted, safe[:, None], axis=-1)[:, 0]
    picked = comm.all_reduce(xp.where(mine, picked, xp.zeros_like(picked)))
    nll = xp.where(valid, xp.log(sum_exp) - picked, xp.zeros_like(picked))
    totals = xp.stack([xp.sum(nll), xp.sum(xp.astype(valid, nll.dtype))])  # [2]
    if dp_comm is not None and dp_comm.size > 1:
        totals = dp_comm.all_reduce(totals)
    count = float(totals[1])
    loss = totals[0] / max(count, 1.0)
    probs /= sum_exp[:, None]
    return loss, (probs, safe, mine, valid, count, tuple(logits.shape))


def vocab_parallel_cross_entropy_backward(dloss, cache):
    """dz_r = dloss (softmax_r - onehot_r) / count on counted rows; no communication."""
    probs, safe, mine, valid, count, shape = cache
    xp = namespace(probs)
    n_rows, V_r = probs.shape
    weight = xp.astype(valid, probs.dtype) * (float(dloss) / max(count, 1.0))   # [N]
    dz = probs * weight[:, None]
    hit = -weight * xp.astype(mine, probs.dtype)
    flat = backend.scatter_add(xp.reshape(dz, (-1,)), xp.arange(n_rows) * V_r + safe, hit)
    return xp.reshape(flat, shape)
