"""The checks' harness: small configs, random-token batches, and loops that train them on
one device and at a layout from the same start, so the two compare number for number.

    CONFIGS          tiny, tiny-llama, tiny-moe, small: DecoderConfig factories, small enough for a
                     test and big enough to split 4 ways (heads, d_ff) and unevenly (V)
    HYPER            the loops' AdamW settings
    make_batches     ids, targets [steps, B, S]: random tokens, a quarter of the targets
                     ignored (so the data-parallel ranks count different numbers of tokens)
    train_single     one device: DecoderLM and optim's AdamW, step by step
    train_layout     any layout (Layout): train_parallel, or train_pipeline with pp
    train_parallel   DP x TP x CP with ZeRO 0-3, accumulation, clipping, buckets
    train_pipeline   the pipeline's executor (stages, schedules, micro-batches)
    train_sharded, train_context_parallel   train_parallel for ZeRO-2/3 and for a ring

Each loop builds its rank with runner.build (the library's builder), steps it with
runner.train_step or pipeline.pipeline_step (the library's one step, the trainer's), and
reports losses, parameters and gradients as one device's flat buffers. Used by the tests,
the chapters, the calculator's small presets and `python -m tfcore.parallel`; the training
path (runner, pipeline, fsdp, context, tfcore.train) does not import it: training on real
text is tfcore.train.
"""
from __future__ import annotations

import hashlib
import math
import time

import numpy as np

from .. import backend, checks, ops
from ..models.decoder import IGNORE_INDEX, DecoderConfig, DecoderLM
from ..optim import ShardView, clip_grad_norm
from .grads import accumulation_weights, check_micro_batches, split_micro_batches
from .layout import Layout
from .mesh import Mesh
from .optimizer import adamw
from .fsdp import STAGES
from .pipeline import (
    build_stage,
    check_pipeline_layout,
    gather_full,
    pipeline_step,
    share_losses,
)
from .runner import build, held_bytes, train_step

