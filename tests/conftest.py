"""Fixtures shared by the tfcore unit tests.

`backend_name` runs a test once per available backend: NumPy, array-api-strict (which
rejects everything outside the array API standard, and so keeps the CuPy code path honest
on a machine without a GPU), and CuPy when it is installed and sees a GPU. The previously
selected backend is restored afterwards.

`rng` is a NumPy generator seeded from the test's id: every test draws its own random
shapes and values, and draws the same ones on every run.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from tfcore import backend


def _available_backends() -> list[str]:
    names = ["numpy", "strict"]
    try:
        import cupy

        if cupy.cuda.is_available():
            names.append("cupy")
    except Exception:  # CuPy missing, or installed without a usable CUDA driver
        pass
    return names


BACKENDS = _available_backends()


@pytest.fixture(params=BACKENDS)
def backend_name(request):
    """Select each available backend in turn for the test; restore the previous one afterwards."""
    previous = backend.get_backend()
    backend.set_backend(request.param)
    try:
        yield request.param
    finally:
        backend.set_backend(previous)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test id (fixed across runs, different between tests)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture()
def kernels_on_numpy():
    """The kernels are for NumPy: a test that asks for this runs there whatever
    TFCORE_BACKEND says (a test that takes `backend_name` selects each backend itself), with
    the kernels switched on even when TFCORE_KERNELS=0 selects the reference for the rest of
    the suite; both settings are restored afterwards."""
    from tfcore import kernels

    previous = backend.get_backend()
    backend.set_backend("numpy")
    was_enabled = kernels.set_enabled(True)
    try:
        yield
    finally:
        kernels.set_enabled(was_enabled)
        backend.set_backend(previous)


@pytest.fixture(scope="session", autouse=True)
def _compiled_kernels():
    """Compile (or load from Numba's disk cache) every fused kernel once per test process,
    before any test: on a cold cache, a simulated rank that compiled a kernel in the middle
    of a step would keep the other ranks waiting in a collective, for up to their timeout."""
    from tfcore import kernels

    if kernels.available():
        kernels.warm_up()
