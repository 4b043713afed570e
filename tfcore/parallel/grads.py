"""What happens to the gradients between the backward and the optimizer step of a real run:
accumulation over micro-batches, a bucketed all-reduce that overlaps the backward, and
clipping by the global norm over every sharding.

Accumulation. A batch of B rows is cut into K micro-batches of B/K rows (K must divide B);
micro-batch k counts c_k targets (ignored ones excluded; summed over the data-parallel
ranks), T_c = sum_k c_k. The loss of the large batch is the mean over its T_c counted
tokens, sum_k c_k / T_c * loss_k with loss_k the mean over micro-batch k, so its gradient
is the sum of the micro-batches' gradients each taken with the upstream gradient
w_k = c_k / T_c: `accumulation_weights` computes them. Not 1 / K: with padding the
micro-batches count different numbers of tokens, and 1 / K would weight a token of a short
micro-batch more than a token of a long one.

Buckets (as PyTorch DDP's bucket_cap_mb). The backward finishes the parameters in the
reverse of the flat buffer's order (head, final norm, block L-1, ..., block 0,
embeddings), so buckets are contiguous ranges of the flat gradient, filled from its end:
a bucket takes parameters (whole tensors) until the next one would take it past
bucket_bytes (one tensor larger than that is a bucket of its own). A bucket is ready when
the unit holding its first parameter (a block, or the head, or the embeddings) has
finished its backward: the model calls `GradientBuckets.unit_done(label)` there, and the
ready buckets' all-reduces start (iall_reduce) while the backward goes on. finish() waits
for them in order and writes the sums into the gradient; blocking=True runs the same
buckets with blocking all-reduces after the backward, the same numbers bit for bit.

Clipping. The global norm ||g|| = sqrt(sum of the squares of every gradient element of
the model, each counted once). A rank passes its local pieces as GradPiece(grad,
sharded_over, where):

    grad         the gradient this rank holds for the piece, already reduced (the same on
                 every rank that holds the same elements)
    sharded_over the communicators over whose ranks the piece is split into disjoint
                 parts (their squares add); over every other group the piece is
                 replicated and is counted once
    where        optional boolean mask of grad's elements that belong to the piece (several
                 pieces may share one buffer: a ZeRO-1 chunk holds tensor-parallel shards
                 and replicated norms side by side)

    tensor parallel   a sharded weight: sharded_over=(tp,); a LayerNorm weight: ()
    ZeRO-1            the owned chunk: add dp to the piece's groups
    pipeline          every piece of a stage: add the pipeline group; the last stage's
                      copy of a tied wte is masked out (the first stage counts it)
    ZeRO-2 / ZeRO-3   the owned chunk of each unit (the shard [Z_d]): add dp

Every rank must pass pieces with the same list of distinct groupings, in any order (an
empty array where it holds none): the partial sums are all-reduced one grouping at a
time, in the order of the groups' names (global_sum_of_squares); tfcore.optim.clip_grad_norm
(pieces, max_norm, global_sum_of_squares) scales by min(1, max_norm / (||g|| + 1e-6)) as
torch.nn.utils.clip_grad_norm_ does.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .. import backend, checks
from ..models.decoder import IGNORE_INDEX
from ..optim import sum_of_squares


# -- accumulation ------------------------------------------------------------------------------
def check_micro_batches(batch: int, micro_batches) -> int:
    """K, after checking that it is a positive integer dividing the batch rows."""
    k = checks.integer("micro_batches", micro_batches, least=1)
    if batch % k:
        raise ValueError(f"micro_batches ({k}) must divide the batch rows ({batch}): every "
                         "micro-batch holds batch / micro_batches rows")
    return k


def split_micro_batches(ids, targets, micro_batches: int):
    """ids, targets [B, S] -> [(ids_k, targets_k)], K pieces of [B/K, S] (consecutive rows)."""
    k = check_micro_batches(ids.shape[0], micro_batches)
    rows = ids.shape[0] // k
    return [(ids[i * rows:(i + 1) * rows], targets[i * rows:(i + 1) * rows]) for i in range(k)]


def accumulation_weights(pieces, dp=None, ignore_index: int = IGNORE_INDEX):
    """[w_k] = c_k / T_c for micro-batches [(ids_k, targets_k)]: c_k the counted targets of
    micro-batch k (summed over dp when given: one all-reduce of K numbers), T_c = sum c_k.
    -> (weights list of K floats, counts list of K floats)."""
    local = np.array([float(np.sum(backend.to_numpy(t) != ignore_index)) for _, t in pieces])
    counts = local
    if dp is not None and dp.size > 1:
        counts = np.asarray(backend.to_numpy(dp.all_reduce(backend.asarray(local))))
    total = float(np.sum(counts))
    return [float(c) / max(total, 1.0) for c in counts], [float(c) for c in counts]


# -- buckets -----------------------------------------------------------------------------------
def backward_units(params, n_layers: int) -> list[tuple[str, tuple[int, int]]]:
    """[(label, (start, stop))]: the flat ranges the backward finishes, in its order:
    'head' (final norm and head), 'h{L-1}' .. 'h0', 'embed' (wte, wpe). Each label is what
    the model reports to unit_done."""
    first = {}
    for name in params.names:
        unit = name.split(".")[0] if name.startswith("h") and name[1:2].isdigit() else (
            "embed" if name in ("wte", "wpe") else "head")
        a, b = params.offsets[name]
        lo, hi = first.get(unit, (a, b))
        first[unit] = (min(lo, a), max(hi, b))
    order = ["head"] + [f"h{i}" for i in reversed(range(n_layers))] + ["embed"]
    units = [(u, first[u]) for u in order if u in first]
    covered = sorted(r for _, r in units)
    if covered[0][0] != 0 or covered[-1][1] != params.size or any(
            covered[i][1] != covered[i + 1][0] for i in range(len(covered) - 1)):
        raise ValueError("the parameters of each backward unit must be contiguous in the "
                         f"flat buffer, got {dict(units)}")
    return units


def pack_buckets(sizes, itemsize: int, cap: int) -> list[list[str]]:
    """[[names]] of each bucket, from the end of the flat buffer: sizes [(name, elements)] in
    the buffer's order, each bucket at most cap bytes unless one tensor is larger."""
    buckets, current, size = [], [], 0
    for name, n in reversed(sizes):
        if current and (size + n) * itemsize > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    buckets.append(current)
    return buckets


