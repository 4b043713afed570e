"""Is each op of the benchmark's step worth splitting over 2 threads? For a quiet machine.

    .venv/bin/python benchmarks/threads_ab.py                     # float32 and float64
    .venv/bin/python benchmarks/threads_ab.py --dtypes float32 --rounds 50

tfcore.kernels splits an op over its pool of threads only when each thread gets at least
MIN_GEMM_FLOPS_PER_THREAD flops (products) or MIN_ELEMENTS_PER_THREAD elements (element-wise
and row-wise ops); below that the op runs on the calling thread. This script times every
shape of the tiny, small and medium steps three ways, alternated round after round on the
same inputs (wall clock, minimum over the rounds):

  one    the op on the calling thread (single-threaded BLAS / Numba loop)
  split  the op split in 2 over the pool (each share single-threaded)
  blas2  products only: one call of a 2-thread BLAS (NumPy's own way)

and prints split / one (below 1: the split pays) beside what the thresholds choose. blas2 is
timed after the other two, and followed by a pause: once OpenBLAS has run on 2 threads its
own threads spin for a while, and on a 2-core machine a split run meanwhile found its second
core taken (the split then took as long as one thread, which made it look useless). On a
quiet 2-core machine the thresholds are right when every op they keep whole has
split / one near or above 1 and every op they split has it below 1. On a busy machine the
figures mean nothing (a worker that waits for a core makes every split look bad).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

from tfcore import bench, kernels

BLAS_THREADS_SETTLE = 1.0   # seconds: OpenBLAS's threads stop spinning well within this


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def shapes(name):
    """(label, kind, arrays maker) of the ops of one config's step."""
    c = bench.CONFIGS[name]
    T, D, V, S, B, H = (c["batch"] * c["seq"], c["d_model"], c["vocab_size"], c["seq"],
                        c["batch"], c["n_heads"])
    F = 4 * D
    ops = []
    for m, k, n in ((T, D, 3 * D), (T, D, D), (T, D, F), (T, F, D), (T, D, V), (D, T, F)):
        ops.append((f"gemm {m}x{k}x{n}", "gemm", (m, k, n)))
    ops.append((f"gelu fwd+bwd [{T}, {F}]", "gelu", (T, F)))
    ops.append((f"layernorm fwd+bwd [{T}, {D}]", "layernorm", (T, D)))
    ops.append((f"tiled attention [{B}, {H}, {S}, {D // H}]", "attention", (B, H, S, D // H)))
    return ops


def make(kind, dims, dtype, rng):
    """fn() running the op once through the kernels."""
    if kind == "gemm":
        m, k, n = dims
        a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        out = np.empty((m, n), dtype)
        return lambda: kernels.matmul(a, b, out=out), 2 * m * k * n
    if kind == "gelu":
        x, dy = (rng.standard_normal(dims).astype(dtype) for _ in range(2))
        return lambda: kernels.gelu_backward(dy, kernels.gelu_forward(x, "tanh"), "tanh"), \
            x.size
    if kind == "layernorm":
        x, dy = (rng.standard_normal(dims).astype(dtype) for _ in range(2))
        g, b = np.ones(dims[1], dtype), np.zeros(dims[1], dtype)

        def run():
            _, cache = kernels.layernorm_forward(x, g, b, 1e-5)
            kernels.layernorm_backward(dy, cache)
        return run, x.size
    q, k, v, do = (rng.standard_normal(dims).astype(dtype) for _ in range(4))
    scale = 1 / math.sqrt(dims[3])

    def attention():
        out, lse = kernels.tiled_attention_forward(q, k, v, True, scale)
        kernels.tiled_attention_backward(do, q, k, v, out, lse, True, scale)
    return attention, 2 * q.size * dims[2]          # the causal forward's flops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(bench.CONFIGS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    limiter = bench.set_threads(2)
    kernels.warm_up()
    rng = np.random.default_rng(0)
    defaults = (kernels.pool.MIN_GEMM_FLOPS_PER_THREAD, kernels.pool.MIN_ELEMENTS_PER_THREAD)

    def policy(split):
        kernels.pool.MIN_GEMM_FLOPS_PER_THREAD = 1 if split else 2 ** 62
        kernels.pool.MIN_ELEMENTS_PER_THREAD = 1 if split else 2 ** 62

    print(f"2 threads, wall clock, min over {args.rounds} alternated rounds (ms); "
          f"thresholds {defaults[0]} flops, {defaults[1]} elements per thread")
    print(f"{'config op':44s} {'dtype':8s} {'one':>8s} {'split':>8s} {'blas2':>8s} "
          f"{'split/one':>9s} {'chosen':>6s}")
    try:
        for name in args.configs:
            for dtype in args.dtypes:
                for label, kind, dims in shapes(name):
                    fn, work = make(kind, dims, dtype, rng)
                    per = defaults[0] if kind in ("gemm", "attention") else defaults[1]
                    chosen = "split" if work // per >= 2 else "one"
                    blas2 = None
                    if kind == "gemm":
                        m, k, n = dims
                        a = rng.standard_normal((m, k)).astype(dtype)
                        b = rng.standard_normal((k, n)).astype(dtype)
                        blas2 = lambda a=a, b=b: np.matmul(a, b)   # noqa: E731
                    best = {"one": math.inf, "split": math.inf, "blas2": math.inf}
                    for _ in range(args.rounds):
                        for mode in ("one", "split"):
                            policy(mode == "split")
                            best[mode] = min(best[mode], timed(fn))
                    if blas2 is not None:          # after the others: see the docstring
                        for _ in range(args.rounds):
                            best["blas2"] = min(best["blas2"], timed(blas2))
                        time.sleep(BLAS_THREADS_SETTLE)
                    b2 = f"{1e3 * best['blas2']:8.3f}" if blas2 is not None else f"{'':8s}"
                    print(f"{name[:6]:6s} {label:37s} {dtype:8s} {1e3 * best['one']:8.3f} "
                          f"{1e3 * best['split']:8.3f} {b2} "
                          f"{best['split'] / best['one']:9.3f} {chosen:>6s}", flush=True)
    finally:
        kernels.pool.MIN_GEMM_FLOPS_PER_THREAD, kernels.pool.MIN_ELEMENTS_PER_THREAD = defaults
        del limiter


if __name__ == "__main__":
    main()
