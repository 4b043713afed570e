"""Run under `mpiexec -n N python tests/mpi_layouts.py OUT.npz CASE ...`: each CASE
("layout | feature", a case of tests/test_layout_matrix.py whose layout has N ranks) trains
its 3 AdamW steps on N processes (MPIComm, ring collectives over point-to-point messages);
rank 0 saves each case's losses and parameters for tests/test_layout_matrix_mpi.py."""
from __future__ import annotations

import sys

import numpy as np

from tfcore.parallel import MPIComm
from tfcore.parallel.comm import abort_on_error
from tfcore.parallel.harness import train_layout

from test_layout_matrix import BATCH, FEATURES, LAYOUTS, SEQ, STEPS


def main(out_path: str, cases: list[str]) -> None:
    with abort_on_error():
        world = MPIComm(timeout=120)
        saved = {}
        for i, case in enumerate(cases):
            lname, fname = case.split(" | ")
            res = train_layout(world, FEATURES[fname], LAYOUTS[lname], STEPS, BATCH, SEQ)
            saved[f"{i}_losses"] = np.array(res["losses"])
            saved[f"{i}_params"] = res["params"]
        if world.rank == 0:
            np.savez(out_path, **saved)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