CONFIGS = {
    # small enough for a test, big enough to split 4 ways (heads, d_ff) and unevenly (V)
    "tiny": lambda: DecoderConfig(vocab_size=31, max_seq_len=16, d_model=16, n_layers=2,
                                  n_heads=4, d_ff=32, dtype="float64"),
    "tiny-llama": lambda: DecoderConfig.llama(vocab_size=29, max_seq_len=16, d_model=16,
                                              n_layers=2, n_heads=4, d_ff=24, dtype="float64"),
    # a mixture of experts: 4 experts, top-2, capacity 1 (tokens drop), both auxiliary losses
    "tiny-moe": lambda: DecoderConfig(vocab_size=31, max_seq_len=16, d_model=16, n_layers=2,
                                      n_heads=4, d_ff=32, dtype="float64", n_experts=4,
                                      top_k=2, d_expert=12, capacity_factor=1.0,
                                      aux_loss_coef=0.05, z_loss_coef=0.01),
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


def train_parallel(world, config: DecoderConfig, steps: int, batch: int, seq: int, tp: int = 1,
                   dp: int | None = None, sequence_parallel: bool = False, zero=0,
                   seed: int = 0, hyper=None, gather: bool = True, micro_batches: int = 1,
                   clip: float | None = None, bucket_bytes: int | None = None,
                   overlap: bool = True, cp: int | None = None, balanced: bool = True,
                   ep: int = 1, ulysses: bool = False):
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
    exposed: the seconds of each step this rank spent waiting for the gradient all-reduce.
    ep: an MoE model's expert-parallel degree (blocks of ep dp ranks share its experts)."""
    K, max_norm = _check_real_run(config, batch, micro_batches, clip, rows_of_the_batch=True)
    stage = int(zero)
    layout = Layout(tp=tp, dp=dp or world.size // (tp * (cp or 1)), sp=sequence_parallel,
                    zero=stage, micro_batches=K, clip=max_norm, bucket_bytes=bucket_bytes,
                    cp=cp, balanced=balanced, ep=ep, ulysses=ulysses).validate(config)
    mesh = Mesh(world, tp, dp, cp=cp, ep=ep)  # the sizes' own messages, before anything else
    layout.validate(config, world=world.size)
    dp_size = mesh.dp_size
    if batch % dp_size:
        raise ValueError(f"the global batch ({batch}) must be divisible by dp={dp_size}")
    if (batch // dp_size) % K:
        raise ValueError(f"micro_batches ({K}) must divide the rows of each data-parallel "
                         f"rank ({batch // dp_size})")
    run = build(world, config, layout, dict(HYPER, **(hyper or {})), mesh)
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
        out.update(local_params=model.params.size)
    out["held"] = held_bytes(run)
    return out


def train_layout(world, config: DecoderConfig, layout: Layout, steps: int, batch: int,
                 seq: int, seed: int = 0, hyper=None, gather: bool = True) -> dict:
    """Train `steps` AdamW steps of make_batches' batches at any layout that validates: the
    pipeline's executor when layout.pp is set, train_parallel otherwise. -> as they return
    (losses and the full parameters on every rank)."""
    layout.validate(config, world=world.size, batch=batch, seq=seq)
    if layout.pp is not None:
        return train_pipeline(world, config, steps, batch, seq, pp=layout.pp,
                              n_microbatches=layout.micro_batches,
                              schedule=layout.pipeline_schedule, n_virtual=layout.virtual,
                              tp=layout.tp, dp=layout.dp, seed=seed, hyper=hyper,
                              gather=gather, clip=layout.clip, sequence_parallel=layout.sp,
                              zero=layout.zero, cp=layout.cp, balanced=layout.balanced,
                              ulysses=layout.ulysses)
    return train_parallel(world, config, steps, batch, seq, tp=layout.tp, dp=layout.dp,
                          sequence_parallel=layout.sp, zero=layout.zero, seed=seed,
                          hyper=hyper, gather=gather, micro_batches=layout.micro_batches,
                          clip=layout.clip, bucket_bytes=layout.bucket_bytes, cp=layout.cp,
                          balanced=layout.balanced, ep=layout.ep, ulysses=layout.ulysses)


def train_pipeline(world, config: DecoderConfig, steps: int, batch: int, seq: int,
                   pp: int, n_microbatches: int, schedule: str = "1f1b", n_virtual: int = 1,
                   tp: int = 1, dp: int | None = None, seed: int = 0, hyper=None,
                   gather: bool = True, clip: float | None = None,
                   sequence_parallel: bool = False, zero: int = 0, cp: int | None = None,
                   balanced: bool = True, ulysses: bool = False):
    """Rank-local: run on every rank of `world` (SimulatedGroup or MPIComm). The global
    batch [B, S] is split by rows over the dp replicas, each replica's rows into m
    micro-batches of B_m = B / (N_D m) rows. -> dict(losses (every rank), params, grads
    (the full single-device buffers, host; the last step's gradient, summed over dp),
    record, peak_live, peak_bytes, chunk_bytes (of the last step), sent (point-to-point
    bytes this rank sent in each step's pipeline), coords (dp, pp, tp), norms).

    clip: max_norm of clipping by the global norm (as train_single's), over the stages
    (every piece sharded over pp), tp inside them, the tied wte counted once. A step is
    pipeline_step, the one the trainer (python -m tfcore.train --pp) calls."""
    for name, value in (("steps", steps), ("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seq > config.max_seq_len:
        raise ValueError(f"seq ({seq}) exceeds max_seq_len={config.max_seq_len}")
    max_norm = None if clip is None else checks.positive("clip", clip)
    dp = check_pipeline_layout(config, world.size, pp, tp, dp, n_microbatches, n_virtual,
                               batch, schedule, cp, sequence_parallel, int(zero))
    layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=int(zero), sp=sequence_parallel,
                    micro_batches=n_microbatches, virtual=n_virtual, schedule=schedule,
                    balanced=balanced, clip=max_norm, ulysses=ulysses)
    run = build_stage(world, config, layout, dict(HYPER, **(hyper or {})))
    stage, mesh = run.model, run.mesh
    full = DecoderLM(config).init(seed).params
    ids, targets = make_batches(config, steps, batch, seq, seed)
    check_same_start(world, full, ids, targets)
    stage.load_full(full)
    losses, grads, sent, out, norms = [], None, [], None, []
    for t in range(steps):
        dropout = None
        if config.dropout > 0:          # each chunk draws from the step's seed afresh
            dropout = (lambda t=t: dict(training=True,
                                        rng=backend.default_rng(10_000 * seed + t)))
        loss, out = pipeline_step(run, ids[t], targets[t], batch, dropout)
        losses += share_losses(run, [loss])           # as runner.train_step shares it
        sent.append(out["sent"])
        norms.append(run.optimizer.last_norm)
        if gather and t == steps - 1 and not zero:   # ZeRO-1 sums only its chunk
            grads = gather_full(stage, mesh, config, "grad")
    params = gather_full(stage, mesh, config, "data") if gather else None
    return dict(losses=losses, params=params, grads=grads, record=out["record"],
                peak_live=out["peak_live"], peak_bytes=out["peak_bytes"],
                chunk_bytes=out["chunk_bytes"], sent=sent,
                norms=norms if max_norm is not None else [],
                coords=(mesh.dp_rank, mesh.pp_rank, mesh.tp_rank),
                local_params=stage.params.size, held=held_bytes(run))



def train_sharded(world, config: DecoderConfig, steps: int, batch: int, seq: int,
                  tp: int = 1, dp: int | None = None, stage: int = 3, seed: int = 0,
                  hyper=None, gather: bool = True, clip: float | None = None,
                  sequence_parallel: bool = False, micro_batches: int = 1):
    """train_parallel with ZeRO stage 2 or 3: the same batches, rows split over dp,
    the same AdamW. -> dict(losses, params (full, host), step_calls, ledger, local_params,
    shard_size, times, norms (with clip))."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    out = train_parallel(world, config, steps, batch, seq, tp=tp, dp=dp, zero=stage,
                         seed=seed, hyper=hyper, gather=gather, clip=clip,
                         sequence_parallel=sequence_parallel, micro_batches=micro_batches)
    if clip is None:
        out["norms"] = []
    return out


def train_context_parallel(comm, config: DecoderConfig, steps: int, batch: int, seq: int,
                           balanced: bool = True, seed: int = 0, hyper=None) -> dict:
    """train_parallel on a ring of every rank of `comm` (context parallelism alone):
    make_batches' batches, each sequence split over the ranks; gradients summed over the
    group, then train_single's AdamW. -> dict(losses, params (host [P]), grads (the
    summed gradient of the last step))."""
    return train_parallel(comm, config, steps, batch, seq, dp=1, cp=comm.size,
                          balanced=balanced, seed=seed, hyper=hyper)


def checksum(flat) -> str:
    """A printable fingerprint of a parameter vector: its sum and its 2-norm."""
    flat = np.asarray(flat, dtype=np.float64)
    return f"sum={flat.sum():.15e} norm={math.sqrt(float(flat @ flat)):.15e}"
