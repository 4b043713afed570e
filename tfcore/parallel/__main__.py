"""Train a few steps of a decoder on a DP x TP mesh and print the losses and a checksum.

    mpiexec -n 4 python -m tfcore.parallel --tp 2 --dp 2 --steps 3 --config tiny
    python -m tfcore.parallel --simulate --tp 2 --dp 2 --steps 3 --config tiny

The same rank-local code runs on MPI processes or, with --simulate, on threads of one
process. Rank 0 prints; --check also trains on one device and exits with status 1 when the
losses or the parameters differ from it by more than --check-tol (relative); --save writes
losses and the final parameters (.npz).

A bad argument ends the run before any training with one line `error: ...` and status 2
(under MPI every rank checks its arguments and the ranks agree before starting, so a rank
with other arguments stops them all). A failure during training under MPI prints the
failing rank's message and aborts the whole job (status 1) instead of leaving the other
ranks waiting; collectives called differently on different ranks fail with a message that
names both calls (--no-call-check turns that check off), and a rank that waits longer than
--timeout seconds for a message fails the job too.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np

from . import runner
from .comm import SimulatedGroup


class UsageError(ValueError):
    """A bad command-line argument (reported as `error: ...`, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # argparse's own checks: raise instead of exiting
        raise UsageError(message)


def _parser(quiet: bool = False) -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m tfcore.parallel", description=__doc__, allow_abbrev=False,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if quiet:                            # --help printed by one MPI rank, not by every one
        ap._print_message = lambda message, file=None: None
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel degree "
                    "(default: world size / tp)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--zero", action="store_true", help="ZeRO-1 optimizer sharding")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="global batch (rows)")
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--config", choices=sorted(runner.CONFIGS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--algorithm", choices=("ring", "naive", "native"), default="ring",
                    help="collective algorithm (native: MPI's own, bytes not observed)")
    ap.add_argument("--simulate", action="store_true",
                    help="run the ranks as threads of this process (world size = tp x dp)")
    ap.add_argument("--check", action="store_true",
                    help="compare with one device; exit 1 if they differ")
    ap.add_argument("--check-tol", type=float, default=1e-12,
                    help="largest relative difference --check accepts (default 1e-12)")
    ap.add_argument("--no-call-check", action="store_true",
                    help="MPI: skip the check that every rank calls the same collective")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="MPI: seconds a rank waits for a message or for the other ranks' "
                    "next collective before it fails the job (default 600)")
    ap.add_argument("--micro-batches", type=int, default=1, help="accumulate the gradient "
                    "over this many micro-batches of each rank's rows (weights c_k / T_c)")
    ap.add_argument("--clip", type=float, default=None, help="clip the gradient to this "
                    "global norm (over every shard, replicas counted once)")
    ap.add_argument("--bucket-bytes", type=int, default=None, help="all-reduce the gradient "
                    "in buckets of at most this many bytes, overlapped with the backward")
    ap.add_argument("--save", default=None, help="write losses and parameters to this .npz")
    ap.add_argument("--quiet-times", action="store_true", help="do not print step times")
    return ap


def parse(argv, quiet: bool = False) -> argparse.Namespace:
    """The arguments, checked: UsageError names the first bad one."""
    args = _parser(quiet).parse_args(argv)
    for name in ("tp", "steps", "batch", "seq"):
        value = getattr(args, name)
        if value < 1:
            raise UsageError(f"--{name} must be a positive integer, got {value}")
    if args.dp is not None and args.dp < 1:
        raise UsageError(f"--dp must be a positive integer, got {args.dp}")
    if args.seed < 0:
        raise UsageError(f"--seed must be a non-negative integer, got {args.seed}")
    if not 0 < args.timeout < float("inf"):
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.micro_batches < 1:
        raise UsageError(f"--micro-batches must be a positive integer, got "
                         f"{args.micro_batches}")
    if args.clip is not None and not 0 < args.clip < float("inf"):
        raise UsageError(f"--clip must be a positive finite norm, got {args.clip}")
    if args.bucket_bytes is not None and args.bucket_bytes < 1:
        raise UsageError(f"--bucket-bytes must be a positive number of bytes, got "
                         f"{args.bucket_bytes}")
    if args.bucket_bytes is not None and (args.zero or args.sp):
        raise UsageError("--bucket-bytes needs a replicated gradient: not with --zero or --sp")
    if not args.check_tol >= 0:          # also refuses nan
        raise UsageError(f"--check-tol must be a number >= 0, got {args.check_tol}")
    longest = runner.CONFIGS[args.config]().max_seq_len
    if args.seq > longest:
        raise UsageError(f"--seq {args.seq} exceeds the context of --config {args.config} "
                         f"({longest} positions)")
    if args.simulate and args.algorithm == "native":
        raise UsageError("--algorithm native is MPI's own; simulate ring or naive")
    if args.save is not None:
        folder = os.path.dirname(os.path.abspath(args.save))
        if os.path.isdir(args.save):
            raise UsageError(f"--save {args.save} is a folder; give a file name (.npz)")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UsageError(f"--save: the folder {folder} does not exist or is not writable")
    return args


