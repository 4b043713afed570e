"""ZeRO stage 2 and stage 3 (FSDP): gradients, and then parameters, sharded over data parallel.

The model is cut into *units*, each a contiguous range of the (tensor-parallel-local) flat
parameter buffer, in the order the forward uses them:

    embed   wte [V_r, D] (and wpe [S_max, D])            M_0 elements
    h0 .. h{L-1}   one block each                         M_1 .. M_L
    head    lnf and head.W / head.b (when there are any)  M_{L+1}

and each unit u is split over the N_D data-parallel ranks by chunk_bounds(M_u, N_D): rank d
keeps chunk c_{u,d} of it. A rank's shard is the concatenation of its chunks of every unit,
Z_d = sum_u c_{u,d} elements; it holds the AdamW moments m, v [Z_d] and the gradient [Z_d].

* ZeRO-2 (stage=2): every rank holds the whole parameters [P] (as DP and ZeRO-1 do). The
  backward produces one unit's gradient at a time in a transient buffer [M_u], which is
  reduce-scattered over dp the moment the unit's backward ends (as DeepSpeed reduces a bucket)
  and freed: the whole gradient [P] never exists. The step updates the shard; an all-gather
  per unit gives every rank the whole parameters again. Per rank-step: one reduce-scatter and
  one all-gather of every unit, 2 Psi (N_D - 1)/N_D on average over the ranks.
* ZeRO-3 / FSDP (stage=3): a rank keeps only its shard of the parameters [Z_d]. Before a
  unit's forward the unit is all-gathered into a transient buffer [M_u]; after it the buffer
  is freed (the forward's caches keep only placeholders where they held a weight); before the
  unit's backward it is gathered again, the placeholders are pointed at the new buffer, the
  gradient [M_u] is computed, reduce-scattered and freed with the parameters. The step
  updates the shard in place and moves nothing. Per rank-step: two all-gathers and one
  reduce-scatter of every unit, 3 Psi (N_D - 1)/N_D on average.

A tied head uses wte twice (the embedding and the head): each use gathers the embed unit
(forward and backward) and reduce-scatters its own gradient contribution, so the embed unit
moves twice per step. Every other unit is used once.

Memory is counted, not estimated: a `Ledger` records every parameter, gradient and optimizer
array a rank holds, as it is allocated and freed, and checks at each free, through a weak
reference, that the array is really gone (no cache or view still holds it). Its timeline is
what the chapter draws; its peak is what `plan` predicts. Buffers inside the collectives
(their work copies, the messages) are the transport's, not the model's, and are not counted.

The arithmetic is the same elementwise AdamW on the same summed gradients as one device, so
the parameters equal one device's in float64. Host NumPy arrays only (the placeholders point
into a buffer by byte offset); sequence parallelism is not combined with these stages.
"""
from __future__ import annotations

import weakref

import numpy as np

from .. import backend, nn
from ..models.decoder import DecoderConfig
from .comm import chunk_bounds
from .grads import tensor_parallel_mask
from .layout import Layout
from .model import TensorParallelDecoder

STAGES = (2, 3)
KINDS = ("params", "grads", "optimizer")


# ---------------------------------------------------------------------------------------
# Units: which tensors are gathered together


def unit_names(config: DecoderConfig) -> list[tuple[str, list[str]]]:
    """[(unit, [tensor names])] in buffer (and forward) order; a unit with no tensor (the
    head of a tied, post-norm model without head bias) is left out."""
    units = {"embed": [], **{f"h{i}": [] for i in range(config.n_layers)}, "head": []}
    for name in config.param_shapes():                 # one pass: h{i}.* go to unit h{i}
        if name in ("wte", "wpe"):
            units["embed"].append(name)
        elif name.startswith(("lnf.", "head.")):
            units["head"].append(name)
        elif name.split(".", 1)[0] in units:
            units[name.split(".", 1)[0]].append(name)
    return [(u, ns) for u, ns in units.items() if ns]


def unit_uses(config: DecoderConfig) -> dict[str, int]:
    """How many times a step uses each unit: 2 for embed with a tied head, else 1."""
    return {u: (2 if u == "embed" and config.tied_head else 1) for u, _ in unit_names(config)}


