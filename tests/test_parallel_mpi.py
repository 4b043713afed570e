"""The same code in real processes: `mpiexec -n 2` and `-n 4` give the losses and the
parameters of the simulated run (bit for bit: the same algorithm moves the same chunks and
adds them in the same order) and of one device (1e-12), and send the same bytes.

And no run ever hangs: a rank that raises ends the whole job with its message, ranks that
call different collectives (another shape, another op) fail with a message naming both, and
a bad argument on any one rank stops every rank with `error: ...` and status 2. Every
mpiexec here runs under a time limit (TIMEOUT), so a hang fails the test instead of
blocking the suite.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore.parallel import SimulatedGroup
from tfcore.parallel import __main__ as cli
from tfcore.parallel.harness import CONFIGS, train_parallel, train_single

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")


TIMEOUT = 90      # seconds for one mpiexec: a healthy run takes a few (busy machine: ~20)
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
CLI = [sys.executable, "-m", "tfcore.parallel"]


def _mpiexec(*args):
    """mpiexec with the given arguments (an MPMD ':' list works too), bounded by TIMEOUT."""
    return subprocess.run([MPIEXEC, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env=ENV)


def _mpi_run(tmp_path, n, *args):
    out = tmp_path / f"mpi{n}.npz"
    done = _mpiexec("-n", str(n), *CLI, *args, "--save", str(out), "--quiet-times")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "parameters: sum=" in done.stdout
    return np.load(out), done.stdout


@pytest.mark.parametrize("n,args", [
    (2, ["--tp", "2", "--config", "tiny-llama", "--sp"]),
    (4, ["--tp", "2", "--dp", "2", "--config", "tiny", "--zero"]),
])
def test_mpi_equals_simulation_and_one_device(tmp_path, n, args):
    steps, batch, seq = 3, 4, 8
    saved, stdout = _mpi_run(tmp_path, n, *args, "--steps", str(steps), "--check")
    assert "one device: max relative difference" in stdout
    opts = dict(zip(args[::2], args[1::2]))
    tp = int(opts["--tp"])
    config = CONFIGS[opts["--config"]]()
    group = SimulatedGroup(n)
    sim = group.run(train_parallel, config, steps, batch, seq, tp=tp, dp=n // tp,
                    sequence_parallel="--sp" in args, zero="--zero" in args)[0]
    np.testing.assert_array_equal(saved["losses"], sim["losses"])
    np.testing.assert_array_equal(saved["params"], sim["params"])
    assert saved["sent"].tolist() == [t.sent for t in group.traffic]
    ref = train_single(config, steps, batch, seq)
    assert np.max(np.abs(saved["losses"] - ref["losses"]) / np.abs(ref["losses"])) < 1e-12
    assert np.max(np.abs(saved["params"] - ref["params"])) / np.max(np.abs(ref["params"])) < 1e-12


def test_mpi_native_collectives_equal_one_device(tmp_path):
    """MPI's own collectives add in their own order: equal to 1e-12, bytes not observed."""
    saved, stdout = _mpi_run(tmp_path, 2, "--tp", "2", "--config", "tiny", "--algorithm",
                             "native", "--steps", "2")
    ref = train_single(CONFIGS["tiny"](), 2, 4, 8)
    assert np.max(np.abs(saved["params"] - ref["params"])) / np.max(np.abs(ref["params"])) < 1e-12
    assert "not observed" in stdout


@pytest.mark.parametrize("args", [
    ["--dp", "4", "--zero", "3"],
    ["--pp", "2", "--dp", "2", "--schedule", "1f1b"],
    ["--cp", "4"],
])
def test_mpi_zero3_pipeline_and_context_equal_simulation_and_one_device(tmp_path, args):
    """ZeRO-3, the pipeline and the ring under `mpiexec -n 4`: --check against one device
    passes, and the losses, parameters and bytes are the simulation's, bit for bit."""
    saved, stdout = _mpi_run(tmp_path, 4, *args, "--steps", "2", "--check")
    assert "one device: max relative difference" in stdout
    parsed = cli.parse([*args, "--steps", "2"])
    group = SimulatedGroup(4)
    sim = group.run(cli.train, parsed, cli.check_layout(parsed, 4))[0]
    np.testing.assert_array_equal(saved["losses"], sim["losses"])
    np.testing.assert_array_equal(saved["params"], sim["params"])
    assert saved["sent"].tolist() == [t.sent for t in group.traffic]


@pytest.mark.parametrize("args", [["--tp", "2", "--sp", "--micro-batches", "2"],
                                  ["--tp", "2", "--sp", "--micro-batches", "2", "--dropout",
                                   "0.1"]])
