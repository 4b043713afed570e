"""Pipeline parallelism: consecutive blocks on different ranks, micro-batches, schedules.

Notation: p = N_P pipeline stages (ranks of the pp group), m micro-batches per step, v
virtual stages (chunks) per rank. The L blocks are cut into p v chunks of L / (p v)
consecutive blocks; chunk c of rank r is the virtual stage s = c p + r (v = 1: stage r
holds blocks r L/p .. (r+1) L/p - 1). Virtual stage 0 also holds the embedding (wte, wpe),
the last one, p v - 1, the final norm, the head and the loss; with a tied head the last
stage keeps its own copy of wte, and the two copies' gradients are summed (one all-reduce
between the first and the last stage) before the optimizer, so the copies stay equal.

A schedule is data: for each rank, the ordered list of operations (op, micro-batch, chunk),
op "F" (forward) or "B" (backward), made by one function per schedule:

    gpipe_schedule(p, m)             every forward, then every backward
    one_f_one_b_schedule(p, m)       p - r - 1 warm-up forwards, then F, B alternating
    interleaved_schedule(p, m, v)    Megatron-LM's interleaved 1F1B over v chunks per rank

One executor (`run_pipeline_step`) runs any of them on one rank, under SimulatedGroup or
MPIComm: a forward of virtual stage s > 0 receives its input [B_m, S, D] from rank
(s - 1) mod p, a backward of s < p v - 1 the gradient [B_m, S, D] from rank (s + 1) mod p,
with the communicator's counted point-to-point send/recv. Every rank knows every schedule,
so it knows the order in which a neighbour sends on their link; a message that arrives
before it is needed (a gradient overtaken by an activation on the same link) is kept until
its operation runs.

The timeline. The executor records, per rank, the operations in the order it ran them and,
for each, the operation whose message it waited for. `measure_timeline` replays that record
with unit costs (forward t_f, backward t_b per chunk and micro-batch; an operation starts
when its rank is free and its input has arrived), in exact fractions, and gives each rank's
busy intervals; the bubble is a rank's idle time over its busy time:

    GPipe, 1F1B:    (p - 1) / m         interleaved:  (p - 1) / (v m)

Memory: the executor counts the caches alive (forward done, backward not yet) on its rank;
the peak, in chunk caches of one micro-batch, is m for GPipe, min(p - r, m) for 1F1B and
min(2 (p - r - 1) + (v - 1) p + 1, v m) interleaved (`peak_stored_microbatches`).
"""
from __future__ import annotations

import re
from fractions import Fraction

import numpy as np

from .. import backend
from ..models.decoder import IGNORE_INDEX, DecoderConfig, DecoderLM
from ..models.parts import count_rows
from ..models.sizes import held_bytes
from .mesh import Mesh
from .layout import SCHEDULES, Layout
from .model import TensorParallelDecoder, check_layout, config_hash, shard_rule
from .optimizer import Replicated, ZeRO1, adamw


# ---------------------------------------------------------------------------------------
# Schedules as data


def _check_counts(n_stages, n_microbatches, n_virtual=1):
    for name, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches),
                        ("n_virtual", n_virtual)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def gpipe_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple]]:
    """Rank r: F(0..m-1) then B(0..m-1), all on chunk 0."""
    _check_counts(n_stages, n_microbatches)
    m = n_microbatches
    return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
            for _ in range(n_stages)]


