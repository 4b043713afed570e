"""Train a few steps of a decoder with any of tfcore's parallelisms and print the losses
and a checksum.

    mpiexec -n 4 python -m tfcore.parallel --tp 2 --dp 2 --steps 3 --config tiny
    python -m tfcore.parallel --simulate --tp 2 --dp 2 --steps 3 --config tiny

The layouts (world size = the product of the degrees; --dp defaults to what is left):
    --tp T --dp D [--sp]        tensor (Megatron-LM) x data parallel, sequence parallel
    --zero {0,1,2,3}            ZeRO stage over the data-parallel ranks: 1 shards the
                                optimizer state, 2 also the gradients, 3 also the
                                parameters (FSDP); a bare --zero means 1
    --pp P [--schedule {gpipe,1f1b,interleaved}] [--virtual V] [--micro-batches M]
                                pipeline over P stages (DP x PP x TP mesh); V chunks per
                                rank need --schedule interleaved; M defaults to P
    --cp C                      context parallel: every sequence split over the C ranks
                                (ring attention, balanced causal chunks)
    --layers L, --dropout P     change the --config's number of blocks, its dropout
    --micro-batches K --bucket-bytes N
                                (--tp/--dp/--sp/--zero 0 or 1) accumulate the gradient
                                over K micro-batches (with --dropout each keeps its rows
                                of the whole batch's masks), all-reduce it in buckets
                                overlapped with the backward
    --clip C                    clip the gradient to the global norm C (every layout but
                                --cp: TP, DP, ZeRO 1/2/3, the pipeline's stages)

    mpiexec -n 4 python -m tfcore.parallel --dp 4 --zero 3 --check
    mpiexec -n 4 python -m tfcore.parallel --pp 2 --dp 2 --schedule gpipe --check
    python -m tfcore.parallel --simulate --pp 2 --schedule interleaved --virtual 2 \\
        --layers 4 --check
    python -m tfcore.parallel --simulate --cp 4 --check

The same rank-local code runs on MPI processes or, with --simulate, on threads of one
process. Rank 0 prints; --check also trains on one device and exits with status 1 when the
losses or the parameters differ from it by more than --check-tol (relative); --save writes
losses and the final parameters (.npz).

A bad argument ends the run before any training with one line `error: ...` and status 2
(under MPI every rank checks its arguments, then the ranks compare every argument before
starting: a rank with a bad argument, or with valid arguments other than rank 0's, stops
them all, and the line names the first argument that differs and the ranks of each
value). A failure during training under MPI prints the failing rank's message and aborts
the whole job (status 1) instead of leaving the other ranks waiting; collectives called
differently on different ranks fail with a message that names both calls (--no-call-check
turns that check off), and a rank that waits longer than --timeout seconds for a message
fails the job too.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
import time
import traceback

import numpy as np

from .. import kernels
from . import context, harness, pipeline
from .comm import SimulatedGroup
from .layout import REFUSALS, Layout, LayoutError
from .model import check_layout as check_model_layout


class UsageError(ValueError):
    """A bad command-line argument (reported as `error: ...`, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):            # argparse's own checks: raise instead of exiting
        raise UsageError(message)


