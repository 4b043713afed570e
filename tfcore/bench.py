"""What a training step of the decoder costs: time, FLOP/s against this machine's matmul peak,
peak memory, and (with PyTorch installed) the same step in PyTorch eager, side by side.

    python -m tfcore.bench                      # tiny, small, medium; float32 and float64
    python -m tfcore.bench --configs small --dtypes float32 --repeats 9
    python -m tfcore.bench --profile            # where a tfcore step spends its time, op by op
    python -m tfcore.bench --no-torch           # tfcore alone

A step is forward + backward + AdamW over a GPT-style DecoderLM (pre-LayerNorm, learned
positions, tanh GELU, tied head). FLOPs of a step: 6 N T + 12 L S^2 D B (N parameters,
T = B S tokens; the second term is attention's QK^T and AV, forward and backward); the
exact count of the matmuls is `step_flops(config, B, S)`. The matmul peak is measured in the
same run (a large square GEMM). Peak memory of a step is measured two ways: NumPy's
allocations seen by tracemalloc (tfcore only), and the process's peak resident memory
(VmHWM, reset before the step through /proc/self/clear_refs) minus its resident memory at
the start of the step, plus the state held between steps (parameters, gradients, AdamW's
m and v). The predicted figure is the model's size table (tfcore.models.sizes).

With PyTorch (`pip install -e .[bench]`, the CPU build), the same model is built in PyTorch
eager with the same weights and tokens; the losses must agree; the two steps are timed
alternately in one process, so that the machine's noise falls on both; the ratios are
tfcore / PyTorch (below 1: tfcore is faster or smaller). BLAS, Numba and PyTorch all use
`--threads` threads (default 2).
"""
from __future__ import annotations

import argparse
import inspect
import ctypes
import gc
import math
import statistics
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from . import backend, kernels
from .models import DecoderConfig, DecoderLM
from .optim import AdamW

CONFIGS = {
    "tiny": dict(vocab_size=65, d_model=64, n_layers=2, n_heads=4, seq=64, batch=16),
    "small": dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, seq=128, batch=8),
    "medium": dict(vocab_size=1024, d_model=512, n_layers=6, n_heads=8, seq=256, batch=4),
}
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1


def decoder_config(name: str, dtype: str) -> tuple[DecoderConfig, int, int]:
    c = CONFIGS[name]
    cfg = DecoderConfig(vocab_size=c["vocab_size"], max_seq_len=c["seq"], d_model=c["d_model"],
                        n_layers=c["n_layers"], n_heads=c["n_heads"], dtype=dtype)
    return cfg, c["batch"], c["seq"]


# -- FLOPs ---------------------------------------------------------------------------------

def formula_flops(n_params: int, cfg: DecoderConfig, batch: int, seq: int) -> int:
    """6 N T + 12 L S^2 D B: the dense part (2 N T forward, 4 N T backward) and attention."""
    return 6 * n_params * batch * seq + 12 * cfg.n_layers * seq * seq * cfg.d_model * batch


def step_flops(cfg: DecoderConfig, batch: int, seq: int) -> int:
    """The exact FLOPs of every matmul of a step of the GPT-style decoder (2 m n k each).

    Forward per layer: qkv 2 T D 3D, scores 2 B S S D, A V 2 B S S D, proj 2 T D D,
    fc 2 T D F, proj 2 T F D; the head 2 T D V. Backward: twice each (dx and dW; dq, dk and
    dA, dv). So 6 T (L (4 D^2 + 2 D F) + D V) + 12 L B S^2 D: the formula's 6 N T with N
    the parameters that take part in a matmul (no biases, gains or positions).
    """
    T, D, F_ = batch * seq, cfg.d_model, cfg.d_ff
    dense = cfg.n_layers * (4 * D * D + 2 * D * F_) + D * cfg.vocab_size
    return 6 * T * dense + 12 * cfg.n_layers * batch * seq * seq * D


def matmul_peak(dtype: str, n: int = 1024, repeats: int = 5) -> float:
    """GFLOP/s of the best of `repeats` n x n x n GEMMs in NumPy (this machine's BLAS peak)."""
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


