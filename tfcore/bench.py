"""What a training step of the decoder costs, measured so that a busy machine cannot fake it.

    python -m tfcore.bench --json benchmarks/results.json      # the full table (a few minutes)
    python -m tfcore.bench --configs small --dtypes float32 --threads 1
    python -m tfcore.bench --profile                           # where a tfcore step goes
    python -m tfcore.bench --no-torch                          # tfcore alone
    python -m tfcore.bench --torch-step PATH                   # PyTorch's step from PATH
    python -m tfcore.bench --show benchmarks/results.json      # print a saved table again
    python -m tfcore.bench --scaling --dtypes float32          # time and memory against S

Configurations: tiny, small and medium (1024 tokens a step, at S = 64, 128 and 256), and
long and long2k (V 1024, D 256, L 2, H 4; S = 1024 and 2048 at the same 2048 tokens a step,
where attention's S^2 terms dominate). --scaling runs the scaling series instead: the long
model at 2048 tokens a step with S = 256, 512, 1024, 2048 (s256, s512, long, long2k), each
with tfcore's dense and tiled attention, both timed against PyTorch's fused attention, to
show how step time and peak memory grow with S. Each saved table records the machine it ran
on (CPU model and family/model numbers, NumPy's SIMD level, the BLAS with its core type, the
versions): a table holds for that CPU only.

A step is forward + backward + AdamW of a GPT-style DecoderLM (pre-LayerNorm, learned
positions, tanh GELU, tied head), with each library's fused attention by default: tfcore's
attention="tiled" (--tfcore-attention dense keeps the [B, H, S, S] scores) and PyTorch's
scaled_dot_product_attention (--torch-attention math writes softmax(QK^T)V out). With
PyTorch installed (the CPU build: `pip install torch==2.13.0+cpu`), the same model is built
in PyTorch eager with the same weights and tokens, the two losses must agree, and the two
steps are timed alternately in one process, so that whatever the machine does falls on both.
tfcore imports no PyTorch code: the PyTorch step is the repository's
benchmarks/torch_step.py, loaded by its path from the checkout (or --torch-step PATH);
without that file, or without torch, the table has no PyTorch column.

Load. For every timed window (one step, or as many steps as fill --min-window seconds) the
benchmark reads the machine's busy CPU time (/proc/stat) and this process's own CPU time
(getrusage, threads and waited-for children included) before and after. What the machine
used beyond this process is other processes' work: a window where they used more than
--max-load CPU-seconds per second (beyond the counters' resolution) is dropped and counted.
When fewer than --repeats clean windows remain for either library, no ratio is printed:
on a busy machine PyTorch's threads stall far more than NumPy's, and a ratio measured there
flatters tfcore several times over.

Threads. Each thread count of --threads limits both libraries alike: BLAS (threadpoolctl),
Numba and tfcore's worker threads (numba.set_num_threads), PyTorch (torch.set_num_threads).

Columns: time is the median of the clean windows (ms per step); ratio = tfcore / PyTorch
(below 1: tfcore is faster); %peak = useful FLOPs per second against the GEMM peak measured in
the same run, with the useful FLOPs of a step 6 N T + 12 L S^2 D B (N parameters, T = B S
tokens; what PyTorch's model does too); MiB = peak resident memory of one step above the
process's resident memory before it, plus the state kept between steps (parameters,
gradients, AdamW's m and v), measured in a fresh process whose allocator returns freed memory
at once (the timed process keeps freed memory for reuse, tfcore.kernels.keep_freed_memory, for
both libraries); clean = clean:dropped windows of tfcore / of PyTorch; load = the
median rate of other processes' CPU use over all windows of the row, kept or dropped
(CPU-seconds per second).
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import textwrap
import time
import tracemalloc
from dataclasses import dataclass, replace

import numpy as np

from . import backend, kernels
from .models import DecoderConfig, DecoderLM, sizes
from .optim import AdamW

CONFIGS = {
    "tiny": dict(vocab_size=65, d_model=64, n_layers=2, n_heads=4, seq=64, batch=16),
    "small": dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, seq=128, batch=8),
    "medium": dict(vocab_size=1024, d_model=512, n_layers=6, n_heads=8, seq=256, batch=4),
    # long sequences at the same 2048 tokens a step: attention's S^2 dominates
    "long": dict(vocab_size=1024, d_model=256, n_layers=2, n_heads=4, seq=1024, batch=2),
    "long2k": dict(vocab_size=1024, d_model=256, n_layers=2, n_heads=4, seq=2048, batch=1),
    # with long and long2k, the scaling series: the same model and 2048 tokens, S from 256
    "s256": dict(vocab_size=1024, d_model=256, n_layers=2, n_heads=4, seq=256, batch=8),
    "s512": dict(vocab_size=1024, d_model=256, n_layers=2, n_heads=4, seq=512, batch=4),
}
TABLE = ("tiny", "small", "medium", "long", "long2k")     # the table's rows (the default)
SCALING = ("s256", "s512", "long", "long2k")               # --scaling: S = 256 ... 2048
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
DTYPES = ("float32", "float64")


def decoder_config(name: str, dtype: str, tiled: bool = False
                   ) -> tuple[DecoderConfig, int, int]:
    c = CONFIGS[name]
    cfg = DecoderConfig(vocab_size=c["vocab_size"], max_seq_len=c["seq"], d_model=c["d_model"],
                        n_layers=c["n_layers"], n_heads=c["n_heads"], dtype=dtype,
                        attention="tiled" if tiled else "dense")
    return cfg, c["batch"], c["seq"]


# -- FLOPs ---------------------------------------------------------------------------------

def formula_flops(n_params: int, cfg: DecoderConfig, batch: int, seq: int) -> int:
    """6 N T + 12 L S^2 D B: the dense part (2 N T forward, 4 N T backward) and attention
    (the whole S x S score matrix: QK^T and AV forward, four products backward)."""
    return 6 * n_params * batch * seq + 12 * cfg.n_layers * seq * seq * cfg.d_model * batch


def step_flops(cfg: DecoderConfig, batch: int, seq: int) -> int:
    """6 T (L (4 D^2 + 2 D F) + D V) + 12 L B S^2 D for the GPT-style decoder with the dense
    attention: the matmuls of a step, from the shapes (count_step_flops measures them);
    models.sizes.step_flops for any config (this is its dense attention without
    recomputation, what the benchmark's configurations run)."""
    return sizes.step_flops(replace(cfg, attention="dense", recompute="none"),
                            batch, seq)


def count_step_flops(model, ids, targets):
    """Run one forward and backward of `model` and count its matmuls as they run
    (tfcore.backend.count_matmuls): returns the MatmulCount, phases "forward" and "backward"."""
    with backend.count_matmuls() as count:
        count.phase = "forward"
        model.forward(ids, targets, training=True)
        count.phase = "backward"
        model.backward()
    return count


def matmul_peak(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    """GFLOP/s of the best of `repeats` n x n x n GEMMs in NumPy (this machine's BLAS peak
    at the current thread setting)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def clean_matmul_peak(dtype: str, meter, max_load: float, tries: int = 5):
    """(GFLOP/s, clean): the best matmul_peak over `tries` windows the load check keeps, or
    the best of all with clean=False when none was kept."""
    kept, every = [], []
    for _ in range(tries):
        box = []
        window = meter.measure(lambda: box.append(matmul_peak(dtype)))
        every.append(box[0])
        if window.clean(max_load):
            kept.append(box[0])
    return (max(kept), True) if kept else (max(every), False)


# -- the load of the machine ---------------------------------------------------------------

CLOCK_TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def machine_busy_seconds(path: str = "/proc/stat") -> float | None:
    """CPU-seconds all CPUs of the machine have spent busy since boot (user, nice, system,
    irq, softirq, steal; not idle or iowait), or None where /proc/stat cannot be read."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    return (user + nice + system + irq + softirq + steal) * CLOCK_TICK


def own_cpu_seconds() -> float:
    """CPU-seconds this process used (all its threads) and its waited-for children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class Window:
    """One timed window: wall seconds, the machine's busy CPU-seconds and this process's."""
    wall: float
    machine: float | None
    own: float
    resolution: float          # the counters' error: a tick per CPU at each end

    @property
    def others(self) -> float | None:
        """CPU-seconds other processes used during the window (None: unknown)."""
        if self.machine is None:
            return None
        return max(0.0, self.machine - self.own)

    @property
    def others_rate(self) -> float | None:
        """Other processes' CPU use, in CPUs (CPU-seconds per second), beyond the resolution."""
        others = self.others
        if others is None:
            return None
        return max(0.0, others - self.resolution) / max(self.wall, 1e-9)

    def clean(self, max_load: float) -> bool:
        """Others used at most max_load CPUs (unknown load is never clean)."""
        rate = self.others_rate
        return rate is not None and rate <= max_load


class LoadMeter:
    """Times a call and measures the CPU the rest of the machine used meanwhile.

    The sources can be replaced (the tests give made-up counters)."""

    def __init__(self, machine=machine_busy_seconds, own=own_cpu_seconds,
                 clock=time.perf_counter, cpus: int | None = None, tick: float = CLOCK_TICK):
        self.machine, self.own, self.clock = machine, own, clock
        self.resolution = 2 * (cpus or os.cpu_count() or 1) * tick

    def measure(self, fn) -> Window:
        m0, o0, t0 = self.machine(), self.own(), self.clock()
        fn()
        t1, o1, m1 = self.clock(), self.own(), self.machine()
        machine = None if m0 is None or m1 is None else m1 - m0
        return Window(t1 - t0, machine, o1 - o0, self.resolution)


def memory_bandwidth(n_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """GB/s of the best of `repeats` copies of an n_bytes array (read + write counted)."""
    a = np.ones(n_bytes // 8)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - start)
    return 2 * a.nbytes / best / 1e9


# -- memory --------------------------------------------------------------------------------

def _fix_malloc():
    """Make glibc return every freed block of 64 KiB or more to the system at once, so that
    resident memory follows what is allocated (otherwise freed blocks linger in the heap)."""
    kernels.set_malloc_thresholds(64 * 1024, 128 * 1024)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_peak_bytes(step) -> int | None:
    """Peak resident memory during step() above the resident memory just before it."""
    gc.collect()
    if not _reset_peak():
        return None
    base = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - base) * 1024


def tracemalloc_peak_bytes(step) -> int:
    """Peak of NumPy's (and Python's) allocations during step(), above the start."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        step()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


# -- the tfcore step -----------------------------------------------------------------------

class TfcoreStep:
    def __init__(self, cfg: DecoderConfig, ids: np.ndarray, targets: np.ndarray):
        self.model = DecoderLM(cfg).init(seed=0)
        self.opt = AdamW(self.model.params, lr=LR, betas=BETAS, eps=EPS,
                         weight_decay=WEIGHT_DECAY)
        self.ids, self.targets = backend.asarray(ids), backend.asarray(targets)
        self.loss = None

    def __call__(self):
        self.model.params.zero_grad()
        # [1]: the logits are not held through the backward (PyTorch's step frees them too)
        loss = self.model.forward(self.ids, self.targets, training=True)[1]
        self.model.backward()
        self.opt.step()
        self.loss = float(loss)

    def first_loss(self) -> float:
        _, loss = self.model.forward(self.ids, self.targets)
        self.model._cache = None
        return float(loss)

    def state_bytes(self) -> int:
        p = self.model.params
        return 4 * p.size * np.dtype(p.dtype).itemsize


# -- the same step in PyTorch eager, outside the package ----------------------------------
# tfcore imports no PyTorch code (PyTorch is an optional, independent cross-check): the
# PyTorch step is benchmarks/torch_step.py of the repository checkout, loaded by file path.

TORCH_STEP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks", "torch_step.py")


def load_torch_step(path: str | None = None):
    """Load the PyTorch step from `path` (default: the checkout's benchmarks/torch_step.py).

    -> (module with TorchStep and torch_version, None), or (None, a one-line reason why the
    table has no PyTorch column: the file is absent, or torch is not installed)."""
    import importlib.util

    path = os.path.abspath(TORCH_STEP if path is None else path)
    if not os.path.isfile(path):
        return None, (f"no PyTorch step at {path} (benchmarks/torch_step.py of the "
                      "repository; --torch-step PATH): tfcore alone")
    spec = importlib.util.spec_from_file_location("_tfcore_bench_torch_step", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        return None, "PyTorch is not installed (pip install torch==2.13.0+cpu): tfcore alone"
    if not hasattr(module, "TorchStep"):
        raise ValueError(f"{path} defines no TorchStep class: expected the PyTorch step of "
                         "benchmarks/torch_step.py")
    return module, None


# -- peak memory, in a fresh process ------------------------------------------------------
# The timed process keeps freed memory for reuse (kernels.keep_freed_memory), so a step's
# temporaries cost no page faults. Resident memory then stays at its high-water mark, which
# hides a step's peak; so the peak is measured in a fresh process whose allocator returns
# every freed block at once (_fix_malloc), where resident memory follows what is allocated.

def memory_of_step(name, dtype, library, attention="sdpa", tiled=False,
                   torch_step: str | None = None) -> int | None:
    """Peak resident memory of one step of `library` ("tfcore" or "torch", whose step is
    loaded from the file `torch_step`) above the resident memory before it, plus the state
    kept between steps; None where it cannot be measured."""
    code = ("from tfcore import bench; "
            f"print(bench._memory_child({name!r}, {dtype!r}, {library!r}, {attention!r}, "
            f"{tiled!r}, {torch_step!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    last = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    return int(last[0]) if last and last[0].isdigit() else None


def _memory_child(name, dtype, library, attention, tiled, torch_step=None):
    backend.set_backend("numpy")
    _fix_malloc()
    set_threads(1)
    cfg, batch, seq = decoder_config(name, dtype, tiled)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(batch, seq + 1))
    step = TfcoreStep(cfg, tokens[:, :-1], tokens[:, 1:])
    if library == "torch":
        module, why = load_torch_step(torch_step)
        if module is None:
            raise RuntimeError(why)
        step = module.TorchStep(cfg, step.model.params, tokens[:, :-1], tokens[:, 1:],
                                attention)
    step()
    rss = rss_peak_bytes(step)
    return None if rss is None else rss + step.state_bytes()


# -- one configuration ---------------------------------------------------------------------

@dataclass
class Side:
    """The clean windows of one library: ms per step of each, and what was dropped."""
    times: list
    dropped: int
    loads: list                 # others' CPU rate of each kept window
    rss: int | None = None
    seen: list = None           # others' CPU rate of every window, kept or dropped

    @property
    def median(self):
        return statistics.median(self.times) if self.times else None


def _timed_rounds(steps, meter, repeats, max_load, per_window, max_rounds, budget=math.inf):
    """Alternate the steps (their order flips every round) until each has `repeats` clean
    windows, or max_rounds rounds ran, or `budget` seconds passed -> one Side per step."""
    sides = [Side([], 0, []) for _ in steps]
    start = time.perf_counter()
    for round_index in range(max_rounds):
        if time.perf_counter() - start > budget:
            break
        if all(len(s.times) >= repeats for s in sides):
            break
        if any(repeats - len(s.times) > max_rounds - round_index for s in sides):
            break                                   # too few rounds left to get enough
        order = range(len(steps)) if round_index % 2 == 0 else reversed(range(len(steps)))
        for i in order:
            step, side = steps[i], sides[i]
            window = meter.measure(lambda: [step() for _ in range(per_window)])
            side.seen = (side.seen or []) + [window.others_rate]
            if window.clean(max_load):
                side.times.append(window.wall / per_window)
                side.loads.append(window.others_rate)
            else:
                side.dropped += 1
    return sides


def run_attentions(name, dtype, tiled, *, repeats=7, torch_step=None, peak=None,
                   attention="sdpa", warmup=2, max_load=0.1, min_window=0.5, meter=None,
                   budget=300.0) -> list[dict]:
    """Time a tfcore step for each of `tiled` (False: dense attention, True: tiled) and
    PyTorch's, all alternated in one loop -> one row per tfcore step, each with the same
    PyTorch side (so that the rows' ratios share one denominator)."""
    use_torch = torch_step is not None
    rng = np.random.default_rng(1)
    ours = []
    for t in tiled:
        cfg, batch, seq = decoder_config(name, dtype, t)
        if not ours:
            tokens = rng.integers(0, cfg.vocab_size, size=(batch, seq + 1))
            ids, targets = tokens[:, :-1], tokens[:, 1:]
        ours.append(TfcoreStep(cfg, ids, targets))        # the same weights (seed 0) in each
    steps = list(ours)
    loss_diff = None
    if use_torch:
        theirs = torch_step.TorchStep(cfg, ours[0].model.params, ids, targets, attention)
        b = theirs.first_loss()
        loss_diff = max(abs(step.first_loss() - b) / abs(b) for step in ours)
        bar = 1e-10 if dtype == "float64" else 1e-4
        if not loss_diff <= bar:
            raise AssertionError(f"{name} {dtype}: losses disagree, tfcore "
                                 f"{[step.first_loss() for step in ours]} PyTorch {b}")
        steps.append(theirs)
    for _ in range(warmup):
        for step in steps:
            step()
    start = time.perf_counter()
    ours[0]()
    per_window = max(1, math.ceil(min_window / max(time.perf_counter() - start, 1e-6)))
    sides = _timed_rounds(steps, meter or LoadMeter(), repeats, max_load, per_window,
                          3 * repeats, budget * len(steps) / 2)
    torch_side = sides[-1] if use_torch else Side([], 0, [])
    if use_torch:
        torch_side.rss = memory_of_step(name, dtype, "torch", attention, tiled[0],
                                        torch_step.__file__)
    useful = formula_flops(ours[0].model.num_parameters(), cfg, batch, seq)
    rows = []
    for t, side in zip(tiled, sides):
        side.rss = memory_of_step(name, dtype, "tfcore", attention, t)
        row = dict(config=name, dtype=dtype, threads=None, batch=batch, seq=seq,
                   useful_flops=useful, matmul_flops_dense=step_flops(cfg, batch, seq),
                   peak_gflops=peak, steps_per_window=per_window, max_load=max_load,
                   repeats=repeats, loss_rel_diff=loss_diff,
                   attention_tfcore="tiled" if t else "dense",
                   attention_torch=attention if use_torch else None)
        for label, one in (("tfcore", side), ("torch", torch_side)):
            med = one.median if len(one.times) >= repeats else None
            row[label] = dict(ms=None if med is None else 1e3 * med, clean=len(one.times),
                              dropped=one.dropped, rss_bytes=one.rss,
                              load_max=max(one.loads) if one.loads else None,
                              load_seen=_median_known(one.seen or []),
                              pct_peak=(None if med is None or not peak
                                        else 100 * useful / med / 1e9 / peak))
        t_ms, p_ms = row["tfcore"]["ms"], row["torch"]["ms"]
        row["ratio"] = t_ms / p_ms if use_torch and t_ms and p_ms else None
        t_rss, p_rss = row["tfcore"]["rss_bytes"], row["torch"]["rss_bytes"]
        row["memory_ratio"] = t_rss / p_rss if use_torch and t_rss and p_rss else None
        rows.append(row)
    return rows


# -- the table -----------------------------------------------------------------------------

def _f(x, fmt, width):
    return ("-" if x is None else format(x, fmt)).rjust(width)


def _table_head(meta: dict) -> list[str]:
    """What every saved table says first: its command, date, machine, load bar and peaks."""
    lines = [f"{meta['command']}",
             f"{meta['date']}  {meta['cpu']}"
             + (f" ({meta['cpu_id']})" if "cpu_id" in meta else "")
             + f", {meta['cpus']} CPUs; numpy {meta['numpy']}, "
             f"torch {meta.get('torch') or '-'}; kernels {meta['kernels']}"
             + (f"; SIMD {meta['simd']}; BLAS {meta['blas']}" if "simd" in meta else ""),
             f"windows dropped when other processes used > {meta['max_load']} CPU; "
             f"ratio = tfcore / PyTorch; attention: {meta.get('tfcore_attention', 'dense')}"
             f" in tfcore, {meta['torch_attention']} in PyTorch",
             "GEMM peak GFLOP/s: " + ", ".join(
                 f"{k} {v:.0f}" + (" (busy)" if k in meta.get("busy_peaks", ()) else "")
                 for k, v in meta["peaks"].items())]
    return [part for line in lines for part in textwrap.wrap(line, 84)]


def format_table(results: dict) -> str:
    """The benchmark's table (what `--json` saved) as one block of text, 84 columns wide."""
    lines = ["thr config dtype  tfcore ms  torch ms ratio %peak tf/pt   MiB tf/pt"
             "  clean tf/pt  load"]
    refused = []
    for r in results["rows"]:
        t, p = r["tfcore"], r.get("torch") or {}
        load = max([x for x in (t.get("load_seen"), p.get("load_seen")) if x is not None],
                   default=None)
        clean = f"{t['clean']}:{t['dropped']}/{p.get('clean', '-')}:{p.get('dropped', '-')}"
        pct = f"{_f(t['pct_peak'], '.0f', 0)}/{_f(p.get('pct_peak'), '.0f', 0)}"
        mem = f"{_f(_mib(t['rss_bytes']), '.0f', 0)}/{_f(_mib(p.get('rss_bytes')), '.0f', 0)}"
        lines.append(f"{r['threads']:3d} {r['config']:6s} {r['dtype']:7s}"
                     f"{_f(t['ms'], '.1f', 10)}{_f(p.get('ms'), '.1f', 10)}"
                     f"{_f(r['ratio'], '.2f', 6)}{pct:>12s}{mem:>12s}"
                     f"{clean:>13s}{_f(load, '.2f', 6)}")
        if p and r["ratio"] is None:
            refused.append(f"{r['threads']} thr {r['config']} {r['dtype']}")
    if refused:
        lines += textwrap.wrap("no ratio (fewer than --repeats clean windows: the machine was "
                               "busy): " + "; ".join(refused), 84)
    return "\n".join(_table_head(results["meta"]) + lines)


def scaling_rows(results: dict) -> list[dict]:
    """The --scaling table's rows, one per (threads, dtype, config): S, B and, for tfcore's
    dense and tiled attention and for PyTorch's, ms per step, peak MiB and the ratio to
    PyTorch (the three steps alternated in one loop: one PyTorch time for both ratios)."""
    rows = {}
    for r in results["rows"]:
        key = (r["threads"], r["dtype"], r["seq"])
        rows.setdefault(key, dict(threads=r["threads"], dtype=r["dtype"], seq=r["seq"],
                                  batch=r["batch"], config=r["config"]))[
            r["attention_tfcore"]] = r
    table = []
    for row in rows.values():
        dense, tiled = row.pop("dense", None), row.pop("tiled", None)
        torch = (tiled or dense or {}).get("torch") or {}
        for label, r in (("dense", dense), ("tiled", tiled)):
            r = r or dict(tfcore={}, ratio=None)
            row[label] = dict(ms=r["tfcore"].get("ms"), mib=_mib(r["tfcore"].get("rss_bytes")),
                              ratio=r["ratio"])
        row["torch"] = dict(ms=torch.get("ms"), mib=_mib(torch.get("rss_bytes")))
        table.append(row)
    return table


def format_scaling(results: dict) -> str:
    """The --scaling table (what `--scaling --json` saved) as one block of text: step time,
    ratio to PyTorch and peak memory against S, at the same tokens a step."""
    lines = [f"{'':19s} |{'ms per step':^21s} |{'/ PyTorch':^12s} |{'peak MiB':^21s}",
             f"{'thr':>3s} {'dtype':7s}{'S':>5s}{'B':>3s} |{'dense':>7s}{'tiled':>7s}"
             f"{'torch':>7s} |{'dense':>6s}{'tiled':>6s} |{'dense':>7s}{'tiled':>7s}"
             f"{'torch':>7s}"]
    refused = []
    for r in scaling_rows(results):
        d, t, p = r["dense"], r["tiled"], r["torch"]
        lines.append(f"{r['threads']:3d} {r['dtype']:7s}{r['seq']:5d}{r['batch']:3d} |"
                     f"{_f(d['ms'], '.1f', 7)}{_f(t['ms'], '.1f', 7)}{_f(p['ms'], '.1f', 7)} |"
                     f"{_f(d['ratio'], '.2f', 6)}{_f(t['ratio'], '.2f', 6)} |"
                     f"{_f(d['mib'], '.1f', 7)}{_f(t['mib'], '.1f', 7)}{_f(p['mib'], '.1f', 7)}")
        if p["ms"] is not None and None in (d["ratio"], t["ratio"]):
            refused.append(f"{r['threads']} thr S={r['seq']} {r['dtype']}")
    if refused:
        lines += textwrap.wrap("a ratio is missing (fewer than --repeats clean windows: the "
                               "machine was busy): " + "; ".join(refused), 84)
    return "\n".join(_table_head(results["meta"]) + lines)


def _mib(n):
    return None if n is None else n / 2**20


def _median_known(values):
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cpu_id() -> str:
    """Family, model and stepping from /proc/cpuinfo: a virtual machine often names its CPU
    only "Intel(R) Xeon(R) Processor", and these say which generation it is."""
    found = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("cpu family", "model", "stepping") and key not in found:
                    found[key] = value.strip()
                if not line.strip() and found:
                    break
    except OSError:
        return "unknown"
    return " ".join(f"{k.split()[-1]} {found[k]}" for k in ("cpu family", "model", "stepping")
                    if k in found) or "unknown"


def _simd_level() -> str:
    """The widest SIMD target NumPy dispatches to on this CPU (its ufuncs' exp, tanh, ...):
    a table from an AVX-512 machine says little about an AVX2 one."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:
        return "unknown"
    usable = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
    return usable[-1] if usable else "baseline"


def _blas() -> str:
    """NumPy's BLAS, its version and the core type its kernels were chosen for (OpenBLAS's
    architecture, which OPENBLAS_CORETYPE overrides)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown"
    blas = [lib for lib in threadpool_info() if lib.get("user_api") == "blas"]
    if not blas:
        return "unknown"
    # NumPy's own (SciPy may load an OpenBLAS of its own beside it)
    lib = min(blas, key=lambda lib: "numpy" not in lib.get("filepath", ""))
    core = lib.get("architecture")
    return f"{lib.get('internal_api')} {lib.get('version')}" + (f" ({core} kernels)" if core else "")


def machine() -> dict:
    """What a benchmark row depends on besides the code: the CPU, its SIMD level, the BLAS
    and its core type, and the versions of the libraries that run the step."""
    import numba
    return dict(cpu=_cpu_name(), cpu_id=_cpu_id(), cpus=os.cpu_count(), simd=_simd_level(),
                blas=_blas(),
                numpy=np.__version__, numba=numba.__version__,
                python=platform.python_version())


# -- the profile ---------------------------------------------------------------------------

class Profiler:
    """Exclusive time per op: every *_forward, *_backward, *_update and layout helper of
    tfcore.functional, tfcore.ops (the kernels' seat, which the models call), tfcore.nn and
    the model modules is wrapped while profiling; an op's time excludes the wrapped ops it
    calls. 'other' is the rest of the step (Python glue)."""

    PATTERNS = ("_forward", "_backward", "_update", "split_heads", "merge_heads", "qkv_split",
                "qkv_merge_grads", "accumulate", "zero_grad")

    def __init__(self):
        self.totals, self.calls, self._stack, self._undo = {}, {}, [], []

    def _wrap(self, label, fn):
        prof = self

        def wrapped(*args, **kwargs):
            prof._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = prof._stack.pop()
                prof.totals[label] = prof.totals.get(label, 0.0) + elapsed - children
                prof.calls[label] = prof.calls.get(label, 0) + 1
                if prof._stack:
                    prof._stack[-1] += elapsed
        wrapped.__wrapped__ = fn
        return wrapped

    def __enter__(self):
        import importlib

        from . import nn

        wrapped = {}
        modules = ["tfcore.functional", "tfcore.ops", "tfcore.nn", "tfcore.models.blocks",
                   "tfcore.models.decoder", "tfcore.optim"]
        for mod_name in modules:
            mod = importlib.import_module(mod_name)
            for name in list(vars(mod)):
                fn = getattr(mod, name)
                if not inspect.isfunction(fn) or name.startswith("_"):
                    continue
                if not any(name.endswith(p) or name == p for p in self.PATTERNS):
                    continue
                label = f"{mod_name.rsplit('.', 1)[-1]}.{name}"
                if fn not in wrapped:
                    wrapped[fn] = self._wrap(label, fn)
                self._undo.append((mod, name, fn))
                setattr(mod, name, wrapped[fn])
        zero = nn.Parameters.zero_grad
        self._undo.append((nn.Parameters, "zero_grad", zero))
        nn.Parameters.zero_grad = self._wrap("Parameters.zero_grad", zero)
        for sub in ("attention", "activations", "softmax", "normalization", "linear",
                    "embedding", "regularization"):
            mod = importlib.import_module(f"tfcore.functional.{sub}")
            for name in list(vars(mod)):
                fn = getattr(mod, name)
                if inspect.isfunction(fn) and fn in wrapped:
                    self._undo.append((mod, name, fn))
                    setattr(mod, name, wrapped[fn])
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self._undo):
            setattr(mod, name, fn)
        return False


def profile_totals(name, dtype, steps=5, warmup=2, tiled=False):
    """-> (ms per step, {op label: exclusive ms per step}, {op label: calls per step}) of a
    tfcore step under the Profiler (whose wrappers add a few microseconds to each op)."""
    cfg, batch, seq = decoder_config(name, dtype, tiled)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(batch, seq + 1))
    step = TfcoreStep(cfg, tokens[:, :-1], tokens[:, 1:])
    for _ in range(warmup):
        step()
    with Profiler() as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        total = (time.perf_counter() - start) / steps
    return (1e3 * total, {k: 1e3 * t / steps for k, t in prof.totals.items()},
            {k: n // steps for k, n in prof.calls.items()})


def profile(name, dtype, steps=5, warmup=2, tiled=False):
    total, ops, calls = profile_totals(name, dtype, steps, warmup, tiled)
    lines = [f"profile of one tfcore step: {name} {dtype}, {total:.1f} ms per step "
             f"(kernels {'on' if kernels.enabled() else 'off'})",
             f"{'op':40s} {'calls':>6s} {'ms/step':>8s} {'share':>6s}"]
    for label, ms in sorted(ops.items(), key=lambda kv: -kv[1]):
        lines.append(f"{label:40s} {calls[label]:6d} {ms:8.2f} {100 * ms / total:5.1f}%")
    rest = total - sum(ops.values())
    lines.append(f"{'other (Python between ops)':40s} {'':6s} {rest:8.2f} "
                 f"{100 * rest / total:5.1f}%")
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------

def set_threads(n: int):
    """BLAS, Numba (and tfcore's workers) and PyTorch each use n threads; returns the
    threadpoolctl limiter (keep it alive while timing)."""
    limiter = None
    try:
        from threadpoolctl import threadpool_limits

        limiter = threadpool_limits(n)
    except ImportError:
        pass
    if kernels.available():
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    return limiter


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """Every bad argument: one line `error: ...` on stderr and exit status 2."""
        sys.stderr.write(f"error: {' '.join(message.split())}\n")
        sys.exit(2)


def _positive(kind, name):
    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be {'an integer' if kind is int else 'a number'}, "
                f"got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text!r}")
        return value
    return convert


def _non_negative(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-load must be a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"--max-load must be >= 0, got {text!r}")
    return value


def parse_args(argv=None):
    parser = _Parser(prog="python -m tfcore.bench", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        help=f"configurations to run (default: {' '.join(TABLE)})")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--threads", nargs="+", type=_positive(int, "--threads"),
                        default=[1, 2], help="thread counts to run at (default: 1 2)")
    parser.add_argument("--repeats", type=_positive(int, "--repeats"), default=7,
                        help="clean windows needed per library (default 7)")
    parser.add_argument("--max-load", type=_non_negative, default=0.1,
                        help="CPUs other processes may use in a kept window (default 0.1)")
    parser.add_argument("--min-window", type=_positive(float, "--min-window"), default=0.5,
                        help="seconds a timed window lasts at least (default 0.5)")
    parser.add_argument("--budget", type=_positive(float, "--budget"), default=300.0,
                        help="seconds of timed windows per row at most (default 300)")
    parser.add_argument("--no-torch", action="store_true", help="tfcore alone")
    parser.add_argument("--torch-step", metavar="PATH",
                        help="the PyTorch step to time against (default: the checkout's "
                             "benchmarks/torch_step.py)")
    parser.add_argument("--torch-attention", choices=["sdpa", "math"], default="sdpa",
                        help="PyTorch's scaled_dot_product_attention (default) or "
                             "softmax(QK^T)V written out")
    parser.add_argument("--tfcore-attention", choices=["dense", "tiled"],
                        help="tfcore's decoder with attention='tiled' (default: online "
                             "softmax, the fused kernel, as PyTorch's default is its fused "
                             "attention) or dense (the [B, H, S, S] scores kept)")
    parser.add_argument("--profile", action="store_true", help="op-by-op profile of tfcore")
    parser.add_argument("--scaling", action="store_true",
                        help="time and memory against S: the scaling series "
                             f"({', '.join(SCALING)}), tfcore dense and tiled against PyTorch")
    parser.add_argument("--json", metavar="PATH", help="also save the table as JSON here")
    parser.add_argument("--show", metavar="PATH", help="print a saved table and exit")
    args = parser.parse_args(argv)
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            parser.error(f"--json: folder {folder} does not exist")
    if args.show:
        try:
            with open(args.show) as f:
                args.shown = json.load(f)
            args.shown["rows"], args.shown["meta"]["command"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            parser.error(f"--show: {args.show} is not a saved benchmark table ({err})")
    if args.torch_step and not os.path.isfile(args.torch_step):
        parser.error(f"--torch-step: {args.torch_step} is not a file")
    if args.profile and args.json:
        parser.error("--profile prints a profile, not a table: leave out --json")
    if args.scaling:
        for given, flag in ((args.configs, "--configs"), (args.tfcore_attention,
                            "--tfcore-attention"), (args.profile, "--profile"),
                            (args.no_torch, "--no-torch")):
            if given:
                parser.error(f"--scaling runs its own series ({' '.join(SCALING)}) with both "
                             f"attentions against PyTorch: leave out {flag}")
    args.configs = args.configs or list(SCALING if args.scaling else TABLE)
    args.tfcore_attention = args.tfcore_attention or "tiled"
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.show:
        print((format_scaling if args.shown["meta"].get("scaling") else format_table)(
            args.shown))
        return 0
    backend.set_backend("numpy")
    kernels.keep_freed_memory()         # for both libraries: this process times them alike
    torch_step = None
    if not args.no_torch and not args.profile:
        torch_step, why = load_torch_step(args.torch_step)
        if why:
            print(why)
    use_torch = torch_step is not None
    if kernels.enabled():
        print(f"kernels on (Numba): warm-up {kernels.warm_up(args.dtypes):.1f} s")
    else:
        print("kernels off: the reference array-API path")
    attentions = (False, True) if args.scaling else (args.tfcore_attention == "tiled",)
    meta = dict(command="python -m tfcore.bench " + " ".join(
                    sys.argv[1:] if argv is None else argv),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **machine(),
                torch=torch_step.torch_version if use_torch else None,
                kernels="on" if kernels.enabled() else "off", max_load=args.max_load,
                torch_attention=args.torch_attention, peaks={}, scaling=args.scaling,
                tfcore_attention="dense and tiled" if args.scaling else args.tfcore_attention)
    rows = []
    meter = LoadMeter()
    for threads in args.threads:
        limiter = set_threads(threads)
        for dtype in args.dtypes:
            peak, clean = clean_matmul_peak(dtype, meter, args.max_load)
            meta["peaks"][f"{dtype} {threads}thr"] = peak
            if not clean:
                meta.setdefault("busy_peaks", []).append(f"{dtype} {threads}thr")
        print(f"{threads} thread(s): GEMM peak " + ", ".join(
            f"{dt} {meta['peaks'][f'{dt} {threads}thr']:.0f} GFLOP/s" for dt in args.dtypes),
            flush=True)
        for name in args.configs:
            for dtype in args.dtypes:
                if args.profile:
                    print(profile(name, dtype, tiled=attentions[0]), flush=True)
                    continue
                for row in run_attentions(name, dtype, attentions, repeats=args.repeats,
                                          torch_step=torch_step,
                                          peak=meta["peaks"][f"{dtype} {threads}thr"],
                                          attention=args.torch_attention,
                                          max_load=args.max_load, min_window=args.min_window,
                                          meter=meter, budget=args.budget):
                    row["threads"] = threads
                    rows.append(row)
                    t = row["tfcore"]
                    seen = t["load_seen"]
                    print(f"  {name} {dtype}"
                          + (f" ({row['attention_tfcore']})" if args.scaling else "")
                          + f": tfcore {t['clean']} clean, {t['dropped']} dropped"
                          + (f"; PyTorch {row['torch']['clean']} clean, "
                             f"{row['torch']['dropped']} dropped" if use_torch else "")
                          + ("" if seen is None else
                             f"; other processes used {seen:.2f} CPU (median)"), flush=True)
        del limiter
    if args.profile:
        return 0
    results = dict(meta=meta, rows=rows)
    print((format_scaling if args.scaling else format_table)(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
