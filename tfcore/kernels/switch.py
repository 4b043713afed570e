"""Whether a kernel may run: the on/off setting (tfcore.ops holds it: one switch for every
registered kernel), Numba's presence, the arrays a kernel takes, and the compiled loops
(tfcore.kernels._numba), loaded on first use."""
from __future__ import annotations

import importlib.util
import os

import numpy as np

from .. import ops as _ops

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_have_numba = importlib.util.find_spec("numba") is not None
_nb = None  # the compiled module, imported on first use


def available() -> bool:
    """Numba is installed (the kernels can run at all)."""
    return _have_numba


def enabled() -> bool:
    """Kernels are switched on and can run."""
    return _ops.kernels_enabled() and _have_numba


def set_enabled(flag: bool) -> bool:
    """Switch the kernels on or off for the whole process; returns the previous setting
    (tfcore.ops.set_kernels_enabled)."""
    return _ops.set_kernels_enabled(flag)


def disabled():
    """``with kernels.disabled():`` runs the reference path of every op inside the block
    (tfcore.ops.reference_only)."""
    return _ops.reference_only()


def applies(*arrays, contiguous: bool = True) -> bool:
    """True when a kernel may take these arrays (None entries are skipped): kernels are on,
    Numba is installed, and every array is a NumPy float32 or float64 array (one dtype),
    C-contiguous unless contiguous=False."""
    if not (_ops._kernels_on and _have_numba):
        return False
    dtype = None
    for a in arrays:
        if a is None:
            continue
        if type(a) is not np.ndarray or a.dtype not in _FLOATS:
            return False
        if dtype is None:
            dtype = a.dtype
        elif a.dtype != dtype:
            return False
        if contiguous and not a.flags.c_contiguous:
            return False
    return dtype is not None


def _k():
    global _nb
    if _nb is None:
        _writable_numba_cache()
        from . import _numba

        _nb = _numba
    return _nb


def _writable_numba_cache() -> None:
    """Point Numba's disk cache at a temporary folder when neither the package folder nor
    the home folder takes it (a read-only install, an unwritable home), with a warning that
    says how to choose; without this, compiling fails with "no locator available"."""
    import tempfile
    import warnings

    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    home_cache = os.path.join(os.path.expanduser("~"), ".cache")
    for folder in (os.path.dirname(__file__), home_cache):
        probe = folder
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if os.access(probe, os.W_OK):
            return
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="tfcore-numba-")
    warnings.warn(f"Numba cannot cache compiled kernels next to tfcore or in {home_cache}; "
                  f"using {os.environ['NUMBA_CACHE_DIR']} for this process (set "
                  "NUMBA_CACHE_DIR to keep a cache, or TFCORE_KERNELS=0 for the reference "
                  "path)", RuntimeWarning, stacklevel=3)
