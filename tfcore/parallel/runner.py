"""One rank of a layout, and its training step: the library's builder and step, which the
trainer (tfcore.train) and the checks' loops (harness.py) share.

    run = build(world, config, layout, hyper)   # the one decoder with this layout's parts,
                                                # its AdamW and sharding strategy: a Run
    run = build(None, config, Layout(micro_batches=K, clip=c), hyper)   # one device
    loss, waited = train_step(run, ids, targets, batch, dropout)

precision='bfloat16' or 'float16' (build's argument) runs the step's products under
tfcore.mixed_precision.autocast, the float32 master weights and AdamW state as they are;
float16 adds a LossScaler (one device only), whose skipped steps it counts.
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from .. import backend
from ..models.decoder import DecoderConfig
from .grads import (
    GradientBuckets,
    accumulation_weights,
    expert_mask,
    split_micro_batches,
    tensor_parallel_mask,
)
from .layout import Layout
from .mesh import Mesh
from .model import TensorParallelDecoder
from .optimizer import ExpertShards, Replicated, ZeRO1, ZeRO1Experts, ZeRO23, adamw


class Run:
    """One rank's training state under a layout: the mesh, the model (the one decoder with
    this layout's parts; a PipelineStage with pp), its optimizer and the optimizer's
    sharding strategy. pipeline: what a pipeline's step needs besides (its schedule, the
    tied embedding's group; pipeline.build_stage), None without pp. On one device (world
    None) mesh is None, the model a DecoderLM and shard the whole buffers' ShardView.
    precision: None, or the low format of the step's products ('bfloat16', 'float16');
    scaler: float16's LossScaler, or None."""

    def __init__(self, mesh, model, optimizer, shard, layout, pipeline=None,
                 precision=None, scaler=None):
        self.mesh, self.model, self.optimizer, self.shard = mesh, model, optimizer, shard
        self.layout, self.pipeline = layout, pipeline
        self.precision, self.scaler = precision, scaler

    @property
    def zero(self) -> int:
        return self.layout.zero


def build(world, config: DecoderConfig, layout: Layout, hyper: dict, mesh=None,
          precision: str | None = None) -> Run:
    """The model and AdamW of one rank of `layout`, with zeroed parameters: load them
    (model.load_full, model.init(seed) on one device, or tfcore.parallel.checkpoint.
    load_state) before training. With pipeline stages (pp) the model is this rank's
    PipelineStage (pipeline.build_stage). mesh: the layout's Mesh on `world`, when already
    built. world None: one device, a DecoderLM and optim's AdamW over its whole buffers
    (the layout may set micro_batches and clip, nothing that needs ranks).
    precision: None, 'bfloat16' or 'float16' (mixed precision: a float32 config; float16's
    loss scaling on one device only)."""
    from .fsdp import ShardedDecoder

    _check_precision(world, config, precision)
    if world is None:
        return _one_device(config, layout, hyper, precision)
    if layout.pp is not None:
        from .pipeline import build_stage

        run = build_stage(world, config, layout, hyper, mesh)
        run.precision = precision
        return run
    mesh = mesh or Mesh(world, layout.tp, layout.dp, cp=layout.cp, ep=layout.ep)
    layout.validate(config, world=world.size)
    data = mesh.data                 # the gradients' group: dp, or dp x cp with a ring
    if layout.zero >= 2:
        model = ShardedDecoder(config, mesh.tp, data, layout.zero, layout.sp, mesh.cp,
                               layout.balanced, layout.ulysses)
        shard = ZeRO23(model)
        opt = adamw(ZeRO23.buffers(model), shard, hyper, clip=layout.clip)
        model.ledger.hold("optimizer", opt.m, "m")                      # [Z_d] each
        model.ledger.hold("optimizer", opt.v, "v")
    else:
        model = TensorParallelDecoder(config, mesh.tp, data, layout.sp, mesh.cp,
                                      layout.balanced, ep=mesh.ep, ulysses=layout.ulysses)
        tp_mask = None if layout.clip is None else tensor_parallel_mask(model)  # [P_local]
        experts = (None if mesh.ep is None
                   else ExpertShards(expert_mask(model), mesh.ep, mesh.edp))
        # replicated: the gradient is summed by the step (buckets, or reduce_gradients)
        if layout.zero == 1 and experts is not None:    # the experts chunked over edp
            shard = ZeRO1Experts(data, mesh.tp, tp_mask, experts)
        elif layout.zero == 1:
            shard = ZeRO1(data, mesh.tp, tp_mask, reduce=layout.bucket_bytes is None)
        else:
            shard = Replicated(data, mesh.tp, tp_mask, reduce=False, experts=experts)
        opt = adamw(model.params, shard, hyper, clip=layout.clip)
    return Run(mesh, model, opt, shard, layout, precision=precision)


