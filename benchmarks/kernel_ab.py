"""Old against new, kernel by kernel: each pair alternated in one process, many rounds.

    .venv/bin/python benchmarks/kernel_ab.py                 # medium's shapes, both dtypes
    .venv/bin/python benchmarks/kernel_ab.py --rounds 40 --threads 1

For each kernel, the previous implementation (A) and the current one (B) run one after the
other, round after round, on the same inputs; the figure kept for each is the minimum over
the rounds (the run least disturbed by anything else on the machine), with the median beside
it. On a busy machine the minimum is the figure to compare; the ratio B / A says what the
change bought. Pairs:

  gelu fwd+bwd  A: the Numba loop (scalar tanh per element)   B: NumPy SIMD ufuncs in chunks
  attention     A: dense attention kernel (full [S, S] scores) B: tiled, causal blocks skipped
  linear        A: rows split over threads (1-thread BLAS)     B: one multithreaded BLAS call
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from tfcore import kernels
from tfcore.kernels import _numba


def gelu_numba(x, dy):
    y, dx = np.empty_like(x), np.empty_like(x)
    _numba.gelu_tanh_forward(x.reshape(-1), y.reshape(-1))
    _numba.gelu_tanh_backward(dy.reshape(-1), x.reshape(-1), dx.reshape(-1))


def gelu_chunks(x, dy):
    kernels.gelu_forward(x, "tanh")
    kernels.gelu_backward(dy, x, "tanh")


def attention_dense(q, k, v, dout):
    out, cache = kernels.attention_forward(q, k, v, True, 1 / math.sqrt(q.shape[-1]), 0.0,
                                           None, False)
    kernels.attention_backward(dout, cache)


def attention_tiled(q, k, v, dout):
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = kernels.tiled_attention_forward(q, k, v, True, scale)
    kernels.tiled_attention_backward(dout, q, k, v, out, lse, True, scale)


def linear_split(x, W, dy):
    kernels.linear_forward(x, W, None)
    kernels.linear_backward(dy, x, W, False)


def linear_blas(x, W, dy):
    y = np.matmul(x, W)
    np.matmul(dy, W.T)
    np.matmul(x.T, dy)
    return y


def ab(name, a, b, args, rounds):
    a(*args)
    b(*args)
    ta, tb = [], []
    for _ in range(rounds):
        for fn, times in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
    print(f"{name:28s} A min {1e3 * min(ta):8.2f} ms (median {1e3 * statistics.median(ta):8.2f})"
          f"   B min {1e3 * min(tb):8.2f} ms (median {1e3 * statistics.median(tb):8.2f})"
          f"   B/A {min(tb) / min(ta):5.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--only", nargs="+", default=["gelu", "attention", "linear"])
    args = parser.parse_args()
    import numba
    from threadpoolctl import threadpool_limits

    limiter = threadpool_limits(args.threads)
    numba.set_num_threads(args.threads)
    kernels.warm_up(args.dtypes)
    rng = np.random.default_rng(0)
    B, S, D, H, F = 4, 256, 512, 8, 2048                 # the medium configuration
    print(f"threads {args.threads}, rounds {args.rounds}, medium shapes B={B} S={S} D={D} "
          f"H={H} F={F}")
    for dt in args.dtypes:
        if "gelu" in args.only:
            x = rng.standard_normal((B * S, F)).astype(dt)
            dy = rng.standard_normal((B * S, F)).astype(dt)
            ab(f"gelu fwd+bwd {dt}", gelu_numba, gelu_chunks, (x, dy), args.rounds)
        if "attention" in args.only:
            q, k, v, dout = (rng.standard_normal((B, H, S, D // H)).astype(dt)
                             for _ in range(4))
            ab(f"attention fwd+bwd {dt}", attention_dense, attention_tiled, (q, k, v, dout),
               args.rounds)
        if "linear" in args.only:
            x = rng.standard_normal((B * S, D)).astype(dt)
            W = rng.standard_normal((D, F)).astype(dt)
            dy = rng.standard_normal((B * S, F)).astype(dt)
            ab(f"linear fwd+bwd {dt} [T,D][D,F]", linear_split, linear_blas, (x, W, dy),
               args.rounds)
    del limiter


if __name__ == "__main__":
    main()
