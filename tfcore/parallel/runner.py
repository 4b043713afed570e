"""One rank of a layout, and its training step: the library's builder and step, which the
trainer (tfcore.train) and the checks' loops (harness.py) share.

    run = build(world, config, layout, hyper)   # the one decoder with this layout's parts,
                                                # its AdamW and sharding strategy: a Run
    loss, waited = train_step(run, ids, targets, batch, dropout)
"""
from __future__ import annotations

import time

import numpy as np

from .. import backend
from ..models.decoder import DecoderConfig
from .grads import (
    GradientBuckets,
    accumulation_weights,
    split_micro_batches,
    tensor_parallel_mask,
)
from .layout import Layout
from .mesh import Mesh
from .model import TensorParallelDecoder
from .optimizer import Replicated, ZeRO1, ZeRO23, adamw


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


def build(world, config: DecoderConfig, layout: Layout, hyper: dict, mesh=None) -> Run:
    """The model and AdamW of one rank of `layout`, with zeroed parameters: load them
    (model.load_full, or tfcore.parallel.checkpoint.load_state) before training. With
    pipeline stages (pp) the model is this rank's PipelineStage (pipeline.build_stage).
    mesh: the layout's Mesh on `world`, when already built."""
    from .fsdp import ShardedDecoder

    if layout.pp is not None:
        from .pipeline import build_stage

        return build_stage(world, config, layout, hyper, mesh)
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