def _check_precision(world, config: DecoderConfig, precision) -> None:
    from ..mixed_precision import LOW_PRECISION

    if precision is None:
        return
    if precision not in LOW_PRECISION:
        raise ValueError(f"precision must be None or one of {', '.join(LOW_PRECISION)}, "
                         f"got {precision!r}")
    if config.dtype != "float32":
        raise ValueError(f"mixed precision keeps float32 master weights and AdamW state: "
                         f"the config's dtype must be float32, got {config.dtype}")
    if precision == "float16" and world is not None:
        raise ValueError("float16's loss scaling trains on one device only: a skipped step "
                         "needs every rank to agree that some gradient overflowed (a "
                         "collective plan() does not price); use bfloat16 under a layout")


def _one_device(config: DecoderConfig, layout: Layout, hyper: dict, precision) -> Run:
    """build() without ranks: DecoderLM (its one-device parts) and optim's AdamW (Adam at
    weight_decay 0) over the whole flat buffers, clipping at layout.clip."""
    from ..mixed_precision import LossScaler
    from ..models.decoder import DecoderLM
    from ..optim import ShardView

    extra = [f for f in ("pp", "cp", "bucket_bytes") if getattr(layout, f) is not None]
    extra += [f for f in ("dp", "tp", "ep") if getattr(layout, f) != 1]
    extra += [f for f in ("zero", "sp") if getattr(layout, f)]
    if extra:
        raise ValueError(f"a one-device run (world None) takes micro_batches and clip from "
                         f"its layout, not {', '.join(extra)}: build it on a world")
    if layout.micro_batches > 1 and config.dropout > 0:
        raise ValueError("micro_batches > 1 on one device needs dropout 0: the one-device "
                         "decoder draws each micro-batch's masks, so the accumulated step "
                         "would not be the whole batch's (a layout's decoder draws the whole "
                         "batch's and keeps its rows)")
    model = DecoderLM(config)
    shard = ShardView()
    opt = adamw(model.params, shard, hyper, clip=layout.clip)
    scaler = LossScaler("float16") if precision == "float16" else None
    return Run(None, model, opt, shard, layout, precision=precision, scaler=scaler)


# autocast sets a process-wide matmul policy, and a simulated layout's ranks are threads of
# one process: a rank leaving its step must not switch the products of a rank still inside
# its own off. So the ranks share one autocast, entered by the first and left by the last.
_SHARED = {"lock": threading.Lock(), "users": 0, "context": None, "precision": None}


@contextlib.contextmanager
def precision_scope(precision: str | None):
    """``with precision_scope('bfloat16'):`` tfcore.mixed_precision.autocast, shared by the
    threads inside it (one process's simulated ranks); None: nothing."""
    if precision is None:
        yield
        return
    from ..mixed_precision import autocast

    shared = _SHARED
    with shared["lock"]:
        if shared["users"] and shared["precision"] != precision:
            raise RuntimeError(f"a step under {shared['precision']} is running in this "
                               f"process; {precision} cannot start beside it")
        if not shared["users"]:
            shared["context"], shared["precision"] = autocast(precision), precision
            shared["context"].__enter__()
        shared["users"] += 1
    try:
        yield
    finally:
        with shared["lock"]:
            shared["users"] -= 1
            if not shared["users"]:
                context, shared["context"], shared["precision"] = shared["context"], None, None
                context.__exit__(None, None, None)


