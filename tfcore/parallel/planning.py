"""What a parallel layout costs, before running it: memory per rank, bytes per step, bubble.

    p = plan(config, dp=4, tp=2, zero=3, batch=32, seq=128)
    p.memory          {'params', 'grads', 'optimizer', 'gathered', 'activations', 'total'}:
                      bytes on the fullest rank at the step's peak
    p.memory_per_rank the same for every world rank w (below)
    p.traffic         {'dp reduce_scatter': bytes, 'tp all_reduce': ...} that the busiest
                      rank sends in one step; p.sent the total per world rank
    p.bubble          the pipeline's idle fraction (p - 1) / (v m) (pipeline.bubble_fraction)
    p.peak_caches     with pp > 1: the most chunk caches each world rank holds at once

A pure function of the config and the layout: nothing is allocated, nothing runs. Every
number comes from the closed forms of volume.py (bytes per collective with the exact
chunking, memory per ZeRO stage) and models/sizes.py (activations), which the tests compare
with the simulated runs: the counted bytes of every call and message
(test_layout_matrix.py: every layout it trains) and the ledger of every array a rank holds
(fsdp.py). World rank w = ((d N_P + s) N_C + c) N_T + t (mesh.py).

Bytes (volume.layout_traffic), for every layout that trains: per micro-batch and per chunk
of layers a rank holds, the tensor-parallel calls of the span (span_collectives, with
recomputation's second forward), the ring's key/value blocks, the sums of replicated and
shared key/value gradients over tp; the pipeline's point-to-point activations and
gradients; the loss and token counts; the gradient over the data group by ZeRO stage (or
in buckets), and clipping's norm. Memory: the parameters, gradients and AdamW state of
the rank's tensors (a pipeline stage's: pipeline.stage_param_names, with a tied head a
second copy of wte on the last stage; ZeRO-1 chunks AdamW's state over the data group), and
p.peak_caches[w] the most chunk caches (one micro-batch through one chunk) a pipeline rank
holds at once (peak_stored_microbatches).

The activations are the bytes a rank's caches keep at the step's peak, for one
micro-batch: one device's (DecoderLM, sizes.decoder_sizes) alone; a rank of the parallel
decoder volume.rank_activation_bytes (its heads and columns under tensor parallelism, its
rows under sequence parallelism, its positions on a ring, the vocab-parallel embedding's
and cross-entropy's masks and indices); a pipeline rank the most chunk caches its schedule
keeps at once (walking its operations). Tests compare each with the caches as held
(test_layout_matrix.py). They are None rather than a guess under mixed precision (tfcore's
autocast keeps float32 arrays where a GPU keeps bfloat16 ones) and with Ulysses (whose
caches, of the heads layout, no formula here counts yet); Ulysses's bytes are priced.

A mixture of experts (config.n_experts > 0) is priced by name: each rank holds N_E / ep of
the experts of every MoE block (layout.ep), and a step adds, per MoE layer, the loads'
all-gather over dp, dispatch and combine as all-to-alls over the rank's block of ep ranks
(and their adjoints in the backward), the auxiliary losses' value over dp, and the
experts' gradient summed over the ranks that hold them (volume.expert_layer_traffic). The
all-to-alls depend on where the router sends the tokens: expert_loads (one [dp, N_E]
matrix of each rank's assignments per MoE layer, as moe_stats' load_by_rank reports them)
gives a step's own, and without it plan assumes an even routing (volume.even_expert_loads).
Its activations and step time are not priced (None, and a cluster is refused).

A layout that Layout.validate refuses (layout.REFUSALS: the one list of the combinations
that do not train, shared with the command line and the builders) raises its ValueError,
before any work; plan(config, layout=Layout(...), batch=, seq=) takes the layout as a value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..models.sizes import decoder_sizes, step_flops
from .comm import chunk_bounds
from .context import ContextLayout
from .layout import Layout
from .model import check_layout
from .pipeline import (
    SCHEDULES,
    bubble_fraction,
    make_schedule,
    peak_stored_microbatches,
    stage_layers,
    stage_param_names,
)
from .volume import layout_traffic, local_shape, rank_activation_bytes, zero_memory

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
# bytes per element of each kind of state under mixed precision: low-precision weights and
# gradients, float32 master weights with AdamW's m and v (4 + 4 + 4) on the optimizer side
MIXED = dict(params=2, grads=2, gathered=2, optimizer=12)
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Plan:
    layout: dict
    memory: dict | None
    memory_per_rank: list | None
    traffic: dict | None
    traffic_per_rank: list | None
    sent: list | None
    bubble: float
    peak_caches: list | None = None
    time: dict | None = None

    def rows(self) -> list[tuple[str, str]]:
        """(quantity, value) rows for a small table: MiB for memory, KiB for traffic."""
        out = [("layout", " ".join(f"{k}={v}" for k, v in self.layout.items()))]
        if self.memory is not None:
            for key, value in self.memory.items():
                text = "n/a" if value is None else f"{value / 2**20:.3f} MiB"
                out.append((f"memory {key}", text))
        if self.traffic is not None:
            for key, value in self.traffic.items():
                out.append((f"sent {key}", f"{value / 2**10:.1f} KiB"))
        if self.peak_caches is not None:
            out.append(("peak caches", " ".join(map(str, self.peak_caches))))
        out.append(("bubble", f"{self.bubble:.3f}"))
        if self.time is not None:
            for key in ("compute", "communication", "bubble", "total"):
                out.append((f"time {key}", f"{self.time[key] * 1e3:.3f} ms"))
            out.append(("time dominated by", self.time["dominant"]))
        return out


@dataclass(frozen=True)
class Cluster:
    """A stated machine for the step time: every rank alike.
    flops           FLOP/s one rank sustains on the step's matmuls (chapter 11's roofline:
                    a training step's products sit at the compute roof, so the FLOPs set it)
    bandwidth       bytes/s one rank sends over its link between machines (beta)
    latency         seconds per round of messages (alpha)
    node_size       ranks per machine: a group whose ranks lie in one machine (mesh.py puts
                    tp innermost, then cp, then pp, then dp) talks at node_bandwidth
    node_bandwidth  bytes/s one rank sends inside a machine (None: bandwidth)"""
    flops: float
    bandwidth: float
    latency: float = 0.0
    node_size: int = 1
    node_bandwidth: float | None = None

    def __post_init__(self):
        for name in ("flops", "bandwidth", "latency", "node_bandwidth"):
            value = getattr(self, name)
            if name == "node_bandwidth" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and (value > 0 or name == "latency" and value == 0)):
                raise ValueError(f"Cluster.{name} must be a finite number > 0"
                                 f"{' (or 0)' if name == 'latency' else ''}, got {value!r}")
        _positive_int("Cluster.node_size", self.node_size)

    def seconds(self, traffic: dict, rounds: int, spans: dict) -> float:
        """alpha-beta time of one rank's step traffic {'<group> <op>': bytes}: each group's
        bytes at the bandwidth of where its ranks lie (spans: group -> consecutive world
        ranks it spans), plus latency x rounds."""
        inside = self.node_bandwidth or self.bandwidth
        return sum(b / (inside if spans[key.rsplit(" ", 1)[0]] <= self.node_size
                        else self.bandwidth) for key, b in traffic.items()
                   ) + self.latency * rounds


def step_time(config, batch: int, seq: int, world: int, communication: float,
              bubble: float, cluster: Cluster) -> dict:
    """Seconds of one step on `cluster`, term by term, without overlap (an upper bound: the
    overlap chapter hides part of the communication behind the backward):
      compute        sizes.step_flops(config, B, S) / N / flops   (the work spread evenly
                     over the N ranks)
      communication  the slowest rank's Cluster.seconds (alpha-beta, group by group)
      bubble         compute x (p - 1) / (v m)   (the pipeline's idle time)
      total          their sum;  dominant: the largest term's name."""
    compute = step_flops(config, batch, seq) / world / cluster.flops
    terms = dict(compute=compute, communication=communication, bubble=compute * bubble)
    return dict(terms, total=sum(terms.values()), dominant=max(terms, key=terms.get))


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def plan(config, layout: Layout | None = None, *, dp: int = 1, tp: int = 1, pp: int = 1,
         cp: int = 1, zero: int = 0, batch: int, seq: int, microbatches: int = 1,
         virtual: int = 1, dtype: str = "float64", algorithm: str = "ring",
         schedule: str | None = None, balanced: bool = True, sp: bool = False,
         clip: bool = False, cluster: Cluster | None = None,
         mixed_precision: str | None = None, expert_loads=None) -> Plan:
    """Memory per rank, bytes per rank per step and the bubble of training `config` on a
    dp x tp (x pp) mesh with ZeRO stage `zero`, global batch [batch, seq]; with pp > 1 the
    pipeline runs `schedule` ('gpipe', '1f1b', 'interleaved'; default 1f1b, interleaved when
    virtual > 1) over m = microbatches micro-batches of batch / (dp m) rows; with cp > 1 the
    sequence is split over cp ranks (balanced: two mirrored chunks each); without pp,
    microbatches > 1 accumulates the gradient; sp: sequence parallelism inside tensor
    parallelism; clip: clipping by the global norm. `layout`: a Layout in place of those
    keywords (pp and cp None are 1; its bucket_bytes prices the buckets' all-reduces).
    mixed_precision 'bf16' or 'fp16': the state a GPU run holds, 2 + 2 + 12 bytes per
    parameter (low-precision weights and gradients, float32 master weights and AdamW's m,
    v: ZeRO-1 shards the 12, ZeRO-2 the gradients too, ZeRO-3 all 16), and 2-byte
    activations and messages (dtype is then ignored; tfcore's own mixed precision keeps
    float32 arrays holding low-precision values, chapter 18).
    cluster: a Cluster, for p.time (step_time: compute, communication, bubble, total,
    dominant). expert_loads: an MoE's routing (see the module docstring). Raises
    ValueError for a layout that cannot run (Layout.validate's refusals first),
    before any work."""
    layout_buckets, ulysses, ep = None, False, 1
    if layout is not None:
        if not isinstance(layout, Layout):
            raise ValueError(f"layout must be a Layout, got {type(layout).__name__}")
        given = dict(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, microbatches=microbatches,
                     virtual=virtual, algorithm=algorithm, schedule=schedule,
                     balanced=balanced, sp=sp, clip=clip)
        defaults = dict(dp=1, tp=1, pp=1, cp=1, zero=0, microbatches=1, virtual=1,
                        algorithm="ring", schedule=None, balanced=True, sp=False,
                        clip=False)
        both = [k for k in given if given[k] != defaults[k]]
        if both:
            raise ValueError(f"give the layout or {both[0]}=, not both")
        layout.validate(config)
        dp, tp, pp, cp, zero = layout.dp, layout.tp, layout.pp or 1, layout.cp or 1, layout.zero
        microbatches, virtual, schedule = layout.micro_batches, layout.virtual, layout.schedule
        algorithm, balanced, sp = layout.algorithm, layout.balanced, layout.sp
        ulysses, ep = layout.ulysses, layout.ep
        clip = layout.clip is not None
        layout_buckets = layout.bucket_bytes
    for name, value in dict(dp=dp, tp=tp, pp=pp, cp=cp, batch=batch, seq=seq,
                            microbatches=microbatches, virtual=virtual).items():
        _positive_int(name, value)
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    if cluster is not None and not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    if mixed_precision not in (None, "bf16", "fp16"):
        raise ValueError(f"mixed_precision must be None, 'bf16' or 'fp16', got "
                         f"{mixed_precision!r}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {tuple(ITEMSIZE)}, got {dtype!r}")
    if algorithm not in ("ring", "naive"):
        raise ValueError(f"algorithm must be 'ring' or 'naive', got {algorithm!r}")
    if not isinstance(balanced, bool):
        raise ValueError(f"balanced must be True or False, got {balanced!r}")
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, value in (("sp", sp), ("clip", clip)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    Layout(dp=dp, tp=tp, pp=pp if pp > 1 else None, cp=cp if cp > 1 else None, zero=zero,
           micro_batches=microbatches, virtual=virtual, schedule=schedule,
           balanced=balanced, sp=sp).validate(config)   # the combinations that do not train
    if config.n_experts and cluster is not None:
        raise ValueError("a step time prices dense decoders (sizes.step_flops); give an MoE "
                         "config without cluster")
    if seq > config.max_seq_len:
        raise ValueError(f"seq ({seq}) exceeds the config's max_seq_len "
                         f"({config.max_seq_len})")
    if batch % dp:
        raise ValueError(f"batch ({batch}) must be divisible by dp ({dp}): each "
                         "data-parallel rank takes batch / dp rows")
    if (batch // dp) % microbatches:
        raise ValueError(f"the rows per data-parallel rank ({batch // dp}) must be divisible "
                         f"by microbatches ({microbatches})")
    if config.n_layers % (pp * virtual):
        raise ValueError(f"n_layers ({config.n_layers}) must be divisible by pp x virtual "
                         f"({pp} x {virtual}): every stage holds whole blocks")
    if cp > 1:
        ContextLayout(seq, cp, balanced)          # its own checks: a position per chunk
    if schedule is None:
        schedule = "interleaved" if virtual > 1 else "1f1b"
    if pp > 1:
        make_schedule(schedule, pp, microbatches, virtual)    # its own checks (p | m, v)
    if cp == 1:
        check_layout(config, tp)                  # heads, d_ff, d_model, V split tp ways
    layout = dict(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, batch=batch, seq=seq,
                  microbatches=microbatches, virtual=virtual, dtype=dtype)
    if pp > 1:
        layout["schedule"] = schedule
    if cp > 1:
        layout["balanced"] = balanced and not ulysses
    if ulysses:
        layout["ulysses"] = True
    if ep > 1:
        layout["ep"] = ep
    if sp:
        layout["sp"] = True
    if clip:
        layout["clip"] = True
    if mixed_precision:
        layout["mixed_precision"] = mixed_precision
    bubble = float(bubble_fraction(pp, microbatches, virtual))
    peak = None
    if pp > 1:
        peak = [peak_stored_microbatches(schedule, pp, s, microbatches, virtual)
                for d in range(dp) for s in range(pp) for c in range(cp) for t in range(tp)]
    if layout_buckets is not None:
        layout["bucket_bytes"] = layout_buckets
    f = 2 if mixed_precision else ITEMSIZE[dtype]
    rounds: list = []
    traffic_per_rank = layout_traffic(
        config, batch=batch, seq=seq, dp=dp, tp=tp, pp=pp, cp=cp if cp > 1 else None,
        zero=zero, sp=sp, micro_batches=microbatches, virtual=virtual, balanced=balanced,
        clip=clip, bucket_bytes=layout_buckets, algorithm=algorithm, itemsize=f,
        rounds=rounds, ulysses=ulysses, ep=ep, expert_loads=expert_loads)
    model = replace(config, dtype=dtype)
    priced = (not mixed_precision and dtype in ("float32", "float64") and not ulysses
              and not config.n_experts)
    ring = ContextLayout(seq, cp, balanced and not ulysses) if cp > 1 else None
    micro = batch // (dp * microbatches)                         # rows of a micro-batch
    memory_per_rank = [_held(config, tp, t, pp, s, virtual, dp * cp, d * cp + c, zero, ep,
                             MIXED if mixed_precision else dict(
                                 params=f, grads=f, gathered=f, optimizer=2 * f),
                             _activations(model, micro, seq, tp, t, sp, pp, s, virtual,
                                          microbatches, schedule, ring, c,
                                          dp * tp * pp * cp == 1)
                             if priced else None)
                       for d in range(dp) for s in range(pp) for c in range(cp)
                       for t in range(tp)]
    traffic_per_rank = [{f"{g} {op}": b for (g, op), b in sorted(r.items()) if b}
                        for r in traffic_per_rank]        # a group of one rank moves nothing
    sent = [sum(r.values()) for r in traffic_per_rank]
    fullest = max(range(len(memory_per_rank)), key=lambda w: memory_per_rank[w]["total"])
    busiest = max(range(len(sent)), key=lambda w: sent[w])
    time = None
    if cluster is not None:      # the consecutive world ranks each group spans (mesh.py)
        spans = {"tp": tp, "kv": tp, "cp": tp * cp, "pp": tp * cp * pp,
                 "embedding": tp * cp * pp, "dp": len(sent), "dp x cp": len(sent)}
        if dp == 1 and cp > 1:
            spans["cp"] = tp * cp                     # the ring is then the data group too
        slowest = max(cluster.seconds(r, n, spans)
                      for r, n in zip(traffic_per_rank, rounds))
        time = step_time(config, batch, seq, len(sent), slowest, bubble, cluster)
    return Plan(layout, memory_per_rank[fullest], memory_per_rank,
                traffic_per_rank[busiest], traffic_per_rank, sent, bubble, peak, time)


def _activations(config, rows, seq, tp, t, sp, pp, s, virtual, microbatches, schedule,
                 ring, c, one_device) -> int:
    """Bytes of the caches rank (s, c, t) holds at its peak: one device's (DecoderLM:
    sizes.decoder_sizes) alone; a rank of the parallel decoder volume.rank_activation_bytes
    for one micro-batch (on ring rank c of `ring`: its S_c positions and chunks); a pipeline
    stage the most its schedule keeps at once: walking its operations, each forward of a
    chunk adds that chunk's caches (its blocks, the embedding's on chunk 0, the head's and
    the loss's on the last) and its backward frees them."""
    if one_device:
        return decoder_sizes(config, rows, seq)["activation_bytes"]
    local = dict(ring_chunks=len(ring.chunks_of(c)) if ring is not None else 0)
    S_c = ring.local_len(c) if ring is not None else seq
    if pp == 1:
        return rank_activation_bytes(config, rows, S_c, tp, t, sp, **local)
    last = pp * virtual - 1
    chunk = {j: rank_activation_bytes(config, rows, S_c, tp, t, sp,
                                      len(stage_layers(config, pp, virtual, j * pp + s)),
                                      j * pp + s == 0, j * pp + s == last, **local)
             for j in range(virtual)}
    held = peak = 0
    for op, _, j in make_schedule(schedule, pp, microbatches, virtual)[s]:
        held += chunk[j] if op == "F" else -chunk[j]
        peak = max(peak, held)
    return peak


def _held(config, tp, t, pp, s, virtual, data, r, zero, ep, size, activations) -> dict:
    """Bytes rank (s, t), rank r of its data group, holds at the step's peak: zero_memory's
    parameters, gradients and AdamW state (its elements times size[kind], bytes per
    element), of the pipeline stage's tensors (ZeRO-1 at most with pp) or the whole
    model's; and the activations when priced."""
    if pp > 1:
        shapes = config.param_shapes()
        P = sum(math.prod(local_shape(n, shapes[n], config, tp, t))
                for n in stage_param_names(config, pp, s, virtual))        # P_s,t
        a, b = chunk_bounds(P, data)[r]
        m = dict(params=P, grads=P, optimizer=(P if zero == 0 else b - a), gathered=0)
    else:
        m = zero_memory(config, tp, t, data, r, zero, 1, ep)
        m["optimizer"] //= 2                          # the elements of the chunk, once
    m = {k: v * size[k] for k, v in m.items()}
    m["activations"] = activations
    m["total"] = m["params"] + m["grads"] + m["optimizer"] + (activations or 0)
    return m
