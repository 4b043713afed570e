"""A few training steps, on one device or on a DP x TP mesh: the same batches, the same
initial parameters, the same AdamW, so the two can be compared number for number."""
from __future__ import annotations

import math
import time

import numpy as np

from .. import backend
from ..models.decoder import IGNORE_INDEX, DecoderConfig, DecoderLM
from ..optim import adamw_update
from .mesh import Mesh
from .model import TensorParallelDecoder
from .optimizer import DataParallelAdamW

CONFIGS = {
    # small enough for a test, big enough to split 4 ways (heads, d_ff) and unevenly (V)
    "tiny": lambda: DecoderConfig(vocab_size=31, max_seq_len=16, d_model=16, n_layers=2,
                                  n_heads=4, d_ff=32, dtype="float64"),
    "tiny-llama": lambda: DecoderConfig.llama(vocab_size=29, max_seq_len=16, d_model=16,
                                              n_layers=2, n_heads=4, d_ff=24, dtype="float64"),
    "small": lambda: DecoderConfig(vocab_size=257, max_seq_len=64, d_model=128, n_layers=4,
                                   n_heads=8, d_ff=512, dtype="float64"),
}

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def make_batches(config: DecoderConfig, steps: int, batch: int, seq: int, seed: int = 0,
                 ignore_fraction: float = 0.25):
    """ids, targets [steps, B, S] (host int64): random tokens; a random quarter of the
    targets are ignore_index, so the data-parallel ranks count different numbers of tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, size=(steps, batch, seq + 1))
    targets = ids[:, :, 1:].copy()
    targets[rng.random(targets.shape) < ignore_fraction] = IGNORE_INDEX
    return ids[:, :, :-1], targets


def _dropout(config, seed, step):
    """Training mode with a generator seeded per step (the same on every rank) when the
    config has dropout: a sharded run draws the whole tensors and keeps its blocks."""
    if config.dropout == 0:
        return {}
    return dict(training=True, rng=backend.default_rng(10_000 * seed + step))


def train_single(config: DecoderConfig, steps: int, batch: int, seq: int, seed: int = 0,
                 hyper=None):
    """One device: -> dict(losses, params (host float64 [P]), grads (of the last step))."""
    hyper = dict(HYPER, **(hyper or {}))
    model = DecoderLM(config).init(seed)
    p = model.params
    m, v = p.data * 0, p.data * 0
    mask = p.decay_mask()
    ids, targets = make_batches(config, steps, batch, seq, seed)
    losses = []
    for t in range(steps):
        p.zero_grad()
        _, loss = model.forward(backend.asarray(ids[t]), backend.asarray(targets[t]),
                                **_dropout(config, seed, t))
        losses.append(float(loss))
        model.backward()
        grads = np.array(backend.to_numpy(p.grad), copy=True)
        adamw_update(p.data, p.grad, m, v, t + 1, decay_mask=mask, **hyper)
    return dict(losses=losses, params=np.array(backend.to_numpy(p.data)), grads=grads)


def train_parallel(world, config: DecoderConfig, steps: int, batch: int, seq: int, tp: int = 1,
                   dp: int | None = None, sequence_parallel: bool = False, zero: bool = False,
                   seed: int = 0, hyper=None, gather: bool = True):
    """Rank-local: run on every rank of `world`. The global batch [B, S] is split by rows over
    the dp ranks. -> dict(losses, params (full, host), grads (full, of the last step, before
    the optimizer; None with ZeRO), traffic) on every rank."""
    hyper = dict(HYPER, **(hyper or {}))
    mesh = Mesh(world, tp, dp)
    if batch % mesh.dp_size:
        raise ValueError(f"the global batch ({batch}) must be divisible by dp={mesh.dp_size}")
    model = TensorParallelDecoder(config, mesh.tp, mesh.dp, sequence_parallel)
    model.load_full(DecoderLM(config).init(seed).params)
    opt = DataParallelAdamW(model.params, mesh.dp, zero=zero, **hyper)
    ids, targets = make_batches(config, steps, batch, seq, seed)
    rows = batch // mesh.dp_size
    b0, b1 = mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows
    losses, grads, step_calls, times = [], None, [], []
    for t in range(steps):
        start = time.perf_counter()
        model.params.zero_grad()
        before = len(world.traffic.calls)
        _, loss = model.forward(backend.asarray(ids[t, b0:b1]), backend.asarray(targets[t, b0:b1]),
                                batch_rows=(b0, b1, batch), **_dropout(config, seed, t))
        losses.append(float(loss))
        model.backward()
        if not zero:
            opt.reduce_gradients()
        opt.step(reduced=not zero)
        step_calls.append(world.traffic.calls[before:])
        times.append(time.perf_counter() - start)
        if not zero and gather and t == steps - 1:   # the summed gradient (step leaves it)
            grads = np.array(backend.to_numpy(model.gather_full("grad")))
    params = np.array(backend.to_numpy(model.gather_full("data"))) if gather else None
    b = np.dtype(model.params.dtype).itemsize                   # what this rank keeps:
    held = dict(params=model.params.data.size * b, grads=model.params.grad.size * b,
                optimizer=(opt.m.size + opt.v.size) * b)
    return dict(losses=losses, params=params, grads=grads, step_calls=step_calls,
                local_params=model.params.size, state_bytes=opt.state_bytes(), times=times,
                held=held)


def checksum(flat) -> str:
    """A printable fingerprint of a parameter vector: its sum and its 2-norm."""
    flat = np.asarray(flat, dtype=np.float64)
    return f"sum={flat.sum():.15e} norm={math.sqrt(float(flat @ flat)):.15e}"
