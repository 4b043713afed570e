"""A few training steps, on one device or on a DP x TP mesh: the same batches, the same
initial parameters, the same AdamW, so the two can be compared number for number."""
from __future__ import annotations

import hashlib
import math
import time

import numpy as np

from .. import backend, checks, ops
from ..models.decoder import IGNORE_INDEX, DecoderConfig, DecoderLM
from ..optim import ShardView, clip_grad_norm
from .grads import (
    GradientBuckets,
    accumulation_weights,
    check_micro_batches,
    split_micro_batches,
    tensor_parallel_mask,
)
from .layout import Layout
from .mesh import Mesh
from .model import TensorParallelDecoder
from .optimizer import Replicated, ZeRO1, ZeRO23, adamw

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


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(backend.to_numpy(a))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def check_same_start(world, full_params, ids, targets) -> None:
    """Before step 1, on every rank of `world` (one small all-gather): the full initial
    parameters each rank built and the batches it drew must be every other rank's. Ranks
    given another seed, config, --steps, --batch or --seq would otherwise train replicas
    from different weights (the loss is all-reduced, so its report would not show it).
    ValueError on every rank, naming the ranks that differ from rank 0."""
    mine = (_digest(full_params.data), _digest(ids, targets))
    every = world.all_gather_object(mine)
    for i, what in enumerate(("the initial parameters", "the training batches")):
        differ = [r for r, d in enumerate(every) if d[i] != every[0][i]]
        if differ:
            raise ValueError(f"{what} differ across ranks: world rank(s) {differ} do not "
                             f"hold rank 0's (give every rank the same seed, config, steps, "
                             f"batch and seq)")


def _dropout(config, seed, step):
    """Training mode with a generator seeded per step (the same on every rank) when the
    config has dropout: a sharded run draws the whole tensors and keeps its blocks."""
    if config.dropout == 0:
        return {}
    return dict(training=True, rng=backend.default_rng(10_000 * seed + step))


def _check_real_run(config, batch, micro_batches, clip, rows_of_the_batch=False):
    """Validate the accumulation and clipping options before any work: -> (K, max_norm).
    rows_of_the_batch: the model draws the dropout masks of the whole batch and keeps its
    micro-batch's rows (the parallel model), so accumulation with dropout equals one device."""
    k = check_micro_batches(batch, micro_batches)
    if k > 1 and config.dropout > 0 and not rows_of_the_batch:
        raise ValueError("micro_batches > 1 needs dropout = 0: the large batch draws its "
                         "dropout masks at once, the micro-batches could not match them")
    return k, (None if clip is None else checks.positive("clip", clip))


def train_single(config: DecoderConfig, steps: int, batch: int, seq: int, seed: int = 0,
                 hyper=None, micro_batches: int = 1, clip: float | None = None):
    """One device: -> dict(losses, params (host float64 [P]), grads (of the last step),
    norms (the global gradient norm of each step, with clip)). micro_batches K: the batch
    is run as K micro-batches whose gradients accumulate with weights c_k / T_c; clip: the
    max_norm of clipping by the global norm (before AdamW)."""
    K, max_norm = _check_real_run(config, batch, micro_batches, clip)
    hyper = dict(HYPER, **(hyper or {}))
    model = DecoderLM(config).init(seed)
    p = model.params
    opt = adamw(p, ShardView(), hyper)
    ids, targets = make_batches(config, steps, batch, seq, seed)
    losses, norms = [], []
    for t in range(steps):
        p.zero_grad()
        if K == 1:
            _, loss = model.forward(backend.asarray(ids[t]), backend.asarray(targets[t]),
                                    **_dropout(config, seed, t))
            losses.append(float(loss))
            model.backward()
        else:   # the loss's backward with upstream gradient w_k, micro-batch by micro-batch
            pieces = split_micro_batches(ids[t], targets[t], K)
            weights, _ = accumulation_weights(pieces)
            total = 0.0
            for (ids_k, targets_k), w in zip(pieces, weights):
                logits, _ = model.forward(backend.asarray(ids_k))           # [B/K, S, V]
                loss, c_loss = ops.cross_entropy_forward(logits, backend.asarray(targets_k),
                                                         IGNORE_INDEX)
                total += w * float(loss)
                model.backward(ops.cross_entropy_backward(w, c_loss))
            losses.append(total)
        if max_norm is not None:
            norms.append(clip_grad_norm(p.grad, max_norm))
        grads = np.array(backend.to_numpy(p.grad), copy=True)
        opt.step()
    return dict(losses=losses, params=np.array(backend.to_numpy(p.data)), grads=grads,
                norms=norms)


class Run:
    """One rank's training state under a layout: the mesh, the model (the one decoder with
    this layout's parts; a PipelineStage with pp), its optimizer and the optimizer's
    sharding strategy. pipeline: what a pipeline's step needs besides (its schedule, the
    tied embedding's group; pipeline.build_stage), None without pp."""

    def __init__(self, mesh, model, optimizer, shard, layout, pipeline=None):
        self.mesh, self.model, self.optimizer, self.shard = mesh, model, optimizer, shard
        self.layout, self.pipeline = layout, pipeline

    @property
    def zero(self) -> int:
        return self.layout.zero