def check_layout(args, world_size: int) -> int:
    """The data-parallel degree of a world of `world_size` ranks; UsageError names the
    argument when the sizes do not fit."""
    if args.dp is None:
        if world_size % args.tp:
            raise UsageError(f"--tp {args.tp}: the world size {world_size} is not a multiple "
                             f"of tp={args.tp}")
        dp = world_size // args.tp
    else:
        dp = args.dp
        if args.tp * dp != world_size:
            raise UsageError(f"--tp {args.tp} x --dp {dp} needs {args.tp * dp} ranks, but the "
                             f"world has {world_size}")
    if args.batch % dp:
        raise UsageError(f"--batch {args.batch} must be divisible by the data-parallel "
                         f"degree dp={dp}")
    if (args.batch // dp) % args.micro_batches:
        raise UsageError(f"--micro-batches {args.micro_batches} must divide the rows of each "
                         f"data-parallel rank ({args.batch // dp})")
    return dp


def compare(out, ref) -> tuple[float, float]:
    """Largest relative differences (losses, parameters) of a parallel run against one
    device: max |a - b| / |b| over the losses, max |a - b| / max |b| over the parameters."""
    losses, ref_losses = np.asarray(out["losses"]), np.asarray(ref["losses"])
    d_loss = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    d_params = float(np.max(np.abs(out["params"] - ref["params"]))
                     / np.max(np.abs(ref["params"])))
    return d_loss, d_params


def report(args, out, traffics, world_size, mode) -> int:
    """Rank 0's printout (and --check, --save); the exit status."""
    print(f"{mode}: world {world_size} = tp {args.tp} x dp {world_size // args.tp}, "
          f"sp={args.sp}, zero={args.zero}, {args.algorithm}, config {args.config}")
    for t, loss in enumerate(out["losses"]):
        line = f"step {t}: loss {loss:.15f}"
        if not args.quiet_times:
            line += f"  ({out['times'][t] * 1e3:.1f} ms)"
        print(line)
    print("parameters:", runner.checksum(out["params"]))
    sent = [t["sent"] if isinstance(t, dict) else t.sent for t in traffics]
    if args.algorithm == "native":
        print("bytes: not observed (MPI's own collectives)")
    else:
        print("bytes sent per rank (whole run):", sent, "total", sum(sent))
    if args.save:
        np.savez(args.save, losses=np.array(out["losses"]), params=out["params"],
                 sent=np.array(sent), times=np.array(out["times"]))
    if args.check:
        ref = runner.train_single(runner.CONFIGS[args.config](), args.steps, args.batch,
                                  args.seq, args.seed, clip=args.clip)
        d_loss, d_params = compare(out, ref)
        print(f"one device: max relative difference of the losses {d_loss:.1e}, "
              f"of the parameters {d_params:.1e}")
        if not (d_loss <= args.check_tol and d_params <= args.check_tol):
            print(f"error: --check: the parallel run differs from one device by more than "
                  f"--check-tol {args.check_tol:.0e} (losses {d_loss:.1e}, parameters "
                  f"{d_params:.1e})", file=sys.stderr)
            return 1
    return 0


def _train_kwargs(args, dp):
    return dict(tp=args.tp, dp=dp, sequence_parallel=args.sp, zero=args.zero, seed=args.seed,
                micro_batches=args.micro_batches, clip=args.clip,
                bucket_bytes=args.bucket_bytes)


def main_simulated(argv) -> int:
    try:
        args = parse(argv)
        dp = check_layout(args, args.tp * (args.dp or 1))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    config = runner.CONFIGS[args.config]()
    size = args.tp * dp
    group = SimulatedGroup(size, args.algorithm)
    try:
        results = group.run(runner.train_parallel, config, args.steps, args.batch, args.seq,
                            **_train_kwargs(args, dp))
    except Exception as err:             # a failure on a rank (its message names it)
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        print(f"error: {err}", file=sys.stderr)
        return 1
    return report(args, results[0], group.traffic, size, "simulated")


def main_mpi(argv) -> int:
    try:
        from mpi4py import MPI
    except ImportError:
        print("error: running without --simulate needs mpi4py and an MPI library "
              "(pip install mpi4py mpich)", file=sys.stderr)
        return 2
    from .comm import MPIComm, abort_on_error

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    with abort_on_error():
        # Every rank checks its own arguments, then all learn every rank's verdict: a rank
        # whose arguments are bad must not leave the others waiting in the first collective.
        args, problem, dp = None, None, None
        try:
            args = parse(argv, quiet=rank != 0)
            dp = check_layout(args, comm.Get_size())
        except UsageError as err:
            problem = str(err)
        except SystemExit as done:       # --help: every rank stops here
            problem = ("exit", done.code)
        problems = comm.allgather(problem)
        if any(p is not None for p in problems):
            first = next(r for r, p in enumerate(problems) if p is not None)
            if isinstance(problems[first], tuple):
                return int(problems[first][1] or 0)
            if rank == 0:
                where = "" if all(p == problems[first] for p in problems) else f"rank {first}: "
                print(f"error: {where}{problems[first]}", file=sys.stderr)
            return 2
        world = MPIComm(algorithm=args.algorithm, check_calls=not args.no_call_check,
                        timeout=args.timeout)
        config = runner.CONFIGS[args.config]()
        out = runner.train_parallel(world, config, args.steps, args.batch, args.seq,
                                    **_train_kwargs(args, dp))
        traffics = world.all_gather_object(world.traffic.summary())
        status = report(args, out, traffics, world.size, "MPI") if rank == 0 else 0
        # every rank exits with rank 0's status (--check runs on rank 0 only); the others
        # wait for it without spinning a core that rank 0's single-device run needs
        request = comm.Ibarrier()
        while not request.Test():
            time.sleep(0.005)
        return int(comm.bcast(status, root=0))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return main_simulated(argv) if "--simulate" in argv else main_mpi(argv)


if __name__ == "__main__":
    sys.exit(main())