def _parser(quiet: bool = False) -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m tfcore.parallel", description=__doc__ + refusals_text(),
                 allow_abbrev=False,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if quiet:                            # --help printed by one MPI rank, not by every one
        ap._print_message = lambda message, file=None: None
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel degree "
                    "(default: world size / tp)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--zero", type=int, nargs="?", const=1, default=0, choices=(0, 1, 2, 3),
                    help="ZeRO stage: 1 optimizer state, 2 also gradients, 3 also "
                    "parameters (FSDP) sharded over dp; a bare --zero means 1 (default 0)")
    ap.add_argument("--pp", type=int, default=None, help="pipeline-parallel stages")
    ap.add_argument("--schedule", choices=pipeline.SCHEDULES, default=None,
                    help="pipeline schedule (with --pp; default 1f1b, interleaved with "
                    "--virtual 2 or more)")
    ap.add_argument("--virtual", type=int, default=None,
                    help="model chunks per pipeline rank (with --pp and the interleaved "
                    "schedule; default 1)")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="micro-batches of each data-parallel replica's rows: with --pp the "
                    "pipeline's (default pp), otherwise gradient accumulation (weights "
                    "c_k / T_c; default 1)")
    ap.add_argument("--cp", type=int, default=None,
                    help="context-parallel degree: the sequence split over every rank")
    ap.add_argument("--ulysses", action="store_true",
                    help="with --cp: attention by heads after all-to-alls (DeepSpeed-Ulysses) "
                    "instead of the ring, on contiguous chunks")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel degree: an MoE config's experts over blocks of ep "
                    "data-parallel ranks (it divides dp; adds no ranks)")
    ap.add_argument("--layers", type=int, default=None,
                    help="number of blocks, replacing the config's (the pipeline needs it "
                    "divisible by pp x virtual)")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="dropout probability of the config (default 0)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="global batch (rows)")
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--config", choices=sorted(harness.CONFIGS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--algorithm", choices=("ring", "naive", "native"), default="ring",
                    help="collective algorithm (native: MPI's own, bytes not observed)")
    ap.add_argument("--simulate", action="store_true",
                    help="run the ranks as threads of this process (world size = cp, or "
                    "tp x pp x dp)")
    ap.add_argument("--check", action="store_true",
                    help="compare with one device; exit 1 if they differ")
    ap.add_argument("--check-tol", type=float, default=1e-12,
                    help="largest relative difference --check accepts (default 1e-12)")
    ap.add_argument("--no-call-check", action="store_true",
                    help="skip the check that every rank calls the same collective (on by "
                    "default, under MPI and --simulate)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="MPI: seconds a rank waits for a message or for the other ranks' "
                    "next collective before it fails the job (default 600)")
    ap.add_argument("--clip", type=float, default=None, help="clip the gradient to this "
                    "global norm (over every shard, replicas counted once)")
    ap.add_argument("--bucket-bytes", type=int, default=None, help="all-reduce the gradient "
                    "in buckets of at most this many bytes, overlapped with the backward")
    ap.add_argument("--save", default=None, help="write losses and parameters to this .npz")
    ap.add_argument("--quiet-times", action="store_true", help="do not print step times "
                    "(--pp and --cp runs do not time their steps)")
    return ap


# The command-line option of each field a refusal reads (Layout's, or the model config's).
OPTIONS = dict(dp="--dp", tp="--tp", pp="--pp", cp="--cp", ep="--ep", ulysses="--ulysses",
               zero="--zero",
               sp="--sp",
               micro_batches="--micro-batches", virtual="--virtual", schedule="--schedule",
               balanced=None, clip="--clip", bucket_bytes="--bucket-bytes",
               algorithm="--algorithm", transport="--simulate", dropout="--dropout",
               n_kv_heads="--config", n_heads="--config", recompute="--config",
               n_experts="--config", attention="--config")


def refusals_text() -> str:
    """The --help section listing Layout's refusals (layout.REFUSALS), one rule a line."""
    lines = ["", "Not supported, and refused before any work (one line `error: ...` naming the",
             "options and the reason, status 2); the list is tfcore.parallel.layout.REFUSALS:"]
    for rule in REFUSALS:
        options = " ".join(dict.fromkeys(OPTIONS[f] for f in rule.fields if OPTIONS[f]))
        lines.append(textwrap.fill(f"{rule.name} ({options}): {rule.why}", width=88,
                                   initial_indent="    ", subsequent_indent="        ",
                                   break_on_hyphens=False))
    return "\n".join(lines) + "\n"


def layout_of(args, dp: int | None = None) -> Layout:
    """The Layout of the arguments (dp: the data-parallel degree, when known)."""
    return Layout(dp=dp or args.dp or 1, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                  ulysses=args.ulysses,
                  zero=args.zero,
                  sp=args.sp, micro_batches=microbatches(args) or 1,
                  virtual=args.virtual or 1, schedule=args.schedule, clip=args.clip,
                  bucket_bytes=args.bucket_bytes, algorithm=args.algorithm,
                  transport="simulated" if args.simulate else "mpi")


def _given(args, field) -> str | None:
    """How the option of `field` was given on the command line ('--tp 2', '--sp'), or None."""
    option = OPTIONS[field]
    if option == "--config":
        return f"--config {args.config}"
    value = {"transport": args.simulate, "micro_batches": args.micro_batches,
             "dropout": args.dropout or None}.get(field, getattr(args, field, None))
    if value is None or value is False or (field in ("tp", "zero") and not value) or (
            field == "ep" and value == 1):
        return None
    return option if value is True else f"{option} {value}"


