"""The pipeline in real processes: `mpiexec -n 4` runs GPipe, 1F1B (with tensor
parallelism) and interleaved 1F1B (with data parallelism) and each equals one device in
float64 and the simulation of the same layout bit for bit, with the same point-to-point
bytes. Every mpiexec runs under a time limit, so a hang fails instead of blocking."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore.parallel import SimulatedGroup
from tfcore.parallel.harness import train_pipeline, train_single

pytest.importorskip("mpi4py")
from test_parallel_mpi import MPIEXEC, _mpiexec  # noqa: E402

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")

SCRIPT = Path(__file__).with_name("mpi_pipeline.py")
sys.path.insert(0, str(SCRIPT.parent))
import mpi_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def mpi_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline") / "runs.npz"
    done = _mpiexec("-n", "4", sys.executable, str(SCRIPT), str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pipeline runs: gpipe, 1f1b, interleaved" in done.stdout
    return np.load(out)


@pytest.mark.parametrize("run", list(mpi_pipeline.LAYOUTS))
def test_mpi_pipeline_equals_one_device_and_the_simulation(mpi_runs, run):
    name, layout = mpi_pipeline.LAYOUTS[run]
    config = mpi_pipeline.config_of(name)
    steps, batch, seq = mpi_pipeline.STEPS, mpi_pipeline.BATCH, mpi_pipeline.SEQ
    ref = train_single(config, steps, batch, seq)
    losses, params, grads = (mpi_runs[f"{run}_{k}"] for k in ("losses", "params", "grads"))
    rel = lambda a, b: np.max(np.abs(a - b)) / np.max(np.abs(b))  # noqa: E731
    assert rel(losses, np.array(ref["losses"])) < 1e-12
    assert rel(params, ref["params"]) < 1e-12
    assert rel(grads, ref["grads"]) < 1e-12
    sim = SimulatedGroup(4).run(train_pipeline, config, steps, batch, seq, **layout)
    np.testing.assert_array_equal(params, sim[0]["params"])
    np.testing.assert_array_equal(losses, sim[0]["losses"])
    assert mpi_runs[f"{run}_sent"].tolist() == [sum(r["sent"]) for r in sim]