def train_step(run: Run, ids, targets, batch: int, dropout=None, overlap: bool = True):
    """One update of `run` on the global batch ids, targets [B, S] (host; every rank holds
    it and takes its rows): its micro-batches forward and backward (weights c_k / T_c), the
    gradient summed over the data group (buckets during the last backward, or after it),
    clipped and stepped by the optimizer. dropout: None, or a function giving the forward's
    dropout settings, dict(training=True, rng=...) with a new generator of the step's seed
    (seeded alike on every rank): each micro-batch draws the whole batch's masks afresh and
    keeps its rows. -> (loss, seconds waited for the gradient's all-reduce).

    A pipeline run takes the step of its schedule (pipeline.pipeline_step: no buckets, so
    no seconds are measured) and shares the loss with every rank, as this step's loss is.
    A one-device run (mesh None) has every row and nothing to wait for (seconds None).

    With run.precision the forwards and backwards run under autocast; with run.scaler
    (float16) each micro-batch's loss gradient is multiplied by the scale, and the scaler
    unscales the summed gradient and steps the optimizer, or skips the step (counted in
    scaler.skipped) when the gradient overflowed. The gradient the step leaves in
    params.grad is the unclipped one when the optimizer does not clip."""
    mesh, model, layout = run.mesh, run.model, run.layout
    if run.pipeline is not None:
        from .pipeline import pipeline_step, share_losses

        with precision_scope(run.precision):
            loss, _ = pipeline_step(run, ids, targets, batch, dropout)
        return share_losses(run, [loss])[0], None
    K = layout.micro_batches
    dp, dp_size, dp_rank = (None, 1, 0) if mesh is None else (mesh.dp, mesh.dp_size,
                                                             mesh.dp_rank)
    rows = batch // dp_size
    b0, b1 = dp_rank * rows, (dp_rank + 1) * rows
    model.zero_grad()
    pieces = split_micro_batches(ids[b0:b1], targets[b0:b1], K)
    weights = [1.0] if K == 1 else accumulation_weights(pieces, dp)[0]
    buckets = None if layout.bucket_bytes is None else GradientBuckets(
        model.params, mesh.data, model.config.n_layers, layout.bucket_bytes,
        blocking=not overlap)
    scale = 1.0 if run.scaler is None else run.scaler.scale
    overflow = (backend.expected_overflow() if run.scaler is not None   # the scaler's to see
                else contextlib.nullcontext())
    loss = 0.0
    with precision_scope(run.precision), overflow:
        for k, ((ids_k, targets_k), w) in enumerate(zip(pieces, weights)):
            r0 = b0 + k * (rows // K)                # micro-batch k: global rows r0 ..
            _, loss_k = model.forward(backend.asarray(ids_k), backend.asarray(targets_k),
                                      batch_rows=(r0, r0 + rows // K, batch),
                                      **(dropout() if dropout is not None else {}))
            loss = float(loss_k) if K == 1 else loss + w * float(loss_k)
            hook = buckets.unit_done if buckets is not None and k == K - 1 else None
            model.backward(dloss=w if run.scaler is None else w * scale, after_unit=hook)
    waited = time.perf_counter()
    exposed = None
    if buckets is not None:
        buckets.finish()
        exposed = buckets.exposed
    elif layout.zero == 0 and mesh is not None:
        run.shard.reduce_gradients(model.params)
        exposed = time.perf_counter() - waited
    if run.scaler is not None:
        run.scaler.step(run.optimizer)          # unscale; step, or skip an overflowed one
    else:
        run.optimizer.step()
    return loss, exposed


def held_bytes(run: Run) -> dict:
    """Bytes of the parameters, gradients and AdamW state this rank holds, what plan()
    prices as memory: its flat buffers (ZeRO-1: AdamW's moments of its chunk), or under
    ZeRO-2/3 the ledger's peak (its shard and the units gathered at once)."""
    if run.layout.zero >= 2:
        peak = run.model.ledger.peak()
        return {kind: peak[kind] for kind in ("params", "grads", "optimizer")}
    params, opt = run.model.params, run.optimizer
    b = np.dtype(params.dtype).itemsize
    return dict(params=params.data.size * b, grads=params.grad.size * b,
                optimizer=(opt.m.size + opt.v.size) * b)