def build(world, config: DecoderConfig, layout: Layout, hyper=None, mesh=None) -> Run:
    """The model and AdamW of one rank of `layout`, with zeroed parameters: load them
    (model.load_full, or tfcore.parallel.checkpoint.load_state) before training. With
    pipeline stages (pp) the model is this rank's PipelineStage (pipeline.build_stage).
    mesh: the layout's Mesh on `world`, when already built."""
    from .fsdp import ShardedDecoder

    if layout.pp is not None:
        from .pipeline import build_stage

        return build_stage(world, config, layout, hyper, mesh)
    hyper = dict(HYPER, **(hyper or {}))
    mesh = mesh or Mesh(world, layout.tp, layout.dp, cp=layout.cp)
    layout.validate(config, world=world.size)
    data = mesh.data                 # the gradients' group: dp, or dp x cp with a ring
    if layout.zero >= 2:
        model = ShardedDecoder(config, mesh.tp, data, layout.zero, layout.sp, mesh.cp,
                               layout.balanced)
        shard = ZeRO23(model)
        opt = adamw(ZeRO23.buffers(model), shard, hyper, clip=layout.clip)
        model.ledger.hold("optimizer", opt.m, "m")                      # [Z_d] each
        model.ledger.hold("optimizer", opt.v, "v")
    else:
        model = TensorParallelDecoder(config, mesh.tp, data, layout.sp, mesh.cp,
                                      layout.balanced)
        tp_mask = None if layout.clip is None else tensor_parallel_mask(model)  # [P_local]
        # replicated: the gradient is summed by the step (buckets, or reduce_gradients)
        shard = (ZeRO1(data, mesh.tp, tp_mask, reduce=layout.bucket_bytes is None)
                 if layout.zero == 1 else Replicated(data, mesh.tp, tp_mask, reduce=False))
        opt = adamw(model.params, shard, hyper, clip=layout.clip)
    return Run(mesh, model, opt, shard, layout)


