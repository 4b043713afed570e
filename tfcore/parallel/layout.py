"""One parallel layout, and the one list of the combinations the library does not train.

    layout = Layout(dp=2, tp=2, zero=1, sp=True)
    layout.validate(config, world=4, batch=8, seq=16)     # ValueError naming the refusal

A Layout is a value: the degrees of every parallelism (dp, tp; pp and cp are None when the
run has no pipeline or no ring, so that a pipeline or a ring of one rank is still that
decoder), the ZeRO stage, the expert-parallel degree (blocks of the dp ranks that share out an MoE
model's experts: it adds no ranks), sequence parallelism, micro-batches (with pp: the pipeline's;
without: gradient accumulation), virtual stages per pipeline rank, the schedule, the
balanced causal split of the ring, Ulysses (the cp group's attention by heads after
all-to-alls, on contiguous chunks, instead of the ring; balanced is then unused), gradient clipping, the overlapped gradient buckets, the
collective algorithm and the transport (simulated threads or MPI processes). Its fields are
checked one by one when it is made (type and range); `validate` then refuses, in one line
that names the combination and the reason, every combination listed in REFUSALS: the
command line, plan() and the builders (the decoders, the mesh's training functions) all
call it, and nothing else decides which combinations train. The README's list of refused
combinations and the command line's --help are generated from REFUSALS (a test checks
both).

Every rule is a Refusal(name, fields, when, why): `fields` are the Layout fields (or, for
dropout, n_kv_heads and recompute, the model config's fields) it reads, `when(layout,
config)` says whether it refuses, `why` the reason. The message of a refusal is
"NAME (field=value, ...): WHY".
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

SCHEDULES = ("gpipe", "1f1b", "interleaved")
ALGORITHMS = ("ring", "naive", "native")
TRANSPORTS = ("simulated", "mpi")
ZERO_STAGES = (0, 1, 2, 3)


class LayoutSizeError(ValueError):
    """A size Layout.validate refuses (a degree that does not divide another, a world, a
    batch or a sequence that does not fit); `field` names what does not fit: a Layout or
    config field, 'world', 'batch' or 'seq' (validate's arguments), or None."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class LayoutError(ValueError):
    """A combination Layout.validate refuses; `rule` is its Refusal, `layout` the layout."""

    def __init__(self, message: str, rule: "Refusal | None" = None,
                 layout: "Layout | None" = None):
        super().__init__(message)
        self.rule, self.layout = rule, layout


@dataclass(frozen=True)
class Refusal:
    name: str                           # the combination, e.g. "ZeRO with pipeline parallelism"
    fields: tuple                       # the Layout (or config) fields it reads
    when: Callable                      # (layout, config) -> bool: refused
    why: str                            # the reason, one clause

    def message(self, layout: "Layout", config) -> str:
        values = ", ".join(f"{f}={_value(layout, config, f)!r}" for f in self.fields)
        return f"{self.name} ({values}): {self.why}"


def _value(layout, config, field):
    if field in LAYOUT_FIELDS:
        return getattr(layout, field)
    return getattr(config, field)


def _ctx(l):                            # the ring decoder runs
    return l.cp is not None


def _pipe(l):                           # the pipeline runs
    return l.pp is not None


def _dropout(c):
    return c is not None and c.dropout > 0


def _moe(c):
    return c is not None and c.n_experts > 0


# The one support matrix: every combination refused, in the order validate tries them.
REFUSALS: list[Refusal] = [
    Refusal("pipeline schedule without pipeline parallelism", ("schedule", "pp"),
            lambda l, c: not _pipe(l) and l.schedule is not None,
            "the schedule orders a pipeline's micro-batches; give pp with it"),
    Refusal("virtual stages without pipeline parallelism", ("virtual", "pp"),
            lambda l, c: not _pipe(l) and l.virtual != 1,
            "virtual stages are chunks of a pipeline rank; give pp with them"),
    Refusal("Ulysses without context parallelism", ("ulysses", "cp"),
            lambda l, c: l.ulysses and not _ctx(l),
            "Ulysses is the cp group's attention; give cp with it"),
    Refusal("Ulysses attention with dropout", ("ulysses", "cp", "dropout"),
            lambda l, c: l.ulysses and _ctx(l) and _dropout(c),
            "the heads layout holds the whole sequence of H/N heads, not one device's "
            "[B, H, S, S] draw; use dropout 0 or the ring"),
    Refusal("context parallelism with dropout on dense attention", ("cp", "dropout",
                                                                    "attention"),
            lambda l, c: _ctx(l) and _dropout(c) and c.attention == "dense",
            "ring attention is the tiled op, whose masks are a hash of the position, not one "
            "device's uniform [B, H, S, S] draw; use attention 'tiled' or dropout 0"),
    Refusal("context parallelism with selective recomputation", ("cp", "recompute"),
            lambda l, c: _ctx(l) and c is not None and c.recompute == "selective",
            "ring attention keeps no [B, H, S, S] probabilities to drop; use recompute "
            "'full' or 'none'"),
    Refusal("ZeRO-2/3 with pipeline parallelism", ("pp", "zero"),
            lambda l, c: _pipe(l) and l.zero >= 2,
            "a stage keeps its parameters and gradients for all its micro-batches; use "
            "ZeRO 0 or 1"),
    Refusal("pipeline with gradient buckets", ("pp", "bucket_bytes"),
            lambda l, c: _pipe(l) and l.bucket_bytes is not None,
            "the stages all-reduce the gradient after the pipeline"),
    Refusal("virtual stages with a one-chunk schedule", ("pp", "virtual", "schedule"),
            lambda l, c: _pipe(l) and l.virtual > 1 and l.schedule in ("gpipe", "1f1b"),
            "gpipe and 1f1b run one chunk per rank; use schedule 'interleaved'"),
    Refusal("gradient buckets with ZeRO-2/3", ("bucket_bytes", "zero"),
            lambda l, c: l.bucket_bytes is not None and l.zero >= 2,
            "ZeRO-2/3 reduce-scatter each unit's gradient as its backward ends already"),
    Refusal("gradient buckets with sequence parallelism", ("bucket_bytes", "sp"),
            lambda l, c: l.bucket_bytes is not None and l.sp,
            "the buckets all-reduce a replicated gradient as the backward goes, and the "
            "replicated tensors' gradients are final only after the whole backward"),
    Refusal("clipping with key/value heads shared across ranks", ("clip", "n_kv_heads", "tp"),
            lambda l, c: (c is not None and l.clip is not None
                          and c.n_kv_heads < l.tp),
            "the norm would count each copy of a shared key/value head; give n_kv_heads "
            ">= tp or no clip"),
    Refusal("gradient buckets with key/value heads shared across ranks",
            ("bucket_bytes", "n_kv_heads", "tp"),
            lambda l, c: (c is not None and l.bucket_bytes is not None
                          and c.n_kv_heads < l.tp),
            "their gradients are summed over the sharing ranks only after the backward"),
    Refusal("expert parallelism without experts", ("ep", "n_experts"),
            lambda l, c: l.ep > 1 and c is not None and c.n_experts == 0,
            "ep shards an MoE model's experts; give n_experts > 0 or ep 1"),
    Refusal("mixture of experts with pipeline parallelism", ("n_experts", "pp"),
            lambda l, c: _moe(c) and _pipe(l),
            "each stage would route its micro-batches apart, and its blocks' auxiliary "
            "losses would have to reach the last stage's loss"),
    Refusal("mixture of experts with context parallelism", ("n_experts", "cp"),
            lambda l, c: _moe(c) and _ctx(l),
            "the ring holds a sequence's positions out of order, and capacity and the "
            "balancing statistics follow the batch's token order"),
    Refusal("mixture of experts with sequence parallelism", ("n_experts", "sp", "tp"),
            lambda l, c: _moe(c) and l.sp and l.tp > 1,
            "the experts route the whole sequences of a rank's rows, which sequence "
            "parallelism splits over tp"),
    Refusal("mixture of experts with ZeRO-2/3", ("n_experts", "zero"),
            lambda l, c: _moe(c) and l.zero >= 2,
            "ZeRO-2/3 shard every unit over dp, whose ranks route through the experts "
            "together (use ZeRO 0 or 1)"),
    Refusal("expert parallelism with gradient buckets", ("n_experts", "ep", "bucket_bytes"),
            lambda l, c: _moe(c) and l.ep > 1 and l.bucket_bytes is not None,
            "the buckets all-reduce over dp, and the experts' gradients are summed over "
            "the ranks holding the same experts"),
    Refusal("mixture of experts with accumulation over data-parallel ranks",
            ("n_experts", "micro_batches", "dp"),
            lambda l, c: _moe(c) and l.micro_batches > 1 and l.dp > 1,
            "a micro-batch would route each rank's rows k with the other ranks' rows k, "
            "not one device's micro-batch k: give micro_batches 1, or dp 1"),
    Refusal("native collectives in a simulation", ("algorithm", "transport"),
            lambda l, c: l.algorithm == "native" and l.transport == "simulated",
            "native is MPI's own; simulate ring or naive"),
]

CONFIG_FIELDS = ("dropout", "n_kv_heads", "n_heads", "recompute", "n_experts", "attention")


def _positive_int(name, value, none_ok=False):
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """How one training step is spread over ranks (see the module docstring)."""
    dp: int = 1
    tp: int = 1
    pp: int | None = None               # pipeline stages; None: no pipeline
    cp: int | None = None               # context-parallel ranks; None: no ring
    ep: int = 1                         # expert-parallel ranks (a block of dp's)
    zero: int = 0                       # ZeRO stage over dp
    sp: bool = False                    # sequence parallelism (with tp)
    micro_batches: int = 1              # with pp: the pipeline's m; else accumulation
    virtual: int = 1                    # model chunks per pipeline rank
    schedule: str | None = None         # None: 1f1b, interleaved when virtual > 1
    balanced: bool = True               # the ring's mirrored causal chunks
    ulysses: bool = False               # cp's attention by heads after all-to-alls
    clip: float | None = None           # max_norm of the global gradient norm
    bucket_bytes: int | None = None     # overlapped gradient all-reduce buckets
    algorithm: str = "ring"             # collective algorithm
    transport: str | None = None        # "simulated" | "mpi" | None (not known here)

    def __post_init__(self):
        for name in ("dp", "tp", "ep", "micro_batches", "virtual"):
            _positive_int(name, getattr(self, name))
        for name in ("pp", "cp", "bucket_bytes"):
            _positive_int(name, getattr(self, name), none_ok=True)
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of {ZERO_STAGES}, got {self.zero!r}")
        for name in ("sp", "balanced", "ulysses"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.clip is not None and (isinstance(self.clip, bool)
                                      or not isinstance(self.clip, (int, float))
                                      or not 0 < self.clip < float("inf")):
            raise ValueError(f"clip must be a positive finite norm, got {self.clip!r}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS} or None, got "
                             f"{self.transport!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * (self.pp or 1) * (self.cp or 1)

    @property
    def pipeline_schedule(self) -> str:
        """The schedule the pipeline runs: the given one, else 1f1b (interleaved when
        virtual > 1)."""
        if self.schedule is not None:
            return self.schedule
        return "interleaved" if self.virtual > 1 else "1f1b"

    def refusal(self, config=None) -> Refusal | None:
        """The first rule of REFUSALS that refuses this layout (with this config), or None."""
        return next((rule for rule in REFUSALS if rule.when(self, config)), None)

    def validate(self, config=None, world: int | None = None, batch: int | None = None,
                 seq: int | None = None) -> "Layout":
        """Raise LayoutError (a ValueError) naming the first refused combination, then
        LayoutSizeError (a ValueError naming its field) when the layout does not fit
        `world` ranks, a global batch of `batch` rows or sequences of `seq` positions;
        -> self."""
        rule = self.refusal(config)
        if rule is not None:
            raise LayoutError(rule.message(self, config), rule, self)
        if self.dp % self.ep:
            raise LayoutSizeError(
                f"the expert-parallel degree ep = {self.ep} must divide the data-parallel "
                f"degree dp = {self.dp}: the experts are sharded over blocks of "
                "data-parallel ranks", "ep")
        if config is not None and config.n_experts and config.n_experts % self.ep:
            raise LayoutSizeError(
                f"the number of experts N_E = {config.n_experts} must be divisible by the "
                f"expert-parallel degree ep = {self.ep} (each rank holds N_E / ep of them)",
                "n_experts")
        if world is not None and self.world_size != world:
            raise LayoutSizeError(f"the layout {self.shape()} needs {self.world_size} ranks, "
                                  f"but the world has {world}", "world")
        if batch is not None and batch % (self.dp * self.micro_batches):
            raise LayoutSizeError(f"the global batch ({batch}) must be divisible by dp x "
                                  f"micro_batches = {self.dp} x {self.micro_batches} = "
                                  f"{self.dp * self.micro_batches}", "batch")
        if seq is not None and config is not None and seq > config.max_seq_len:
            raise LayoutSizeError(f"seq ({seq}) exceeds the config's max_seq_len "
                                  f"({config.max_seq_len})", "seq")
        if self.ulysses and config is not None and (config.n_heads // self.tp) % (self.cp or 1):
            raise LayoutSizeError(f"Ulysses splits each tensor-parallel rank's n_heads / tp = "
                                  f"{config.n_heads} / {self.tp} heads over cp = {self.cp} "
                                  "ranks: they must divide")
        if self.ulysses and seq is not None and seq % (self.cp or 1):
            raise LayoutSizeError(f"with Ulysses the sequence length ({seq}) must be "
                                  f"divisible by the context-parallel degree ({self.cp})",
                                  "seq")
        if seq is not None and self.sp and seq % self.tp:
            raise LayoutSizeError(f"with sequence parallelism the sequence length ({seq}) "
                                  f"must be divisible by the tensor-parallel degree "
                                  f"({self.tp})", "seq")
        return self

    def shape(self) -> str:
        """'dp=2 x pp=2 x tp=2' (the degrees that are set)."""
        parts = [f"dp={self.dp}"]
        if self.pp is not None:
            parts.append(f"pp={self.pp}")
        parts.append(f"tp={self.tp}")
        if self.cp is not None:
            parts.append(f"cp={self.cp}" + (" (Ulysses)" if self.ulysses else ""))
        shape = " x ".join(parts)
        return shape + (f" (ep={self.ep})" if self.ep > 1 else "")


LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))


def refusal_lines() -> list[str]:
    """One line per rule, "NAME: WHY" (the README's list and --help are made of them)."""
    return [f"{rule.name}: {rule.why}" for rule in REFUSALS]


def readme_list(width: int = 92) -> str:
    """The README's list of refused combinations, a Markdown list wrapped at `width`."""
    import textwrap

    return "\n".join(textwrap.fill(line, width, initial_indent="- ", subsequent_indent="  ",
                                   break_on_hyphens=False) for line in refusal_lines())
