"""The data-parallel sharding strategies of the one optimizer (tfcore.optim's AdamW and SGD).

A strategy is a tfcore.optim.ShardView: it says which part [Z] of the flat buffers this rank
updates, how the summed gradient of that part reaches it, and what happens after the update.
The optimizer's arithmetic is the same on every view, elementwise, so every strategy gives
one device's parameters.

The loss of every data-parallel rank is already divided by the number of counted tokens of
the whole global batch (vocab_parallel_cross_entropy_forward sums the counts over dp), so
the global gradient is the *sum* of the ranks' gradients: with equal counts this is the
mean of the ranks' mean-loss gradients; with unequal counts the mean of means would weight
a token of a short batch more than a token of a long one.

* Replicated(dp): all-reduce the gradient buffer [P] (unless reduce=False: the caller sums
  it first, with buckets or reduce_gradients()); every rank updates the whole buffer and
  keeps m and v [P] each.
* ZeRO1(dp): reduce-scatter the gradient, so rank d gets the summed gradient of its chunk
  [P_d] (chunk_bounds); it keeps m and v for that chunk only, updates that chunk of the
  parameters, and an all-gather gives every rank the whole buffer. A ring reduce-scatter
  plus a ring all-gather move exactly what one ring all-reduce moves.
* ZeRO23(model): a ShardedDecoder (tfcore.parallel.fsdp) reduce-scatters each unit's
  gradient during its backward into shard_grad [Z_d]; the update runs on the shard (stage
  3: the parameters' shard itself; stage 2: this rank's chunks of the whole parameters [P],
  all-gathered unit by unit after the update).

Clipping (the optimizer's clip=max_norm) takes the view's gradient as pieces for
tfcore.optim.clip_grad_norm, with grads.global_sum_of_squares summing each element once
over the groups: tp_mask (bool [P]) marks the tensor-parallel shards (split over tp), the
rest is replicated over tp; a ZeRO chunk or shard is split over dp; pp (a pipeline group)
and counted (bool [P], False for a copy another rank counts) as in grads.parallel_pieces.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import backend
from ..optim import Adam, AdamW, ShardView
from .comm import chunk_bounds
from .grads import GradPiece, global_sum_of_squares, parallel_pieces


class ExpertShards(NamedTuple):
    """An MoE model's experts under expert parallelism: mask (bool [P]) marks their elements
    in the flat buffer; each rank holds N_E / ep of them, split over the expert-parallel
    group ep, and the ranks holding the same experts form edp (dp / ep of them)."""

    mask: object
    ep: object
    edp: object

    def positions(self):
        """(dense [P - E], experts [E]): the flat buffer's positions of each kind, int64."""
        mask = np.asarray(backend.to_numpy(self.mask), dtype=bool)
        return (backend.asarray(np.nonzero(~mask)[0].astype(np.int64)),
                backend.asarray(np.nonzero(mask)[0].astype(np.int64)))


def _place(xp, n: int, parts, dtype):
    """[n] with each (positions, values) of `parts` written at its positions (a scatter into
    zeros: the positions are disjoint; every array library takes it)."""
    out = xp.zeros((n,), dtype=dtype)
    for at, values in parts:
        if backend.is_numpy(out) or backend.is_cupy(out):
            out[at] = values                                # in place, no accumulation
        else:
            out = backend.scatter_add(out, at, values)
    return out


class _DataParallel(ShardView):
    """A contiguous range (a, b) of the flat buffers over the data-parallel group dp."""

    sharded = False                   # the dp ranks hold disjoint chunks (ZeRO)

    def __init__(self, dp, tp=None, tp_mask=None, pp=None, counted=None, experts=None):
        if tp_mask is not None and tp is None:
            raise ValueError("tp_mask needs the tensor-parallel group tp")
        self.dp, self.tp, self.tp_mask, self.pp, self.counted = dp, tp, tp_mask, pp, counted
        self.experts = experts        # ExpertShards, or None (every rank holds them all)
        self.bounds = None            # (a, b): set by size(), from the parameters' size

    def size(self, params) -> int:
        n = int(params.data.shape[0])
        self.bounds = chunk_bounds(n, self.dp.size)[self.dp.rank] if self.sharded else (0, n)
        return self.bounds[1] - self.bounds[0]

    def select(self, params, full):
        a, b = self.bounds
        return full[a:b]

    sum_squares = staticmethod(global_sum_of_squares)

    def pieces(self, grad) -> list:
        a, b = self.bounds
        dp = self.dp if self.sharded else None
        counted = None if self.counted is None else self.counted[a:b]
        if self.experts is not None:  # the experts: split over ep, whole on every tp rank
            xp = backend.namespace(grad)
            mine = self.experts.mask[a:b]
            others = xp.logical_not(mine)
            counted = others if counted is None else xp.logical_and(counted, others)
            groups = tuple(g for g in (self.experts.ep, dp, self.pp) if g is not None)
            if self.tp is None:
                rest = [GradPiece(grad, tuple(g for g in (dp, self.pp) if g is not None),
                                  counted)]
            else:
                mask = (self.tp_mask if self.tp_mask is not None
                        else xp.zeros((b,), dtype=xp.bool))[a:b]
                rest = parallel_pieces(grad, mask, self.tp, dp, self.pp, counted)
            return rest + [GradPiece(grad, groups, mine)]
        if self.tp is None:
            if counted is not None:
                raise ValueError("counted needs the tensor-parallel group tp")
            return [GradPiece(grad, tuple(g for g in (dp, self.pp) if g is not None))]
        mask = self.tp_mask
        if mask is None:
            xp = backend.namespace(grad)
            mask = xp.zeros((self.bounds[1],), dtype=xp.bool)
        return parallel_pieces(grad, mask[a:b], self.tp, dp, self.pp, counted)


