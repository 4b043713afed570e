"""What a parallel layout costs, before running it: memory per rank, bytes per step, bubble.

    p = plan(config, dp=4, tp=2, zero=3, batch=32, seq=128)
    p.memory          {'params', 'grads', 'optimizer', 'gathered', 'activations', 'total'}:
                      bytes on the fullest rank at the step's peak
    p.memory_per_rank the same for every world rank w = d * tp + t
    p.traffic         {'dp reduce_scatter': bytes, 'tp all_reduce': ...} that the busiest
                      rank sends in one step; p.sent the total per world rank
    p.bubble          the pipeline's idle fraction (p - 1) / (v m)

A pure function of the config and the layout: nothing is allocated, nothing runs. Every
number comes from the closed forms of volume.py (bytes per collective with the exact
chunking, memory per ZeRO stage) and models/sizes.py (activations), which the tests compare
with the simulated runs: the counted bytes of every call and the ledger of every array a
rank holds (fsdp.py). The activations are one device's caches for the rows of one
data-parallel rank (sizes.py); the parallel model's caches keep a few bytes per token more
(the vocabulary masks and indices of its embedding and cross-entropy), not priced here.
Layouts it cannot price give None rather than a guess: activations with tp > 1, memory and
traffic with pp > 1 or microbatches > 1 (the pipeline's per-stage tables join here with
that module).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..models.sizes import decoder_sizes
from .model import check_layout
from .volume import step_traffic, zero_memory

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
        out.append(("bubble", f"{self.bubble:.3f}"))
        return out


def _bubble_fraction(pp: int, virtual: int, microbatches: int) -> float:
    """The pipeline schedule's bubble: idle time over useful time, (p - 1) / (v m) (GPipe and
    1F1B with v = 1, interleaved 1F1B with v virtual stages per rank)."""
    return (pp - 1) / (virtual * microbatches)


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def plan(config, *, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, batch: int,
         seq: int, microbatches: int = 1, virtual: int = 1, dtype: str = "float64",
         algorithm: str = "ring") -> Plan:
    """Memory per rank, bytes per rank per step and the bubble of training `config` on a
    dp x tp (x pp) mesh with ZeRO stage `zero`, global batch [batch, seq]. Raises ValueError
    for a layout that cannot run, before any work."""
    for name, value in dict(dp=dp, tp=tp, pp=pp, batch=batch, seq=seq,
                            microbatches=microbatches, virtual=virtual).items():
        _positive_int(name, value)
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {tuple(ITEMSIZE)}, got {dtype!r}")
    if algorithm not in ("ring", "naive"):
        raise ValueError(f"algorithm must be 'ring' or 'naive', got {algorithm!r}")
    if seq > config.max_seq_len:
        raise ValueError(f"seq ({seq}) exceeds the config's max_seq_len "
                         f"({config.max_seq_len})")
    if batch % dp:
        raise ValueError(f"batch ({batch}) must be divisible by dp ({dp}): each "
                         "data-parallel rank takes batch / dp rows")
    if (batch // dp) % microbatches:
        raise ValueError(f"the rows per data-parallel rank ({batch // dp}) must be divisible "
                         f"by microbatches ({microbatches})")
    if virtual > 1 and pp == 1:
        raise ValueError(f"virtual stages ({virtual}) need pipeline parallelism (pp > 1)")
    if config.n_layers % (pp * virtual):
        raise ValueError(f"n_layers ({config.n_layers}) must be divisible by pp x virtual "
                         f"({pp} x {virtual}): every stage holds whole blocks")
    check_layout(config, tp)

    layout = dict(dp=dp, tp=tp, pp=pp, zero=zero, batch=batch, seq=seq,
                  microbatches=microbatches, virtual=virtual, dtype=dtype)
    bubble = _bubble_fraction(pp, virtual, microbatches)
    if pp > 1 or microbatches > 1:
        return Plan(layout, None, None, None, None, None, bubble)
    f = ITEMSIZE[dtype]
    activations = None
    if tp == 1 and dtype in ("float32", "float64"):   # the dtypes DecoderLM runs in
        activations = decoder_sizes(replace(config, dtype=dtype), batch // dp,
                                    seq)["activation_bytes"]
    memory_per_rank = []
    traffic_per_rank = step_traffic(config, batch // dp, seq, tp, dp, False, zero, algorithm,
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