def validate_layout(args, dp: int | None = None, world: int | None = None) -> Layout:
    """Layout.validate of the arguments; UsageError: the options given, then its message."""
    layout = layout_of(args, dp)
    try:
        return layout.validate(config_of(args), world=world)
    except LayoutError as err:
        given = " ".join(dict.fromkeys(g for f in err.rule.fields
                                       if (g := _given(args, f)) is not None))
        error = UsageError(f"{given}: {err}" if given else str(err))
        error.rule = err.rule            # the refusal of layout.REFUSALS it reports
        raise error from None
    except ValueError as err:            # a size that does not fit (ep and dp, the world)
        raise UsageError(str(err)) from None


def parse(argv, quiet: bool = False) -> argparse.Namespace:
    """The arguments, checked: UsageError names the first bad one."""
    args = _parser(quiet).parse_args(argv)
    for name in ("tp", "ep", "steps", "batch", "seq"):
        value = getattr(args, name)
        if value < 1:
            raise UsageError(f"--{name} must be a positive integer, got {value}")
    if args.dp is not None and args.dp < 1:
        raise UsageError(f"--dp must be a positive integer, got {args.dp}")
    if args.seed < 0:
        raise UsageError(f"--seed must be a non-negative integer, got {args.seed}")
    if not 0 < args.timeout < float("inf"):
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.clip is not None and not 0 < args.clip < float("inf"):
        raise UsageError(f"--clip must be a positive finite norm, got {args.clip}")
    if args.bucket_bytes is not None and args.bucket_bytes < 1:
        raise UsageError(f"--bucket-bytes must be a positive number of bytes, got "
                         f"{args.bucket_bytes}")
    if not args.check_tol >= 0:          # also refuses nan
        raise UsageError(f"--check-tol must be a number >= 0, got {args.check_tol}")
    longest = harness.CONFIGS[args.config]().max_seq_len
    if args.seq > longest:
        raise UsageError(f"--seq {args.seq} exceeds the context of --config {args.config} "
                         f"({longest} positions)")
    if not 0 <= args.dropout < 1:        # also refuses nan
        raise UsageError(f"--dropout must be a probability in [0, 1), got {args.dropout}")
    check_combination(args)
    if args.save is not None:
        folder = os.path.dirname(os.path.abspath(args.save))
        if os.path.isdir(args.save):
            raise UsageError(f"--save {args.save} is a folder; give a file name (.npz)")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UsageError(f"--save: the folder {folder} does not exist or is not writable")
    return args


