"""Exposed communication with and without overlap, in real processes.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python benchmarks/overlap_mpi.py [--out FILE]

Pure data parallelism over 4 ranks (dp = 4) on the "small" config (float64), each rank
training on its rows of the batch; three ways to all-reduce the gradient [P]:

    one all-reduce    after the backward, the whole buffer at once (the baseline)
    buckets, blocking the same buckets as below, each all-reduced after the backward
    buckets, overlap  each bucket started (iall_reduce) as soon as its blocks are done,
                      waited on before the optimizer step

for two transports: "ring" (tfcore's ring over MPI point-to-point messages; a non-blocking
bucket runs on the communicator's progress thread) and "native" (MPI_Allreduce, and
MPI_Iallreduce for the buckets). The exposed communication of a step is the time this rank
spent blocked in the gradient all-reduce or in wait(): what the step would lose to the
network if compute were free. The modes alternate within one process, round after round,
and the first step of every run is dropped (warm-up). Around every run rank 0 reads
/proc/stat and subtracts the CPU time of the job's own processes: the CPU used by other
processes meanwhile is reported with the figures (a busy machine is not a measurement).
Writes a small JSON (default benchmarks/overlap_mpi.json) that chapter 22 reads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path

import numpy as np

from tfcore.parallel.comm import MPIComm, abort_on_error
from tfcore.parallel.harness import CONFIGS, train_parallel

MODES = [("one all-reduce", None, True), ("buckets, blocking", "B", False),
         ("buckets, overlap", "B", True)]


def _busy_jiffies():
    """(busy, total) CPU jiffies of the whole machine since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def _own_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--batch", type=int, default=8, help="global rows (2 per rank)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first dropped)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-bytes", type=int, default=1 << 20)
    ap.add_argument("--out", default=str(Path(__file__).with_name("overlap_mpi.json")))
    args = ap.parse_args()
    config = CONFIGS[args.config]()
    hz = os.sysconf("SC_CLK_TCK")
    rows = []
    with abort_on_error():
        probe = MPIComm()
        for rnd in range(args.rounds):
            for algorithm in ("ring", "native"):
                for mode, bucket, overlap in MODES:
                    world = MPIComm(algorithm=algorithm)
                    world.barrier()
                    busy0, own0, wall0 = _busy_jiffies()[0], _own_cpu(), time.time()
                    out = train_parallel(world, config, args.steps, args.batch, args.seq,
                                         dp=world.size, overlap=overlap, gather=False,
                                         bucket_bytes=args.bucket_bytes if bucket else None)
                    own = world.all_gather_object(_own_cpu() - own0)
                    busy, wall = (_busy_jiffies()[0] - busy0) / hz, time.time() - wall0
                    rows.append(dict(round=rnd, algorithm=algorithm, mode=mode,
                                     exposed=world.all_gather_object(out["exposed"][1:]),
                                     step=world.all_gather_object(out["times"][1:]),
                                     others_cpu=max(0.0, busy - sum(own)) / wall))
        if probe.rank != 0:
            return
        P = sum(int(np.prod(s)) for s in config.param_shapes().values())
        summary = []
        for algorithm in ("ring", "native"):
            for mode, _, _ in MODES:
                mine = [r for r in rows if r["algorithm"] == algorithm and r["mode"] == mode]
                exposed = np.array([r["exposed"] for r in mine])     # [rounds, N, steps-1]
                step = np.array([r["step"] for r in mine])
                summary.append(dict(
                    algorithm=algorithm, mode=mode,
                    exposed_ms=[round(1e3 * float(np.median(exposed[:, n, :])), 1)
                                for n in range(exposed.shape[1])],
                    step_ms=round(1e3 * float(np.median(step)), 1),
                    others_cpu=round(float(np.median([r["others_cpu"] for r in mine])), 2)))
        result = dict(
            command="OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python benchmarks/overlap_mpi.py",
            config=args.config, parameters=P, gradient_bytes=8 * P,
            bucket_bytes=args.bucket_bytes, world=probe.size, batch=args.batch,
            seq=args.seq, kept_steps=(args.steps - 1) * args.rounds,
            threads=os.environ.get("OPENBLAS_NUM_THREADS", "unset"),
            cpus=os.cpu_count(), machine=platform.processor() or platform.machine(),
            loadavg=open("/proc/loadavg").read().split()[:3], summary=summary)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"config {args.config}: P = {P} parameters, gradient {8 * P / 1e6:.1f} MB "
              f"(float64), buckets of {args.bucket_bytes / 1e6:.2f} MB, {probe.size} ranks, "
              f"OPENBLAS_NUM_THREADS={result['threads']}, {os.cpu_count()} CPUs, "
              f"load average {' '.join(result['loadavg'])}")
        print(f"{'transport':9} {'all-reduce':18} {'exposed ms per rank':>26} "
              f"{'step ms':>8} {'others':>7}")
        for s in summary:
            ranks = " ".join(f"{v:6.1f}" for v in s["exposed_ms"])
            print(f"{s['algorithm']:9} {s['mode']:18} {ranks:>26} {s['step_ms']:8.1f} "
                  f"{s['others_cpu']:7.2f}")
        print("(medians over the kept steps; others: CPUs' worth of other processes' use)")


if __name__ == "__main__":
    main()