def make_buckets(params, units, bucket_bytes) -> list[dict]:
    """Buckets: [{'range': (start, stop), 'ready': unit label, 'names': [...]}], from the
    end of the flat buffer; each at most bucket_bytes unless one tensor is larger."""
    cap = checks.integer("bucket_bytes", bucket_bytes)
    if cap <= 0:
        raise ValueError(f"bucket_bytes must be a positive number of bytes, got {cap}")
    itemsize = np.dtype(params.dtype).itemsize
    unit_of = {}
    for label, (a, b) in units:
        for name in params.names:
            s, e = params.offsets[name]
            if a <= s and e <= b:
                unit_of[name] = label
    order = {label: i for i, (label, _) in enumerate(units)}
    sizes = [(n, params.offsets[n][1] - params.offsets[n][0]) for n in params.names]
    out = []
    for names in pack_buckets(sizes, itemsize, cap):
        start, stop = params.offsets[names[-1]][0], params.offsets[names[0]][1]
        ready = max((unit_of[n] for n in names), key=order.__getitem__)
        out.append(dict(range=(start, stop), ready=ready, names=names))
    return out


class GradientBuckets:
    """The data-parallel all-reduce of params.grad [P] in buckets, started during the
    backward (overlap) or after it (blocking=True). Rank-local, on every dp rank:

        buckets = GradientBuckets(params, dp, n_layers, bucket_bytes)
        model.backward(after_unit=buckets.unit_done)
        buckets.finish()            # params.grad now holds the sum over dp
        buckets.exposed             # seconds this rank waited for communication
    """

    def __init__(self, params, dp, n_layers: int, bucket_bytes: int, blocking: bool = False):
        self.params, self.dp, self.blocking = params, dp, bool(blocking)
        self.units = backward_units(params, n_layers)
        self.buckets = make_buckets(params, self.units, bucket_bytes)
        self.requests: list = []
        self.exposed = 0.0
        self._done: set = set()

    def unit_done(self, label: str) -> None:
        """The backward has finished unit `label`: start the buckets that became ready."""
        if label not in {u for u, _ in self.units}:
            raise ValueError(f"unknown backward unit {label!r}; known: "
                             f"{[u for u, _ in self.units]}")
        self._done.add(label)
        self.dp.record_compute(f"backward {label}")
        if self.blocking or self.dp.size == 1:
            return
        for i, bucket in enumerate(self.buckets):
            if i == len(self.requests) and bucket["ready"] in self._done:
                a, b = bucket["range"]
                self.requests.append(self.dp.iall_reduce(self.params.grad[a:b],
                                                         label=f"bucket {i}"))

    def finish(self) -> None:
        """Wait for every bucket (or, blocking, all-reduce each now); params.grad <- sum."""
        missing = [u for u, _ in self.units if u not in self._done]
        if missing:
            raise RuntimeError(f"finish() before the backward reported units {missing}")
        if self.dp.size == 1:
            return
        grad = self.params.grad
        for i, bucket in enumerate(self.buckets):
            a, b = bucket["range"]
            if self.blocking:
                start = time.perf_counter()
                grad[a:b] = self.dp.all_reduce(grad[a:b])
                self.exposed += time.perf_counter() - start
            else:
                grad[a:b] = self.requests[i].wait()
                self.exposed += self.requests[i].waited