class MatmulCounter:
    """While active, counts 2 m n k for every matmul that the linear and attention ops run.

    with MatmulCounter() as count: ...one step...    then count.flops, count.by_kind
    The ops' own matmuls, listed from their shapes (on any backend): linear forward
    x W [N, D_in] [D_in, D_out]; backward dy W^T and x^T dy; attention forward q k^T and
    A v per (batch, head); backward dout v^T, A^T dout, dZ k and dZ^T q.
    """

    def __init__(self):
        self.flops = 0
        self.by_kind: dict[str, int] = {}
        self._undo = []

    def add(self, kind: str, m: int, k: int, n: int, batch: int = 1):
        flops = 2 * m * k * n * batch
        self.flops += flops
        self.by_kind[kind] = self.by_kind.get(kind, 0) + flops

    def __enter__(self):
        from . import functional as F
        from .models import blocks

        lin_f, lin_b = F.linear_forward, F.linear_backward
        att_f, att_b = F.attention_forward, F.attention_backward

        def linear_forward(x, W, b=None):
            self.add("linear forward", math.prod(x.shape[:-1]), *W.shape)
            return lin_f(x, W, b)

        def linear_backward(dy, cache):
            x, W = cache[0], cache[1]
            n, (d_in, d_out) = math.prod(x.shape[:-1]), W.shape
            self.add("linear backward", n, d_out, d_in)              # dx = dy W^T
            self.add("linear backward", d_in, n, d_out)              # dW = x^T dy
            return lin_b(dy, cache)

        def attention_forward(q, k, v, *args, **kwargs):
            b, h, s_q, d_h = q.shape
            s_k, d_v = k.shape[2], v.shape[3]
            self.add("attention forward", s_q, d_h, s_k, b * h)      # q k^T
            self.add("attention forward", s_q, s_k, d_v, b * h)      # A v
            return att_f(q, k, v, *args, **kwargs)

        def attention_backward(dout, cache):
            q, k, v = cache[0], cache[1], cache[2]
            b, h, s_q, d_h = q.shape
            s_k, d_v = k.shape[2], v.shape[3]
            self.add("attention backward", s_k, s_q, d_v, b * h)     # dV = A^T dout
            self.add("attention backward", s_q, d_v, s_k, b * h)     # dA = dout V^T
            self.add("attention backward", s_q, s_k, d_h, b * h)     # dQ = dZ K
            self.add("attention backward", s_k, s_q, d_h, b * h)     # dK = dZ^T Q
            return att_b(dout, cache)

        for mod, name, fn in ((F, "linear_forward", linear_forward),
                              (F, "linear_backward", linear_backward),
                              (F, "attention_forward", attention_forward),
                              (F, "attention_backward", attention_backward),
                              (blocks, "attention_forward", attention_forward),
                              (blocks, "attention_backward", attention_backward)):
            self._undo.append((mod, name, getattr(mod, name)))
            setattr(mod, name, fn)
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self._undo):
            setattr(mod, name, fn)
        return False


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
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)     # M_MMAP_THRESHOLD (also stops its dynamic growth)
        libc.mallopt(-1, 128 * 1024)    # M_TRIM_THRESHOLD
    except OSError:
        pass


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
        _, loss = self.model.forward(self.ids, self.targets, training=True)
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


# -- the same step in PyTorch eager --------------------------------------------------------

