"""The one decoder under composed layouts: every (layout x model feature) case that
Layout.validate accepts trains 3 AdamW steps equal to one device in float64 (losses and
the parameters after each step's update, relative 1e-12). The cases are generated from the
lists below and the validation, not restated; the count is observed."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import Layout, SimulatedGroup
from tfcore.parallel.harness import train_layout, train_single

STEPS, BATCH, SEQ = 3, 4, 8
TOL = 1e-12

LAYOUTS = {
    "tp2 x cp2": Layout(tp=2, cp=2),
    "tp2 x cp2, sp": Layout(tp=2, cp=2, sp=True),
    "dp2 x pp2 x tp2, zero1": Layout(dp=2, pp=2, tp=2, zero=1, micro_batches=2),
    "pp2 x tp2, sp": Layout(pp=2, tp=2, sp=True, micro_batches=2),
    "pp2 x cp2": Layout(pp=2, cp=2, micro_batches=2),
    "tp2 x dp2, sp, zero3": Layout(tp=2, dp=2, sp=True, zero=3),
    "cp2 x dp2, zero1": Layout(cp=2, dp=2, zero=1),
    "cp2 x dp2, zero2": Layout(cp=2, dp=2, zero=2),
    "cp2 x dp2, zero3": Layout(cp=2, dp=2, zero=3),
    "dp2, zero2, K=2": Layout(dp=2, zero=2, micro_batches=2),
    "dp2, zero3, K=2": Layout(dp=2, zero=3, micro_batches=2),
    "cp2, clip": Layout(cp=2, clip=0.05),
    "dp2, zero1, buckets": Layout(dp=2, zero=1, bucket_bytes=2048),
    "tp2 x dp2, sp, K=2, clip": Layout(tp=2, dp=2, sp=True, micro_batches=2, clip=0.05),
    "dp2 x cp2 x tp2, zero1": Layout(dp=2, cp=2, tp=2, zero=1),
    "pp2 x cp2 x tp2": Layout(pp=2, cp=2, tp=2, micro_batches=2),
}

BASE = dict(vocab_size=31, max_seq_len=16, d_model=16, n_layers=2, n_heads=4, d_ff=32,
            dtype="float64")
FEATURES = {
    "gpt": DecoderConfig(**BASE),
    "llama": DecoderConfig.llama(vocab_size=29, max_seq_len=16, d_model=16, n_layers=2,
                                 n_heads=4, d_ff=24, dtype="float64"),
    "tiled": DecoderConfig(**BASE, attention="tiled", attention_block_size=3),
    "gqa": DecoderConfig(**BASE, n_kv_heads=2),
    "mqa": DecoderConfig(**BASE, n_kv_heads=1),
    "recompute full": DecoderConfig(**BASE, recompute="full"),
    "recompute selective": DecoderConfig(**BASE, recompute="selective"),
    "untied, no bias, post-norm": DecoderConfig(**BASE, tied_head=False, bias=False,
                                                norm_placement="post"),
    "dropout": DecoderConfig(**BASE, dropout=0.1),
    "tiled, dropout": DecoderConfig(**BASE, attention="tiled", attention_block_size=3,
                                    dropout=0.1),
}

CASES = [(lname, fname) for lname, layout in LAYOUTS.items()
         for fname, config in FEATURES.items() if layout.refusal(config) is None]


def test_the_matrix_is_large():
    assert len(CASES) >= 60, len(CASES)


def one_device_references(features: dict, steps: int, batch: int, seq: int):
    """reference(fname, clip=None) -> train_single's run of features[fname] (steps AdamW
    steps of [batch, seq], clipped at clip), computed once per (fname, clip): the one device
    a matrix's cases are compared with."""
    done: dict = {}

    def reference(fname, clip=None):
        if (fname, clip) not in done:
            done[(fname, clip)] = train_single(features[fname], steps, batch, seq, clip=clip)
        return done[(fname, clip)]

    return reference


_reference = one_device_references(FEATURES, STEPS, BATCH, SEQ)


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("lname,fname", CASES, ids=[f"{l} | {f}" for l, f in CASES])
def test_a_composed_layout_trains_as_one_device(lname, fname):
    layout, config = LAYOUTS[lname], FEATURES[fname]
    ref = _reference(fname, layout.clip)
    results = SimulatedGroup(layout.world_size).run(train_layout, config, layout, STEPS,
                                                    BATCH, SEQ)
    for out in results:
        assert _rel(out["losses"], ref["losses"]) < TOL
        assert _rel(out["params"], ref["params"]) < TOL       # after 3 AdamW steps
        if out.get("grads") is not None:  # every gradient of the last step (ZeRO keeps none
            assert _rel(out["grads"], ref["grads"]) < TOL     # whole: its params show them)


