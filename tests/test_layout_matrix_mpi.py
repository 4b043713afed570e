"""Composed layouts on real processes: 12 cases of the matrix (tests/test_layout_matrix.py)
under `mpiexec -n 4` and 4 under `mpiexec -n 8`, each equal to one device in float64
(losses and parameters after 3 AdamW steps, relative 1e-12). One mpiexec per world size,
bounded by TIMEOUT, so a hang fails the test instead of blocking."""
from __future__ import annotations

import pytest

from mpi_layouts import check_under_mpi
from mpi_tools import needs_mpi
from test_layout_matrix import CASES, LAYOUTS

TIMEOUT = 300     # seconds for one mpiexec (8 processes on 2 cores take a while)


def _spread(size: int, count: int) -> list[str]:
    """`count` cases whose layout has `size` ranks, spread over the layouts and features."""
    mine = [(l, f) for l, f in CASES if LAYOUTS[l].world_size == size]
    step = max(len(mine) // count, 1)
    picked = [mine[i] for i in range(0, len(mine), step)][:count]
    assert len(picked) == count, (size, len(mine))
    return [f"{l} | {f}" for l, f in picked]


@needs_mpi
@pytest.mark.parametrize("size,count", [(4, 12), (8, 4)])
def test_composed_layouts_under_mpi_equal_one_device(tmp_path, size, count):
    cases = _spread(size, count)
    assert len({c.split(" | ")[0] for c in cases}) >= min(count, 2)   # several layouts
    check_under_mpi(tmp_path, size, cases, TIMEOUT)
