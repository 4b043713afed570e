"""Train a few steps of a decoder on a DP x TP mesh and print the losses and a checksum.

    mpiexec -n 4 python -m tfcore.parallel --tp 2 --dp 2 --steps 3 --config tiny
    python -m tfcore.parallel --simulate --tp 2 --dp 2 --steps 3 --config tiny

The same rank-local code runs on MPI processes or, with --simulate, on threads of one
process. Rank 0 prints; --check also trains on one device and prints the largest relative
differences; --save writes losses and the final parameters (.npz).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from .comm import SimulatedGroup
from .runner import CONFIGS, checksum, train_parallel, train_single


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m tfcore.parallel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel degree "
                    "(default: world size / tp)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--zero", action="store_true", help="ZeRO-1 optimizer sharding")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="global batch (rows)")
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--algorithm", choices=("ring", "naive", "native"), default="ring",
                    help="collective algorithm (native: MPI's own, bytes not observed)")
    ap.add_argument("--simulate", action="store_true",
                    help="run the ranks as threads of this process (world size = tp x dp)")
    ap.add_argument("--check", action="store_true", help="compare with one device")
    ap.add_argument("--save", default=None, help="write losses and parameters to this .npz")
    ap.add_argument("--quiet-times", action="store_true", help="do not print step times")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    config = CONFIGS[args.config]()
    kw = dict(tp=args.tp, dp=args.dp, sequence_parallel=args.sp, zero=args.zero,
              seed=args.seed)
    try:
        if args.simulate:
            if args.algorithm == "native":
                raise ValueError("--algorithm native is MPI's own; simulate ring or naive")
            size = args.tp * (args.dp or 1)
            group = SimulatedGroup(size, args.algorithm)
            results = group.run(train_parallel, config, args.steps, args.batch, args.seq, **kw)
            traffics, rank, world_size = group.traffic, 0, size
        else:
            from .comm import MPIComm

            world = MPIComm(algorithm=args.algorithm)
            results = [train_parallel(world, config, args.steps, args.batch, args.seq, **kw)]
            rank, world_size = world.global_rank, world.size
            traffics = world.all_gather_object(world.traffic.summary())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if rank != 0:
        return 0
    out = results[0]
    mode = "simulated" if args.simulate else "MPI"
    print(f"{mode}: world {world_size} = tp {args.tp} x dp {world_size // args.tp}, "
          f"sp={args.sp}, zero={args.zero}, {args.algorithm}, config {args.config}")
    for t, loss in enumerate(out["losses"]):
        line = f"step {t}: loss {loss:.15f}"
        if not args.quiet_times:
            line += f"  ({out['times'][t] * 1e3:.1f} ms)"
        print(line)
    print("parameters:", checksum(out["params"]))
    sent = [t["sent"] if isinstance(t, dict) else t.sent for t in traffics]
    if args.algorithm == "native":
        print("bytes: not observed (MPI's own collectives)")
    else:
        print("bytes sent per rank (whole run):", sent, "total", sum(sent))
    if args.check:
        ref = train_single(config, args.steps, args.batch, args.seq, args.seed)
        dl = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], ref["losses"]))
        dp_ = float(np.max(np.abs(out["params"] - ref["params"])) / np.max(np.abs(ref["params"])))
        print(f"one device: max relative difference of the losses {dl:.1e}, "
              f"of the parameters {dp_:.1e}")
    if args.save:
        np.savez(args.save, losses=np.array(out["losses"]), params=out["params"],
                 sent=np.array(sent), times=np.array(out["times"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
