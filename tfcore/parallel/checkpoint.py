"""Training state that moves between layouts: every tensor under its one-device name.

A rank of a layout holds blocks of the parameters (tensor parallelism), chunks of the
optimizer's moments (ZeRO-1: a chunk of its flat buffer; ZeRO-2/3: a chunk of each unit),
and the whole of the rest. `gather_state` rebuilds, on every rank, the state one device
would hold: the parameters and AdamW's two moments as flat buffers [P] in
DecoderConfig.param_shapes() order, and the step count. `load_state` gives a rank of any
other layout its share of such a state. So a run saved under DP 2 x TP 2 resumes under
ZeRO-3 over 4 ranks, under a ring, in pipeline stages, or on one device, and continues as
the uninterrupted run would (tests/test_checkpoint_layouts.py):

    state = gather_state(run)          # collective; every rank gets the same dict
    ...
    load_state(other_run, state)       # no communication: each rank takes its share

A rank's share of a moment goes through two maps, each the inverse of the other:
one device's flat [P] <-> this rank's local flat [P_t] (its tensor-parallel blocks, by name:
parts.shard_tensor / unshard_tensor) <-> the optimizer's view [Z] (the strategy's
select, and its all-gather back).

A pipeline stage (PipelineStage) holds its own tensors only: its blocks' parameters and
moments, the first stage the embedding, the last the final norm and the head, and, with a
tied head, its own copy of wte (whose gradient the two stages sum, so that the copies and
their moments stay equal). The one-device state holds wte once, the first stage's; a
stage's local buffer takes, by name, what it holds of one device's.
"""
from __future__ import annotations

import numpy as np

from .. import backend, nn
from .fsdp import ShardedDecoder
from .model import gather_tensors, shard_tensor
from .optimizer import ZeRO1, ZeRO23
from .pipeline import PipelineStage, gather_stages

MOMENTS = ("m", "v")


def _local_shapes(model) -> dict:
    """{name: shape} of this rank's local flat buffer, in its order."""
    if isinstance(model, ShardedDecoder):
        return dict(model._local_shapes())
    return dict(model.params.shapes)


def _named(model, local):
    """get(name) -> the view of tensor `name` in a local flat buffer [P_t]."""
    holder = nn.Parameters(_local_shapes(model), model.config.dtype)
    holder.data[...] = local
    return holder.__getitem__


def _view_to_local(run, values):
    """The optimizer view's values [Z] -> this rank's local flat buffer [P_t] (collective
    over the data group for ZeRO)."""
    model, shard = run.model, run.shard
    if isinstance(shard, ZeRO23):
        out = np.empty(model.size, dtype=model.dtype)
        for unit in model.units.values():
            out[unit.start:unit.stop] = model.dp.all_gather_flat(
                values[unit.shard_start:unit.shard_stop], unit.bounds)
        return out
    if isinstance(shard, ZeRO1):
        return shard.local_of(values, int(model.params.data.shape[0]))
    return values


def _gather(run, get):
    """One device's flat buffer [P] (host) from get(name) -> this rank's block of `name`."""
    model = run.model
    if isinstance(model, PipelineStage):                 # over tp, then over the stages
        return gather_stages(model, run.mesh, get)
    return np.asarray(backend.to_numpy(gather_tensors(model.config, model.tp, get,
                                                      getattr(model, "ep", None))))


def gather_state(run) -> dict:
    """One device's training state from a rank of any layout (collective over the world;
    every rank returns the same): params, m, v [P] (host), t, skipped."""
    model, opt = run.model, run.optimizer
    params = (gather_stages(model, run.mesh, model.params.__getitem__)
              if isinstance(model, PipelineStage) else model.gather_full("data"))
    state = dict(params=np.asarray(backend.to_numpy(params)), t=int(opt.t),
                 skipped=int(opt.skipped))
    for name in MOMENTS:
        local = _view_to_local(run, getattr(opt, name))                  # [P_t]
        state[name] = _gather(run, _named(model, local))                 # [P]
    return state


def _local_from_full(model, full) -> np.ndarray:
    """One device's flat buffer [P] -> this rank's local flat buffer [P_t] (no communication)."""
    config = model.config
    offsets, start = {}, 0
    for name, shape in config.param_shapes().items():
        size = int(np.prod(shape))
        offsets[name] = (start, start + size, shape)
        start += size
    pieces = []
    for name in _local_shapes(model):
        a, b, shape = offsets[name]
        pieces.append(np.reshape(shard_tensor(name, np.reshape(full[a:b], shape), config,
                                              model.tp.size, model.tp.rank,
                                              model.parts.ep_size, model.parts.ep_rank),
                                 (-1,)))
    return np.concatenate(pieces)


def check_state(model, state: dict) -> None:
    """ValueError naming what does not fit this model, before anything changes."""
    P = sum(int(np.prod(s)) for s in model.config.param_shapes().values())
    for name in ("params", *MOMENTS):
        if name not in state:
            raise ValueError(f"training state lacks {name!r}")
        shape = tuple(np.shape(state[name]))
        if shape != (P,):
            raise ValueError(f"training state {name} has shape {shape}, this model's "
                             f"one-device buffers ({P},)")
        if not np.all(np.isfinite(state[name])):
            raise ValueError(f"training state {name} holds nan or inf")
    for name in ("t", "skipped"):
        value = state.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"training state {name} must be an integer >= 0, got {value!r}")


def load_state(run, state: dict) -> None:
    """Give this rank its share of one device's training state (gather_state's dict, or a
    checkpoint's): its blocks of the parameters, its view of m and v, the step count.
    Everything is checked first; nothing changes on error."""
    model, opt, shard = run.model, run.optimizer, run.shard
    check_state(model, state)
    full = nn.Parameters(model.config.param_shapes(), model.config.dtype)
    full.data[...] = backend.asarray(np.asarray(state["params"]), dtype=model.config.dtype)
    params = ZeRO23.buffers(model) if isinstance(shard, ZeRO23) else model.params
    moments = {name: shard.select(params, _local_from_full(model, np.asarray(state[name])))
               for name in MOMENTS}                                     # [Z] each
    model.load_full(full)
    xp = backend.namespace(opt.m)
    for name, values in moments.items():
        getattr(opt, name)[...] = xp.asarray(values, dtype=getattr(opt, name).dtype)
    opt.t, opt.skipped = int(state["t"]), int(state["skipped"])