def test_mpi_accumulation_with_sequence_parallelism_passes_check(args):
    """Accumulation under `mpiexec -n 4` (tp 2 x dp 2) with sequence parallelism (each
    micro-batch's contribution to the replicated tensors' gradients summed once), and with
    dropout too (each micro-batch keeps its rows of the whole batch's masks): --check
    against one device (1e-12)."""
    done = _mpiexec("-n", "4", *CLI, *args, "--steps", "2", "--check", "--quiet-times")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "one device: max relative difference" in done.stdout


def test_mpi_reports_a_wrong_layout():
    done = _mpiexec("-n", "2", *CLI, "--tp", "3")
    assert done.returncode == 2
    assert done.stderr == "error: --tp 3: the world size 2 is not a multiple of tp=3\n"


@pytest.mark.parametrize("args,named", [
    (["--tp", "0"], "--tp must be a positive integer"),
    (["--batch", "0"], "--batch must be a positive integer"),
    (["--batch", "3"], "--batch 3 must be divisible by the data-parallel degree dp=2"),
    (["--tp", "two"], "argument --tp: invalid int value"),
    (["--cp", "2", "--dropout", "0.1"], "--cp 2 --dropout 0.1 --config tiny: context "
                                        "parallelism with dropout on dense attention"),
    (["--pp", "2", "--zero", "3"], "--pp 2 --zero 3: ZeRO-2/3 with pipeline parallelism "
                                   "(pp=2, zero=3)"),
    (["--cp", "4"], "--cp 4 needs 4 ranks, but the world has 2"),
    (["--pp", "2", "--dp", "2"], "--pp 2 --tp 1 --micro-batches 2: the mesh dp=2 x pp=2 x "
                                 "tp=1 needs 4 ranks, but the world has 2"),
])
def test_mpi_bad_argument_is_one_line_and_status_2(args, named):
    done = _mpiexec("-n", "2", *CLI, *args)
    assert done.returncode == 2
    assert done.stderr.startswith("error: " + named) and done.stderr.count("\n") == 1
    assert done.stdout == ""


def test_a_bad_argument_on_one_rank_stops_every_rank():
    """Rank 1 alone gets --steps 0 (an MPMD launch): rank 0 must not wait for it."""
    done = _mpiexec("-n", "1", *CLI, "--tp", "2", ":", "-n", "1", *CLI, "--tp", "2",
                    "--steps", "0")
    assert done.returncode == 2
    assert done.stderr == "error: rank 1: --steps must be a positive integer, got 0\n"


def test_an_unsupported_combination_on_one_rank_stops_every_rank():
    """Rank 1 alone asks for --sp with buckets: refused before rank 0 starts training."""
    done = _mpiexec("-n", "1", *CLI, "--tp", "2", ":", "-n", "1", *CLI, "--tp", "2",
                    "--sp", "--bucket-bytes", "1024")
    assert done.returncode == 2
    assert done.stderr.startswith("error: rank 1: --bucket-bytes 1024 --sp: gradient "
                                  "buckets with sequence parallelism (bucket_bytes=1024, "
                                  "sp=True)")
    assert done.stderr.count("\n") == 1 and done.stdout == ""


_PLANTED = """
import sys
import numpy as np
from tfcore.parallel import MPIComm
from tfcore.parallel.comm import abort_on_error

with abort_on_error():
    world = MPIComm(timeout=3)
    world.all_reduce(np.ones(5))              # every rank is running
    {body}
    world.barrier()
print("rank", world.rank, "finished")
"""


def _planted(tmp_path, n, body):
    script = tmp_path / "planted.py"
    script.write_text(_PLANTED.format(body=body))
    return _mpiexec("-n", str(n), sys.executable, str(script))


def test_a_raising_rank_ends_the_job_with_its_message(tmp_path):
    """Without the abort, ranks 0, 2 and 3 would wait in the barrier forever."""
    done = _planted(tmp_path, 4, 'if world.rank == 2:\n'
                                 '        raise RuntimeError("planted failure")')
    assert done.returncode != 0
    assert "rank 2: RuntimeError: planted failure" in done.stderr
    assert "finished" not in done.stdout


_FAILING_RANK = """
import sys
from mpi4py import MPI
from tfcore.parallel import __main__ as cli
from tfcore.parallel import harness

if MPI.COMM_WORLD.Get_rank() == 2:
    def failing(world, *args, **kwargs):
        raise RuntimeError("planted failure in training")
    harness.train_parallel = failing
sys.exit(cli.main(sys.argv[1:]))
"""
ENDS_WITHIN = 30      # seconds: a healthy 4-rank run takes a few; the default --timeout 600


