"""Which array library tfcore computes with, and the few operations the libraries do not share.

Every op in tfcore is written once against the Python array API standard and asks its
inputs for their namespace (`namespace(x)`), so the same line of code runs on

* ``numpy``  -- the default, on the CPU;
* ``cupy``   -- on an NVIDIA GPU (``pip install -e .[gpu]``);
* ``strict`` -- array-api-strict, a deliberately minimal implementation of the standard.
  It has no GPU, but it refuses everything outside the standard that NumPy would quietly
  accept and CuPy might not, so running the op tests on it keeps the CuPy path honest on
  machines without a GPU.

Choose with the environment variable ``TFCORE_BACKEND`` or with :func:`set_backend`.
The backend decides where *new* arrays are created (:func:`asarray`, :func:`default_rng`);
an op always computes where its inputs already live.

The operations the standard leaves out, and which tfcore needs, live here once:
:func:`erf` (exact GELU), :func:`scatter_add` (embedding backward with repeated ids) and
:func:`uniform` (dropout masks). And one entry point every matmul of the ops goes through,
:func:`matmul`, so that :func:`count_matmuls` can observe the products a step really makes.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading

import array_api_compat
import numpy as np

BACKENDS = ("numpy", "cupy", "strict")
FLOAT_DTYPES = ("float32", "float64")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine (library or GPU missing)."""


def _import_backend(name: str):
    """Return the array namespace of backend `name`, or raise a clear error."""
    if name == "numpy":
        return array_api_compat.array_namespace(np.empty(0))
    if name == "strict":
        try:
            import array_api_strict
        except ImportError as err:
            raise BackendUnavailable(
                "backend 'strict' needs array-api-strict: pip install array-api-strict"
            ) from err
        return array_api_strict
    if name == "cupy":
        try:
            import cupy
        except ImportError as err:
            raise BackendUnavailable(
                "backend 'cupy' needs CuPy, which is not installed: pip install -e .[gpu]"
            ) from err
        if not cupy.cuda.is_available():
            raise BackendUnavailable(
                "backend 'cupy' needs a CUDA GPU, and CuPy sees none on this machine"
            )
        return array_api_compat.array_namespace(cupy.empty(0))
    raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")


_name: str | None = None
_xp = None


def set_backend(name: str):
    """Select the backend new arrays are created on; returns its array namespace."""
    global _name, _xp
    xp = _import_backend(name)  # raises before changing anything
    _name, _xp = name, xp
    return xp


def get_backend() -> str:
    """The name of the selected backend ('numpy' unless TFCORE_BACKEND or set_backend says otherwise)."""
    if _name is None:
        set_backend(os.environ.get("TFCORE_BACKEND", "numpy"))
    return _name


def xp():
    """The array namespace of the selected backend."""
    get_backend()
    return _xp


def namespace(*arrays):
    """The array namespace the given arrays live in (None entries are ignored).

    Raises TypeError when they come from different libraries: ops never move data silently.
    """
    present = [a for a in arrays if a is not None]
    try:
        return array_api_compat.array_namespace(*present)
    except TypeError as err:
        kinds = sorted({type(a).__module__ + "." + type(a).__name__ for a in present})
        raise TypeError(
            f"inputs must be arrays of one library, got {', '.join(kinds)}; "
            "move them with tfcore.backend.asarray first"
        ) from err


def is_numpy(x) -> bool:
    return isinstance(x, np.ndarray)


def is_cupy(x) -> bool:
    return array_api_compat.is_cupy_array(x)


def to_numpy(x) -> np.ndarray:
    """Copy (or view) any backend's array, or a Python number, as a NumPy array on the host."""
    if isinstance(x, np.ndarray):
        return x
    if is_cupy(x):
        return x.get()
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return np.asarray(x)


def dtype_string(dtype) -> str:
    """The name of a dtype given as a string, a NumPy type or dtype, or any backend's dtype object.

    'float32', np.float32, np.dtype('float32') and array_api_strict.float32 all give 'float32'.
    """
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, (type, np.dtype)):
        return np.dtype(dtype).name
    return str(dtype).rsplit(".", 1)[-1].removeprefix("dtype('").removesuffix("')")


