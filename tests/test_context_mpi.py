"""Context parallelism in real processes: `mpiexec -n 4` runs ring attention and a few AdamW
steps of the context-parallel decoder over MPIComm. Ring attention equals the dense op and
the trained parameters equal one device's (float64, 1e-12) and the simulated run's bit for
bit (the same code moves the same blocks and adds them in the same order); every rank sends
the bytes of the formula. mpiexec runs under a time limit (as in test_parallel_mpi.py), so
a hang fails the test instead of blocking the suite."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore.parallel import SimulatedGroup
from tfcore.parallel.context import ContextLayout, ring_attention_bytes
from tfcore.parallel.harness import CONFIGS, train_context_parallel, train_single

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")

TIMEOUT = 90      # seconds for one mpiexec, as test_parallel_mpi.py allows
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
N, SEQ, BATCH, HEADS, D_H, STEPS = 4, 19, 2, 3, 4, 3

SCRIPT = """
import sys
import numpy as np
from tfcore import functional as F
from tfcore.parallel import MPIComm
from tfcore.parallel.comm import abort_on_error
from tfcore.parallel.context import (
    ContextLayout,
    ring_attention_backward,
    ring_attention_forward,
)
from tfcore.parallel.harness import CONFIGS, train_context_parallel

with abort_on_error():
    world = MPIComm(timeout=60)
    layout = ContextLayout({seq}, world.size, balanced=True)
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(({batch}, {heads}, {seq}, {d_h})) for _ in range(4))
    shard = lambda x: layout.shard(x, world.rank, axis=2)
    out, cache = ring_attention_forward(shard(q), shard(k), shard(v), world, layout,
                                        causal=True, block_size=3)
    grads = ring_attention_backward(shard(g), cache)
    ring_sent = world.traffic.sent
    pieces = [world.all_gather_object(x) for x in (out, *grads)]
    train = train_context_parallel(world, CONFIGS["tiny"](), {steps}, 2, 16, balanced=True)
    sent = world.all_gather_object(ring_sent)
    if world.rank == 0:
        full = [layout.unshard(p, axis=2) for p in pieces]
        np.savez(sys.argv[1], out=full[0], dq=full[1], dk=full[2], dv=full[3],
                 losses=np.array(train["losses"]), params=train["params"],
                 ring_sent=np.array(sent))
"""


def test_context_parallel_under_mpi_equals_one_device(tmp_path):
    script = tmp_path / "context.py"
    script.write_text(SCRIPT.format(seq=SEQ, batch=BATCH, heads=HEADS, d_h=D_H, steps=STEPS))
    saved_path = tmp_path / "context.npz"
    done = subprocess.run([MPIEXEC, "-n", str(N), sys.executable, str(script),
                           str(saved_path)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = np.load(saved_path)

    from tfcore import functional as F

    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((BATCH, HEADS, SEQ, D_H)) for _ in range(4))
    ref, cache = F.attention_forward(q, k, v, causal=True)
    for name, want in zip(("out", "dq", "dk", "dv"), (ref, *F.attention_backward(g, cache))):
        got = saved[name]
        assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-12, name
    layout = ContextLayout(SEQ, N, balanced=True)
    formula = ring_attention_bytes(layout, BATCH, HEADS, D_H)
    assert saved["ring_sent"].tolist() == [f + b for f, b in zip(formula["forward"],
                                                                 formula["backward"])]

    config = CONFIGS["tiny"]()
    ref = train_single(config, STEPS, 2, 16)
    assert np.max(np.abs(saved["losses"] - ref["losses"]) / np.abs(ref["losses"])) < 1e-12
    assert np.max(np.abs(saved["params"] - ref["params"])) / np.max(np.abs(ref["params"])) < 1e-12
    sim = SimulatedGroup(N).run(train_context_parallel, config, STEPS, 2, 16, balanced=True)[0]
    np.testing.assert_array_equal(saved["params"], sim["params"])
    np.testing.assert_array_equal(saved["losses"], sim["losses"])