def check_combination(args) -> None:
    """The range of each pipeline and ring option, then Layout.validate (the combinations
    the library does not train, layout.REFUSALS), before any work."""
    for name in ("pp", "cp", "virtual", "micro_batches", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    validate_layout(args)


def argument_values(args) -> list[tuple[str, object]]:
    """[(option, value)] of every option, in the order --help lists them (parsed values:
    a default and the same value given explicitly are equal)."""
    return [(action.option_strings[0], getattr(args, action.dest))
            for action in _parser(quiet=True)._actions
            if action.option_strings and action.dest != "help"]


def first_difference(every) -> str | None:
    """every: argument_values of each rank. None when all agree, else one sentence naming
    the first option whose values differ and the ranks that hold each value."""
    for i, (option, _) in enumerate(every[0]):
        values = [args[i][1] for args in every]
        if any(v != values[0] for v in values):
            groups: dict = {}
            for rank, value in enumerate(values):
                groups.setdefault(repr(value), []).append(rank)
            held = " and ".join(f"{option} {value} on rank{'s' if len(ranks) > 1 else ''} "
                                f"{', '.join(map(str, ranks))}"
                                for value, ranks in groups.items())
            return (f"the ranks were started with different arguments: {held}; give every "
                    "rank the same arguments")
    return None


def config_of(args):
    """The model config of --config, with --layers and --dropout."""
    config = harness.CONFIGS[args.config]()
    changes = dict(dropout=args.dropout) if args.dropout else {}
    if args.layers is not None:
        changes["n_layers"] = args.layers
    return dataclasses.replace(config, **changes) if changes else config


def simulated_size(args) -> int:
    """The world size of a simulated run: the product of the degrees (--dp defaults to 1)."""
    return args.tp * (args.pp or 1) * (args.cp or 1) * (args.dp or 1)


def check_layout(args, world_size: int) -> int:
    """The data-parallel degree of a world of `world_size` ranks; UsageError names the
    arguments when the sizes do not fit."""
    config = config_of(args)
    inner = args.tp * (args.pp or 1) * (args.cp or 1)
    if args.pp is not None:              # the pipeline's check names its sizes
        try:
            dp = pipeline.check_pipeline_layout(
                config, world_size, args.pp, args.tp, args.dp, microbatches(args),
                args.virtual or 1, args.batch, schedule(args), args.cp, args.sp, args.zero)
        except LayoutError:
            validate_layout(args, args.dp)           # the refusal, named by its options
            raise
        except ValueError as err:
            flags = f"--pp {args.pp} --tp {args.tp} --micro-batches {microbatches(args)}"
            raise UsageError(f"{flags}: {err}") from None
    else:
        given = [f"--tp {args.tp}"] if args.tp != 1 or args.cp is None else []
        given += [f"--cp {args.cp}"] if args.cp is not None else []
        given += [f"--dp {args.dp}"] if args.dp is not None else []
        what = f"tp={args.tp}" + (f" x cp={args.cp}" if args.cp is not None else "")
        if args.dp is None:
            if world_size % inner and args.cp is not None and world_size < inner:
                raise UsageError(f"{' '.join(given)} needs {inner} ranks, but the world has "
                                 f"{world_size}")
            if world_size % inner:
                raise UsageError(f"{' '.join(given)}: the world size {world_size} is not a "
                                 f"multiple of {what}")
            dp = world_size // inner
        else:
            dp = args.dp
            if inner * dp != world_size:
                raise UsageError(f"{' '.join(given)} needs {inner * dp} ranks, but the "
                                 f"world has {world_size}")
    if args.pp is None:                  # (the pipeline's check names its micro-batches)
        if args.batch % dp:
            raise UsageError(f"--batch {args.batch} must be divisible by the data-parallel "
                             f"degree dp={dp}")
        if (args.batch // dp) % (args.micro_batches or 1):
            raise UsageError(f"--micro-batches {args.micro_batches} must divide the rows of "
                             f"each data-parallel rank ({args.batch // dp})")
    validate_layout(args, dp, world_size)            # the combination, with the real dp
    try:
        check_model_layout(config, args.tp, args.seq, args.sp and args.cp is None)
    except ValueError as err:
        raise UsageError(f"--tp {args.tp}: {err}") from None
    if args.cp is not None:
        try:
            ring = context.ContextLayout(args.seq, args.cp, balanced=True)
            sizes = sorted({ring.local_len(r) for r in range(args.cp)})
            if args.sp and any(n % args.tp for n in sizes):
                raise ValueError(f"with sequence parallelism the positions each ring rank "
                                 f"holds ({sizes}) must be divisible by the "
                                 f"tensor-parallel degree ({args.tp})")
        except ValueError as err:
            raise UsageError(f"--cp {args.cp} --seq {args.seq}: {err}") from None
    return dp


def microbatches(args) -> int:
    return args.micro_batches or args.pp


def schedule(args) -> str:
    """The pipeline's schedule: --schedule, else 1f1b (interleaved with --virtual 2 or more)."""
    return layout_of(args).pipeline_schedule


def compare(out, ref) -> tuple[float, float]:
    """Largest relative differences (losses, parameters) of a parallel run against one
    device: max |a - b| / |b| over the losses, max |a - b| / max |b| over the parameters."""
    losses, ref_losses = np.asarray(out["losses"]), np.asarray(ref["losses"])
    d_loss = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
    d_params = float(np.max(np.abs(out["params"] - ref["params"]))
                     / np.max(np.abs(ref["params"])))
    return d_loss, d_params


def layout_line(args, world_size: int) -> str:
    dp = world_size // (args.tp * (args.pp or 1) * (args.cp or 1))
    ring = "" if args.cp is None else f" x cp {args.cp}"
    if args.pp is not None:
        line = (f"world {world_size} = dp {dp} x pp {args.pp} x tp {args.tp}{ring}, "
                f"{schedule(args)} m={microbatches(args)} v={args.virtual or 1}")
    elif args.cp is not None:
        line = (f"world {world_size} = cp {args.cp}" if dp == args.tp == 1 else
                f"world {world_size} = dp {dp} x cp {args.cp} x tp {args.tp}")
        line += (" (Ulysses attention, contiguous chunks)" if args.ulysses
                 else " (ring attention, balanced chunks)")
        if args.sp or args.zero:
            line += f", sp={args.sp}, zero={args.zero}"
    else:
        line = (f"world {world_size} = tp {args.tp} x dp {dp}, "
                f"sp={args.sp}, zero={args.zero}")
    if args.ep > 1:
        line += f", ep={args.ep} (experts over blocks of {args.ep} dp ranks)"
    if args.layers is not None:
        line += f", {args.layers} layers"
    if args.dropout:
        line += f", dropout {args.dropout}"
    return f"{line}, {args.algorithm}, config {args.config}"


def train(world, args, dp):
    """Rank-local: the library's one training function, at the chosen layout."""
    return harness.train_layout(world, config_of(args), layout_of(args, dp), args.steps,
                               args.batch, args.seq, seed=args.seed)


def report(args, out, traffics, world_size, mode) -> int:
    """Rank 0's printout (and --check, --save); the exit status."""
    print(f"{mode}: {layout_line(args, world_size)}")
    times = out.get("times")             # the pipeline and the ring do not time their steps
    for t, loss in enumerate(out["losses"]):
        line = f"step {t}: loss {loss:.15f}"
        if times is not None and not args.quiet_times:
            line += f"  ({out['times'][t] * 1e3:.1f} ms)"
        print(line)
    print("parameters:", harness.checksum(out["params"]))
    sent = [t["sent"] if isinstance(t, dict) else t.sent for t in traffics]
    if args.algorithm == "native":
        print("bytes: not observed (MPI's own collectives)")
    else:
        print("bytes sent per rank (whole run):", sent, "total", sum(sent))
    if args.save:
        np.savez(args.save, losses=np.array(out["losses"]), params=out["params"],
                 sent=np.array(sent), times=np.array(times if times is not None else []))
    if args.check:
        ref = harness.train_single(config_of(args), args.steps, args.batch, args.seq,
                                  args.seed, clip=args.clip)
        d_loss, d_params = compare(out, ref)
        print(f"one device: max relative difference of the losses {d_loss:.1e}, "
              f"of the parameters {d_params:.1e}")
        if not (d_loss <= args.check_tol and d_params <= args.check_tol):
            print(f"error: --check: the parallel run differs from one device by more than "
                  f"--check-tol {args.check_tol:.0e} (losses {d_loss:.1e}, parameters "
                  f"{d_params:.1e})", file=sys.stderr)
            return 1
    return 0


def main_simulated(argv) -> int:
    try:
        args = parse(argv)
        size = simulated_size(args)
        dp = check_layout(args, size)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    group = SimulatedGroup(size, args.algorithm, check_calls=not args.no_call_check)
    try:
        results = group.run(train, args, dp)
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
        args, problem, dp, values = None, None, None, None
        try:
            args = parse(argv, quiet=rank != 0)
            dp = check_layout(args, comm.Get_size())
            values = argument_values(args)
        except UsageError as err:
            problem = str(err)
        except SystemExit as done:       # --help: every rank stops here
            problem = ("exit", done.code)
        every = comm.allgather((problem, values))
        problems = [p for p, _ in every]
        if any(p is not None for p in problems):
            first = next(r for r, p in enumerate(problems) if p is not None)
            if isinstance(problems[first], tuple):
                return int(problems[first][1] or 0)
            if rank == 0:
                where = "" if all(p == problems[first] for p in problems) else f"rank {first}: "
                print(f"error: {where}{problems[first]}", file=sys.stderr)
            return 2
        differ = first_difference([v for _, v in every])
        if differ is not None:           # valid on each rank, but not the same run
            if rank == 0:
                print(f"error: {differ}", file=sys.stderr)
            return 2
        world = MPIComm(algorithm=args.algorithm, check_calls=not args.no_call_check,
                        timeout=args.timeout)
        out = train(world, args, dp)
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
    kernels.keep_freed_memory()       # a step reuses last step's memory (no page faults)
    return main_simulated(argv) if "--simulate" in argv else main_mpi(argv)


if __name__ == "__main__":
    sys.exit(main())