class Unit:
    """One unit on one rank: its tensors' shapes and offsets inside the unit buffer [M],
    where the unit sits in the full local buffer (start, stop), its dp chunks (bounds) and
    where this rank's chunk sits in the shard [Z_d] (shard_start, shard_stop)."""

    def __init__(self, name, shapes: dict, start: int, dp_size: int, dp_rank: int,
                 shard_start: int):
        self.name, self.shapes = name, shapes
        self.offsets, size = {}, 0
        for n, s in shapes.items():
            self.offsets[n] = (size, size + int(np.prod(s)))
            size += int(np.prod(s))
        self.size = size                                           # M_u
        self.start, self.stop = start, start + size
        self.bounds = chunk_bounds(size, dp_size)                  # [(a, b)] per dp rank
        a, b = self.bounds[dp_rank]
        self.shard_start, self.shard_stop = shard_start, shard_start + b - a


class UnitParams:
    """What the model's sub-block code reads, for the units in use: p[name], name in p,
    p.grad_of(name) (views of the unit buffers [M_u], and of their gradient buffers)."""

    def __init__(self, units, datas, grads=None):
        self._values, self._grads = {}, {}
        for i, unit in enumerate(units):
            for name, (a, b) in unit.offsets.items():
                self._values[name] = np.reshape(datas[i][a:b], unit.shapes[name])
                if grads is not None:
                    self._grads[name] = np.reshape(grads[i][a:b], unit.shapes[name])

    def __getitem__(self, name):
        return self._values[name]

    def __contains__(self, name):
        return name in self._values

    def grad_of(self, name):
        return self._grads[name]


# ---------------------------------------------------------------------------------------
# Counting what a rank holds


class Ledger:
    """Every parameter, gradient and optimizer array a rank holds, as allocated and freed.

    hold(kind, array, label) -> key; release(key) after the holder dropped its references:
    raises if a weak reference shows the array still alive (a view or a cache kept it).
    timeline: [(event, {kind: bytes held})] after each event; peak(): the largest total.
    """

    def __init__(self):
        self.held: dict[int, tuple] = {}
        self.timeline: list[tuple[str, dict]] = []
        self._next = 0

    def now(self) -> dict:
        out = dict.fromkeys(KINDS, 0)
        for kind, nbytes, _, _ in self.held.values():
            out[kind] += nbytes
        return out

    def hold(self, kind, array, label) -> int:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        key, self._next = self._next, self._next + 1
        self.held[key] = (kind, int(array.nbytes), label, weakref.ref(array))
        self.timeline.append((f"+{kind} {label}", self.now()))
        return key

    def release(self, key):
        kind, nbytes, label, ref = self.held.pop(key)
        if ref() is not None:
            raise RuntimeError(f"{kind} of {label} ({nbytes} bytes) were released but are "
                               "still referenced (a cache or a view kept them)")
        self.timeline.append((f"-{kind} {label}", self.now()))

    def mark(self, event):
        self.timeline.append((event, self.now()))

    def peak(self) -> dict:
        """{kind: bytes} at the moment the total held was largest, and 'total'."""
        best = max(self.timeline, key=lambda e: sum(e[1].values()))[1]
        return dict(best, total=sum(best.values()))


# ---------------------------------------------------------------------------------------
# Placeholders for the weights a forward cache keeps (ZeRO-3 frees them after the forward)


class _WeightRef:
    """Where a cached weight view sat in a unit buffer: (unit, byte offset, shape, strides)."""

    def __init__(self, unit, offset, shape, strides):
        self.unit, self.offset, self.shape, self.strides = unit, offset, shape, strides


def _root(a):
    while isinstance(getattr(a, "base", None), np.ndarray):
        a = a.base
    return a


def _rebuilt(like: tuple, items: list) -> tuple:
    """A tuple of `like`'s type (a cache's NamedTuple stays one) holding `items`."""
    return type(like)(*items) if hasattr(like, "_fields") else tuple(items)


def _strip(obj, buffers):
    """obj with every array viewing one of `buffers` ({id(buffer): (unit, buffer)})
    replaced by a _WeightRef (nested tuples, lists and dicts are rebuilt)."""
    if isinstance(obj, tuple):
        return _rebuilt(obj, [_strip(o, buffers) for o in obj])
    if isinstance(obj, list):
        return [_strip(o, buffers) for o in obj]
    if isinstance(obj, dict):
        return {k: _strip(v, buffers) for k, v in obj.items()}
    if isinstance(obj, np.ndarray) and id(_root(obj)) in buffers:
        unit, buf = buffers[id(_root(obj))]
        offset = obj.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
        return _WeightRef(unit, offset, obj.shape, obj.strides)
    return obj


def _restore(obj, buffers):
    """The inverse of _strip with the newly gathered buffers ({unit: buffer})."""
    if isinstance(obj, tuple):
        return _rebuilt(obj, [_restore(o, buffers) for o in obj])
    if isinstance(obj, list):
        return [_restore(o, buffers) for o in obj]
    if isinstance(obj, dict):
        return {k: _restore(v, buffers) for k, v in obj.items()}
    if isinstance(obj, _WeightRef):
        buf = buffers[obj.unit]
        return np.ndarray(obj.shape, buf.dtype, buffer=buf, offset=obj.offset,
                          strides=obj.strides)
    return obj


