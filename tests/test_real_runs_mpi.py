"""What a real run needs, in real processes: under `mpiexec -n 4` the bucketed all-reduce
that overlaps the backward (ring on a progress thread, or MPI_Iallreduce) equals the
blocking one and one device, clipping over TP x DP with ZeRO-1 equals one device's clip,
and the same run placed by a host file on two host names (both this machine) gives the same
numbers. Every mpiexec runs under a time limit, so a hang fails instead of blocking."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore.parallel import SimulatedGroup
from tfcore.parallel.harness import CONFIGS, train_parallel, train_single

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")

TIMEOUT = 120
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
PROGRAM = str(Path(__file__).with_name("mpi_real_runs.py"))
STEPS, BATCH, SEQ, BUCKET, MAX_NORM = 2, 8, 8, 2048, 0.1


def _run(tmp_path, *launch):
    out = tmp_path / "out.npz"
    done = subprocess.run([MPIEXEC, *launch, "-n", "4", sys.executable, PROGRAM, str(out)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=ENV,
                          cwd=str(Path(__file__).parents[1]))
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(out)


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _check(saved):
    config = CONFIGS["tiny"]()
    # overlapped == blocking buckets bit for bit, and == the simulation's bit for bit
    np.testing.assert_array_equal(saved["overlap_params"], saved["blocking_params"])
    sim = SimulatedGroup(4).run(train_parallel, config, STEPS, BATCH, SEQ, dp=4,
                                bucket_bytes=BUCKET, micro_batches=2)[0]
    np.testing.assert_array_equal(saved["overlap_params"], sim["params"])
    one = train_single(config, STEPS, BATCH, SEQ)
    for name in ("overlap", "native"):       # MPI's own sum adds in its own order: 1e-12
        assert _rel(saved[f"{name}_params"], one["params"]) < 1e-12
        assert _rel(saved[f"{name}_losses"], np.array(one["losses"])) < 1e-12
    clipped = train_single(config, STEPS, BATCH, SEQ, clip=MAX_NORM)
    assert min(clipped["norms"]) > 5 * MAX_NORM           # the clip acts
    assert _rel(saved["clip_norms"], np.array(clipped["norms"])) < 1e-12
    assert _rel(saved["clip_params"], clipped["params"]) < 1e-12


def test_overlap_and_clipping_under_mpi(tmp_path):
    _check(_run(tmp_path))


def test_two_host_names_from_a_host_file(tmp_path):
    """Two distinct names of this machine, two ranks each: hydra starts one proxy per name
    (without ssh: both resolve to this machine) and tells each rank its host's name."""
    other = socket.gethostname()
    if other in ("localhost", ""):
        pytest.skip("this machine's host name is 'localhost': no second name to use")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost:2\n{other}:2\n")
    saved = _run(tmp_path, "-f", str(hostfile))
    assert saved["hosts"].tolist() == ["localhost", "localhost", other, other]
    _check(saved)


def test_the_command_line_under_mpi():
    """The CLI's options under mpiexec: accumulation, overlapped buckets and clipping on
    dp = 4, checked against one device by --check (status 1 if they differ)."""
    done = subprocess.run([MPIEXEC, "-n", "4", sys.executable, "-m", "tfcore.parallel",
                           "--batch", "8", "--micro-batches", "2", "--bucket-bytes", "2048",
                           "--clip", "0.1", "--check", "--quiet-times"],
                          capture_output=True, text=True, timeout=TIMEOUT, env=ENV,
                          cwd=str(Path(__file__).parents[1]))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "one device: max relative difference" in done.stdout


@pytest.mark.parametrize("layout", [["--pp", "2", "--tp", "2", "--layers", "4"],
                                    ["--dp", "2", "--tp", "2", "--zero", "3"]])
def test_clipping_of_the_pipeline_and_zero3_under_mpi(layout):
    """--clip with the pipeline (stages x TP, tied head) and with ZeRO-3 (dp x tp) under
    `mpiexec -n 4`, checked against one device's clip by --check (status 1 if they differ;
    0.1 is below these steps' gradient norms, so the clip acts)."""
    from test_parallel_mpi import CLI, _mpiexec

    done = _mpiexec("-n", "4", *CLI, *layout, "--batch", "8", "--clip", "0.1", "--check",
                    "--quiet-times")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "one device: max relative difference" in done.stdout
