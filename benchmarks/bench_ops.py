"""Time every tfcore op, forward and backward, at a realistic size; print step times and GFLOP/s.

    .venv/bin/python benchmarks/bench_ops.py                  # float32, NumPy
    .venv/bin/python benchmarks/bench_ops.py --dtype float64
    TFCORE_BACKEND=cupy .venv/bin/python benchmarks/bench_ops.py   # on a GPU

Each figure is the median of --repeats runs after one warm-up. Peak memory is the largest
amount of host memory NumPy allocated during one forward+backward (tracemalloc), which
shows what each op keeps in its cache. Each op runs as the model runs it: through
tfcore.ops (its fused kernel where the kernel takes the call; --reference times the
proved functional op instead).
"""
from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np

from tfcore import backend, ops
from tfcore import functional as reference


class _Ops:
    """tfcore.ops' op where it has one, else the functional op (which is then the one the
    model runs); with reference=True, always the functional op."""

    def __init__(self, reference_only: bool = False):
        self.reference_only = reference_only

    def __getattr__(self, name):
        if not self.reference_only and hasattr(ops, name):
            return getattr(ops, name)
        return getattr(reference, name)


F = _Ops()


def synchronize():
    if backend.get_backend() == "cupy":
        import cupy

        cupy.cuda.Device().synchronize()


def measure(fn, repeats: int) -> float:
    fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(fn) -> int:
    if backend.get_backend() != "numpy":
        return 0
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference", action="store_true",
                        help="time the proved functional ops, not tfcore.ops' default path")
    args = parser.parse_args()
    F.reference_only = args.reference

    B, S, D, V, dt = args.batch, args.seq, args.width, args.vocab, args.dtype
    rng = np.random.default_rng(0)
    A = lambda a: backend.asarray(a, dt)
    x = A(rng.standard_normal((B, S, D)))
    dy = A(rng.standard_normal((B, S, D)))
    W = A(rng.standard_normal((D, 4 * D)) / np.sqrt(D))
    b = A(np.zeros(4 * D))
    dh = A(rng.standard_normal((B, S, 4 * D)))
    gamma, beta = A(np.ones(D)), A(np.zeros(D))
    scores = A(rng.standard_normal((B, 8, S, S)))
    dscores = A(rng.standard_normal((B, 8, S, S)))
    mask = F.causal_mask(S, dt)
    logits = A(rng.standard_normal((B, S, V)))
    labels = backend.asarray(rng.integers(0, V, (B, S)), "int64")
    ids = backend.asarray(rng.integers(0, V, (B, S)), "int64")
    E = A(rng.standard_normal((V, D)))
    drop_rng = backend.default_rng(0)

    def pair(forward, backward, upstream):
        return lambda: backward(upstream, forward()[1])

    cases = {
        "linear  [B,S,D]@[D,4D]": (pair(lambda: F.linear_forward(x, W, b), F.linear_backward, dh), 3 * 2 * B * S * D * 4 * D),
        "gelu exact [B,S,4D]": (pair(lambda: F.gelu_forward(dh), F.gelu_backward, dh), 0),
        "gelu tanh  [B,S,4D]": (pair(lambda: F.gelu_forward(dh, "tanh"), F.gelu_backward, dh), 0),
        "relu [B,S,4D]": (pair(lambda: F.relu_forward(dh), F.relu_backward, dh), 0),
        "softmax+causal [B,8,S,S]": (pair(lambda: F.softmax_forward(scores, mask), F.softmax_backward, dscores), 0),
        "layernorm [B,S,D]": (pair(lambda: F.layernorm_forward(x, gamma, beta), F.layernorm_backward, dy), 0),
        "rmsnorm [B,S,D]": (pair(lambda: F.rmsnorm_forward(x, gamma), F.rmsnorm_backward, dy), 0),
        "cross-entropy [B,S,V]": (pair(lambda: F.cross_entropy_forward(logits, labels), F.cross_entropy_backward, 1.0), 0),
        "embedding [V,D] gather": (pair(lambda: F.embedding_forward(ids, E), F.embedding_backward, dy), 0),
        "dropout p=0.1 [B,S,D]": (pair(lambda: F.dropout_forward(x, 0.1, drop_rng), F.dropout_backward, dy), 0),
    }
    print(f"backend={backend.get_backend()} dtype={dt} B={B} S={S} D={D} V={V} (median of {args.repeats})")
    print(f"{'op (forward+backward)':28s} {'ms':>9s} {'GFLOP/s':>9s} {'peak MiB':>9s}")
    for name, (fn, flops) in cases.items():
        seconds = measure(fn, args.repeats)
        rate = f"{flops / seconds / 1e9:9.1f}" if flops else f"{'-':>9s}"
        print(f"{name:28s} {seconds * 1e3:9.2f} {rate} {peak_bytes(fn) / 2**20:9.1f}")


if __name__ == "__main__":
    main()
