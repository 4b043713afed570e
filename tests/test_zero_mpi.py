"""ZeRO-2 and ZeRO-3 under mpiexec -n 4 (real processes, MPIComm, ring collectives over
point-to-point messages) equal one device in float64, and move the bytes of the formula.

mpiexec runs under a time limit (TIMEOUT), so a hang fails the test instead of blocking."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tfcore.parallel.harness import CONFIGS, train_single
from tfcore.parallel.volume import step_traffic

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")

TIMEOUT = 90      # seconds for one mpiexec: a healthy run takes a few (busy machine: ~20)
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
STEPS, BATCH, SEQ = 3, 4, 8

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from tfcore.parallel.comm import MPIComm, abort_on_error
    from tfcore.parallel.harness import CONFIGS, train_sharded

    name, tp, stage, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    with abort_on_error():
        world = MPIComm(algorithm="ring")
        res = train_sharded(world, CONFIGS[name](), {steps}, {batch}, {seq}, tp=tp,
                            stage=stage)
        sent = [sum(c.sent for c in calls) for calls in res["step_calls"]]
        every = world.all_gather_object(sent)
        if world.rank == 0:
            np.savez(out, params=res["params"], losses=res["losses"], sent=np.array(every))
""").format(steps=STEPS, batch=BATCH, seq=SEQ)


def _mpiexec(*args):
    """mpiexec with the given arguments, bounded by TIMEOUT."""
    return subprocess.run([MPIEXEC, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env=ENV)


@pytest.mark.parametrize("name,tp,stage", [("tiny", 1, 2), ("tiny", 1, 3),
                                           ("tiny-llama", 2, 3)])
def test_zero_under_mpi_equals_one_device(tmp_path, name, tp, stage):
    script = tmp_path / "zero_run.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.npz"
    done = _mpiexec("-n", "4", sys.executable, str(script), name, str(tp), str(stage),
                    str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    got = np.load(out)
    ref = train_single(CONFIGS[name](), STEPS, BATCH, SEQ)
    scale = np.max(np.abs(ref["params"]))
    assert np.max(np.abs(got["params"] - ref["params"])) / scale < 1e-12
    assert np.max(np.abs(got["losses"] - ref["losses"])) / max(ref["losses"]) < 1e-12
    formula = step_traffic(CONFIGS[name](), BATCH // (4 // tp), SEQ, tp, 4 // tp, False,
                           stage)
    for w, per_step in enumerate(got["sent"]):
        assert list(per_step) == [sum(formula[w].values())] * STEPS
