"""The seams of the one decoder: what a parallel layout swaps in, and the one-device parts.

DecoderLM and its block (decoder.py, blocks.py) are written once. Where a layout changes what
happens, they call a *part* instead of an op, and a parallel layout hands them other parts
(tfcore.parallel.parts.ParallelParts) with the same methods:

    seam                          one device (this module)       a parallel layout
    block_spec(spec)              the spec                       this rank's heads (TP)
    stream_index(S)               all S positions                a block (SP), the ring's
                                                                 chunks (CP), or both
    attention_index(S)            all S positions                the ring's chunks (CP)
    draws(rng, rows, S)           rng                            the whole tensor's draws,
                                                                 this rank's block kept
    embed_forward / _backward     wte[ids]                       vocab-parallel (TP), the
                                                                 ring's positions (CP)
    enter_forward / _backward     identity                       f, or all-gather along S
    row_linear_forward/_backward  x W + b                        exit(x W_r) + b
    attention_forward/_backward   dense or tiled                 ring attention (CP)
    attention_keep_output         the tiled cache keeps the      the ring's likewise
                                  merged heads' view
    head_forward / _backward      x W + b                        column-parallel (TP)
    loss_forward / _backward      mean cross-entropy             vocab-parallel; the count
                                                                 summed over dp and cp
    reduce_grads(params, names)   nothing                        sum over tp what each rank
                                                                 computed from its share
    expert_groups                 None: every expert, every      the token (dp) group and
                                  token here                     the expert-parallel group
                                                                 (parallel/experts.py's
                                                                 ExpertGroups)

A part's forward returns (out, cache) and its backward takes (dout, cache), as every op pair.
The one-device parts are the ops the book proves, through tfcore.ops (a kernel where one
takes the arrays, with the same result), called exactly as the model called them before it
had seams, so a one-device run is unchanged bit for bit.
"""
from __future__ import annotations

from .. import functional as F
from .. import nn, ops
from ..backend import namespace

IGNORE_INDEX = -100


# Positions a rank holds: a slice of the sequence, or a tuple of slices (the ring's chunks,
# concatenated in increasing order). Slices, not index arrays: every array library (the
# array API standard included) takes them, and one slice is a view.


def rows_at(x, at, axis: int = 0):
    """x's entries at the positions `at` along `axis` (a view for one slice)."""
    if isinstance(at, slice):
        index = [slice(None)] * x.ndim
        index[axis] = at
        return x[tuple(index)]
    pieces = [rows_at(x, s, axis) for s in at]
    return namespace(x).concat(pieces, axis=axis) if len(pieces) > 1 else pieces[0]


def add_rows_at(target, at, values) -> None:
    """target[at] += values along axis 0 (values: the rows of `at`, concatenated)."""
    if isinstance(at, slice):
        target[at, ...] += values
        return
    offset = 0
    for s in at:
        n = s.stop - s.start
        target[s, ...] += values[offset:offset + n, ...]
        offset += n


def count_rows(at) -> int:
    return at.stop - at.start if isinstance(at, slice) else sum(s.stop - s.start for s in at)


def sub_rows(at, start: int, stop: int):
    """The positions of rows start..stop-1 of the concatenation `at` (a slice or a tuple)."""
    if isinstance(at, slice):
        return slice(at.start + start, at.start + stop)
    out, offset = [], 0
    for s in at:
        n = s.stop - s.start
        a, b = max(start - offset, 0), min(stop - offset, n)
        if a < b:
            out.append(slice(s.start + a, s.start + b))
        offset += n
    return out[0] if len(out) == 1 else tuple(out)