def test_the_sharded_initialisation_is_the_one_device_one():
    """Every rank's tensors are exactly its blocks of DecoderLM(config).init(seed): gathered
    back they are the one-device buffer, bit for bit (no two ranks draw alike where one
    device would draw differently)."""
    from tfcore.models.decoder import DecoderLM
    from tfcore.parallel.mesh import Mesh
    from tfcore.parallel.model import TensorParallelDecoder

    for fname in ("gpt", "llama", "mqa"):
        config = FEATURES[fname]
        full = np.asarray(DecoderLM(config).init(5).params.data)

        def body(world, config=config):
            mesh = Mesh(world, tp=2, dp=1)
            model = TensorParallelDecoder(config, mesh.tp, mesh.dp).init(5)
            return np.asarray(model.gather_full("data"))

        for gathered in SimulatedGroup(2).run(body):
            assert np.array_equal(gathered, full)
        assert dataclasses.asdict(config)                 # the config is a plain value


def test_tiled_attention_never_builds_the_scores_under_any_layout(monkeypatch):
    """attention='tiled' is the tiled op (or the ring, made of it) under every layout: the
    dense op, the one that builds the [B, H, S, S] scores, is never called."""
    import tfcore.functional as F
    from tfcore import ops
    from tfcore.functional import attention as dense_module

    dense_calls = []

    def dense(q, *args, **kwargs):
        dense_calls.append(tuple(q.shape))
        raise AssertionError("the dense attention op ran under attention='tiled'")

    for where in (ops, dense_module, F):
        monkeypatch.setattr(where, "attention_forward", dense)
    config = FEATURES["tiled"]
    ran = [name for name, layout in LAYOUTS.items() if layout.refusal(config) is None]
    for name in ran:
        layout = LAYOUTS[name]
        SimulatedGroup(layout.world_size).run(train_layout, config, layout, 1, BATCH, SEQ)
    assert dense_calls == [] and len(ran) == len(LAYOUTS)


# a few more layouts for the bytes alone (one step of two features each)
BYTES_LAYOUTS = {
    "cp2, K=2": Layout(cp=2, micro_batches=2),
    "cp2 x dp2, zero2, K=2": Layout(cp=2, dp=2, zero=2, micro_batches=2),
    "pp2 x tp2, clip": Layout(pp=2, tp=2, micro_batches=2, clip=0.05),
    "dp2 x pp2, zero1, clip": Layout(dp=2, pp=2, zero=1, micro_batches=2, clip=0.05),
    "dp2 x tp2, zero3, clip": Layout(dp=2, tp=2, zero=3, clip=0.05),
    "dp2 x tp2, buckets": Layout(dp=2, tp=2, bucket_bytes=4096),
}
BYTES_CASES = CASES + [(l, f) for l in BYTES_LAYOUTS for f in ("gpt", "llama")]


@pytest.mark.parametrize("lname,fname", BYTES_CASES, ids=[f"{l} | {f}" for l, f in BYTES_CASES])
def test_the_bytes_of_a_composed_layout_are_its_formula(lname, fname):
    """What each rank sent in a step, counted as it moved (collectives and point-to-point
    messages alike), equals plan()'s bytes per step (volume.layout_traffic), rank by rank:
    every layout the matrix trains, pipelines, accumulation, buckets and clipping included
    (a pipeline's step shares its loss with every rank, as the trainer's does); and the
    parameters, gradients and AdamW state each rank holds (at the step's peak for ZeRO-2/3)
    are plan()'s memory."""
    from tfcore.parallel import plan

    layout, config = {**LAYOUTS, **BYTES_LAYOUTS}[lname], FEATURES[fname]
    group = SimulatedGroup(layout.world_size)
    results = group.run(train_layout, config, layout, 1, BATCH, SEQ, gather=False)
    priced = plan(config, layout, batch=BATCH, seq=SEQ)
    assert [t.sent for t in group.traffic] == priced.sent
    for out, memory in zip(results, priced.memory_per_rank):   # and what each rank holds
        assert {k: memory[k] for k in out["held"]} == out["held"]


@pytest.mark.parametrize("lname", ["tp2 x cp2", "dp2 x pp2 x tp2, zero1",
                                   "tp2 x dp2, sp, zero3", "cp2 x dp2, zero1"])