class Replicated(_DataParallel):
    """Every dp rank updates the whole buffers from the all-reduced gradient.
    reduce=False: the caller has summed params.grad over dp before step() (buckets that
    overlap the backward, or reduce_gradients() timed on its own)."""

    def __init__(self, dp, tp=None, tp_mask=None, pp=None, counted=None, reduce: bool = True,
                 experts=None):
        super().__init__(dp, tp, tp_mask, pp, counted, experts)
        self.reduce = reduce
        # (dense, experts) positions of the flat buffer, when the experts are split over ep
        self.positions = (experts.positions() if experts is not None and experts.ep.size > 1
                          else None)

    def reduce_gradients(self, params) -> None:
        """params.grad <- sum over dp of params.grad (in place); under expert parallelism
        the experts' elements are summed over edp instead (the ranks holding the same
        experts), the rest over dp."""
        if self.positions is None:
            if self.dp.size > 1:
                params.grad[...] = self.dp.all_reduce(params.grad)
            return
        xp, grad = backend.namespace(params.grad), params.grad
        dense_at, experts_at = self.positions
        dense = self.dp.all_reduce(xp.take(grad, dense_at))
        experts = xp.take(grad, experts_at)
        if self.experts.edp.size > 1:
            experts = self.experts.edp.all_reduce(experts)
        grad[...] = _place(xp, grad.shape[0], [(dense_at, dense), (experts_at, experts)],
                           grad.dtype)

    def gradient(self, params):
        if self.reduce:
            self.reduce_gradients(params)
        return params.grad                                               # [P]


class ZeRO1(_DataParallel):
    """ZeRO stage 1: the gradient reduce-scattered, this rank's chunk [P_d] updated, the
    parameters all-gathered. reduce=False: the caller has summed params.grad over dp
    already (gradient buckets all-reduced during the backward); the step takes its chunk."""

    sharded = True
    same_on_every_rank = False

    def __init__(self, dp, tp=None, tp_mask=None, pp=None, counted=None, reduce: bool = True,
                 experts=None):
        super().__init__(dp, tp, tp_mask, pp, counted, experts)
        self.reduce = reduce

    def gradient(self, params):
        if not self.reduce:
            a, b = self.bounds
            return params.grad[a:b]                                     # [P_d], summed
        return self.dp.reduce_scatter_flat(params.grad, self._all_bounds(params))   # [P_d]

    def parameters(self, params):
        xp = backend.namespace(params.data)
        a, b = self.bounds
        return xp.asarray(params.data[a:b], copy=True)                   # [P_d]

    def publish(self, params, values) -> None:
        params.data[...] = self.local_of(values, int(params.data.shape[0]))

    def local_of(self, values, n: int):
        """The whole local buffer [n] from every rank's view [Z] (collective)."""
        return self.dp.all_gather_flat(values, chunk_bounds(n, self.dp.size))

    def _all_bounds(self, params):
        return chunk_bounds(int(params.data.shape[0]), self.dp.size)


