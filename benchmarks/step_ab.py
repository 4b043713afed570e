"""A training step of tfcore at a git revision (A) against the working tree (B), alternated.

    .venv/bin/python benchmarks/step_ab.py --base main                    # every config
    .venv/bin/python benchmarks/step_ab.py --base main --configs tiny --threads 1 2
    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 .venv/bin/python benchmarks/step_ab.py \\
        --base main --clock cpu --threads 1                              # a busy machine

The package as it was at --base is exported (git archive) into a temporary folder under the
name `tfcore_base` and imported beside the working tree's `tfcore`, so both run in one
process on the same inputs: a step of A, a step of B, round after round. A step is
forward + backward + AdamW of the benchmark's decoder (tfcore.bench's configs, tiled
attention as in benchmarks/results.json). For each library the figure kept is the minimum
over the rounds (the one least disturbed) and the median beside it; B / A below 1 means the
working tree is faster. Both losses must agree (the two packages compute the same step).

--clock wall (the default) is what a quiet machine should be measured with: it sees what
threads buy. --clock cpu counts the process's CPU time instead (time.process_time): on a
shared machine, with one thread, it shows what a change costs in instructions, but with
two threads it counts spinning workers as work and idle waits as nothing.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_base(ref: str) -> str:
    """tfcore at `ref` as the package tfcore_base in a temporary folder; returns the folder."""
    folder = tempfile.mkdtemp(prefix="tfcore-ab-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref, "tfcore"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    os.rename(os.path.join(folder, "tfcore"), os.path.join(folder, "tfcore_base"))
    return folder


def set_threads(packages, n):
    for pkg in packages:
        pkg.bench.set_threads(n)


def make_step(pkg, name, dtype):
    bench = pkg.bench
    cfg, batch, seq = bench.decoder_config(name, dtype, tiled=True)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(batch, seq + 1))
    return bench.TfcoreStep(cfg, tokens[:, :-1], tokens[:, 1:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="git revision of A (e.g. main)")
    parser.add_argument("--configs", nargs="+", default=["tiny", "small", "medium"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args(argv)

    sys.path.insert(0, export_base(args.base))
    sys.path.insert(0, ROOT)
    packages = {}
    for label, name in (("A", "tfcore_base"), ("B", "tfcore")):
        pkg = importlib.import_module(name)
        pkg.bench = importlib.import_module(name + ".bench")
        packages[label] = pkg
    importlib.import_module("tfcore.kernels").keep_freed_memory()   # as tfcore.bench does
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"A = {args.base}, B = working tree; {args.clock} clock, min (median) ms per step "
          f"over {args.rounds} alternated rounds")
    print(f"{'config':8s} {'dtype':8s} {'thr':>3s} {'A ms':>16s} {'B ms':>16s} {'B/A':>6s}")
    for threads in args.threads:
        set_threads(packages.values(), threads)
        for name in args.configs:
            for dtype in args.dtypes:
                steps = {k: make_step(p, name, dtype) for k, p in packages.items()}
                for step in steps.values():          # compile, warm the caches
                    step()
                    step()
                loss_a, loss_b = steps["A"].loss, steps["B"].loss
                assert abs(loss_a - loss_b) <= 1e-4 * abs(loss_a), (loss_a, loss_b)
                times = {k: [] for k in steps}
                for _ in range(args.rounds):
                    for k, step in steps.items():
                        start = clock()
                        step()
                        times[k].append(1e3 * (clock() - start))
                a, b = (min(times[k]) for k in ("A", "B"))
                ma, mb = (statistics.median(times[k]) for k in ("A", "B"))
                print(f"{name:8s} {dtype:8s} {threads:3d} {a:7.2f} ({ma:7.2f}) "
                      f"{b:7.2f} ({mb:7.2f}) {b / a:6.3f}", flush=True)


if __name__ == "__main__":
    main()