def test_mixed_precision_composes_with_the_layouts(lname):
    """bfloat16 products (tfcore.mixed_precision.autocast, float32 accumulation) with
    float32 master weights and AdamW state, under a composed layout: the products are
    rounded on every rank (the losses move from the float32 run's by a bfloat16-sized
    amount), and the run stays as close to one device's bfloat16 run as bfloat16 allows
    (the layout splits some sums, so it cannot be the same bits: the losses agree to within
    2^-7, bfloat16's precision, where float32 runs agree to 1e-6)."""
    import dataclasses

    from tfcore.mixed_precision import autocast

    layout = LAYOUTS[lname]
    config = dataclasses.replace(FEATURES["llama"], dtype="float32")
    group = SimulatedGroup(layout.world_size)
    with autocast("bfloat16"):              # process-wide: every simulated rank's products
        one = train_single(config, STEPS, BATCH, SEQ)
        low = group.run(train_layout, config, layout, STEPS, BATCH, SEQ)[0]
    full = group.run(train_layout, config, layout, STEPS, BATCH, SEQ)[0]
    full_one = train_single(config, STEPS, BATCH, SEQ)
    assert _rel(full["losses"], full_one["losses"]) < 1e-6          # float32 composes
    assert _rel(low["losses"], full["losses"]) > 1e-6               # the products rounded
    assert _rel(low["losses"], one["losses"]) < 2.0 ** -7           # bfloat16 composes


ACTIVATION_LAYOUTS = {
    "dp2": Layout(dp=2),
    "dp2, zero3": Layout(dp=2, zero=3),
    "tp2": Layout(tp=2),
    "tp2, sp": Layout(tp=2, sp=True),
    "tp4, sp": Layout(tp=4, sp=True),
    "pp2 x tp2, sp": Layout(pp=2, tp=2, sp=True, micro_batches=2),
    "pp2 x dp2, gpipe": Layout(pp=2, dp=2, micro_batches=2, schedule="gpipe"),
    "pp2, v2": Layout(pp=2, micro_batches=2, virtual=2),
    "cp2": Layout(cp=2),
    "cp2, contiguous": Layout(cp=2, balanced=False),
    "cp2 x tp2, sp": Layout(cp=2, tp=2, sp=True),
    "cp2 x dp2, zero1": Layout(cp=2, dp=2, zero=1),
    "pp2 x cp2": Layout(pp=2, cp=2, micro_batches=2),
}
ACTIVATION_CASES = [(l, f) for l, layout in ACTIVATION_LAYOUTS.items()
                    for f, config in FEATURES.items()
                    if layout.refusal(dataclasses.replace(config, n_layers=4)) is None]


def _cache_bytes(world, config, layout):
    """The bytes this rank's caches keep after one training forward of its rows."""
    from tfcore import backend
    from tfcore.models.decoder import DecoderLM
    from tfcore.models.sizes import held_bytes
    from tfcore.parallel.harness import HYPER, make_batches
    from tfcore.parallel.optimizer import ZeRO23
    from tfcore.parallel.runner import build

    run = build(world, config, layout, HYPER)
    model, rows = run.model, BATCH // layout.dp
    model.load_full(DecoderLM(config).init(0).params)
    ids, targets = make_batches(config, 1, BATCH, SEQ)
    r0 = run.mesh.dp_rank * rows
    x, y = (backend.asarray(a[0, r0:r0 + rows]) for a in (ids, targets))
    train = dict(training=True, rng=backend.default_rng(1)) if config.dropout else {}
    model.forward(x, y, batch_rows=(r0, r0 + rows, BATCH), **train)
    tables = [model._sinusoidal, *(model._rope or ())]
    params = ZeRO23.buffers(model) if layout.zero >= 2 else model.params
    return held_bytes(model._cache, [params.data, params.grad, x, y, *tables])


@pytest.mark.parametrize("lname,fname", ACTIVATION_CASES,
                         ids=[f"{l} | {f}" for l, f in ACTIVATION_CASES])
def test_the_activations_of_a_layout_are_its_formula(lname, fname):
    """plan()'s activations per rank are the bytes its caches keep, measured as they are
    kept (sizes.held_bytes: every buffer once): after a forward of the rank's rows under
    tensor, sequence, data and context parallelism (the ring's positions, balanced or
    contiguous), and at a pipeline rank's peak over its schedule (the executor's count of
    the chunk caches alive at once)."""
    from tfcore.parallel import plan

    layout = ACTIVATION_LAYOUTS[lname]
    config = dataclasses.replace(FEATURES[fname], n_layers=4)    # 2 blocks a chunk
    priced = [m["activations"] for m in plan(config, layout, batch=BATCH,
                                             seq=SEQ).memory_per_rank]
    group = SimulatedGroup(layout.world_size)
    if layout.pp is None:
        measured = group.run(_cache_bytes, config, layout)
    else:
        out = group.run(train_layout, config, layout, 1, BATCH, SEQ, gather=False)
        measured = [o["peak_bytes"] for o in out]
    assert priced == measured