def one_f_one_b_schedule(n_stages: int, n_microbatches: int) -> list[list[tuple]]:
    """Rank r: w = min(p - r - 1, m) forwards, then (F(w + i), B(i)) for i < m - w, then the
    remaining backwards. At most w + 1 <= p - r micro-batches wait for their backward."""
    _check_counts(n_stages, n_microbatches)
    p, m = n_stages, n_microbatches
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        ops = [("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i, 0), ("B", i, 0)]
        out.append(ops + [("B", i, 0) for i in range(m - warm, m)])
    return out


def interleaved_schedule(n_stages: int, n_microbatches: int,
                         n_virtual: int) -> list[list[tuple]]:
    """Megatron-LM's interleaved 1F1B. The k-th forward of a rank runs micro-batch
    (k // (p v)) p + k mod p on chunk (k // p) mod v (p micro-batches through chunk 0, the
    same p through chunk 1, ...); the k-th backward the same micro-batch on chunk
    v - 1 - (k // p) mod v. Rank r runs w = min(2 (p - r - 1) + (v - 1) p, v m) forwards
    first, then alternates F, B, then finishes the backwards. Needs p | m."""
    _check_counts(n_stages, n_microbatches, n_virtual)
    p, m, v = n_stages, n_microbatches, n_virtual
    if m % p:
        raise ValueError(f"the interleaved schedule needs n_microbatches ({m}) divisible by "
                         f"n_stages ({p}): micro-batches go through the chunks in groups of n_stages")
    total = v * m

    def forward(k):
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k):
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    out = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        ops = [forward(k) for k in range(warm)]
        for i in range(total - warm):
            ops += [forward(warm + i), backward(i)]
        out.append(ops + [backward(k) for k in range(total - warm, total)])
    return out


def forward_schedule(n_stages: int, n_microbatches: int,
                     n_virtual: int = 1) -> list[list[tuple]]:
    """Forward only (an evaluation): rank r runs F(i, c) for every micro-batch i, and within
    it every chunk c in order. An operation waits only for one earlier in (i, c, rank)
    order, so the ranks never wait on each other in a circle."""
    _check_counts(n_stages, n_microbatches, n_virtual)
    return [[("F", i, c) for i in range(n_microbatches) for c in range(n_virtual)]
            for _ in range(n_stages)]


def make_schedule(schedule: str, n_stages: int, n_microbatches: int,
                  n_virtual: int = 1) -> list[list[tuple]]:
    """[rank] -> [(op, micro-batch, chunk)] for schedule in SCHEDULES."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    _check_counts(n_stages, n_microbatches, n_virtual)
    if schedule == "interleaved":
        return interleaved_schedule(n_stages, n_microbatches, n_virtual)
    if n_virtual != 1:
        raise ValueError(f"n_virtual must be 1 for the {schedule!r} schedule (one chunk per "
                         f"rank), got {n_virtual}; use 'interleaved' for v > 1")
    if schedule == "gpipe":
        return gpipe_schedule(n_stages, n_microbatches)
    return one_f_one_b_schedule(n_stages, n_microbatches)


# ---------------------------------------------------------------------------------------
# The closed forms (a calculator imports these)


def bubble_fraction(n_stages: int, n_microbatches: int, n_virtual: int = 1) -> Fraction:
    """Idle time over busy time of every rank: (p - 1) / (v m). v = 1 for GPipe and 1F1B."""
    _check_counts(n_stages, n_microbatches, n_virtual)
    return Fraction(n_stages - 1, n_virtual * n_microbatches)


def peak_stored_microbatches(schedule: str, n_stages: int, rank: int, n_microbatches: int,
                             n_virtual: int = 1) -> int:
    """The most chunk caches (one micro-batch through one chunk of L / (p v) blocks) that
    rank `rank` holds at once: m (GPipe), min(p - r, m) (1F1B), min(2 (p - r - 1) +
    (v - 1) p + 1, v m) (interleaved). A stage's activations for one micro-batch are v
    chunk caches, so the interleaved count divided by v compares with the others."""
    make_schedule(schedule, n_stages, n_microbatches, n_virtual)     # the same checks
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < n_stages:
        raise ValueError(f"rank must be in 0..{n_stages - 1}, got {rank!r}")
    p, m, v, r = n_stages, n_microbatches, n_virtual, rank
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - r, m)
    return min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)


def pipeline_bytes_sent(n_stages: int, rank: int, n_microbatches: int, n_virtual: int,
                        micro_tokens: int, d_model: int, itemsize: int) -> int:
    """Point-to-point bytes rank r sends in one step: per micro-batch, an activation
    [B_m, S, D] from every chunk but the last virtual stage and a gradient of the same size
    from every chunk but virtual stage 0 (micro_tokens = B_m S). Messages from a rank to
    itself (p = 1) do not move."""
    if n_stages == 1:
        return 0
    p, v = n_stages, n_virtual
    stages = [c * p + rank for c in range(v)]
    messages = sum(s != p * v - 1 for s in stages) + sum(s != 0 for s in stages)
    return messages * n_microbatches * micro_tokens * d_model * itemsize


# ---------------------------------------------------------------------------------------
# The layout: what refuses before any work


def check_pipeline_layout(config: DecoderConfig, world_size: int, pp: int, tp: int = 1,
                          dp: int | None = None, n_microbatches: int = 1,
                          n_virtual: int = 1, batch: int | None = None,
                          schedule: str = "1f1b", cp: int | None = None, sp: bool = False,
                          zero: int = 0) -> int:
    """Raise ValueError naming the sizes when the layout does not divide, and Layout.validate's
    refusal of a combination; -> dp."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, value in (("pp", pp), ("tp", tp), ("n_microbatches", n_microbatches),
                        ("n_virtual", n_virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    inner = pp * tp * (cp or 1)
    ring = "" if cp is None else f" x cp={cp}"
    if dp is None:
        if world_size % inner:
            raise ValueError(f"the world size {world_size} is not a multiple of pp={pp} x "
                             f"tp={tp}{ring} = {inner}")
        dp = world_size // inner
    if dp * inner != world_size:
        raise ValueError(f"the mesh dp={dp} x pp={pp} x tp={tp}{ring} needs {dp * inner} "
                         f"ranks, but the world has {world_size}")
    if config.n_layers % (pp * n_virtual):
        raise ValueError(f"n_layers ({config.n_layers}) must be divisible by pp x n_virtual "
                         f"= {pp} x {n_virtual} = {pp * n_virtual}: every virtual stage "
                         "holds the same number of blocks")
    Layout(dp=dp, tp=tp, pp=pp, micro_batches=n_microbatches, virtual=n_virtual,
           schedule=schedule, cp=cp, sp=sp, zero=zero).validate(config)
    make_schedule(schedule, pp, n_microbatches, n_virtual)        # its own checks
    if batch is not None and batch % (dp * n_microbatches):
        raise ValueError(f"the global batch ({batch}) must be divisible by dp x "
                         f"n_microbatches = {dp} x {n_microbatches} = {dp * n_microbatches}")
    check_layout(config, tp)
    return dp


def stage_layers(config: DecoderConfig, n_stages: int, n_virtual: int,
                 virtual_stage: int) -> range:
    """The blocks of one virtual stage: L / (p v) consecutive ones."""
    per = config.n_layers // (n_stages * n_virtual)
    return range(virtual_stage * per, (virtual_stage + 1) * per)


def stage_param_names(config: DecoderConfig, n_stages: int, rank: int,
                      n_virtual: int = 1) -> list[str]:
    """The parameters rank r of the pipeline holds, in the single-device buffer's order."""
    p, v = n_stages, n_virtual
    stages = [c * p + rank for c in range(v)]
    layers = {i for s in stages for i in stage_layers(config, p, v, s)}
    first, last = 0 in stages, p * v - 1 in stages
    names = []
    for name in config.param_shapes():
        if name == "wte":
            keep = first or (last and config.tied_head)
        elif name == "wpe":
            keep = first
        elif re.match(r"h\d+\.", name):
            keep = int(name[1:].split(".", 1)[0]) in layers
        else:                                                   # lnf.*, head.*
            keep = last
        if keep:
            names.append(name)
    return names


# ---------------------------------------------------------------------------------------
# One rank's stage of the model


class PipelineStage(TensorParallelDecoder):
    """The one decoder on one pipeline rank: the blocks of its chunks (and its
    tensor-parallel block of each), with the embedding on virtual stage 0 and the final
    norm, head and loss on the last; DecoderLM.forward_span / backward_span run a chunk.

        chunk_forward(c, inputs, targets)  inputs: ids [B_m, S] (virtual stage 0) or
            X [B_m, S, D] -> (X [B_m, S, D] for the next stage, or on the last one the
            micro-batch's mean loss and its counted tokens), cache
        chunk_backward(c, G, cache, scale) G [B_m, S, D] (None on the last stage)
            -> the gradient of the chunk's input X (None on virtual stage 0)
    """

    def __init__(self, config: DecoderConfig, tp, n_stages: int, stage: int,
                 n_virtual: int = 1, sequence_parallel: bool = False, cp=None,
                 balanced: bool = True, ulysses: bool = False):
        Layout(tp=tp.size, pp=n_stages, virtual=n_virtual, sp=sequence_parallel,
               cp=None if cp is None else cp.size, ulysses=ulysses).validate(config)
        tp.check_same(config_hash(config, tp=tp.size, pp=n_stages, v=n_virtual),
                      "the model configuration (or the parallel layout)")
        self.n_stages, self.stage, self.n_virtual = n_stages, stage, n_virtual
        chunks = [stage_layers(config, n_stages, n_virtual, self.virtual_stage(c))
                  for c in range(n_virtual)]
        # a micro-batch's loss: its mean over the tokens of this replica's rows (over the
        # ring's ranks when the sequences are split); the executor weights it
        super().__init__(config, tp, cp, sequence_parallel, cp, balanced,
                         layers=[i for layers in chunks for i in layers], ulysses=ulysses)
        self.chunk_layers = chunks

    def held_shapes(self) -> dict:
        full = self.config.param_shapes()
        return {n: full[n] for n in stage_param_names(self.config, self.n_stages,
                                                      self.stage, self.n_virtual)}

    def init(self, seed: int = 0) -> "PipelineStage":
        return self.load_full(DecoderLM(self.config).init(seed).params)

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.n_stages + self.stage

    def is_first(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == self.n_stages * self.n_virtual - 1

    def chunk_forward(self, chunk: int, inputs, targets=None, seq: int | None = None,
                      rng=None, rows=None):
        """seq: the whole sequence's length (inputs of a later stage hold this rank's rows
        of it); default: inputs' second axis. rng: a fresh generator of the step's seed
        (training with dropout), rows = (start, stop, B_global) the micro-batch's rows of
        the batch: the draws of the units before this chunk are replayed and discarded, so
        the chunk draws one device's masks."""
        seq = seq or inputs.shape[1]
        if rng is not None:
            start = self.chunk_layers[chunk][0] if len(self.chunk_layers[chunk]) else 0
            for shape in self.dropout_draws(rows[2], seq, range(start),
                                            embed=not self.is_first(chunk)):
                rng.random(shape)
        ctx = self.context(seq, rng is not None, rng, rows)
        if self.is_first(chunk):
            self._check_ids(inputs)
        out, cache = self.forward_span(inputs, targets, ctx, self.chunk_layers[chunk],
                                       self.is_first(chunk), self.is_last(chunk))
        if self.is_last(chunk):
            out = (float(out[1]), self.loss_count(cache))  # the micro-batch's mean, count
        return out, cache

    def loss_count(self, cache) -> float:
        """The targets a last-stage chunk's loss counted."""
        return self.parts.loss_count(cache.loss)

    def chunk_backward(self, chunk: int, G, cache, scale: float = 1.0):
        """scale (last stage): d(step loss)/d(this micro-batch's mean loss) = T_c,mb / T_c."""
        if self.is_last(chunk) and G is not None:
            raise ValueError("G must be None on the last virtual stage: the loss starts "
                             "its backward")
        self.source.begin_backward()
        dx = self.backward_span(cache, G=G, dloss=scale)
        self.source.end_backward()
        return dx


# ---------------------------------------------------------------------------------------
# The executor


def _messages_on_links(schedule, n_stages, n_virtual, rank):
    """{src: [keys in the order src sends them to `rank`]} from the senders' schedules.
    A key ("F", i, s) is the input of F on virtual stage s, ("B", i, s) the gradient."""
    p, last = n_stages, n_stages * n_virtual - 1
    order = {}
    for src in range(p):
        for op, i, c in schedule[src]:
            s = c * p + src
            if op == "F" and s != last:
                key, dst = ("F", i, s + 1), (s + 1) % p
            elif op == "B" and s != 0:
                key, dst = ("B", i, s - 1), (s - 1) % p
            else:
                continue
            if dst == rank and src != rank:
                order.setdefault(src, []).append(key)
    return order


def run_pipeline_step(stage: PipelineStage, pp, schedule, ids, targets, count_total: float,
                      dropout=None, forward_only: bool = False):
    """Run this rank's operations of `schedule` for one step; gradients add into
    stage.params.grad. ids, targets [m, B_m, S] (host): the micro-batches (only the first and
    last virtual stages read them). count_total: T_c, the counted targets of the whole
    global batch. dropout: (new_generator, rows) for training with dropout: new_generator()
    a fresh generator of the step's seed for each chunk's forward, rows[i] = (start, stop,
    B_global) micro-batch i's rows of the batch. forward_only: a schedule of forwards
    (forward_schedule: an evaluation) whose caches are dropped at once. -> dict(loss (the
    step's loss on the last stage, else None), record [(op, micro-batch, chunk, key of
    the message waited for or None)], peak_live, peak_bytes, chunk_bytes {chunk: bytes of
    one micro-batch's cache: the buffers it keeps alive, sizes.held_bytes, without the
    parameters, the ids and targets and the position tables})."""
    p, v = stage.n_stages, stage.n_virtual
    r = stage.stage
    xp = backend.xp()
    D, dtype = stage.config.d_model, stage.params.data.dtype
    like = xp.zeros((1,), dtype=dtype)
    seq = ids.shape[2]
    rows = count_rows(stage.parts.stream_index(seq))   # the residual stream's rows here
    shape = (ids.shape[1], rows, D)                                    # [B_m, S_loc, D]
    expected = _messages_on_links(schedule, p, v, r)
    position = {src: 0 for src in expected}
    arrived, local, handles = {}, {}, []
    caches, loss_sum = {}, 0.0
    record, live, peak_live, peak_bytes, live_bytes = [], 0, 0, 0, 0
    chunk_bytes = {}                                  # chunk -> bytes of one cache

    def send(key, dst, x):
        if dst == r:
            local[key] = x
        else:
            flat = xp.reshape(xp.asarray(x, copy=True), (-1,))
            handles.append(pp.send(dst, flat))

    def receive(key, src):
        if src == r:
            return local.pop(key)
        while key not in arrived:                 # take the link's messages in its order
            if position[src] >= len(expected[src]):
                raise RuntimeError(f"rank {r}: rank {src} never sends {key}")
            next_key = expected[src][position[src]]
            position[src] += 1
            flat = pp.recv(src, int(np.prod(shape)), like)
            arrived[next_key] = xp.reshape(flat, shape)
        return arrived.pop(key)

    last = p * v - 1
    for op, i, c in schedule[r]:
        s = c * p + r
        if op == "F":
            if s == 0:
                inputs, waited = backend.asarray(ids[i]), None
            else:
                waited = ("F", i, s - 1)
                inputs = receive(("F", i, s), (s - 1) % p)
            rng, rows = (None, None) if dropout is None else (dropout[0](), dropout[1][i])
            chunk_targets = backend.asarray(targets[i]) if s == last else None
            out, cache = stage.chunk_forward(c, inputs, chunk_targets, seq=seq, rng=rng,
                                             rows=rows)
            if not forward_only:           # (an evaluation keeps no cache)
                caches[(i, c)] = cache
                live += 1
                chunk_bytes[c] = held_bytes(cache, [    # the same for every micro-batch
                    stage.params.data, stage.params.grad, chunk_targets,
                    inputs if s == 0 else None, stage._sinusoidal, *(stage._rope or ())])
                live_bytes += chunk_bytes[c]
                peak_live, peak_bytes = max(peak_live, live), max(peak_bytes, live_bytes)
            if s == last:
                mean, count = out
                loss_sum += mean * count / count_total
            else:
                send(("F", i, s + 1), (s + 1) % p, out)
        else:
            cache = caches.pop((i, c))
            if s == last:
                G, waited = None, ("F", i, s)
                scale = stage.loss_count(cache) / count_total  # T_c,mb / T_c
            else:
                waited = ("B", i, s + 1)
                G, scale = receive(("B", i, s), (s + 1) % p), 1.0
            dx = stage.chunk_backward(c, G, cache, scale)
            live -= 1
            live_bytes -= chunk_bytes[c]          # (the backward empties the cache)
            if s != 0:
                send(("B", i, s - 1), (s - 1) % p, dx)
        record.append((op, int(i), int(c), waited))
    for handle in handles:
        pp._wait(handle)
    if caches or arrived or local:
        raise RuntimeError(f"rank {r}: the schedule left work behind: caches "
                           f"{sorted(caches)}, messages {sorted(arrived) + sorted(local)}")
    return dict(loss=loss_sum if any(c * p + r == last for c in range(v)) else None,
                record=record, peak_live=peak_live, peak_bytes=peak_bytes,
                chunk_bytes=chunk_bytes)


# ---------------------------------------------------------------------------------------
# The timeline, measured from the executor's record with unit costs


def measure_timeline(records, n_stages: int, n_virtual: int = 1, cost_forward=1,
                     cost_backward=2) -> dict:
    """records[r]: rank r's record from run_pipeline_step. Replays it: each operation starts
    when its rank has finished the previous one and the operation whose message it waited
    for has finished, and lasts cost_forward or cost_backward (Fractions, exact).
    -> dict(intervals [rank] -> [(start, stop, op, micro-batch, chunk)], span, busy [rank],
    idle [rank], bubble [rank] = idle / busy)."""
    p = n_stages
    cost = dict(F=Fraction(cost_forward), B=Fraction(cost_backward))
    finished = {}                                   # (op, micro-batch, virtual stage) -> time
    clock = [Fraction(0)] * p
    position = [0] * p
    intervals = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while position[r] < len(records[r]):
                op, i, c, waited = records[r][position[r]]
                if waited is not None and waited not in finished:
                    break                            # its input has not arrived yet
                start = max(clock[r], finished[waited] if waited is not None else 0)
                stop = start + cost[op]
                finished[(op, i, c * p + r)] = stop
                clock[r] = stop
                intervals[r].append((start, stop, op, i, c))
                position[r] += 1
                progress = True
    if any(position[r] < len(records[r]) for r in range(p)):
        raise RuntimeError("the record cannot be replayed: an operation waits for one that "
                           "never finishes")
    span = max(clock)
    busy = [sum((b - a for a, b, *_ in intervals[r]), Fraction(0)) for r in range(p)]
    idle = [span - busy[r] for r in range(p)]
    return dict(intervals=intervals, span=span, busy=busy, idle=idle,
                bubble=[idle[r] / busy[r] for r in range(p)])


# ---------------------------------------------------------------------------------------
# Training on a DP x PP x TP mesh


def build_stage(world, config: DecoderConfig, layout: Layout, hyper: dict, mesh=None):
    """This rank's PipelineStage of `layout` (layout.pp set) and its AdamW, as a runner.Run
    whose `pipeline` holds what a step needs besides the model: the schedule [rank] ->
    [(op, micro-batch, chunk)], `tied` (the group of the first and the last stage, which
    sum the gradients of their two copies of a tied wte; None elsewhere) and `holds_last`
    (this rank runs the last virtual stage: the loss). The parameters are zero: load them
    (stage.load_full, or tfcore.parallel.checkpoint.load_state) before training.
    runner.build calls it for a layout with pp; mesh: the layout's Mesh, when built."""
    from .grads import tensor_parallel_mask
    from .runner import Run

    pp, m, v = layout.pp, layout.micro_batches, layout.virtual
    schedule = layout.pipeline_schedule
    check_pipeline_layout(config, world.size, pp, layout.tp, layout.dp, m, v, None,
                          schedule, layout.cp, layout.sp, layout.zero)
    mesh = mesh or Mesh(world, tp=layout.tp, dp=layout.dp, pp=pp, cp=layout.cp)
    plan = make_schedule(schedule, pp, m, v)
    world.check_same(f"{schedule} m={m} v={v}", "the pipeline schedule")
    stage = PipelineStage(config, mesh.tp, pp, mesh.pp_rank, v, layout.sp, mesh.cp,
                          layout.balanced, layout.ulysses)
    r = mesh.pp_rank
    holds_last = any(c * pp + r == pp * v - 1 for c in range(v))
    # a tied head: the first and the last stage each hold wte; their gradients are summed
    tied = None
    if config.tied_head and pp > 1 and r in (0, pp - 1):
        tied = mesh.pp.subgroup([0, pp - 1], name="embedding")
    # the stage's whole gradient, summed over the data group (dp, or dp x cp), or its
    # ZeRO-1 chunks; with clipping, the norm's pieces over tp and the stages
    clipped = {} if layout.clip is None else dict(
        tp=mesh.tp, tp_mask=tensor_parallel_mask(stage), pp=mesh.pp,
        counted=counted_mask(stage))                                       # [P_local] each
    shard = (ZeRO1 if layout.zero == 1 else Replicated)(mesh.data, **clipped)
    opt = adamw(stage.params, shard, hyper, clip=layout.clip)
    return Run(mesh, stage, opt, shard, layout,
               pipeline=dict(schedule=plan, tied=tied, holds_last=holds_last))


def _micro_batches(run, ids, targets, batch: int):
    """This replica's rows of the global batch ids, targets [B, S] (host), as the m
    micro-batches [m, B_m, S] each (B_m = B / (N_D m)), and their rows of the batch."""
    mesh, m = run.mesh, run.layout.micro_batches
    rows = batch // mesh.dp_size
    b0, micro, seq = mesh.dp_rank * rows, rows // m, ids.shape[1]
    mb_ids = ids[b0:b0 + rows].reshape(m, micro, seq)                       # [m, B_m, S]
    mb_targets = targets[b0:b0 + rows].reshape(m, micro, seq)
    return mb_ids, mb_targets, [(b0 + i * micro, b0 + (i + 1) * micro, batch)
                                for i in range(m)]


def _count_total(run, mb_targets) -> float:
    """T_c of the global batch on a rank of the last stage (this replica's counted targets,
    summed over dp; at least 1); 1.0 elsewhere (no other stage reads it)."""
    if not run.pipeline["holds_last"]:
        return 1.0
    mesh = run.mesh
    local = np.array([float(np.sum(mb_targets != IGNORE_INDEX))])
    total = mesh.dp.all_reduce(backend.asarray(local)) if mesh.dp_size > 1 else local
    return max(float(backend.to_numpy(total)[0]), 1.0)


def pipeline_step(run, ids, targets, batch: int, dropout=None):
    """One update of a pipeline run (build_stage) on the global batch ids, targets [B, S]
    (host; every rank holds it): this replica's rows as m micro-batches through the
    schedule (run_pipeline_step), the tied wte's two gradients summed, the optimizer's step
    (the gradient summed over the data group, clipped by the global norm when the layout
    clips). dropout: None, or a function giving the forward's dropout settings,
    dict(training=True, rng=...) with a fresh generator of the step's seed (as
    runner.train_step's): each chunk's forward draws one device's masks from it.
    -> (this rank's share of the step's loss: on a rank of the last stage its replica's
    tokens' loss over the global T_c, None elsewhere (share_losses sums and sends it),
    the executor's dict with `sent`, the point-to-point bytes of its pipeline)."""
    stage, world = run.model, run.mesh.world
    stage.params.zero_grad()
    mb_ids, mb_targets, rows = _micro_batches(run, ids, targets, batch)
    count = _count_total(run, mb_targets)
    draws = None
    if dropout is not None and stage.config.dropout > 0:
        draws = (lambda: dropout()["rng"], rows)      # each chunk draws from the seed afresh
    before = world.traffic.sent
    out = run_pipeline_step(stage, run.mesh.pp, run.pipeline["schedule"], mb_ids,
                            mb_targets, count, draws)
    out["sent"] = world.traffic.sent - before
    tied = run.pipeline["tied"]
    if tied is not None:
        g = stage.params.grad_of("wte")
        g[...] = xp_reshape(tied.all_reduce(xp_reshape(g, (-1,))), g.shape)
    run.optimizer.step()
    return out["loss"], out


def share_losses(run, losses) -> list[float]:
    """Every rank's copy of a pipeline run's step losses (pipeline_step's shares, [n]): the
    last stage's shares summed over dp (each replica's is its tokens' loss over the global
    T_c), then broadcast down the pipeline from the last stage (other ranks pass None)."""
    mesh, n = run.mesh, len(losses)
    holds_last = run.pipeline["holds_last"]
    mine = backend.xp().asarray(np.array(losses if holds_last else [0.0] * n,
                                         dtype=np.float64))
    if holds_last and mesh.dp_size > 1:
        mine = mesh.dp.all_reduce(mine)
    if mesh.pp_size > 1:
        mine = mesh.pp.broadcast(mine, root=mesh.pp_size - 1)
    return [float(x) for x in backend.to_numpy(mine)]


def pipeline_loss(run, ids, targets, batch: int) -> float:
    """The loss of the global batch ids, targets [B, S] (host) under a pipeline run, for
    evaluation: the forward-only schedule (every micro-batch through the stages in order,
    no dropout, no cache kept, no gradient), the shares summed as in training. Every rank
    gets it; no rank needs the whole model."""
    p, m, v = run.mesh.pp_size, run.layout.micro_batches, run.layout.virtual
    mb_ids, mb_targets, _ = _micro_batches(run, ids, targets, batch)
    count = _count_total(run, mb_targets)
    out = run_pipeline_step(run.model, run.mesh.pp, forward_schedule(p, m, v), mb_ids,
                            mb_targets, count, forward_only=True)
    return share_losses(run, [out["loss"]])[0]


def counted_mask(stage: PipelineStage):
    """bool [P_local]: the elements of this rank's buffer that the global gradient norm
    counts: all but the last stage's copy of a tied wte (the first stage counts it; after
    the all-reduce of the two copies' gradients they are equal)."""
    params = stage.params
    mask = np.ones(params.size, dtype=bool)
    if stage.config.tied_head and stage.n_stages > 1 and stage.stage == stage.n_stages - 1:
        a, b = params.offsets["wte"]
        mask[a:b] = False
    return backend.asarray(mask)


def xp_reshape(x, shape):
    return backend.namespace(x).reshape(x, shape)


def gather_full(stage: PipelineStage, mesh: Mesh, config: DecoderConfig, which: str):
    """The single-device flat buffer (host) of the parameters (which='data') or their
    gradients ('grad') on every rank: gather_stages."""
    return gather_stages(stage, mesh, stage.params.__getitem__ if which == "data"
                         else stage.params.grad_of)


def gather_stages(stage: PipelineStage, mesh: Mesh, get):
    """One device's flat buffer [P] (host, config.param_shapes() order) on every rank, from
    get(name) -> this rank's block of tensor `name` (a stage's own tensors): each stage's
    tensors are unsharded over tp, then the stages' tensors collected over pp (objects, not
    counted). A tied wte is taken from the first stage (the last one's copy is equal)."""
    from .model import unshard_tensor

    config = stage.config
    mine = {}
    for name in stage.params.names:
        local = np.array(backend.to_numpy(get(name)))
        if shard_rule(name) == "replicated":
            mine[name] = local
        else:
            pieces = mesh.tp.all_gather_object(local)
            mine[name] = np.asarray(unshard_tensor(name, pieces, config))
    merged = {}
    for part in (mesh.pp.all_gather_object(mine) if mesh.pp is not None else [mine]):
        for name, value in part.items():
            merged.setdefault(name, value)          # wte: the first stage's copy
    return np.concatenate([merged[n].reshape(-1) for n in config.param_shapes()])
