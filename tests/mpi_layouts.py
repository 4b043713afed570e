"""Run under `mpiexec -n N python tests/mpi_layouts.py OUT.npz CASE ...`: each CASE
("layout | feature", a case of tests/test_layout_matrix.py or of tests/test_expert_layouts.py
whose layout has N ranks) trains its AdamW steps on N processes (MPIComm, ring collectives
over point-to-point messages); rank 0 saves each case's losses and parameters for
tests/test_layout_matrix_mpi.py and tests/test_expert_layouts.py.

The two matrices' LAYOUTS and FEATURES are merged: a layout name both use must name the
same layout, and no feature name is in both (merge() refuses either). A case's feature
names its matrix, which gives its steps, batch and sequence length (the matrices differ)."""
from __future__ import annotations

import sys

import numpy as np

import test_expert_layouts
import test_layout_matrix

MATRICES = (test_layout_matrix, test_expert_layouts)


def merge(*dicts: dict, equal_ok: bool) -> dict:
    """One dict of `dicts`; a name in two of them is refused unless `equal_ok` and its
    values are equal (then it means one thing)."""
    merged: dict = {}
    for d in dicts:
        for name, value in d.items():
            if name in merged and not (equal_ok and merged[name] == value):
                raise ValueError(f"the name {name!r} collides between the matrices")
            merged[name] = value
    return merged


LAYOUTS = merge(*(m.LAYOUTS for m in MATRICES), equal_ok=True)
FEATURES = merge(*(m.FEATURES for m in MATRICES), equal_ok=False)
MATRIX_OF = {fname: m for m in MATRICES for fname in m.FEATURES}


def resolve(case: str):
    """"layout | feature" -> (layout, config, steps, batch, seq): a case its matrix trains
    (one that Layout.validate accepts), or a ValueError naming it."""
    lname, fname = case.split(" | ")
    matrix = MATRIX_OF.get(fname)
    if matrix is None or (lname, fname) not in matrix.CASES:
        raise ValueError(f"{case!r} is a case of neither matrix")
    return LAYOUTS[lname], FEATURES[fname], matrix.STEPS, matrix.BATCH, matrix.SEQ


def main(out_path: str, cases: list[str]) -> None:
    from tfcore.parallel import MPIComm
    from tfcore.parallel.comm import abort_on_error
    from tfcore.parallel.harness import train_layout

    with abort_on_error():
        resolved = [resolve(case) for case in cases]      # every name, before any work
        world = MPIComm(timeout=120)
        saved = {}
        for i, (layout, config, steps, batch, seq) in enumerate(resolved):
            res = train_layout(world, config, layout, steps, batch, seq)
            saved[f"{i}_losses"] = np.array(res["losses"])
            saved[f"{i}_params"] = res["params"]
        if world.rank == 0:
            np.savez(out_path, **saved)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
