"""Composed layouts on real processes: 12 cases of the matrix (tests/test_layout_matrix.py)
under `mpiexec -n 4` and 4 under `mpiexec -n 8`, each equal to one device in float64
(losses and parameters after 3 AdamW steps, relative 1e-12). One mpiexec per world size,
bounded by TIMEOUT, so a hang fails the test instead of blocking."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_layout_matrix import CASES, LAYOUTS, TOL, _reference, _rel

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")

TIMEOUT = 300     # seconds for one mpiexec (8 processes on 2 cores take a while)
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
HERE = Path(__file__).parent


def _spread(size: int, count: int) -> list[str]:
    """`count` cases whose layout has `size` ranks, spread over the layouts and features."""
    mine = [(l, f) for l, f in CASES if LAYOUTS[l].world_size == size]
    step = max(len(mine) // count, 1)
    picked = [mine[i] for i in range(0, len(mine), step)][:count]
    assert len(picked) == count, (size, len(mine))
    return [f"{l} | {f}" for l, f in picked]


@pytest.mark.parametrize("size,count", [(4, 12), (8, 4)])
def test_composed_layouts_under_mpi_equal_one_device(tmp_path, size, count):
    cases = _spread(size, count)
    assert len({c.split(" | ")[0] for c in cases}) >= min(count, 2)   # several layouts
    out = tmp_path / "out.npz"
    done = subprocess.run([MPIEXEC, "-n", str(size), sys.executable,
                           str(HERE / "mpi_layouts.py"), str(out), *cases],
                          capture_output=True, text=True, timeout=TIMEOUT, env=ENV,
                          cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = np.load(out)
    for i, case in enumerate(cases):
        lname, fname = case.split(" | ")
        ref = _reference(fname, LAYOUTS[lname].clip)
        assert _rel(saved[f"{i}_losses"], ref["losses"]) < TOL, case
        assert _rel(saved[f"{i}_params"], ref["params"]) < TOL, case
