"""Backend selection and the few operations tfcore.backend provides itself."""
from __future__ import annotations

import math
import re
import sys
import types

import array_api_strict
import numpy as np
import pytest

from tfcore import backend
from tfcore.backend import BackendUnavailable, asarray, to_numpy
from tfcore.checks import dtype_name
from tfcore.gradcheck import assert_close


@pytest.fixture(autouse=True)
def _keep_backend():
    """Whatever a test selects, the backend selected before it is back afterwards."""
    previous = backend.get_backend()
    yield
    backend.set_backend(previous)


# --------------------------------------------------------------------------------------
# Selection


def test_unknown_backend_name_is_rejected_and_nothing_changes():
    before = backend.get_backend()
    with pytest.raises(ValueError, match=re.escape("unknown backend 'tpu': expected one of numpy, cupy, strict")):
        backend.set_backend("tpu")
    assert backend.get_backend() == before


def test_cupy_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    before = backend.get_backend()
    with pytest.raises(BackendUnavailable, match=re.escape("backend 'cupy' needs CuPy, which is not installed: pip install -e .[gpu]")):
        backend.set_backend("cupy")
    assert backend.get_backend() == before


def test_cupy_without_a_gpu(monkeypatch):
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    before = backend.get_backend()
    with pytest.raises(BackendUnavailable, match=re.escape("backend 'cupy' needs a CUDA GPU, and CuPy sees none on this machine")):
        backend.set_backend("cupy")
    assert backend.get_backend() == before
    assert issubclass(BackendUnavailable, RuntimeError)


def test_strict_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "array_api_strict", None)
    with pytest.raises(BackendUnavailable, match=re.escape("backend 'strict' needs array-api-strict")):
        backend.set_backend("strict")


@pytest.mark.parametrize("name", ["numpy", "strict"])
def test_environment_variable_chooses_the_default(monkeypatch, name):
    monkeypatch.setattr(backend, "_name", None)
    monkeypatch.setenv("TFCORE_BACKEND", name)
    assert backend.get_backend() == name
    x = asarray([1.0, 2.0])
    assert (type(x) is np.ndarray) == (name == "numpy")
    assert (type(x) is type(array_api_strict.asarray(1.0))) == (name == "strict")


def test_numpy_is_the_default(monkeypatch):
    monkeypatch.setattr(backend, "_name", None)
    monkeypatch.delenv("TFCORE_BACKEND", raising=False)
    assert backend.get_backend() == "numpy"


def test_bad_environment_variable(monkeypatch):
    monkeypatch.setattr(backend, "_name", None)
    monkeypatch.setenv("TFCORE_BACKEND", "tpu")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        backend.get_backend()


def test_set_backend_returns_the_namespace():
    assert backend.set_backend("strict") is array_api_strict
    assert backend.xp() is array_api_strict
    xp = backend.set_backend("numpy")
    assert backend.xp() is xp
    assert isinstance(xp.asarray([1.0]), np.ndarray)


# --------------------------------------------------------------------------------------
# Arrays on the selected backend


@pytest.mark.usefixtures("backend_name")
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "bool"])
def test_asarray_and_to_numpy_round_trip(dtype):
    host = np.array([[0, 1, 2], [3, 0, 5]]).astype(dtype)
    x = asarray(host.tolist(), dtype)
    assert dtype_name(x) == dtype
    assert tuple(x.shape) == (2, 3)
    back = to_numpy(x)
    assert isinstance(back, np.ndarray) and back.dtype == np.dtype(dtype)
    assert np.array_equal(back, host)
    # an array that already lives on some backend moves too
    assert np.array_equal(to_numpy(asarray(asarray(host))), host)


@pytest.mark.usefixtures("backend_name")
def test_asarray_takes_dtype_objects_and_refuses_masked_arrays():
    xp = backend.xp()
    for dtype in (np.float32, np.dtype("float32"), xp.float32, "float32"):
        assert dtype_name(asarray([1.0, 2.0], dtype)) == "float32"
    assert dtype_name(asarray([1, 2], xp.int64)) == "int64"
    with pytest.raises(TypeError, match=re.escape("masked arrays are not supported")):
        asarray(np.ma.masked_array([1.0, 2.0], mask=[0, 1]))


@pytest.mark.usefixtures("backend_name")
def test_uniform_follows_the_array_not_the_generator():
    """A NumPy generator with an array of another library still gives draws on that library."""
    like = asarray(np.zeros(1))
    draws = backend.uniform(np.random.default_rng(3), (4,), like=like)
    assert type(draws) is type(like)


@pytest.mark.usefixtures("backend_name")
def test_namespace_ignores_none_and_rejects_mixed():
    x = asarray(np.ones(3))
    assert backend.namespace(x, None) is backend.namespace(x)
    other = np.ones(3) if backend.get_backend() == "strict" else array_api_strict.asarray(np.ones(3))
    with pytest.raises(TypeError, match="inputs must be arrays of one library"):
        backend.namespace(x, other)


@pytest.mark.usefixtures("backend_name")
def test_scatter_add_with_repeated_indices(rng):
    target = asarray(np.zeros((4, 2)))
    index = asarray(np.array([1, 3, 1, 1, 0]), "int64")
    values = rng.standard_normal((5, 2))
    out = backend.scatter_add(target, index, asarray(values))
    expected = np.zeros((4, 2))
    for i, row in zip([1, 3, 1, 1, 0], values):
        expected[i] += row
    assert_close("scatter_add", out, expected)
    assert np.all(to_numpy(out)[2] == 0.0)


@pytest.mark.usefixtures("backend_name")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("width", [None, 5])
def test_scatter_add_makes_numpys_additions_in_numpys_order(rng, dtype, width):
    """Many repeats of few ids (an embedding's gradient): the bits of np.add.at, whose
    additions go row by row in the order of `index`, on every backend and every run (on a
    GPU, atomic adds would sum a row's repeats in whatever order the threads finish)."""
    rows, n = 7, 3000
    tail = () if width is None else (width,)
    start = rng.standard_normal((rows,) + tail).astype(dtype)
    index = rng.integers(-rows, rows, size=n)              # negative ids count from the end
    values = (rng.standard_normal((n,) + tail) * 10.0 ** rng.integers(-3, 4, (n,) + tail))
    values = values.astype(dtype)
    expected = start.copy()
    np.add.at(expected, index, values)
    for _ in range(2):
        out = backend.scatter_add(asarray(start.copy()), asarray(index, "int64"),
                                  asarray(values))
        assert dtype_name(out) == dtype
        assert np.array_equal(to_numpy(out), expected)


@pytest.mark.usefixtures("backend_name")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_erf(dtype):
    x = np.linspace(-3.0, 3.0, 13)
    out = backend.erf(asarray(x, dtype))
    assert dtype_name(out) == dtype
    assert_close("erf", out, [math.erf(v) for v in x], tol=1e-15 if dtype == "float64" else 1e-6)


@pytest.mark.usefixtures("backend_name")
def test_uniform_and_default_rng():
    like = asarray(np.zeros(1))
    u1 = backend.uniform(backend.default_rng(11), (200, 3), like=like)
    u2 = backend.uniform(backend.default_rng(11), (200, 3), like=like)
    assert type(u1) is type(like)
    h = to_numpy(u1)
    assert h.shape == (200, 3)
    assert np.all((h >= 0.0) & (h < 1.0))
    assert np.array_equal(h, to_numpy(u2))
    assert 0.4 < h.mean() < 0.6
