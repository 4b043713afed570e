"""The communication at the boundaries of a tensor-parallel region, as op pairs (Megatron's
mappings.py): each forward is paired with the adjoint of its own linear map as its backward.

Per-rank values: "replicated" means every rank of the group holds the same tensor,
"partial" means the true tensor is the sum over ranks of what they hold, "sharded" means
rank r holds block r (of the sequence, or of the last axis).

    op                                forward                   backward (the adjoint)
    copy_to_tp_region ("f")           identity (replicate)      all-reduce
    reduce_from_tp_region ("g")       all-reduce (partial->rep) identity
    gather_from_sequence_region       all-gather along S        reduce-scatter along S
    reduce_scatter_to_sequence_region reduce-scatter along S    all-gather along S
    scatter_to_sequence_region        keep block r along S      all-gather along S
    gather_from_tp_region             all-gather last axis      keep block r (split)
    all_to_all (axes a -> b)          block j of axis a to j,   all_to_all (axes b -> a)
                                      concatenated along b
    all_to_allv (counts s, r)         rows s_j to rank j,       all_to_allv (counts r, s)
                                      r_i rows from rank i

An all-to-all is a permutation of the rows held over all ranks: its adjoint is its inverse,
the all-to-all with the transposed count matrix (each rank's send and receive counts
swapped), or with the split and concatenation axes swapped. The expert-parallel dispatch
and combine (experts.py) and Ulysses' sequence <-> heads exchange are built on this pair.

Each pair is `*_forward(x, comm) -> (y, cache)` and `*_backward(dy, cache) -> dx`.
"""
from __future__ import annotations

from .. import checks
from ..backend import namespace

SEQ_AXIS = 1   # activations are [B, S, D]


def _cache(comm, y, **extra):
    return dict(comm=comm, shape=tuple(y.shape), dtype=checks.dtype_name(y), **extra)


def _check(name, dy, cache):
    checks.shape(name, dy, cache["shape"])
    if checks.dtype_name(dy) != cache["dtype"]:
        raise TypeError(f"{name} must be {cache['dtype']} like the forward output, got "
                        f"{checks.dtype_name(dy)}")


def copy_to_tp_region_forward(x, comm):
    """f: x replicated -> the same x on every rank (no communication).  x [...]"""
    return x, _cache(comm, x)


def copy_to_tp_region_backward(dy, cache):
    """f*: each rank's dy is the gradient of its own copy; the input's is their sum."""
    _check("dy", dy, cache)
    return cache["comm"].all_reduce(dy)


def reduce_from_tp_region_forward(x, comm):
    """g: partial sums -> their total, replicated.  x [...] -> y [...]"""
    y = comm.all_reduce(x)
    return y, _cache(comm, y)


def reduce_from_tp_region_backward(dy, cache):
    """g*: every partial summand gets the (replicated) gradient of the total unchanged."""
    _check("dy", dy, cache)
    return dy


def gather_from_sequence_region_forward(x, comm, axis: int = SEQ_AXIS):
    """Sequence shards -> the whole sequence on every rank, as that rank's own copy for its
    column-parallel layer (f fused in).  [B, S/N, D] -> [B, S, D]"""
    y = comm.all_gather(x, axis=axis)
    return y, _cache(comm, y, axis=axis)


def gather_from_sequence_region_backward(dy, cache):
    """The adjoint: rank r's shard receives the sum over ranks of block r of dy."""
    _check("dy", dy, cache)
    return cache["comm"].reduce_scatter(dy, axis=cache["axis"])


def reduce_scatter_to_sequence_region_forward(x, comm, axis: int = SEQ_AXIS):
    """Partial sums of the whole sequence -> rank r's block of their total.
    [B, S, D] -> [B, S/N, D]"""
    y = comm.reduce_scatter(x, axis=axis)
    return y, _cache(comm, y, axis=axis)


def reduce_scatter_to_sequence_region_backward(dy, cache):
    """The adjoint: every rank's partial gets the whole gathered gradient."""
    _check("dy", dy, cache)
    return cache["comm"].all_gather(dy, axis=cache["axis"])


def _block(x, comm, axis):
    n = x.shape[axis]
    if n % comm.size:
        raise ValueError(f"axis {axis} of size {n} must be a multiple of the group size "
                         f"{comm.size} to be split into equal blocks")
    step = n // comm.size
    index = [slice(None)] * x.ndim
    index[axis] = slice(comm.rank * step, (comm.rank + 1) * step)
    return namespace(x).asarray(x[tuple(index)], copy=True)


def scatter_to_sequence_region_forward(x, comm, axis: int = SEQ_AXIS):
    """Replicated whole sequence -> rank r keeps block r (no communication)."""
    y = _block(x, comm, axis % x.ndim)
    return y, _cache(comm, y, axis=axis)


def scatter_to_sequence_region_backward(dy, cache):
    _check("dy", dy, cache)
    return cache["comm"].all_gather(dy, axis=cache["axis"])


def gather_from_tp_region_forward(x, comm):
    """Last-axis shards -> the whole last axis, replicated.  [..., D/N] -> [..., D]"""
    y = comm.all_gather(x, axis=x.ndim - 1)
    return y, _cache(comm, y)


def gather_from_tp_region_backward(dy, cache):
    """The adjoint of an all-gather of replicated blocks is keeping one's own block."""
    _check("dy", dy, cache)
    return _block(dy, cache["comm"], dy.ndim - 1)


def all_to_all_forward(x, comm, split_axis: int = 0, concat_axis: int = 0):
    """Block j along split_axis to rank j, the arrivals concatenated along concat_axis in
    rank order.  [..., n, ..., m, ...] -> [..., n / N, ..., N m, ...]"""
    y = comm.all_to_all(x, split_axis, concat_axis)
    return y, _cache(comm, y, split_axis=split_axis, concat_axis=concat_axis)


def all_to_all_backward(dy, cache):
    """The adjoint: the same exchange with the axes swapped sends every block back."""
    _check("dy", dy, cache)
    return cache["comm"].all_to_all(dy, split_axis=cache["concat_axis"],
                                    concat_axis=cache["split_axis"])


def all_to_allv_forward(x, comm, send_counts, recv_counts):
    """Rows send_counts[j] to rank j, recv_counts[i] rows from rank i (in rank order).
    [sum(send_counts), ...] -> [sum(recv_counts), ...]"""
    y = comm.all_to_allv(x, send_counts, recv_counts)
    return y, _cache(comm, y, send_counts=tuple(int(c) for c in send_counts),
                     recv_counts=tuple(int(c) for c in recv_counts))


def all_to_allv_backward(dy, cache):
    """The adjoint: every row's gradient goes back to the rank it came from (the counts
    transposed).  [sum(recv_counts), ...] -> [sum(send_counts), ...]"""
    _check("dy", dy, cache)
    return cache["comm"].all_to_allv(dy, cache["recv_counts"], cache["send_counts"])