def asarray(x, dtype=None):
    """Put `x` (a list, a NumPy array, or any backend's array) on the selected backend.

    `dtype` is a name ('float32', 'float64', 'int64', 'bool', ...) or a dtype object
    (np.float32, the backend's xp.float32).
    """
    ns = xp()
    host = to_numpy(x)
    if isinstance(host, np.ma.MaskedArray):
        raise TypeError("masked arrays are not supported, pass x.filled(...) or x.data")
    if dtype is not None:
        host = host.astype(dtype_string(dtype), copy=False)
    return ns.asarray(host)


def expected_overflow():
    """A context in which overflow and invalid results are expected and handled by the caller.

    NumPy (and array-api-strict, which computes with NumPy) would print a RuntimeWarning for
    an intermediate inf or nan that the op then detects and repairs; CuPy never warns.
    """
    return np.errstate(over="ignore", invalid="ignore")


def default_rng(seed: int | None = None):
    """A random generator that creates numbers on the selected backend (used by dropout)."""
    if get_backend() == "cupy":
        import cupy

        return cupy.random.default_rng(seed)
    return np.random.default_rng(seed)


def uniform(rng, shape: tuple[int, ...], like):
    """Uniform numbers in [0, 1) of `shape`, on the same library as the array `like`."""
    draws = rng.random(shape)
    if (is_numpy(like) and is_numpy(draws)) or (is_cupy(like) and is_cupy(draws)):
        return draws
    return namespace(like).asarray(to_numpy(draws))  # a generator of another library


def erf(x):
    """The error function, element-wise, on x's own library (not part of the array API)."""
    if is_numpy(x):
        from scipy.special import erf as scipy_erf

        return scipy_erf(x)
    if is_cupy(x):
        from cupyx.scipy.special import erf as cupy_erf

        return cupy_erf(x)
    from scipy.special import erf as scipy_erf

    return namespace(x).asarray(scipy_erf(to_numpy(x)))


def scatter_add(target, index, values):
    """target[index[i]] += values[i] along axis 0, correct when `index` repeats; returns target.

    target [R, ...], index [N] integer in [0, R), values [N, ...].
    NumPy and CuPy update `target` in place; other libraries return a new array, so always
    use the return value.
    """
    if is_numpy(target):
        np.add.at(target, index, values)
        return target
    if is_cupy(target):
        return _cupy_scatter_add(target, index, values)
    host = np.array(to_numpy(target))  # writable copy
    np.add.at(host, to_numpy(index), to_numpy(values))
    return namespace(target).asarray(host)


_segment_add = None     # the CuPy kernel of _cupy_scatter_add, compiled on first use


def _cupy_scatter_add(target, index, values):
    """np.add.at(target, index, values) on the GPU, making NumPy's additions in NumPy's order:
    target row r gets its values one after the other, in the order they come in `index`.
    (cupyx.scatter_add adds with atomics, in whatever order the threads finish: a sum of
    repeated ids, an embedding's gradient, then changed in its last bits from run to run.)
    The values are grouped by row with a sort on (index, position); one GPU thread then
    sums a row's group column by column."""
    import cupy

    global _segment_add
    n = int(index.shape[0])
    if n == 0 or target.size == 0:
        return target
    if not target.flags.c_contiguous:             # the kernel writes rows of width `width`
        host = np.array(to_numpy(target))
        np.add.at(host, to_numpy(index), to_numpy(values))
        target[...] = cupy.asarray(host)
        return target
    if _segment_add is None:
        _segment_add = cupy.ElementwiseKernel(
            "raw T values, raw int64 starts, raw int64 ends, raw int64 rows, int64 width",
            "raw T target",
            """
            const long long group = i / width, column = i - group * width;
            const long long at = rows[group] * width + column;
            T total = target[at];
            for (long long r = starts[group]; r < ends[group]; ++r)
                total += values[r * width + column];
            target[at] = total;
            """, "tfcore_segment_add")
    rows_of = target.shape[0]
    index = index.astype(cupy.int64, copy=False)
    index = cupy.where(index < 0, index + rows_of, index)            # NumPy's negative ids
    values = cupy.broadcast_to(cupy.asarray(values, dtype=target.dtype),
                               (n,) + tuple(target.shape[1:]))
    order = cupy.argsort(index * n + cupy.arange(n, dtype=cupy.int64))  # stable by position
    ids = index[order]
    starts = cupy.flatnonzero(cupy.concatenate((cupy.ones(1, dtype=bool), ids[1:] != ids[:-1])))
    ends = cupy.concatenate((starts[1:], cupy.full(1, n, dtype=starts.dtype)))
    width = target.size // rows_of
    grouped = cupy.ascontiguousarray(values[order]).reshape(n, width)
    _segment_add(grouped, starts.astype(cupy.int64), ends.astype(cupy.int64),
                 ids[starts], width, target.reshape(rows_of, width), size=int(starts.size) * width)
    return target


