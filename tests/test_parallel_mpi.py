"""The same code in real processes: `mpiexec -n 2` and `-n 4` give the losses and the
parameters of the simulated run (bit for bit: the same algorithm moves the same chunks and
adds them in the same order) and of one device (1e-12), and send the same bytes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore.parallel import SimulatedGroup
from tfcore.parallel.runner import CONFIGS, train_parallel, train_single

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")


def _mpi_run(tmp_path, n, *args):
    out = tmp_path / f"mpi{n}.npz"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "tfcore.parallel", *args,
           "--save", str(out), "--quiet-times"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "parameters: sum=" in done.stdout
    return np.load(out), done.stdout


@pytest.mark.parametrize("n,args", [
    (2, ["--tp", "2", "--config", "tiny-llama", "--sp"]),
    (4, ["--tp", "2", "--dp", "2", "--config", "tiny", "--zero"]),
])
def test_mpi_equals_simulation_and_one_device(tmp_path, n, args):
    steps, batch, seq = 3, 4, 8
    saved, stdout = _mpi_run(tmp_path, n, *args, "--steps", str(steps))
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


def test_mpi_reports_a_wrong_layout(tmp_path):
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "tfcore.parallel", "--tp", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "world size 2 is not a multiple of tp=3" in done.stderr