class TorchStep:
    """The same GPT-style decoder in PyTorch eager, weights copied from tfcore's flat buffer.

    Weights keep tfcore's layout ([D_in, D_out]: y = x @ W + b, through torch.addmm);
    attention is PyTorch's scaled_dot_product_attention (causal); AdamW is torch.optim.AdamW
    (the default implementation) with weight decay on the weight matrices only.
    """

    def __init__(self, cfg: DecoderConfig, params, ids, targets, attention="sdpa"):
        import torch

        self.torch, self.cfg, self.attention = torch, cfg, attention
        dt = getattr(torch, cfg.dtype)
        self.w = {n: torch.tensor(np.array(backend.to_numpy(params[n])), dtype=dt,
                                  requires_grad=True) for n in params.names}
        decay = [t for n, t in self.w.items() if n.endswith(".W")]
        rest = [t for n, t in self.w.items() if not n.endswith(".W")]
        self.opt = torch.optim.AdamW([dict(params=decay, weight_decay=WEIGHT_DECAY),
                                      dict(params=rest, weight_decay=0.0)],
                                     lr=LR, betas=BETAS, eps=EPS)
        self.ids = torch.tensor(np.asarray(ids))
        self.targets = torch.tensor(np.asarray(targets))
        self.loss = None
        for t in self.w.values():            # gradients live between steps, as tfcore's do
            t.grad = torch.zeros_like(t)

    def forward(self):
        torch, cfg, w = self.torch, self.cfg, self.w
        F = torch.nn.functional
        B, S = self.ids.shape
        D, H = cfg.d_model, cfg.n_heads

        def linear(x, name):
            y = torch.addmm(w[name + ".b"], x.reshape(-1, x.shape[-1]), w[name + ".W"])
            return y.view(*x.shape[:-1], y.shape[-1])

        x = w["wte"][self.ids] + w["wpe"][:S]
        for i in range(cfg.n_layers):
            h = F.layer_norm(x, (D,), w[f"h{i}.ln1.g"], w[f"h{i}.ln1.b"], cfg.eps)
            q, k, v = linear(h, f"h{i}.attn.qkv").split(D, -1)
            q, k, v = (t.view(B, S, H, D // H).transpose(1, 2) for t in (q, k, v))
            if self.attention == "sdpa":
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                z = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D // H))
                mask = torch.ones(S, S, dtype=torch.bool).triu(1)
                a = torch.softmax(z.masked_fill(mask, -math.inf), -1) @ v
            x = x + linear(a.transpose(1, 2).reshape(B, S, D), f"h{i}.attn.proj")
            h = F.layer_norm(x, (D,), w[f"h{i}.ln2.g"], w[f"h{i}.ln2.b"], cfg.eps)
            hidden = F.gelu(linear(h, f"h{i}.mlp.fc"), approximate=cfg.gelu_approximate)
            x = x + linear(hidden, f"h{i}.mlp.proj")
        x = F.layer_norm(x, (D,), w["lnf.g"], w["lnf.b"], cfg.eps)
        logits = x.view(-1, D) @ w["wte"].T
        return F.cross_entropy(logits, self.targets.view(-1), ignore_index=-100)

    def __call__(self):
        self.opt.zero_grad(set_to_none=False)
        loss = self.forward()
        loss.backward()
        self.opt.step()
        self.loss = float(loss)

    def first_loss(self) -> float:
        with self.torch.no_grad():
            return float(self.forward())

    def state_bytes(self) -> int:
        n = sum(t.numel() for t in self.w.values())
        return 4 * n * self.w["wte"].element_size()


# -- one configuration ---------------------------------------------------------------------

@dataclass
class Result:
    config: str
    dtype: str
    times: list
    flops: int
    formula: int
    peak: float
    tracemalloc: int
    rss: int | None
    predicted: int
    torch_times: list | None = None
    torch_rss: int | None = None
    loss_diff: float | None = None


def run_config(name, dtype, repeats, use_torch, peak, attention="sdpa", warmup=2):
    cfg, batch, seq = decoder_config(name, dtype)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, size=(batch, seq + 1))
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    ours = TfcoreStep(cfg, ids, targets)
    theirs = None
    loss_diff = None
    if use_torch:
        theirs = TorchStep(cfg, ours.model.params, ids, targets, attention)
        a, b = ours.first_loss(), theirs.first_loss()
        loss_diff = abs(a - b) / abs(b)
        bar = 1e-10 if dtype == "float64" else 1e-4
        if not loss_diff <= bar:
            raise AssertionError(f"{name} {dtype}: losses disagree, tfcore {a} PyTorch {b}")
    for _ in range(warmup):
        ours()
        if theirs is not None:
            theirs()
    times, torch_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ours()
        times.append(time.perf_counter() - start)
        if theirs is not None:
            start = time.perf_counter()
            theirs()
            torch_times.append(time.perf_counter() - start)
    rss = rss_peak_bytes(ours)
    rss = None if rss is None else rss + ours.state_bytes()
    traced = tracemalloc_peak_bytes(ours)
    torch_rss = None
    if theirs is not None:
        torch_rss = rss_peak_bytes(theirs)
        torch_rss = None if torch_rss is None else torch_rss + theirs.state_bytes()
    sizes = ours.model.size_table(batch, seq)
    n_params = ours.model.num_parameters()
    return Result(name, dtype, times, step_flops(cfg, batch, seq),
                  formula_flops(n_params, cfg, batch, seq), peak, traced + ours.state_bytes(),
                  rss, sizes["total_training_bytes"], torch_times or None, torch_rss, loss_diff)


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def report(r: Result, batch_tokens: int) -> str:
    med = statistics.median(r.times)
    spread = (max(r.times) - min(r.times)) / 2
    gflops = r.formula / med / 1e9
    line = (f"{r.config:6s} {r.dtype:7s} {med * 1e3:8.1f} ms +-{spread * 1e3:6.1f} "
            f"{batch_tokens / med:9.0f} tok/s  {r.formula / 1e9:7.3f} GFLOP "
            f"{gflops:6.1f} GFLOP/s {100 * gflops / r.peak:5.1f}% of peak  "
            f"mem MiB: traced {_mib(r.tracemalloc)} rss {_mib(r.rss)} "
            f"predicted {_mib(r.predicted)}")
    if r.torch_times:
        tmed = statistics.median(r.torch_times)
        tg = r.formula / tmed / 1e9
        ratio_mem = (r.rss / r.torch_rss) if (r.rss and r.torch_rss) else float("nan")
        line += (f"\n{'':14s} PyTorch {tmed * 1e3:8.1f} ms +-"
                 f"{(max(r.torch_times) - min(r.torch_times)) / 2 * 1e3:6.1f} "
                 f"{tg:6.1f} GFLOP/s {100 * tg / r.peak:5.1f}% of peak  rss "
                 f"{_mib(r.torch_rss)} MiB   loss rel diff {r.loss_diff:.1e}"
                 f"\n{'':14s} ratio tfcore/PyTorch: time {med / tmed:.2f}  "
                 f"peak memory {ratio_mem:.2f}")
    return line


# -- the profile ---------------------------------------------------------------------------

class Profiler:
    """Exclusive time per op: every *_forward, *_backward, *_update and layout helper of
    tfcore.functional, tfcore.nn and the model modules is wrapped while profiling; an op's
    time excludes the wrapped ops it calls. 'other' is the rest of the step (Python glue)."""

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
        modules = ["tfcore.functional", "tfcore.nn", "tfcore.models.blocks",
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


def profile(name, dtype, steps=5, warmup=2):
    cfg, batch, seq = decoder_config(name, dtype)
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
    rows = sorted(prof.totals.items(), key=lambda kv: -kv[1])
    lines = [f"profile of one tfcore step: {name} {dtype}, {total * 1e3:.1f} ms per step "
             f"(kernels {'on' if kernels.enabled() else 'off'})",
             f"{'op':40s} {'calls':>6s} {'ms/step':>8s} {'share':>6s}"]
    accounted = 0.0
    for label, t in rows:
        per = t / steps
        accounted += per
        lines.append(f"{label:40s} {prof.calls[label] // steps:6d} {per * 1e3:8.2f} "
                     f"{100 * per / total:5.1f}%")
    lines.append(f"{'other (Python between ops)':40s} {'':6s} {(total - accounted) * 1e3:8.2f} "
                 f"{100 * (total - accounted) / total:5.1f}%")
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------

def set_threads(n: int):
    """BLAS, Numba and PyTorch each use n threads (returns the threadpoolctl limiter)."""
    limiter = None
    try:
        from threadpoolctl import threadpool_limits

        limiter = threadpool_limits(n)
    except ImportError:
        pass
    if kernels.enabled():
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass
    return limiter


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tfcore.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"],
                        choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--torch-attention", choices=["sdpa", "math"], default="sdpa",
                        help="PyTorch's fused attention (default) or softmax(QK^T)V written out")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    backend.set_backend("numpy")
    _fix_malloc()
    limiter = set_threads(args.threads)
    use_torch = not args.no_torch
    if use_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("PyTorch is not installed (pip install -e .[bench]): tfcore alone")
            use_torch = False
    if kernels.enabled():
        print(f"kernels on (Numba): warm-up {kernels.warm_up(args.dtypes):.1f} s")
    else:
        print("kernels off: the reference array-API path")
    peaks = {dt: matmul_peak(dt) for dt in args.dtypes}
    print("matmul peak (NumPy, 1024^3 GEMM, best of 5): "
          + ", ".join(f"{dt} {p:.1f} GFLOP/s" for dt, p in peaks.items()))
    print(f"threads {args.threads}; FLOPs of a step = 6 N T + 12 L S^2 D B; memory: traced = "
          "tracemalloc peak + state, rss = VmHWM over the step + state (params, grads, m, v)")
    for name in args.configs:
        for dtype in args.dtypes:
            if args.profile:
                print(profile(name, dtype))
                continue
            r = run_config(name, dtype, args.repeats, use_torch, peaks[dtype],
                           args.torch_attention)
            c = CONFIGS[name]
            print(report(r, c["batch"] * c["seq"]), flush=True)
    del limiter


if __name__ == "__main__":
    main()