# ---------------------------------------------------------------------------------------
# The model


class GatherOnUse:
    """The parameter source of ZeRO-2/3 (models/parts.py's protocol): a unit's parameters are
    gathered before it runs and freed after (stage 3), and its gradient, made in a buffer of
    its own, is reduce-scattered over dp the moment its backward ends."""

    def __init__(self, model: "ShardedDecoder"):
        self.model = model

    def forward(self, names, fn):
        return self.model._run_forward(names, fn)

    def backward(self, names, fn, box, head=False):
        return self.model._run_backward(names, fn, box, head)

    def begin_backward(self):
        self.model.ledger.mark("backward")

    def end_backward(self):
        pass


class ShardedDecoder(TensorParallelDecoder):
    """The one decoder whose parameters (stage 3) or gradients (stages 2 and 3) are sharded
    over `dp` unit by unit: a TensorParallelDecoder with the GatherOnUse source. Rank-local:

        model = ShardedDecoder(config, mesh.tp, mesh.dp, stage=3).load_full(full_params)
        logits, loss = model.forward(ids, targets, batch_rows=...); model.backward()
        adamw(ZeRO23.buffers(model), ZeRO23(model), hyper).step()

    Holds: shard_grad [Z_d]; stage 3: shard [Z_d]; stage 2: data [P] (the whole local
    parameters). `ledger` counts them and every transient unit buffer. Gradients accumulate
    in shard_grad over micro-batches (backward(dloss=w_k)) until zero_grad().
    """

    def __init__(self, config: DecoderConfig, tp, dp, stage: int = 3,
                 sequence_parallel: bool = False, cp=None, balanced: bool = True,
                 ulysses: bool = False):
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES} (ZeRO-1 is optimizer.ZeRO1), "
                             f"got {stage!r}")
        if backend.get_backend() != "numpy":
            raise ValueError("ZeRO-2/3 here run on the NumPy backend (host arrays)")
        Layout(tp=tp.size, zero=stage, sp=sequence_parallel,
               cp=None if cp is None else cp.size, ulysses=ulysses).validate(config)
        # the parent builds this rank's whole buffers once, for their shapes and decay
        # mask; they are dropped at once (stage 2 then holds its own copy of the values)
        super().__init__(config, tp, dp, sequence_parallel, cp, balanced, ulysses=ulysses)
        self.source = GatherOnUse(self)
        shapes = self.params.shapes                       # this tensor-parallel rank's shapes
        self.dtype = self.params.dtype
        self.size = self.params.size                      # P (local to the tp rank)
        self.decay = np.asarray(self.params.decay_mask())  # [P]
        tp_mask = np.asarray(tensor_parallel_mask(self))  # [P]: tensor-parallel shards
        self.params = None                                # never the whole buffers again
        self.stage = stage
        self.units, start, shard = {}, 0, 0
        for name, names in unit_names(config):
            unit = Unit(name, {n: shapes[n] for n in names}, start, dp.size, dp.rank, shard)
            self.units[name] = unit
            start, shard = unit.stop, unit.shard_stop
        if start != self.size:
            raise RuntimeError("internal: the units must tile the parameter buffer")
        self.uses = unit_uses(config)
        self.shard_size = shard                           # Z_d
        # bool [Z_d]: the shard's elements that belong to a tensor-parallel shard (for the
        # global gradient norm: their squares add over tp and dp, the others' over dp)
        self.shard_tp_mask = np.concatenate([self.chunk_of(u, tp_mask)
                                             for u in self.units.values()])
        self.ledger = Ledger()
        self.shard_grad = np.zeros(shard, dtype=self.dtype)           # [Z_d]
        self.ledger.hold("grads", self.shard_grad, "shard")
        if stage == 3:
            self.shard = np.zeros(shard, dtype=self.dtype)            # [Z_d]
            self.ledger.hold("params", self.shard, "shard")
        else:
            self.data = np.zeros(self.size, dtype=self.dtype)         # [P]
            self.ledger.hold("params", self.data, "all")
        self._gathered: dict = {}                         # unit -> (buffer [M_u], ledger key)

    # -- parameters ----------------------------------------------------------------------
    def chunk_of(self, unit: Unit, flat):
        """This rank's chunk of the unit inside a full local buffer flat [P] -> [c_{u,d}]."""
        a, b = unit.bounds[self.dp.rank]
        return flat[unit.start + a:unit.start + b]

    def load_full(self, full_params: nn.Parameters) -> "ShardedDecoder":
        """Keep this rank's part of a single-device model's parameters."""
        local = nn.Parameters(dict(self._local_shapes()), self.dtype)
        self.params = local
        super().load_full(full_params)
        self.params = None
        flat = np.asarray(local.data)
        if self.stage == 2:
            self.data[...] = flat
        else:
            for unit in self.units.values():
                self.shard[unit.shard_start:unit.shard_stop] = self.chunk_of(unit, flat)
        return self

    def _local_shapes(self):
        for unit in self.units.values():
            yield from unit.shapes.items()

    def _unit_data(self, unit: Unit, why: str):
        """The whole unit [M_u]: stage 2 a view of data; stage 3 all-gathered (counted)."""
        if self.stage == 2:
            return self.data[unit.start:unit.stop]
        buf = self.dp.all_gather_flat(self.shard[unit.shard_start:unit.shard_stop],
                                      unit.bounds)
        if buf.base is not None:      # own the memory, so that the ledger watches the memory
            buf = buf.copy()
        key = self.ledger.hold("params", buf, f"{unit.name} ({why})")
        self._gathered[unit.name] = (weakref.ref(buf), key)
        return buf

    def _free(self, names):
        """Drop the gathered parameters of these units (stage 3): checked really gone."""
        for name in names:
            if name in self._gathered:
                _, key = self._gathered.pop(name)
                self.ledger.release(key)

    def full_flat(self):
        """The whole local parameter buffer [P] (all-gathers every unit under stage 3)."""
        if self.stage == 2:
            return self.data.copy()
        out = np.empty(self.size, dtype=self.dtype)
        for unit in self.units.values():
            out[unit.start:unit.stop] = self.dp.all_gather_flat(
                self.shard[unit.shard_start:unit.shard_stop], unit.bounds)
        return out

    def gather_full(self, which: str = "data"):
        """The single-device flat buffer (collective over dp and tp); data only."""
        if which != "data":
            raise ValueError("a sharded model keeps no whole gradient: which must be 'data'")
        local = nn.Parameters(dict(self._local_shapes()), self.dtype)
        local.data[...] = self.full_flat()
        self.params = local
        try:
            return super().gather_full("data")
        finally:
            self.params = None

    # -- running a piece of the model on gathered units ---------------------------------------
    def _run_forward(self, names, fn):
        """Gather the units, run fn(their parameters), free them; the returned cache keeps
        placeholders instead of the weights (stage 3)."""
        units = [self.units[n] for n in names]
        datas = [self._unit_data(u, "forward") for u in units]
        out, cache = fn(UnitParams(units, datas))
        if self.stage == 3:
            cache = _strip(cache, {id(d): (u.name, d) for u, d in zip(units, datas)})
        del datas
        self._free(names)
        return out, cache

    def _run_backward(self, names, fn, box, head=False):
        """Gather the units again, fn(params, box) with fresh gradient buffers [M_u], free
        the parameters; sum over tp what the parts sum (sequence parallelism, shared
        key/value heads), reduce-scatter each gradient into shard_grad, free it."""
        units = [self.units[n] for n in names]
        datas = [self._unit_data(u, "backward") for u in units]
        grads = [np.zeros(u.size, dtype=self.dtype) for u in units]       # [M_u] each
        keys = [self.ledger.hold("grads", g, u.name) for u, g in zip(units, grads)]
        if self.stage == 3:
            box[0] = _restore(box[0], {u.name: d for u, d in zip(units, datas)})
        params = UnitParams(units, datas, grads)
        out = fn(params, box)
        # the tensors this backward wrote: the head's reads only wte of the embed unit
        written = [n for u in units if not (head and u.name == "embed") for n in u.shapes]
        self.parts.reduce_grads(params, None, written)
        del params, datas
        self._free(names)
        for unit, key in zip(units, keys):
            grad = grads.pop(0)
            chunk = self.dp.reduce_scatter_flat(grad, unit.bounds)         # [c_{u,d}]
            del grad
            self.ledger.release(key)
            self.shard_grad[unit.shard_start:unit.shard_stop] += chunk
        return out

    def forward(self, ids, targets=None, training: bool = False, rng=None, batch_rows=None):
        """DecoderLM.forward (same arguments, same results), one unit at a time."""
        self.ledger.mark("forward")
        return super().forward(ids, targets, training, rng, batch_rows)

    def zero_grad(self):
        self.shard_grad[...] = 0.0


__all__ = ["ShardedDecoder", "Ledger", "train_sharded", "unit_names",
           "unit_uses"]
