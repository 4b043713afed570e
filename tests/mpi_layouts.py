"""Run under `mpiexec -n N python tests/mpi_layouts.py OUT.npz CASE ...`: each CASE
("layout | feature", a case of tests/test_layout_matrix.py, tests/test_expert_layouts.py or
tests/test_ulysses_layouts.py whose layout has N ranks) trains its AdamW steps on N
processes (MPIComm, ring collectives over point-to-point messages); rank 0 saves each
case's losses and parameters for the tests of those files that run it.

The matrices' LAYOUTS and FEATURES are merged: a name two of them use must name the same
layout or model (merge() refuses otherwise). A case belongs to the matrix that lists it,
which gives its steps, batch and sequence length (the matrices differ)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import test_expert_layouts
import test_layout_matrix
import test_ulysses_layouts

MATRICES = (test_layout_matrix, test_expert_layouts, test_ulysses_layouts)


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
FEATURES = merge(*(m.FEATURES for m in MATRICES), equal_ok=True)


def matrix_of(case: str):
    """The matrix module that lists the case "layout | feature", or a ValueError naming it."""
    lname, fname = case.split(" | ")
    matrix = next((m for m in MATRICES if (lname, fname) in m.CASES), None)
    if matrix is None:
        raise ValueError(f"{case!r} is a case of no matrix")
    return matrix


def resolve(case: str):
    """"layout | feature" -> (layout, config, steps, batch, seq): a case its matrix trains
    (one that Layout.validate accepts), or a ValueError naming it."""
    matrix = matrix_of(case)
    lname, fname = case.split(" | ")
    return LAYOUTS[lname], FEATURES[fname], matrix.STEPS, matrix.BATCH, matrix.SEQ


def check_under_mpi(tmp_path, size: int, cases: list[str], timeout: float) -> None:
    """Train `cases` (each of `size` ranks) in one `mpiexec -n size` of this script and
    assert each equals its matrix's one device: the losses and the parameters after its
    steps, relative difference below the matrix's TOL."""
    from mpi_tools import run_mpi

    out = tmp_path / "out.npz"
    here = Path(__file__).parent
    done = run_mpi(size, Path(__file__), [str(out), *cases], timeout, cwd=here)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = np.load(out)
    for i, case in enumerate(cases):
        lname, fname = case.split(" | ")
        matrix = matrix_of(case)
        ref = matrix._reference(fname, matrix.LAYOUTS[lname].clip)
        assert matrix._rel(saved[f"{i}_losses"], ref["losses"]) < matrix.TOL, case
        assert matrix._rel(saved[f"{i}_params"], ref["params"]) < matrix.TOL, case


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