class OneDevice:
    """Every seam the plain op: the decoder on one device."""

    name = "one device"
    tp_size = 1
    ring = False                      # attention is the local dense or tiled op
    grads_final_per_unit = True       # no sum over ranks after the whole backward
    expert_groups = None              # MoE: every expert here, the batch's tokens here

    def block_spec(self, spec):
        """The block spec this rank runs (its heads under tensor parallelism)."""
        return spec

    def stream_index(self, seq: int):
        """The positions of the residual stream's rows on this rank, of a sequence of seq."""
        return slice(0, seq)

    def attention_index(self, seq: int):
        """The positions attention's queries (and keys before the ring) cover here."""
        return slice(0, seq)

    def draws(self, rng, rows, seq: int):
        """What dropout draws from: rng itself on one device."""
        return rng

    def dropout_index(self, rng, q_shape, k_shape):
        """The tiled op's dropout_index (whole shape, origin) of this rank's block of the
        attention: None on one device (the block is the whole)."""
        return None

    def attention_keep_output(self, cache, out):
        """The tiled attention's cache holding `out` (a view of the merged heads, equal to
        its own output) in place of its output."""
        return cache._replace(out=out)

    # -- embedding: ids [B, S] -> tokens [B, S, D] (positions are the model's) ---------------
    def embed_forward(self, params, ids):
        return F.embedding_forward(ids, params["wte"])

    def embed_backward(self, params, dx, cache):
        nn.accumulate(params, "wte", ops.embedding_backward(dx, cache, trusted=True))

    # -- the boundaries of a column-parallel then row-parallel pair ----------------------------
    def enter_forward(self, x):
        return x, None

    def enter_backward(self, dx, cache):
        return dx

    def row_linear_forward(self, params, name, x):
        return nn.linear_forward(params, name, x)

    def row_linear_backward(self, params, name, dy, cache, overwrite_input=False):
        return nn.linear_backward(params, name, dy, cache, overwrite_input=overwrite_input)

    # -- head and loss ---------------------------------------------------------------------
    def head_forward(self, x, W, b):
        """x [B, S, D] -> logits [B, S, V]."""
        return ops.linear_forward(x, W, b, trusted=True)

    def head_backward(self, dlogits, cache):
        """-> dx, dW [D, V], db."""
        return ops.linear_backward(dlogits, cache, trusted=True)

    def loss_forward(self, logits, targets):
        """The mean cross-entropy over the counted targets (-100 skips one)."""
        return ops.cross_entropy_forward(logits, targets, IGNORE_INDEX)

    def loss_backward(self, dloss, cache, overwrite=False):
        return ops.cross_entropy_backward(dloss, cache, overwrite=overwrite)

    def loss_count(self, cache) -> float:
        """The targets the loss counted (on this rank)."""
        return float(cache[3])

    # -- after a backward ------------------------------------------------------------------
    def take_reduced_grads(self, params):
        """Before a backward: what reduce_grads must not add again (nothing here)."""
        return None

    def reduce_grads(self, params, before=None, names=None):
        """After a backward: nothing to sum on one device."""
        return None


ONE_DEVICE = OneDevice()


class Resident:
    """The parameter source of a model that holds all its parameters (one device, tensor,
    sequence, pipeline and context parallelism, ZeRO-1): every unit runs on model.params.

        forward(names, fn)        fn(params) -> (out, cache), for the units `names`
        backward(names, fn, box, head=False)  fn(params, box): box = [cache], which fn
                                  pops, so the unit's backward holds its caches alone;
                                  head=True for the head's (which reads a tied wte of the
                                  embedding's unit, and writes no other of its tensors)
        begin_backward() / end_backward()   around one whole backward: the parts' sums over
                                  the tensor-parallel group of what each rank computed from
                                  its share (sequence parallelism, shared key/value heads)

    ZeRO-2/3 (tfcore.parallel.fsdp) hand the model another source with the same methods,
    which gathers a unit before use and frees it after."""

    def __init__(self, model):
        self.model = model
        self._before = None

    def forward(self, names, fn):
        return fn(self.model.params)

    def backward(self, names, fn, box, head=False):
        return fn(self.model.params, box)

    def begin_backward(self):
        self._before = self.model.parts.take_reduced_grads(self.model.params)

    def end_backward(self):
        before, self._before = self._before, None
        self.model.parts.reduce_grads(self.model.params, before)