def overlap_timeline(events, compute_cost: dict, comm_cost: dict) -> dict:
    """A timeline from one rank's recorded events (Traffic.events) and a cost model.

    The order is the recorded one: the computations run one after the other; a request
    launched after computation X starts when X ends, or when the request before it ends
    (one progress thread: one collective at a time), and lasts comm_cost[label]; wait()
    calls come after the last computation. compute_cost: {compute label: duration};
    comm_cost: {request label: duration}. -> dict(compute=[(label, start, end)],
    comm=[(label, start, end)], compute_end, end, exposed), exposed = end - compute_end:
    the communication left when the computation is done."""
    clock, free, compute, comm = 0.0, 0.0, [], []
    for kind, label in events:
        if kind == "compute":
            compute.append((label, clock, clock + compute_cost[label]))
            clock += compute_cost[label]
        elif kind == "launch":
            start = max(clock, free)
            free = start + comm_cost[label]
            comm.append((label, start, free))
    end = max(clock, free)
    return dict(compute=compute, comm=comm, compute_end=clock, end=end, exposed=end - clock)


# -- clipping ----------------------------------------------------------------------------------
@dataclass
class GradPiece:
    """A piece of the model's gradient held by this rank (see the module docstring)."""

    grad: object                       # array, any shape
    sharded_over: tuple = ()           # communicators the piece is split over
    where: object = None               # optional bool mask, grad's shape


def global_sum_of_squares(pieces) -> float:
    """sum of the squares over the whole model, each element counted once: each piece's
    local sum (tfcore.optim.sum_of_squares), added per grouping, all-reduced over each
    grouping's groups (a collective). The sum_squares of tfcore.optim.clip_grad_norm."""
    sums: dict = {}
    for piece in pieces:
        if not isinstance(piece, GradPiece):
            raise TypeError(f"pieces must be GradPiece objects, got {type(piece).__name__}")
        groups = tuple(sorted(piece.sharded_over, key=lambda g: g.name))
        key = tuple(g.name for g in groups)
        total, _ = sums.get(key, (0.0, groups))
        sums[key] = (total + float(sum_of_squares(piece)), groups)
    norm_sq = 0.0
    for key in sorted(sums):
        value, groups = sums[key]
        for group in groups:
            if group.size > 1:
                value = float(group.all_reduce(backend.asarray(np.array([value])))[0])
        norm_sq += value
    return norm_sq


def global_grad_norm(pieces) -> float:
    """sqrt(global_sum_of_squares(pieces)): the norm of the whole model's gradient."""
    return math.sqrt(global_sum_of_squares(pieces))


def tensor_parallel_mask(model):
    """bool [P_local]: True for the elements of this rank's flat buffer that belong to a
    tensor-parallel shard, False for the replicated tensors (norms, wpe, row biases) and
    the experts (whole on every tensor-parallel rank)."""
    from .model import shard_rule

    params = model.params
    mask = np.zeros(params.size, dtype=bool)
    if model.tp.size > 1:
        for name in params.names:
            if shard_rule(name) not in ("replicated", "experts"):
                a, b = params.offsets[name]
                mask[a:b] = True
    return backend.asarray(mask)


def expert_mask(model):
    """bool [P_local]: True for the elements of this rank's flat buffer that hold its
    experts (an MoE model's moe.experts.* tensors)."""
    from .model import shard_rule

    params = model.params
    mask = np.zeros(params.size, dtype=bool)
    for name in params.names:
        if shard_rule(name) == "experts":
            a, b = params.offsets[name]
            mask[a:b] = True
    return backend.asarray(mask)


def parallel_pieces(grad, mask, tp, dp=None, pp=None, counted=None) -> list[GradPiece]:
    """The two pieces of a TP (x DP, x PP) rank's gradient buffer, ZeRO chunk or shard: its
    tensor-parallel shards (sharded over tp, and dp when dp is given: a ZeRO chunk or
    shard, and pp when given: a pipeline stage) and its replicated tensors (sharded over
    dp and pp only, counted once over tp). counted: optional bool mask, grad's shape, of
    the elements this rank counts (False for a copy that another rank counts: the last
    stage's copy of a tied wte)."""
    extra = tuple(g for g in (dp, pp) if g is not None)
    xp = backend.namespace(grad)
    shards, replicated = mask, xp.logical_not(mask)
    if counted is not None:
        checks.shape("counted", counted, tuple(grad.shape))
        shards = xp.logical_and(shards, counted)
        replicated = xp.logical_and(replicated, counted)
    return [GradPiece(grad, (tp,) + extra, shards), GradPiece(grad, extra, replicated)]