def test_a_failing_rank_ends_the_real_command_within_seconds(tmp_path):
    """The command line itself (main_mpi, the default --timeout of 600 s, nothing shorter)
    with rank 2 raising as training starts, while ranks 0, 1 and 3 wait for it in their
    first collective: MPI_Abort must end the whole job within seconds. (A plain raise on
    rank 2 instead would leave the others waiting until the 600 s timeout.) The job runs in
    its own session so that a hang is killed with all its processes."""
    import signal
    import time

    script = tmp_path / "failing_rank.py"
    script.write_text(_FAILING_RANK)
    start = time.monotonic()
    job = subprocess.Popen([MPIEXEC, "-n", "4", sys.executable, str(script), "--dp", "4",
                            "--steps", "2", "--quiet-times"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        out, err = job.communicate(timeout=ENDS_WITHIN)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        pytest.fail(f"the job was still running {ENDS_WITHIN} s after one rank failed")
    elapsed = time.monotonic() - start
    assert job.returncode != 0
    assert "rank 2: RuntimeError: planted failure in training" in err
    assert "step 0" not in out
    assert elapsed < ENDS_WITHIN


def test_collectives_of_other_shapes_name_both(tmp_path):
    done = _planted(tmp_path, 4, "world.all_reduce(np.ones((2, 3 + (world.rank == 3))))")
    assert done.returncode != 0
    assert ("group rank 0 (world rank 0) called all_reduce(shape (2, 3), float64, op sum), "
            "group rank 3 (world rank 3) called all_reduce(shape (2, 4), float64, op sum)"
            in done.stderr)


def test_collectives_in_another_order_name_both(tmp_path):
    done = _planted(tmp_path, 2, "if world.rank == 0:\n"
                                 "        world.broadcast(np.ones(4))\n"
                                 "    world.all_gather(np.ones(4))")
    assert done.returncode != 0
    assert "called broadcast(shape (4,), float64, root 0)" in done.stderr
    assert "called all_gather(shape (4,), float64, axis 0)" in done.stderr


@pytest.mark.parametrize("common,ranks,named", [
    (["--pp", "2", "--dp", "2"], [[], ["--seed", "1"], [], []],
     "--seed 0 on ranks 0, 2, 3 and --seed 1 on rank 1"),
    (["--dp", "2"], [["--steps", "2"], ["--steps", "3"]],
     "--steps 2 on rank 0 and --steps 3 on rank 1"),
    (["--cp", "2"], [["--seq", "8"], ["--seq", "4"]], "--seq 8 on rank 0 and --seq 4 on rank 1"),
    (["--tp", "2"], [["--seq", "8"], ["--seq", "4"]], "--seq 8 on rank 0 and --seq 4 on rank 1"),
])
def test_ranks_started_with_different_valid_arguments_stop_before_any_work(common, ranks,
                                                                           named):
    """An MPMD launch whose ranks' arguments are each valid but differ: every rank compares
    every argument first, and the job ends at once with status 2 and one line naming the
    first argument that differs and the ranks of each value (not a run of replicas trained
    from different weights, a wait until --timeout, or MPI's "Message truncated")."""
    launch = []
    for extra in ranks:
        launch += [":", "-n", "1", *CLI, *common, *extra]
    done = _mpiexec(*launch[1:])
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == (f"error: the ranks were started with different arguments: {named}; "
                           "give every rank the same arguments\n")
    assert done.stdout == ""


def test_first_difference_names_the_first_differing_argument():
    every = [cli.argument_values(cli.parse(argv)) for argv in
             (["--dp", "2"], ["--dp", "2", "--seed", "0"], ["--dp", "2", "--steps", "4",
                                                            "--seed", "5"])]
    assert cli.first_difference(every[:2]) is None         # a default given explicitly
    assert cli.first_difference(every) == (
        "the ranks were started with different arguments: --steps 3 on ranks 0, 1 and "
        "--steps 4 on rank 2; give every rank the same arguments")
    options = [option for option, _ in every[0]]          # every option is compared
    assert set(options) == {a.option_strings[0] for a in cli._parser()._actions
                            if a.option_strings and a.dest != "help"}


def test_ranks_in_collectives_of_different_groups_time_out(tmp_path):
    """Rank 0 waits in its pair's all-reduce while rank 2, its partner, waits in the world's:
    no header can compare calls on different groups; the timeout (3 s here) ends the job."""
    done = _planted(tmp_path, 4, "pair = world.split(world.rank % 2)\n"
                                 "    if world.rank == 0:\n"
                                 "        pair.all_reduce(np.ones(3))\n"
                                 "    world.all_reduce(np.ones(3))")
    assert done.returncode != 0
    assert "TimeoutError" in done.stderr and "waited 3 s for" in done.stderr
