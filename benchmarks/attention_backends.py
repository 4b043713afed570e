"""Dense against tiled attention in a whole training step, on the backend you choose.

    .venv/bin/python benchmarks/attention_backends.py                   # NumPy (the kernels)
    python benchmarks/attention_backends.py --backend cupy              # on a GPU

For tfcore.bench's configurations (and long4k: S = 4096, B = 1), one DecoderLM step
(forward, backward, AdamW; float32) with attention="dense" and one with "tiled": the best
and the median of 8 timed steps after 3 warm-up steps, the two losses' difference, and the
memory the backend's allocator holds after the steps (CuPy's pool; on NumPy, '-'). On NumPy
the tiled op is the fused kernel of tfcore.kernels; on CuPy it is the reference of
tfcore.functional, a Python loop over tiles whose every step is a few GPU launches, against
the dense attention's few large products: which is why the decoder's default stays dense.
--block-sizes times the tiled op with larger tiles (DecoderConfig.attention_block_size):
fewer, larger launches, for memory that grows with the tile's side, not with S^2.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfcore import backend, bench  # noqa: E402

CONFIGS = ("tiny", "small", "medium", "s256", "long", "long2k", "long4k")


def step_times(name, tiled, pool, block=64):
    if pool is not None:
        pool.free_all_blocks()
    cfg, batch, seq = bench.decoder_config(name, "float32", tiled)
    cfg = dataclasses.replace(cfg, attention_block_size=block)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(batch, seq + 1))
    step = bench.TfcoreStep(cfg, tokens[:, :-1], tokens[:, 1:])
    for _ in range(3):
        step()
    times = []
    for _ in range(8):
        start = time.perf_counter()
        step()                          # ends with float(loss): the device has finished
        times.append(time.perf_counter() - start)
    held = None if pool is None else pool.total_bytes() / 2**20
    return 1e3 * min(times), 1e3 * float(np.median(times)), step.loss, held, batch, seq


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[64],
                        help="the tiled op's tile sides to time (default: the decoder's 64)")
    args = parser.parse_args(argv)
    backend.set_backend(args.backend)
    bench.CONFIGS.setdefault("long4k", dict(vocab_size=1024, d_model=256, n_layers=2,
                                            n_heads=4, seq=4096, batch=1))
    pool = None
    if args.backend == "cupy":
        import cupy

        pool = cupy.get_default_memory_pool()
    print(f"backend {args.backend}; float32; ms per step: best (median) of 8")
    for name in args.configs:
        dense = step_times(name, False, pool)
        for block in args.block_sizes:
            tiled = step_times(name, True, pool, block)
            mib = ("-", "-") if pool is None else (f"{dense[3]:.1f}", f"{tiled[3]:.1f}")
            side = "" if args.block_sizes == [64] else f" block {block:4d}"
            print(f"{name:7s} S={dense[5]:5d} B={dense[4]:2d}  dense {dense[0]:8.2f} "
                  f"({dense[1]:8.2f}) MiB {mib[0]:>7s}  tiled{side} {tiled[0]:8.2f} "
                  f"({tiled[1]:8.2f}) MiB {mib[1]:>7s}  tiled/dense {tiled[0] / dense[0]:6.2f}"
                  f"  loss diff {abs(dense[2] - tiled[2]):.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