def train_step(run: Run, ids, targets, batch: int, dropout=None, overlap: bool = True):
    """One update of `run` on the global batch ids, targets [B, S] (host; every rank holds
    it and takes its rows): its micro-batches forward and backward (weights c_k / T_c), the
    gradient summed over the data group (buckets during the last backward, or after it),
    clipped and stepped by the optimizer. dropout: None, or a function giving the forward's
    dropout settings, dict(training=True, rng=...) with a new generator of the step's seed
    (seeded alike on every rank): each micro-batch draws the whole batch's masks afresh and
    keeps its rows. -> (loss, seconds waited for the gradient's all-reduce).

    A pipeline run takes the step of its schedule (pipeline.pipeline_step: no buckets, so
    no seconds are measured) and shares the loss with every rank, as this step's loss is."""
    mesh, model, layout = run.mesh, run.model, run.layout
    if run.pipeline is not None:
        from .pipeline import pipeline_step, share_losses

        loss, _ = pipeline_step(run, ids, targets, batch, dropout)
        return share_losses(run, [loss])[0], None
    K = layout.micro_batches
    rows = batch // mesh.dp_size
    b0, b1 = mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows
    model.zero_grad()
    pieces = split_micro_batches(ids[b0:b1], targets[b0:b1], K)
    weights = [1.0] if K == 1 else accumulation_weights(pieces, mesh.dp)[0]
    buckets = None if layout.bucket_bytes is None else GradientBuckets(
        model.params, mesh.data, model.config.n_layers, layout.bucket_bytes,
        blocking=not overlap)
    loss = 0.0
    for k, ((ids_k, targets_k), w) in enumerate(zip(pieces, weights)):
        r0 = b0 + k * (rows // K)                # micro-batch k: global rows r0 ..
        _, loss_k = model.forward(backend.asarray(ids_k), backend.asarray(targets_k),
                                  batch_rows=(r0, r0 + rows // K, batch),
                                  **(dropout() if dropout is not None else {}))
        loss = float(loss_k) if K == 1 else loss + w * float(loss_k)
        hook = buckets.unit_done if buckets is not None and k == K - 1 else None
        model.backward(dloss=w, after_unit=hook)
    waited = time.perf_counter()
    exposed = None
    if buckets is not None:
        buckets.finish()
        exposed = buckets.exposed
    elif layout.zero == 0:
        run.shard.reduce_gradients(model.params)
        exposed = time.perf_counter() - waited
    run.optimizer.step()
    return loss, exposed


def train_parallel(world, config: DecoderConfig, steps: int, batch: int, seq: int, tp: int = 1,
                   dp: int | None = None, sequence_parallel: bool = False, zero=0,
                   seed: int = 0, hyper=None, gather: bool = True, micro_batches: int = 1,
                   clip: float | None = None, bucket_bytes: int | None = None,
                   overlap: bool = True, cp: int | None = None, balanced: bool = True):
    """Rank-local: run on every rank of `world`. The global batch [B, S] is split by rows over
    the dp ranks (and each sequence over the cp ranks of a ring). -> dict(losses, params
    (full, host), grads (full, of the last step, before the optimizer; None with ZeRO),
    traffic, norms, exposed) on every rank.

    zero: the ZeRO stage over the data group (dp, or dp x cp with a ring): 0, 1 (or
    True), 2 or 3 (the ShardedDecoder); micro_batches K: each rank's rows run as K
    micro-batches (weights c_k / T_c, counts summed over dp; with dropout each draws the
    whole batch's masks, seeded per step, and keeps its own rows, so the masks are one
    device's on the whole batch); clip: max_norm of clipping by the global norm;
    bucket_bytes: all-reduce the gradient in buckets of at most that many bytes, started
    during the last micro-batch's backward (overlap=True) or after it (overlap=False).
    exposed: the seconds of each step this rank spent waiting for the gradient all-reduce."""
    K, max_norm = _check_real_run(config, batch, micro_batches, clip, rows_of_the_batch=True)
    stage = int(zero)
    layout = Layout(tp=tp, dp=dp or world.size // (tp * (cp or 1)), sp=sequence_parallel,
                    zero=stage, micro_batches=K, clip=max_norm, bucket_bytes=bucket_bytes,
                    cp=cp, balanced=balanced).validate(config)
    mesh = Mesh(world, tp, dp, cp=cp)        # the sizes' own messages, before anything else
    layout.validate(config, world=world.size)
    dp_size = mesh.dp_size
    if batch % dp_size:
        raise ValueError(f"the global batch ({batch}) must be divisible by dp={dp_size}")
    if (batch // dp_size) % K:
        raise ValueError(f"micro_batches ({K}) must divide the rows of each data-parallel "
                         f"rank ({batch // dp_size})")
    run = build(world, config, layout, hyper, mesh)
    model = run.model
    full = DecoderLM(config).init(seed).params
    ids, targets = make_batches(config, steps, batch, seq, seed)
    check_same_start(world, full, ids, targets)
    model.load_full(full)
    losses, grads, step_calls, times, norms, exposed = [], None, [], [], [], []
    for t in range(steps):
        start = time.perf_counter()
        before = len(world.traffic.calls)
        if stage >= 2:
            model.ledger.mark(f"step {t}")
        loss, waited = train_step(run, ids[t], targets[t], batch,
                                  lambda t=t: _dropout(config, seed, t), overlap)
        losses.append(loss)
        if waited is not None:
            exposed.append(waited)
        if stage >= 2:
            model.ledger.mark("optimizer step")
        norms.append(run.optimizer.last_norm)
        step_calls.append(world.traffic.calls[before:])
        times.append(time.perf_counter() - start)
        if stage == 0 and gather and t == steps - 1:   # the summed gradient (step leaves it)
            grads = np.array(backend.to_numpy(model.gather_full("grad")))
    params = np.array(backend.to_numpy(model.gather_full("data"))) if gather else None
    out = dict(losses=losses, params=params, grads=grads, step_calls=step_calls,
               state_bytes=run.optimizer.state_bytes(), times=times, norms=norms,
               exposed=exposed)
    if stage >= 2:
        out.update(ledger=model.ledger, local_params=model.size, shard_size=model.shard_size)
    else:
        b = np.dtype(model.params.dtype).itemsize                   # what this rank keeps:
        opt = run.optimizer
        out.update(local_params=model.params.size,
                   held=dict(params=model.params.data.size * b,
                             grads=model.params.grad.size * b,
                             optimizer=(opt.m.size + opt.v.size) * b))
    return out


def train_layout(world, config: DecoderConfig, layout: Layout, steps: int, batch: int,
                 seq: int, seed: int = 0, hyper=None, gather: bool = True) -> dict:
    """Train `steps` AdamW steps of the runner's batches at any layout that validates: the
    pipeline's executor when layout.pp is set, train_parallel otherwise. -> as they return
    (losses and the full parameters on every rank)."""
    from .pipeline import train_pipeline

    layout.validate(config, world=world.size, batch=batch, seq=seq)
    if layout.pp is not None:
        return train_pipeline(world, config, steps, batch, seq, pp=layout.pp,
                              n_microbatches=layout.micro_batches,
                              schedule=layout.pipeline_schedule, n_virtual=layout.virtual,
                              tp=layout.tp, dp=layout.dp, seed=seed, hyper=hyper,
                              gather=gather, clip=layout.clip, sequence_parallel=layout.sp,
                              zero=layout.zero, cp=layout.cp, balanced=layout.balanced)
    return train_parallel(world, config, steps, batch, seq, tp=layout.tp, dp=layout.dp,
                          sequence_parallel=layout.sp, zero=layout.zero, seed=seed,
                          hyper=hyper, gather=gather, micro_batches=layout.micro_batches,
                          clip=layout.clip, bucket_bytes=layout.bucket_bytes, cp=layout.cp,
                          balanced=layout.balanced)


def checksum(flat) -> str:
    """A printable fingerprint of a parameter vector: its sum and its 2-norm."""
    flat = np.asarray(flat, dtype=np.float64)
    return f"sum={flat.sum():.15e} norm={math.sqrt(float(flat @ flat)):.15e}"
