"""What every test that runs real processes needs: the mpiexec to start them with, a mark
that skips such a test where mpiexec or mpi4py is missing (as a fresh clone without
`pip install mpich mpi4py` is), and one bounded run of a script on n processes.

    from mpi_tools import needs_mpi, run_mpi
    done = run_mpi(4, SCRIPT, [str(out)], timeout=90)   # subprocess.CompletedProcess
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# the mpiexec installed beside this interpreter (pip install mpich), else one on the PATH
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
    "mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                               reason="mpi4py and mpiexec not installed (pip install mpich)")
# one thread a process: n processes share the machine's cores
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def run_mpi(n: int, script, args=(), timeout: float = 300, cwd=None):
    """`mpiexec -n n python script *args`, its output captured; killed (TimeoutExpired, a
    failure) after `timeout` seconds, so a hang fails the test instead of blocking it."""
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(script), *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)