# -- matmuls, counted ------------------------------------------------------------------------
# Every matmul of tfcore's ops (the reference ops and the kernels) calls matmul() below or, for
# a product made another way (a BLAS call on a part of the arrays), record_matmul(). While a
# count_matmuls() block is active each product adds its 2 m k n FLOPs, so a FLOP count is a
# measurement of what ran, not a list of what should have run.


class MatmulCount:
    """The matmuls seen inside one ``with count_matmuls() as count:`` block.

    count.flops     total 2 m k n over every product (times the batch of a batched product)
    count.calls     how many matmul calls
    count.by        {(phase, label): flops}; label names the op family ("linear",
                    "attention", "tiled attention"); phase is whatever the caller set in
                    count.phase before the products ran (for example "forward", "backward")
    """

    def __init__(self):
        self.flops = 0
        self.calls = 0
        self.phase = None
        self.by: dict[tuple, int] = {}

    def add(self, label: str, m: int, k: int, n: int, batch: int = 1, calls: int = 1):
        flops = 2 * m * k * n * batch
        self.flops += flops
        self.calls += calls
        key = (self.phase, label)
        self.by[key] = self.by.get(key, 0) + flops

    def total(self, phase=None, label=None) -> int:
        """FLOPs of the products of one phase and/or one label (None: any)."""
        return sum(f for (p, lab), f in self.by.items()
                   if (phase is None or p == phase) and (label is None or lab == label))


_counts: list[MatmulCount] = []
_count_lock = threading.Lock()      # kernels may make products on several threads at once


@contextlib.contextmanager
def count_matmuls():
    """``with count_matmuls() as count:`` -> every matmul of tfcore's ops inside is counted."""
    count = MatmulCount()
    _counts.append(count)
    try:
        yield count
    finally:
        _counts.remove(count)


def record_matmul(label: str, a_shape, b_shape):
    """Count a product a [..., m, k] @ b [..., k, n] (leading axes broadcast) made elsewhere."""
    if not _counts:
        return
    m, k = a_shape[-2:] if len(a_shape) > 1 else (1, a_shape[0])
    n = b_shape[-1] if len(b_shape) > 1 else 1
    lead_a, lead_b = tuple(a_shape[:-2]), tuple(b_shape[:-2])
    width = max(len(lead_a), len(lead_b))
    lead_a = (1,) * (width - len(lead_a)) + lead_a
    lead_b = (1,) * (width - len(lead_b)) + lead_b
    batch = math.prod(max(x, y) for x, y in zip(lead_a, lead_b))
    with _count_lock:
        for count in _counts:
            count.add(label, int(m), int(k), int(n), int(batch))


def record_products(label: str, mkn: int, calls: int):
    """Count `calls` products made elsewhere whose m k n add up to `mkn` (the tally of a
    compiled loop that makes its products itself)."""
    if not _counts or not calls:
        return
    with _count_lock:
        for count in _counts:
            count.add(label, int(mkn), 1, 1, 1, int(calls))


# The precision every matmul() computes in. None: the arrays' own dtype. Otherwise a function
# (a, b) -> a @ b that computes the product another way: tfcore.mixed_precision.autocast sets
# one that rounds the operands to bfloat16 or float16 and accumulates in float32, so every
# product of the reference ops (forward and backward) takes the low precision from one place.
_matmul_policy = None


def set_matmul_policy(policy):
    """Make every matmul() compute as `policy(a, b)` (None: plainly); returns the previous one."""
    global _matmul_policy
    if policy is not None and not callable(policy):
        raise TypeError(f"policy must be a function (a, b) -> a @ b or None, got {policy!r}")
    previous, _matmul_policy = _matmul_policy, policy
    return previous


def matmul(a, b, label: str = "matmul"):
    """a @ b on the arrays' own library (array API matmul), counted by count_matmuls().

    a [..., m, k], b [..., k, n] -> [..., m, n]
    Inside tfcore.mixed_precision.autocast the product is the policy's (see set_matmul_policy).
    """
    if _counts:
        record_matmul(label, tuple(a.shape), tuple(b.shape))
    if _matmul_policy is not None:
        return _matmul_policy(a, b)
    return namespace(a, b).matmul(a, b)
