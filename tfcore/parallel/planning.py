"""What a parallel layout costs, before running it: memory per rank, bytes per step, bubble.

    p = plan(config, dp=4, tp=2, zero=3, batch=32, seq=128)
    p.memory          {'params', 'grads', 'optimizer', 'gathered', 'activations', 'total'}:
                      bytes on the fullest rank at the step's peak
    p.memory_per_rank the same for every world rank w = (d * pp + s) * tp + t (mesh.py;
                      the context rank r with cp > 1)
    p.traffic         {'dp reduce_scatter': bytes, 'tp all_reduce': ...} that the busiest
                      rank sends in one step; p.sent the total per world rank
    p.bubble          the pipeline's idle fraction (p - 1) / (v m) (pipeline.bubble_fraction)
    p.peak_caches     with pp > 1: the most chunk caches each world rank holds at once

A pure function of the config and the layout: nothing is allocated, nothing runs. Every
number comes from the closed forms of volume.py (bytes per collective with the exact
chunking, memory per ZeRO stage) and models/sizes.py (activations), which the tests compare
with the simulated runs: the counted bytes of every call and the ledger of every array a
rank holds (fsdp.py). The activations are one device's caches for the rows of one
data-parallel rank (sizes.py); the parallel model's caches keep a few bytes per token more
(the vocabulary masks and indices of its embedding and cross-entropy), not priced here.
Pipeline parallelism (pp > 1, tp = 1, zero = 0): rank w = (d pp + s) tp + t holds the
parameters of its stage s (pipeline.stage_param_names: its blocks, the embedding on the first
stage, the final norm and head on the last, and with a tied head a second copy of wte there),
their gradients and AdamW's m, v; it sends pipeline_bytes_sent point-to-point, all-reduces its
stage's gradients over dp, the last stage the token count T_c over dp, and the first and last
stage the tied wte's gradient between them. p.peak_caches[w] is the most chunk caches (one
micro-batch through one chunk) that rank holds at once (peak_stored_microbatches); their bytes
are not priced (activations None): the parallel blocks keep more than sizes.py's one-device
caches, and that difference has no closed form here yet.

Context parallelism (cp = N_C > 1 alone: dp = tp = pp = 1): every rank holds the whole
model (replicated AdamW) and S / N_C positions of each sequence; per step it sends, in each
of the L layers, ring_attention_bytes (the K, V blocks forward; K, V and the dK, dV partials
backward), then all-reduces the loss and the token count (2 elements) and the gradients
(P elements) over the context group.

A layout that Layout.validate refuses (layout.REFUSALS: the one list of the combinations
that do not train, shared with the command line and the builders) raises its ValueError,
before any work; plan(config, layout=Layout(...), batch=, seq=) takes the layout as a value.
Layouts that train but that it cannot price give None rather than a guess, and why:
  activations with tp > 1 or pp > 1     the parallel model's caches have no closed form yet
  pp > 1 with tp > 1                    it runs (train_pipeline, simulated and under MPI),
                                        but the bytes of the tp collectives inside a stage
                                        have no closed form here yet
  microbatches > 1 without pp           accumulation runs (train_parallel), but these closed
                                        forms price one pass of the batch per step: the
                                        collectives of each micro-batch are not priced yet
  activations with cp > 1               the ring's caches have no closed form here yet
  a ring with pp or accumulation, and     they run (train_layout), but their closed forms
  pp with ZeRO-1, sp or shared key/value  are not written here yet: memory and bytes None
  heads (n_kv_heads < tp), and gradient
  buckets (their chunks)
A ring composed with dp, tp, sp or ZeRO, recomputation and key/value heads shared across
tensor-parallel ranks are priced: volume.step_traffic adds the ring's bytes per layer, the
recomputed forward's collectives and the shared heads' gradient sums.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..models.sizes import decoder_sizes
from .context import ContextLayout, ring_attention_bytes
from .layout import Layout
from .model import check_layout
from .pipeline import (
    SCHEDULES,
    bubble_fraction,
    make_schedule,
    peak_stored_microbatches,
    pipeline_bytes_sent,
    stage_param_names,
)
from .volume import collective_bytes, local_parameters, step_traffic, zero_memory

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
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
        return out


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def plan(config, layout: Layout | None = None, *, dp: int = 1, tp: int = 1, pp: int = 1,
         cp: int = 1, zero: int = 0, batch: int, seq: int, microbatches: int = 1,
         virtual: int = 1, dtype: str = "float64", algorithm: str = "ring",
         schedule: str | None = None, balanced: bool = True, sp: bool = False) -> Plan:
    """Memory per rank, bytes per rank per step and the bubble of training `config` on a
    dp x tp (x pp) mesh with ZeRO stage `zero`, global batch [batch, seq]; with pp > 1 the
    pipeline runs `schedule` ('gpipe', '1f1b', 'interleaved'; default 1f1b, interleaved when
    virtual > 1) over m = microbatches micro-batches of batch / (dp m) rows; with cp > 1 the
    sequence is split over cp ranks (balanced: two mirrored chunks each); sp: sequence
    parallelism inside tensor parallelism. `layout`: a
    Layout in place of those keywords (pp and cp None are 1). Raises ValueError for a
    layout that cannot run (Layout.validate's refusals first), before any work."""
    layout_buckets = None
    if layout is not None:
        if not isinstance(layout, Layout):
            raise ValueError(f"layout must be a Layout, got {type(layout).__name__}")
        given = dict(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, microbatches=microbatches,
                     virtual=virtual, algorithm=algorithm, schedule=schedule,
                     balanced=balanced, sp=sp)
        defaults = dict(dp=1, tp=1, pp=1, cp=1, zero=0, microbatches=1, virtual=1,
                        algorithm="ring", schedule=None, balanced=True, sp=False)
        both = [k for k in given if given[k] != defaults[k]]
        if both:
            raise ValueError(f"give the layout or {both[0]}=, not both")
        layout.validate(config)
        dp, tp, pp, cp, zero = layout.dp, layout.tp, layout.pp or 1, layout.cp or 1, layout.zero
        microbatches, virtual, schedule = layout.micro_batches, layout.virtual, layout.schedule
        algorithm, balanced, sp = layout.algorithm, layout.balanced, layout.sp
        layout_buckets = layout.bucket_bytes
    for name, value in dict(dp=dp, tp=tp, pp=pp, cp=cp, batch=batch, seq=seq,
                            microbatches=microbatches, virtual=virtual).items():
        _positive_int(name, value)
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {tuple(ITEMSIZE)}, got {dtype!r}")
    if algorithm not in ("ring", "naive"):
        raise ValueError(f"algorithm must be 'ring' or 'naive', got {algorithm!r}")
    if not isinstance(balanced, bool):
        raise ValueError(f"balanced must be True or False, got {balanced!r}")
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not isinstance(sp, bool):
        raise ValueError(f"sp must be True or False, got {sp!r}")
    Layout(dp=dp, tp=tp, pp=pp if pp > 1 else None, cp=cp if cp > 1 else None, zero=zero,
           micro_batches=microbatches, virtual=virtual, schedule=schedule,
           balanced=balanced, sp=sp).validate(config)   # the combinations that do not train
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
    bubble = float(bubble_fraction(pp, microbatches, virtual))
    f = ITEMSIZE[dtype]
    if sp:
        layout["sp"] = True
    if layout_buckets is not None:          # the buckets' chunks: not priced here yet
        layout["bucket_bytes"] = layout_buckets
        return Plan(layout, None, None, None, None, None, bubble)
    if cp > 1 and (pp > 1 or microbatches > 1):
        layout["balanced"] = balanced             # not priced here yet
        return Plan(layout, None, None, None, None, None, bubble)
    if pp > 1 and (zero or sp or config.n_kv_heads < tp):
        return Plan(layout, None, None, None, None, None, bubble)
    if cp > 1 and (dp, tp, zero, sp, config.recompute) != (1, 1, 0, False, "none"):
        layout["balanced"] = balanced
        return _composed_context_plan(config, layout, dp, tp, cp, zero, sp, balanced, batch,
                                      seq, f, algorithm, bubble)
    if cp > 1:
        layout["balanced"] = balanced
        return _context_plan(config, layout, cp, balanced, batch, seq, f, algorithm, bubble)
    if pp > 1:
        peak = [peak_stored_microbatches(schedule, pp, s, microbatches, virtual)
                for d in range(dp) for s in range(pp) for t in range(tp)]
        if tp > 1:
            return Plan(layout, None, None, None, None, None, bubble, peak)
        return _pipeline_plan(config, layout, dp, pp, virtual, microbatches, batch, seq, f,
                              algorithm, bubble, peak)
    if microbatches > 1:
        return Plan(layout, None, None, None, None, None, bubble)
    activations = None
    if tp == 1 and dtype in ("float32", "float64"):   # the dtypes DecoderLM runs in
        activations = decoder_sizes(replace(config, dtype=dtype), batch // dp,
                                    seq)["activation_bytes"]
    memory_per_rank = []
    traffic_per_rank = step_traffic(config, batch // dp, seq, tp, dp, sp, zero, algorithm,
                                    f)
    for d in range(dp):
        for t in range(tp):
            m = zero_memory(config, tp, t, dp, d, zero, f)
            m["activations"] = activations
            m["total"] = m["params"] + m["grads"] + m["optimizer"] + (activations or 0)
            memory_per_rank.append(m)
    sent = [sum(r.values()) for r in traffic_per_rank]
    fullest = max(range(len(memory_per_rank)), key=lambda w: memory_per_rank[w]["total"])
    busiest = max(range(len(sent)), key=lambda w: sent[w])
    traffic = {f"{g} {op}": b for (g, op), b in sorted(traffic_per_rank[busiest].items())
               if b}                                  # a group of one rank moves nothing
    return Plan(layout, memory_per_rank[fullest], memory_per_rank,
                traffic, [{f"{g} {op}": b for (g, op), b in r.items()}
                          for r in traffic_per_rank], sent, bubble)


def _pipeline_plan(config, layout, dp, pp, virtual, microbatches, batch, seq, f, algorithm,
                   bubble, peak) -> Plan:
    """pp > 1, tp = 1, zero = 0: rank w = d pp + s. Per step, stage s of replica d:
        pp  send        pipeline_bytes_sent(p, s, m, v, B_m S, D, f)
        dp  all_reduce  P_s (its stage's gradients), and 1 element (T_c) on the last stage
        embedding all_reduce  V D (the tied wte's gradient), first and last stage only
    memory: params P_s f, grads P_s f, optimizer 2 P_s f (replicated AdamW)."""
    import math

    shapes = config.param_shapes()
    micro_tokens = batch // (dp * microbatches) * seq               # B_m S
    memory_per_rank, traffic_per_rank = [], []
    for d in range(dp):
        for s in range(pp):
            names = stage_param_names(config, pp, s, virtual)
            P = sum(math.prod(shapes[n]) for n in names)            # P_s
            memory_per_rank.append(dict(params=P * f, grads=P * f, optimizer=2 * P * f,
                                        gathered=0, activations=None, total=4 * P * f))
            by_op = {"pp send": pipeline_bytes_sent(pp, s, microbatches, virtual,
                                                    micro_tokens, config.d_model, f)}
            holds_last = any(c * pp + s == pp * virtual - 1 for c in range(virtual))
            if dp > 1:
                by_op["dp all_reduce"] = collective_bytes("all_reduce", algorithm, P, dp,
                                                          f)["sent"][d]
                if holds_last:
                    by_op["dp all_reduce"] += collective_bytes("all_reduce", algorithm, 1,
                                                               dp, f)["sent"][d]
            if config.tied_head and s in (0, pp - 1):
                M = math.prod(shapes["wte"])
                by_op["embedding all_reduce"] = collective_bytes(
                    "all_reduce", algorithm, M, 2, f)["sent"][0 if s == 0 else 1]
            traffic_per_rank.append(by_op)
    sent = [sum(r.values()) for r in traffic_per_rank]
    fullest = max(range(len(memory_per_rank)), key=lambda w: memory_per_rank[w]["total"])
    busiest = max(range(len(sent)), key=lambda w: sent[w])
    traffic = {k: b for k, b in sorted(traffic_per_rank[busiest].items()) if b}
    return Plan(layout, memory_per_rank[fullest], memory_per_rank, traffic,
                traffic_per_rank, sent, bubble, peak)


def _composed_context_plan(config, layout, dp, tp, cp, zero, sp, balanced, batch, seq, f,
                           algorithm, bubble) -> Plan:
    """A ring with dp, tp, ZeRO or SP: volume.step_traffic's bytes per world rank
    w = (d cp + c) tp + t, and each rank's parameters, gradients and optimizer state from
    zero_memory over the data group (dp x cp); activations are not priced (None)."""
    traffic_per_rank = step_traffic(config, batch // dp, seq, tp, dp, sp, zero, algorithm, f,
                                    cp=cp, balanced=balanced)
    memory_per_rank = []
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                m = zero_memory(config, tp, t, dp * cp, d * cp + c, zero, f)
                m["activations"] = None
                m["total"] = m["params"] + m["grads"] + m["optimizer"]
                memory_per_rank.append(m)
    sent = [sum(r.values()) for r in traffic_per_rank]
    fullest = max(range(len(memory_per_rank)), key=lambda w: memory_per_rank[w]["total"])
    busiest = max(range(len(sent)), key=lambda w: sent[w])
    traffic = {f"{g} {op}": b for (g, op), b in sorted(traffic_per_rank[busiest].items())}
    return Plan(layout, memory_per_rank[fullest], memory_per_rank, traffic,
                traffic_per_rank, sent, bubble)


def _context_plan(config, layout, cp, balanced, batch, seq, f, algorithm, bubble) -> Plan:
    """cp > 1 alone: rank r sends L (forward_r + backward_r) of ring_attention_bytes, then
    all-reduces 2 elements (the loss and T_c) and P (the gradients) over the context group.
    memory: params P f, grads P f, optimizer 2 P f (every rank holds the whole model)."""
    P = local_parameters(config, 1, 0)
    ring = ring_attention_bytes(ContextLayout(seq, cp, balanced), batch, config.n_kv_heads,
                                config.head_dim, itemsize=f)
    memory_per_rank, traffic_per_rank = [], []
    for r in range(cp):
        memory_per_rank.append(dict(params=P * f, grads=P * f, optimizer=2 * P * f,
                                    gathered=0, activations=None, total=4 * P * f))
        traffic_per_rank.append({
            "cp ring": config.n_layers * (ring["forward"][r] + ring["backward"][r]),
            "cp all_reduce": sum(collective_bytes("all_reduce", algorithm, M, cp,
                                                  f)["sent"][r] for M in (2, P))})
    sent = [sum(r.values()) for r in traffic_per_rank]
    busiest = max(range(cp), key=lambda w: sent[w])
    return Plan(layout, memory_per_rank[0], memory_per_rank,
                dict(sorted(traffic_per_rank[busiest].items())), traffic_per_rank, sent,
                bubble)
