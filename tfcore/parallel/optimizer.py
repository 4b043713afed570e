"""Data-parallel AdamW over the flat buffers: replicated state, or ZeRO stage 1.

The loss of every data-parallel rank is already divided by the number of counted tokens of
the whole global batch (vocab_parallel_cross_entropy_forward sums the counts over dp), so
the global gradient is the *sum* of the ranks' gradients: with equal counts this is the
mean of the ranks' mean-loss gradients; with unequal counts the mean of means would weight
a token of a short batch more than a token of a long one.

* replicated (zero=False): all-reduce the gradient buffer [P]; every rank runs the same
  adamw_update on the whole buffer, keeping m and v [P] each.
* ZeRO-1 (zero=True): reduce-scatter the gradient, so rank d gets the summed gradient of its
  chunk [P_d] (chunk_bounds); it keeps m and v for that chunk only, updates that chunk of
  the parameters with adamw_update, and an all-gather gives every rank the whole buffer.
  Same arithmetic, elementwise, hence the same parameters; a ring reduce-scatter plus a
  ring all-gather move exactly what one ring all-reduce moves.

clip (optional): a function clip(grad, (start, stop)) called on the reduced gradient this
rank updates, the whole buffer [P] or its ZeRO-1 chunk [P_d] at (start, stop), before the
update; it scales grad in place and returns the global norm (grads.clip_grad_norm over the
pieces it builds), kept as `last_norm`.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..optim import adamw_update
from .comm import chunk_bounds


class DataParallelAdamW:
    def __init__(self, params, dp, zero: bool = False, lr: float = 1e-3, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                 clip=None):
        self.params, self.dp, self.zero = params, dp, zero
        self.clip, self.last_norm = clip, None
        self.hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        self.bounds = chunk_bounds(params.size, dp.size)
        xp = backend.namespace(params.data)
        mask = params.decay_mask()
        start, stop = self.bounds[dp.rank] if zero else (0, params.size)
        self.slice = (start, stop)
        self.mask = xp.asarray(mask[start:stop], copy=True)
        self.m = xp.zeros((stop - start,), dtype=params.data.dtype)      # [P_d] or [P]
        self.v = xp.zeros((stop - start,), dtype=params.data.dtype)
        self.t = 0

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (m and v)."""
        return 2 * self.m.shape[0] * np.dtype(self.params.dtype).itemsize

    def reduce_gradients(self):
        """Replicated mode: params.grad <- sum over dp of params.grad (in place)."""
        if self.zero:
            raise RuntimeError("with ZeRO-1 the gradients are reduce-scattered inside step()")
        if self.dp.size > 1:
            self.params.grad[...] = self.dp.all_reduce(self.params.grad)

    def step(self, reduced: bool = False):
        """Reduce the gradients over dp (unless `reduced`: reduce_gradients() ran already),
        update, and (ZeRO) gather the parameters."""
        self.t += 1
        p = self.params
        if not self.zero:
            if not reduced:
                self.reduce_gradients()
            if self.clip is not None:
                self.last_norm = self.clip(p.grad, self.slice)
            adamw_update(p.data, p.grad, self.m, self.v, self.t, decay_mask=self.mask,
                         **self.hyper)
            return
        xp = backend.namespace(p.data)
        a, b = self.slice
        grad = self.dp.reduce_scatter_flat(p.grad, self.bounds)            # [P_d]
        if self.clip is not None:
            self.last_norm = self.clip(grad, self.slice)
        shard = xp.asarray(p.data[a:b], copy=True)                          # [P_d]
        adamw_update(shard, grad, self.m, self.v, self.t, decay_mask=self.mask, **self.hyper)
        p.data[...] = self.dp.all_gather_flat(shard, self.bounds)