class ZeRO1Experts(ZeRO1):
    """ZeRO-1 under expert parallelism: the experts' elements (experts.mask) differ between
    the ranks of an ep block, so they are chunked over edp (the ranks holding the same
    experts) and the rest over dp. The view [Z] is this rank's chunk of the dense elements,
    then its chunk of its experts' elements; the gradient reaches it by one reduce-scatter
    over each group, and the update is published by one all-gather over each."""

    def __init__(self, dp, tp=None, tp_mask=None, experts: ExpertShards = None):
        super().__init__(dp, tp, tp_mask, experts=experts)
        self.dense_at, self.experts_at = experts.positions()       # [P - E], [E]
        self.dense_bounds = chunk_bounds(int(self.dense_at.shape[0]), dp.size)
        self.expert_bounds = chunk_bounds(int(self.experts_at.shape[0]), experts.edp.size)
        a, b = self.dense_bounds[dp.rank]
        c, d = self.expert_bounds[experts.edp.rank]
        self.n_dense = b - a
        xp = backend.namespace(self.dense_at)
        self.view_at = xp.concat([self.dense_at[a:b], self.experts_at[c:d]])   # [Z]

    def size(self, params) -> int:
        self.bounds = (0, int(self.view_at.shape[0]))
        return self.bounds[1]

    def select(self, params, full):
        return backend.namespace(full).take(full, self.view_at)

    def gradient(self, params):
        xp, grad = backend.namespace(params.grad), params.grad
        return xp.concat([
            self.dp.reduce_scatter_flat(xp.take(grad, self.dense_at), self.dense_bounds),
            self.experts.edp.reduce_scatter_flat(xp.take(grad, self.experts_at),
                                                 self.expert_bounds)])       # [Z]

    def parameters(self, params):
        return self.select(params, params.data)                             # a copy

    def local_of(self, values, n: int):
        xp = backend.namespace(values)
        dense = self.dp.all_gather_flat(values[:self.n_dense], self.dense_bounds)
        experts = self.experts.edp.all_gather_flat(values[self.n_dense:], self.expert_bounds)
        return _place(xp, n, [(self.dense_at, dense), (self.experts_at, experts)],
                      values.dtype)

    def pieces(self, grad) -> list:
        nd = self.n_dense
        mask = self.tp_mask
        xp = backend.namespace(grad)
        if mask is None:
            mask = xp.zeros((nd,), dtype=xp.bool)
        else:
            mask = xp.take(mask, self.view_at[:nd])
        dense = (parallel_pieces(grad[:nd], mask, self.tp, self.dp) if self.tp is not None
                 else [GradPiece(grad[:nd], (self.dp,))])
        return dense + [GradPiece(grad[nd:], (self.experts.ep, self.experts.edp))]


class ZeRO23(ShardView):
    """ZeRO stage 2 or 3 over a ShardedDecoder: the gradient is its shard_grad [Z_d]
    (reduce-scattered unit by unit during the backward). Pass `ZeRO23.buffers(model)` as
    the optimizer's params."""

    same_on_every_rank = False
    sum_squares = staticmethod(global_sum_of_squares)

    def __init__(self, model):
        self.model = model

    @staticmethod
    def buffers(model):
        return _UnitBuffers(model)

    def size(self, params) -> int:
        return int(self.model.shard_size)

    def select(self, params, full):                                    # [P] -> [Z_d]
        return np.concatenate([self.model.chunk_of(u, full) for u in self.model.units.values()])

    def gradient(self, params):
        return self.model.shard_grad                                     # [Z_d]

    def parameters(self, params):
        model = self.model
        if model.stage == 3:
            return model.shard                                           # [Z_d], in place
        return self.select(params, model.data)                           # [Z_d], a copy

    def publish(self, params, values) -> None:
        model = self.model
        if model.stage == 3:
            return
        for u in model.units.values():
            model.data[u.start:u.stop] = model.dp.all_gather_flat(
                values[u.shard_start:u.shard_stop], u.bounds)

    def pieces(self, grad) -> list:
        model = self.model
        return parallel_pieces(grad, model.shard_tp_mask, model.tp, model.dp)


class _UnitBuffers:
    """A ShardedDecoder's buffers as the optimizer's params: data (stage 3: the shard
    [Z_d]; stage 2: the whole parameters [P]), grad (the shard [Z_d]), the decay mask [P]."""

    def __init__(self, model):
        self.model = model

    @property
    def data(self):
        return self.model.shard if self.model.stage == 3 else self.model.data

    @property
    def grad(self):
        return self.model.shard_grad

    def decay_mask(self):
        return self.model.decay


def adamw(params, shard: ShardView, hyper: dict, clip: float | None = None) -> AdamW:
    """tfcore.optim.AdamW over `shard` from a dict of lr, beta1, beta2, eps, weight_decay
    (the trainer's settings, or harness.HYPER); Adam when weight_decay is 0 (the same update, saved as Adam, as
    the one-device trainer saves it)."""
    betas = (hyper["beta1"], hyper["beta2"])
    if not hyper["weight_decay"]:
        return Adam(params, lr=hyper["lr"], betas=betas, eps=hyper["eps"], shard=shard,
                    clip=clip)
    return AdamW(params, lr=hyper["lr"], betas=betas, eps=hyper["eps"],
                 weight_decay=hyper["weight_decay"], shard=shard, clip=clip)
