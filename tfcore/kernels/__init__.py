"""Fused CPU kernels for the element-wise and row-wise ops of the training step: Numba loops
for the row-wise ones, NumPy's SIMD ufuncs on cache-sized chunks for GELU (Numba's tanh, exp
and erf are scalar calls), BLAS products split over threads, and a tiled causal attention
(``tiled_attention_forward`` / ``tiled_attention_backward``, see ``_tiled``).

Threads. All of the kernels' parallel work goes through one pool of worker threads (see
"threads" below): a Numba loop or a BLAS product runs single-threaded on a share of the rows,
and an op is split only when each thread gets at least MIN_GEMM_FLOPS_PER_THREAD or
MIN_ELEMENTS_PER_THREAD of work; below that it runs on the calling thread, with no fork/join
at all. The thread count is Numba's (``numba.set_num_threads``, NUMBA_NUM_THREADS).

The array-API functions of ``tfcore.functional`` are the reference: the book proves them, and
the tests compare every kernel here with them. A reference op hands its work to a kernel only
when ``applies(...)`` says so:

* kernels are enabled: ``TFCORE_KERNELS`` is not ``0`` in the environment, and neither
  ``set_enabled(False)`` nor ``with kernels.disabled():`` switched them off;
* Numba is installed;
* every array is a NumPy array of float32 or float64 (one dtype), C-contiguous where the
  kernel reads it flat. Everything else (CuPy, array-api-strict, views with strides) runs
  the reference.

Every kernel returns what the reference returns, with caches of the same format, so a cache
made by either path can go to either backward. The Numba kernels compute in float64 whatever
the storage dtype; GELU runs the reference's own operations in the storage dtype. Compiled
code is cached on disk (``cache=True``): only the first use on a machine pays Numba's
compile time (see ``warm_up``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import threading

import numpy as np

from ..backend import namespace, record_matmul

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_enabled = os.environ.get("TFCORE_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no")
_have_numba = importlib.util.find_spec("numba") is not None
_nb = None  # the compiled module, imported on first use


def set_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """glibc's malloc: blocks of mmap_bytes or more are mapped on their own and handed back
    at once when freed (M_MMAP_THRESHOLD, which also stops its own adjustment), and the heap
    is trimmed when trim_bytes lie free at its top (M_TRIM_THRESHOLD). The whole process's
    setting; True when set, False where there is no glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, mmap_bytes)
                and libc.mallopt(m_trim_threshold, trim_bytes))


def keep_freed_memory() -> bool:
    """Ask the C library's malloc (glibc) to keep freed memory for reuse rather than hand it
    back to the system: blocks up to 32 MiB come from the heap and the heap is never trimmed
    (set_malloc_thresholds).

    A training step frees and allocates the same arrays every step. Handed back, their pages
    are faulted in again at the next step: on a quiet 2-core virtual machine that was a
    quarter of the tiny benchmark model's step (21 ms against 16 ms at 1 thread). Resident
    memory then stays at its high-water mark. The setting is the whole process's: the
    training and benchmark commands (python -m tfcore.train, tfcore.bench, tfcore.parallel)
    call this at their start; a program of your own may too. Returns True when set, False
    where there is no glibc."""
    return set_malloc_thresholds(32 * 2 ** 20, 2 ** 31 - 1)


def available() -> bool:
    """Numba is installed (the kernels can run at all)."""
    return _have_numba


def enabled() -> bool:
    """Kernels are switched on and can run."""
    return _enabled and _have_numba


def set_enabled(flag: bool) -> bool:
    """Switch the kernels on or off for the whole process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


@contextlib.contextmanager
def disabled():
    """``with kernels.disabled():`` runs the reference path of every op inside the block."""
    previous = set_enabled(False)
    try:
        yield
    finally:
        set_enabled(previous)


def applies(*arrays, contiguous: bool = True) -> bool:
    """True when a kernel may take these arrays (None entries are skipped): see the module doc."""
    if not (_enabled and _have_numba):
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


from ._tiled import (  # noqa: E402,F401
    as_rows_apart,
    rows_apart,
    tiled_attention_backward,
    tiled_attention_forward,
)


def _rows(x, width):
    return x.reshape(-1, width)


# -- GELU -------------------------------------------------------------------------------
# Numba from PyPI calls a scalar tanh/exp/erf per element (its LLVM has no vector math
# library), while NumPy's own np.tanh and np.exp are SIMD loops. So GELU runs the reference's
# own sequence of operations, but on chunks of CHUNK elements that stay in the core's cache
# (the reference makes a pass over the whole [T, F] activation per operation), with the
# chunks shared among the threads. Each chunk is a few calls, each of which takes Python's
# lock (the GIL) to start: on 2 threads, chunks of 2^14 elements made the threads wait on
# each other at every call, and GELU ran slower on 2 threads than on 1 (1.1 ms against
# 0.9 ms on 2^20 float32); with 2^18 it takes 0.58 ms (and 0.68 ms on 1 thread). The
# forward keeps its intermediate in its output; the backward needs a scratch chunk, so
# its chunks are smaller (BACKWARD_CHUNK: 0.73 ms on 2 threads), to keep the step's peak
# memory down. For the tanh form the plain arithmetic before and after
# np.tanh is one Numba loop each (FUSED_GELU; 1.6-2.7 times less CPU than a NumPy pass per
# operation on the benchmark's shapes); the exact form keeps a pass per ufunc (erf, exp). The
# operations and their order are the reference's, so the result is the reference's to the
# last bit.

CHUNK = 2 ** 18
BACKWARD_CHUNK = 2 ** 16


def _gelu_tanh_t_chunk(x, t):
    """t = tanh(sqrt(2/pi) x (1 + 0.044715 x^2)), the reference's sequence, into t [n]."""
    from ..functional import activations as act

    with np.errstate(over="ignore"):   # tanh(+-inf) = +-1 for |x| past ~1e19 (float32)
        np.multiply(x, x, out=t)
        t *= act._GELU_CUBIC
        t += 1.0
        t *= x
        t *= act._SQRT_2_OVER_PI
    np.tanh(t, out=t)


_GELU_CONSTANTS = {}
FUSED_GELU = True       # False: the chunks make one NumPy pass per operation, as before


def _gelu_constants(dtype):
    """The tanh-GELU's constants in the storage dtype, for the fused loops of _numba."""
    c = _GELU_CONSTANTS.get(dtype)
    if c is None:
        from ..functional import activations as act

        c = np.array([act._GELU_CUBIC, act._SQRT_2_OVER_PI, 1.0, 0.5, 3.0 * act._GELU_CUBIC,
                      -1.0, act._GELU_CLIP], dtype=dtype)
        _GELU_CONSTANTS[dtype] = c
    return c


def _gelu_forward_chunk(x, y, approximate):
    """x [n] -> y [n] (flat chunks); y holds the intermediate t as well (every operation
    after it reads t and x at one index and writes that index)."""
    from ..functional import activations as act

    t = y

    if approximate == "tanh" and FUSED_GELU:
        k, c = _k(), _gelu_constants(x.dtype)
        k.gelu_tanh_argument(x, t, c)        # one loop where the reference makes five passes
        np.tanh(t, out=t)                    # NumPy's SIMD tanh
        k.gelu_tanh_output(x, t, y, c)
    elif approximate == "tanh":
        _gelu_tanh_t_chunk(x, t)
        t += 1.0
        t *= 0.5                             # exact, and (1 + t) x would overflow near max
        np.multiply(t, x, out=y)                             # 0.5 (1 + t) x
    else:
        from scipy.special import erf

        np.multiply(x, act._INV_SQRT_2, out=t)
        erf(t, out=t)
        t += 1.0
        t *= 0.5                                             # Phi(x)
        np.multiply(t, x, out=y)


def _gelu_backward_chunk(dy, x, dx, approximate, t, u=None, w=None):
    """dy, x [n] -> dx [n] (may be dy); t, u, w [n] scratch (t alone for the fused tanh)."""
    from ..functional import activations as act

    if approximate == "tanh" and FUSED_GELU:
        k, c = _k(), _gelu_constants(x.dtype)
        k.gelu_tanh_argument(x, t, c)
        np.tanh(t, out=t)
        if dx.ctypes.data == dy.ctypes.data:    # one loop where the reference makes 15
            k.gelu_tanh_grad_in_place(dy, x, t, c)          # passes
        else:
            k.gelu_tanh_grad(dy, x, t, dx, c)
        return
    if approximate == "tanh":
        _gelu_tanh_t_chunk(x, t)
        du = np.clip(x, -act._GELU_CLIP, act._GELU_CLIP, out=w)  # 1 - t^2 = 0 past the clip
        du *= du
        du *= 3.0 * act._GELU_CUBIC
        du += 1.0
        du *= act._SQRT_2_OVER_PI                            # du/dx
        np.multiply(t, t, out=u)
        u *= -1.0
        u += 1.0
        u *= x                                               # x (1 - t^2)
        u *= du
        u *= 0.5
        t += 1.0
        t *= 0.5
        u += t
    else:
        from scipy.special import erf

        with np.errstate(over="ignore"):   # x^2 = inf for huge |x|: exp(-inf) = 0, as it should
            np.multiply(x, x, out=u)
        u *= -0.5
        np.exp(u, out=u)
        u *= act._INV_SQRT_2PI
        u *= x                                               # x phi(x)
        np.multiply(x, act._INV_SQRT_2, out=t)
        erf(t, out=t)
        t += 1.0
        t *= 0.5
        u += t                                               # Phi(x) + x phi(x)
    np.multiply(u, dy, out=dx)


def _chunked(fn, n, threads, dtype, n_scratch, arrays, extra, chunk):
    """fn(*[a[lo:hi] for a in arrays], *extra, *scratch) over chunks of `chunk` elements, the
    chunks of each thread's contiguous share done in order on that thread."""
    def share(lo, hi):
        scratch = [np.empty(min(chunk, hi - lo), dtype=dtype) for _ in range(n_scratch)]
        for c0 in range(lo, hi, chunk):
            c1 = min(c0 + chunk, hi)
            fn(*[a[c0:c1] for a in arrays], *extra, *[w[:c1 - c0] for w in scratch])

    parts = _parts(n, MIN_ELEMENTS_PER_THREAD, n, threads)
    _on_threads([(share, bounds) for bounds in _bounds(n, parts)])


def add(a, b):
    """a + b -> a new array (a, b C-contiguous, of one shape and dtype), split over the
    threads as the row-wise ops are: the same halves of the rows, so that the rows a thread
    adds are in its cache when the next op (the residual sum's norm) gives it the same rows."""
    out = np.empty_like(a)
    if out.ndim == 0 or out.size == 0:
        return np.add(a, b, out=out)
    d = out.shape[-1]
    _split_rows(np.add, (_rows(a, d), _rows(b, d), _rows(out, d)), (),   # np.add(a, b, out)
                per_thread=_streaming(out.dtype))
    return out


def gelu_forward(x, approximate):
    """x [...] -> y [...] (the reference's cache is (x, approximate))."""
    y = np.empty_like(x)
    _chunked(_gelu_forward_chunk, x.size, _threads(), x.dtype, 0,
             (x.reshape(-1), y.reshape(-1)), (approximate,), CHUNK)
    return y


def gelu_backward(dy, x, approximate, out=None):
    """dy, x [...] -> dx [...] (out may be dy itself)."""
    dx = np.empty_like(x) if out is None else out
    scratch = 1 if approximate == "tanh" and FUSED_GELU else 3
    _chunked(_gelu_backward_chunk, x.size, _threads(), x.dtype, scratch,
             (dy.reshape(-1), x.reshape(-1), dx.reshape(-1)), (approximate,), BACKWARD_CHUNK)
    return dx


# -- softmax ----------------------------------------------------------------------------

def softmax_forward(z):
    """z [..., K] -> s [..., K]."""
    s = np.empty_like(z)
    _split_rows(_k().softmax_rows, (_rows(z, z.shape[-1]), _rows(s, z.shape[-1])), ())
    return s


def softmax_backward(ds, s, scale=1.0, out=None):
    """ds, s [..., K] -> dz = scale * s * (ds - rowsum(ds * s)) (out may be ds itself)."""
    dz = np.empty_like(s) if out is None else out
    k = s.shape[-1]
    _split_rows(_k().softmax_backward_rows, (_rows(ds, k), _rows(s, k), _rows(dz, k)),
                (float(scale),))
    return dz


def attention_softmax_(z, scale, causal):
    """In place: scores z [B, H, S_q, S_k] -> A = softmax(scale * z + causal mask)."""
    s_q, s_k = z.shape[-2:]
    offset = s_k - s_q if causal else s_k
    _split_matrices(_k().causal_softmax_inplace, (z.reshape(-1, s_q, s_k),), (float(scale),),
                    offset)
    return z


def attention_softmax_backward_(dA, A, scale, causal):
    """In place: dA [B, H, S_q, S_k] -> dZ = scale * A * (dA - rowsum(dA * A))."""
    s_q, s_k = A.shape[-2:]
    offset = s_k - s_q if causal else s_k
    _split_matrices(_k().causal_softmax_backward_inplace,
                    (dA.reshape(-1, s_q, s_k), A.reshape(-1, s_q, s_k)), (float(scale),), offset)
    return dA


# -- normalization ----------------------------------------------------------------------

def layernorm_forward(x, gamma, beta, eps):
    """x [..., D] -> y [..., D], cache (xhat [..., D], rstd [..., 1], gamma); None when a row's
    variance overflows or x is not finite (the reference handles those rows)."""
    d = x.shape[-1]
    y, xhat = np.empty_like(x), np.empty_like(x)
    rstd = np.empty(x.shape[:-1] + (1,), dtype=x.dtype)
    kernel = _k().layernorm_forward
    _split(lambda lo, hi: kernel(_rows(x, d)[lo:hi], gamma, beta, float(eps),
                                 _rows(y, d)[lo:hi], _rows(xhat, d)[lo:hi],
                                 rstd.reshape(-1)[lo:hi]), x.size // d, d)
    if np.isnan(rstd).any():
        return None
    return y, (xhat, rstd, gamma)


def rmsnorm_forward(x, gain, eps):
    """x [..., D] -> y [..., D], cache (xhat [..., D], rrms [..., 1], gain); None as above."""
    d = x.shape[-1]
    y, xhat = np.empty_like(x), np.empty_like(x)
    rrms = np.empty(x.shape[:-1] + (1,), dtype=x.dtype)
    kernel = _k().rmsnorm_forward
    _split(lambda lo, hi: kernel(_rows(x, d)[lo:hi], gain, float(eps), _rows(y, d)[lo:hi],
                                 _rows(xhat, d)[lo:hi], rrms.reshape(-1)[lo:hi]), x.size // d, d)
    if np.isnan(rrms).any():
        return None
    return y, (xhat, rrms, gain)


def _norm_backward(dy, cache, centered):
    xhat, rstd, gamma = cache
    d = dy.shape[-1]
    n = dy.size // d
    parts = _parts(n * d, MIN_ELEMENTS_PER_THREAD, n)
    dgamma = np.zeros((parts, d))                 # one row of partial sums per thread's share
    dbeta = np.zeros((parts, d))
    dx = np.empty_like(dy)
    rows = (_rows(dy, d), _rows(xhat, d), rstd.reshape(-1), _rows(dx, d))
    kernel = _k().norm_backward

    def share(c, lo, hi):
        dy_, xhat_, rstd_, dx_ = (a[lo:hi] for a in rows)
        kernel(dy_, xhat_, rstd_, gamma, centered, dx_, dgamma[c:c + 1], dbeta[c:c + 1])

    _on_threads([(share, (c, lo, hi)) for c, (lo, hi) in enumerate(_bounds(n, parts))])
    return dx, dgamma.sum(axis=0).astype(dy.dtype), dbeta.sum(axis=0).astype(dy.dtype)


def layernorm_backward(dy, cache):
    """dy [..., D] -> dx [..., D], dgamma [D], dbeta [D]."""
    return _norm_backward(dy, cache, True)


def rmsnorm_backward(dy, cache):
    """dy [..., D] -> dx [..., D], dgain [D]."""
    dx, dgain, _ = _norm_backward(dy, cache, False)
    return dx, dgain


# -- cross-entropy ----------------------------------------------------------------------

def cross_entropy_forward(z, safe, valid):
    """z [N, V], safe [N] int64, valid [N] bool -> (probs [N, V], sum of the kept nll)."""
    probs = np.empty_like(z)
    nll = np.empty(z.shape[0], dtype=np.float64)
    _split_rows(_k().cross_entropy_forward, (z, safe, valid, probs, nll), (), z.shape[1])
    return probs, float(nll.sum())


def cross_entropy_backward(dloss, cache, out=None):
    """The reference's cache -> dlogits [..., V] (out [N, V]: may be the cache's probs)."""
    probs, safe, valid, n_valid, shape = cache
    dz = np.empty_like(probs) if out is None else out
    scale = float(dloss) / max(n_valid, 1)
    if dz.ctypes.data == probs.ctypes.data:           # in place (see gelu_tanh_grad_in_place)
        kernel = _k().cross_entropy_backward_in_place
        _split(lambda lo, hi: kernel(probs[lo:hi], safe[lo:hi], valid[lo:hi], scale),
               probs.shape[0], probs.shape[1], _streaming(dz.dtype))
    else:
        kernel = _k().cross_entropy_backward
        _split(lambda lo, hi: kernel(probs[lo:hi], safe[lo:hi], valid[lo:hi], scale,
                                     dz[lo:hi]), probs.shape[0], probs.shape[1],
               _streaming(dz.dtype))
    return dz.reshape(shape)


# -- optimizer and embedding ------------------------------------------------------------

_NO_MASK = {np.dtype(np.float32): np.zeros(0, np.float32), np.dtype(np.float64): np.zeros(0)}


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias1, bias2, decay_mask):
    """In place on p, m, v [P]: the reference adamw_update's arithmetic, one pass."""
    mask = _NO_MASK[p.dtype] if decay_mask is None else decay_mask
    kernel = _k().adamw_update
    scalars = tuple(float(a) for a in (lr, beta1, beta2, eps, weight_decay, bias1, bias2))
    _split(lambda lo, hi: kernel(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], *scalars,
                                 mask[lo:hi]), p.shape[0], 1)


def embedding_backward(dx, flat_ids, w_shape):
    """dx [..., D], ids [N] -> dW [V, D] (zeros, then every row of dx added at its id)."""
    dW = np.zeros(w_shape, dtype=dx.dtype)
    rows, kernel, d = _rows(dx, w_shape[1]), _k().embedding_backward, w_shape[1]
    # each thread adds every row into its own share of the columns
    parts = _parts(rows.size, MIN_ELEMENTS_PER_THREAD, d)
    _on_threads([(kernel, (flat_ids, rows[:, lo:hi], dW[:, lo:hi], 1))
                 for lo, hi in _bounds(d, parts)])
    return dW


def warm_up(dtypes=("float32", "float64")) -> float:
    """Run every kernel once on tiny inputs (compiles or loads from the disk cache); seconds."""
    import time

    start = time.perf_counter()
    for name in dtypes:
        x = np.linspace(-2, 2, 24, dtype=name).reshape(2, 3, 4)
        for form in ("none", "tanh"):
            gelu_backward(x, x, form)
            dy = x.copy()
            gelu_backward(dy, x, form, out=dy)           # in place: another kernel
            gelu_forward(x, form)
        s = softmax_forward(x)
        softmax_backward(x, s)
        z = np.ones((1, 2, 3, 4), dtype=name)
        attention_softmax_backward_(z.copy(), attention_softmax_(z, 0.5, True), 0.5, True)
        qkv = np.linspace(-1, 1, 3 * 2 * 5 * 4, dtype=name).reshape(3, 1, 2, 5, 4)
        out, lse = tiled_attention_forward(*qkv, True, 0.5, block=2, span=4)
        tiled_attention_backward(out, *qkv, out, lse, True, 0.5, block=2, span=4)
        g = np.ones(4, dtype=name)
        layernorm_backward(x, layernorm_forward(x, g, g, 1e-5)[1])
        rmsnorm_backward(x, rmsnorm_forward(x, g, 1e-5)[1])
        labels = np.zeros(6, dtype=np.int64)
        probs, _ = cross_entropy_forward(x.reshape(6, 4), labels, labels == 0)
        cross_entropy_backward(1.0, (probs, labels, labels == 0, 6, (6, 4)))
        cross_entropy_backward(1.0, (probs, labels, labels == 0, 6, (6, 4)), out=probs)
        flat = x.reshape(-1).copy()
        adamw_update(flat, flat, flat.copy(), flat * 0, 1e-3, 0.9, 0.99, 1e-8, 0.1, 0.1, 0.01,
                     None)
        adamw_update(flat, flat, flat.copy(), flat * 0, 1e-3, 0.9, 0.99, 1e-8, 0.1, 0.1, 0.01,
                     np.ones_like(flat))
        embedding_backward(x, labels, (3, 4))
        w = np.ones((4, 5), dtype=name)              # a linear layer with a bias, both ways
        y = linear_forward(x, w, w[0])
        linear_backward(y, x, w, True, grads=(w.copy(), w[0].copy()))
        linear_backward(y, x, w, True)
        if _threads() > 1:                   # the worker's compiled half, on a split product
            a, b, out = x.reshape(6, 4), x.reshape(4, 6), np.empty((6, 6), dtype=name)
            _on_threads([(_matmul_into, (a[:3], b, out[:3])), (_matmul_into, (a[3:], b, out[3:]))])
    return time.perf_counter() - start


# -- threads: one pool, and only where the work pays for a fork/join ------------------------
# A batched product [B, H, m, k] @ [B, H, k, n] is B*H small GEMMs. NumPy hands each of them
# to a multi-threaded BLAS, which forks and joins its threads B*H times; on a busy machine
# every join waits for the slowest thread, and the attention's products ran 10-25 times
# slower with 2 BLAS threads than with 1. So every product of the kernels runs on a
# single-threaded BLAS, and the batch (or the rows) is split over the threads of one pool
# (the same pool runs the Numba loops and the GELU chunks): one fork/join per product.
#
# A fork/join through sleeping Python threads cost some 90 microseconds on a quiet 2-core
# virtual machine, whose idle CPUs halt at once: the system woke the worker (about 40), and
# the caller again when it had gone to sleep waiting for the worker's share. So the worker
# and the waiting caller poll for SPIN_CYCLES CPU cycles (some 0.3-0.5 ms) before they
# sleep, and a product's share runs on the worker from compiled code, without the GIL (see
# _spin); at 2 threads this took the tiny benchmark step about 6% faster, the small one 1%.
# A spinning thread takes a core: on a machine shared with other busy processes, set
# SPIN_CYCLES to 0 (each side then sleeps at once, as before).
#
# An op is split only when each thread's share is worth a fork/join (now some 10-25
# microseconds: a product's share costs the least, a Python call's one pass of the GIL): a
# GEMM share of MIN_GEMM_FLOPS_PER_THREAD flops (about 45 microseconds of one core at 90
# GFLOP/s float32), an element-wise or row-wise share of MIN_ELEMENTS_PER_THREAD elements
# (15-80 microseconds at 1-5 ns per element); below that the op runs on the calling thread
# alone, with no fork/join at all. Against 2^16 elements, 2^14 took the tiny step at 2 threads
# 1.5% (float32) and 2% (float64) faster, where the norms and the loss of [1024, 64] rows now
# split (benchmarks/threads_ab.py measures where splitting pays). An op that makes one or two
# additions per element it reads (the residual sum, the loss's backward) runs at memory
# speed, 0.1-0.2 ns per element: its share must write MIN_STREAM_BYTES_PER_THREAD bytes (a
# float32 sum of 2^19 elements broke even on 2 threads; 2^16 took 42 us split, 15 alone).

MIN_GEMM_FLOPS_PER_THREAD = 2 ** 22
MIN_ELEMENTS_PER_THREAD = 2 ** 14
MIN_STREAM_BYTES_PER_THREAD = 2 ** 20
SPIN_CYCLES = 2 ** 20     # how long a waiting thread polls before it sleeps

_pool: list = []     # the worker threads, made on first use
_pool_lock = threading.Lock()
if hasattr(os, "register_at_fork"):      # a forked child has none of its parent's threads
    os.register_at_fork(after_in_child=_pool.clear)
_blas = None


_get_num_threads = None


def _threads() -> int:
    """Numba's thread count (numba.set_num_threads), the kernels' too."""
    global _get_num_threads
    if _get_num_threads is None:
        from numba import get_num_threads

        _get_num_threads = get_num_threads
    return _get_num_threads()


def _parts(work: int, per_thread: int, limit: int, threads: int | None = None) -> int:
    """How many shares to split `work` into: one per thread, each at least `per_thread`,
    at most `limit` (the rows there are to split)."""
    threads = _threads() if threads is None else threads
    return max(1, min(threads, limit, work // per_thread))


def _bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of `parts` nearly equal consecutive shares of range(n)."""
    edges = [(n * t) // parts for t in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _on_threads(calls) -> None:
    """fn(*args) for each (fn, args) in calls: the first on this thread, the others on the
    pool's workers; returns when all are done (re-raising a worker's error)."""
    if len(calls) == 1:
        fn, args = calls[0]
        fn(*args)
        return
    if not _pool_lock.acquire(blocking=False):   # another thread of the program has the
        for fn, args in calls:                   # workers: do this call's shares here
            fn(*args)
        return
    try:
        workers = _thread_pool(len(calls))
        for worker, call in zip(workers, calls[1:]):
            worker.start(call)
        fn, args = calls[0]
        try:
            fn(*args)
        finally:
            errors = [worker.wait() for worker in workers[:len(calls) - 1]]
    finally:
        _pool_lock.release()
    for error in errors:
        if error is not None:
            raise error


class _Worker:
    """One thread that runs the shares handed to it, one at a time (see _spin): a product is
    run from compiled code without the GIL, anything else as a Python call. The worker and
    the caller waiting for it each poll for SPIN_CYCLES CPU cycles before they sleep on a
    semaphore; a flag in the control block tells the other side to post it."""

    def __init__(self, name):
        self.control = np.zeros(_sp().CONTROL_SLOTS, dtype=np.int64)
        self.args = np.zeros(_sp().ARG_SLOTS, dtype=np.int64)
        self._wake_worker, self._wake_caller = threading.Semaphore(0), threading.Semaphore(0)
        self._task = 0
        self._call = self._error = None
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self):
        sp, control = _sp(), self.control
        like32, like64 = np.empty(0, np.float32), np.empty(0, np.float64)
        done = 0
        while True:
            code = sp.serve(control, self.args, done, SPIN_CYCLES, like32, like64)
            done = 0
            if code == sp.WAKE_CALLER:
                self._wake_caller.release()
            elif code == sp.IDLE:
                sp.store(control, sp.WORKER_SLEEPS, 1)
                if sp.load(control, sp.POSTED) == sp.load(control, sp.DONE):
                    self._wake_worker.acquire()        # nothing posted since: sleep
                sp.store(control, sp.WORKER_SLEEPS, 0)
            else:                                      # task `code` is a Python call
                fn, args = self._call
                try:
                    fn(*args)
                except BaseException as error:         # handed to the caller by wait()
                    self._error = error
                # hold no reference to the call's arrays while idle (they are freed with
                # the caller's, not at the next call)
                self._call = fn = args = None
                done = code                            # marked done by serve, GIL released

    def _post(self, kind):
        sp, control = _sp(), self.control
        self._task += 1
        sp.store(control, sp.KIND, kind)
        sp.store(control, sp.POSTED, self._task)
        if sp.load(control, sp.WORKER_SLEEPS):
            self._wake_worker.release()

    def start(self, call):
        """Hand the worker fn(*args) for call = (fn, args); a product _matmul_into(a, b, out,
        bias, into) goes to the compiled side when BLAS takes its arrays as they lie."""
        fn, args = call
        if fn is _matmul_into and _product_args(self.args, *args):
            self._post(_sp().PRODUCT)
        else:
            self._call = call
            self._post(_sp().PYTHON_CALL)

    def wait(self):
        """Block until the task handed to start() is done -> its exception or None."""
        sp, control, task = _sp(), self.control, self._task
        if not sp.wait_done(control, task, SPIN_CYCLES):
            sp.store(control, sp.CALLER_SLEEPS, 1)
            while sp.load(control, sp.DONE) != task:
                self._wake_caller.acquire()
            sp.store(control, sp.CALLER_SLEEPS, 0)
        error, self._error = self._error, None
        return error


_sp_module = None
_gemm_addresses = None


def _sp():
    global _sp_module, _gemm_addresses
    if _sp_module is None:
        _writable_numba_cache()
        from . import _spin as module

        _gemm_addresses = module.blas_gemm_addresses() or ()
        _sp_module = module
    return _sp_module


def _gemm_address(dtype) -> int:
    """The address of the cblas gemm (of NumPy's BLAS) for `dtype` that compiled code calls,
    or 0 where none was found (see _spin.blas_gemm_addresses)."""
    _sp()
    if not _gemm_addresses or dtype not in _FLOATS:
        return 0
    return _gemm_addresses[1 if dtype == np.float64 else 0]


def _blas_matrix(x):
    """(transposed, leading dimension) with which NumPy's matmul hands the 2-D view x to
    BLAS (the same test as NumPy's is_blasable2d), or None where it would not."""
    size = x.itemsize
    (s0, s1), (d0, d1) = x.strides, x.shape
    if s1 == size and s0 % size == 0 and s0 // size >= d1:
        return False, s0 // size
    if s0 == size and s1 % size == 0 and s1 // size >= d0:
        return True, s1 // size
    return None


def _product_args(slots, a, b, out, bias=None, into=None) -> bool:
    """Fill `slots` with the cblas arguments of out = a @ b (+ bias; into += out), as NumPy's
    matmul would pass them (so that the worker's share has the bits NumPy's would), and
    return True; False where the compiled side does not take these arrays (then the share
    runs as a Python call)."""
    if not _gemm_addresses or a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        return False
    dtype = out.dtype
    if not (a.dtype == b.dtype == dtype) or dtype not in _FLOATS:
        return False
    (m, k), n = a.shape, b.shape[1]
    if min(m, n, k) < 2 or a.ctypes.data == b.ctypes.data:   # NumPy: gemv, syrk there
        return False
    layout_a, layout_b, layout_out = _blas_matrix(a), _blas_matrix(b), _blas_matrix(out)
    if layout_a is None or layout_b is None or layout_out is None or layout_out[0]:
        return False
    for extra in (bias, into):
        if extra is not None and (extra.dtype != dtype or extra.strides[-1] != dtype.itemsize):
            return False
    if bias is not None and bias.shape != (n,):
        return False
    layout_into = None if into is None else _blas_matrix(into)
    if into is not None and (into.shape != (m, n) or layout_into is None or layout_into[0]):
        return False
    sp = _sp()
    double = dtype == np.float64
    slots[:] = 0
    slots[sp.ORDER] = sp.ROW_MAJOR
    slots[sp.TRANS_A] = sp.TRANS if layout_a[0] else sp.NO_TRANS
    slots[sp.TRANS_B] = sp.TRANS if layout_b[0] else sp.NO_TRANS
    slots[sp.M], slots[sp.N], slots[sp.K] = m, n, k
    slots[sp.A], slots[sp.LDA] = a.ctypes.data, layout_a[1]
    slots[sp.B], slots[sp.LDB] = b.ctypes.data, layout_b[1]
    slots[sp.C], slots[sp.LDC] = out.ctypes.data, layout_out[1]
    slots[sp.FUNCTION] = _gemm_address(dtype)
    slots[sp.DOUBLE] = int(double)
    if bias is not None:
        slots[sp.BIAS] = bias.ctypes.data
    if into is not None:
        slots[sp.INTO], slots[sp.LD_INTO] = into.ctypes.data, layout_into[1]
    return True


def _split(share, n_rows: int, row_width: int, per_thread: int = 0) -> None:
    """share(lo, hi) over the rows lo..hi of an op on n_rows rows of row_width elements, each
    share at least per_thread elements (0: MIN_ELEMENTS_PER_THREAD)."""
    parts = _parts(n_rows * row_width, per_thread or MIN_ELEMENTS_PER_THREAD, n_rows)
    _on_threads([(share, bounds) for bounds in _bounds(n_rows, parts)])


def _split_rows(kernel, row_arrays, scalars, row_width=None, per_thread=0) -> None:
    """kernel(*[a[lo:hi] for a in row_arrays], *scalars) over shares of the rows (axis 0)."""
    first = row_arrays[0]
    width = first.shape[-1] if row_width is None else row_width
    _split(lambda lo, hi: kernel(*[a[lo:hi] for a in row_arrays], *scalars),
           first.shape[0], width, per_thread)


def _streaming(dtype) -> int:
    """The least elements of a thread's share of an op that runs at memory speed."""
    return MIN_STREAM_BYTES_PER_THREAD // np.dtype(dtype).itemsize


def _split_matrices(kernel, arrays, scalars, offset) -> None:
    """A causal softmax kernel(*arrays [R, S_q, S_k], *scalars, offset) over shares of the R
    matrices, or of the query rows of a single matrix (R = 1; the share that starts at query
    row lo sees its keys through offset + lo): each share C-contiguous, as the kernels' row
    sums want their rows."""
    n_mat, s_q, s_k = arrays[0].shape
    parts = _parts(n_mat * s_q * s_k, MIN_ELEMENTS_PER_THREAD, n_mat * s_q)
    if parts <= n_mat or n_mat > 1:
        parts = min(parts, n_mat)
        _on_threads([(kernel, tuple(a[lo:hi] for a in arrays) + tuple(scalars) + (offset,))
                     for lo, hi in _bounds(n_mat, parts)])
    else:
        _on_threads([(kernel, tuple(a[:, lo:hi] for a in arrays) + tuple(scalars)
                      + (offset + lo,)) for lo, hi in _bounds(s_q, parts)])


def _blas_libraries():
    global _blas
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController

            _blas = ThreadpoolController().select(user_api="blas").lib_controllers
        except Exception:  # threadpoolctl missing or unable to see the BLAS
            _blas = []
    return _blas


@contextlib.contextmanager
def single_threaded_blas():
    """Inside the block every BLAS library the process loaded runs on one thread (the
    setting is read first and changed, then restored, only where it is not 1 already)."""
    changed = [(lib, lib.num_threads) for lib in _blas_libraries() if lib.num_threads != 1]
    for lib, _ in changed:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, n in changed:
            lib.set_num_threads(n)


def _thread_pool(threads: int) -> list:
    """The process's worker threads (grown to `threads` - 1 workers on demand)."""
    while len(_pool) < threads - 1:
        _pool.append(_Worker(f"tfcore-worker-{len(_pool)}"))
    return _pool


def batched_matmul(a, b, out=None, label="attention"):
    """a [B, H, m, k] @ b [B, H, k, n] -> out [B, H, m, n] (out may be a strided view)."""
    record_matmul(label, a.shape, b.shape)
    if out is None:
        out = np.empty(a.shape[:-1] + b.shape[-1:], dtype=np.result_type(a, b))
    threads = _threads()
    axis = 0 if a.shape[0] >= threads else 1
    return _split_matmul(a, b, out, axis, threads)


def matmul(a, b, out=None, label="linear", bias=None, into=None):
    """a [m, k] @ b [k, n] (+ bias [n]) -> out [m, n], the rows of a split over the threads
    (each thread adds the bias to its own rows, while they are in its cache); into [m, n]:
    each thread then adds its rows of out into it too."""
    record_matmul(label, a.shape, b.shape)
    if out is None:
        out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    return _split_matmul(a, b, out, 0, _threads(), bias, into)


def _split_matmul(a, b, out, axis, threads, bias=None, into=None):
    """np.matmul(a, b, out=out) (+ bias; into += out) on a single-threaded BLAS, with axis
    `axis` of a and out (and into) split into shares of at least MIN_GEMM_FLOPS_PER_THREAD
    flops, one per thread (b is shared when it is 2-D)."""
    flops = 2 * a.size * b.shape[-1]
    parts = _parts(flops, MIN_GEMM_FLOPS_PER_THREAD, a.shape[axis], threads)
    with single_threaded_blas():
        if parts == 1:
            _matmul_into(a, b, out, bias, into)
            return out
        shared_b = b.ndim == 2
        calls = []
        for lo, hi in _bounds(a.shape[axis], parts):
            p = (slice(lo, hi),) if axis == 0 else (slice(None), slice(lo, hi))
            calls.append((_matmul_into, (a[p], b if shared_b else b[p], out[p], bias,
                                         None if into is None else into[p])))
        _on_threads(calls)
    return out


def _matmul_into(a, b, out, bias=None, into=None):
    np.matmul(a, b, out=out)
    if bias is not None or into is not None:
        if out.ndim == 2 and out.dtype in _FLOATS:
            _sp().epilogue(out, bias, into)
        else:
            if bias is not None:
                out += bias
            if into is not None:
                into += out


def linear_forward(x, W, b):
    """x [..., D_in] @ W [D_in, D_out] + b -> y [..., D_out]: one GEMM over the rows."""
    d_in, d_out = W.shape
    y = np.empty(x.shape[:-1] + (d_out,), dtype=x.dtype)
    matmul(x.reshape(-1, d_in), W, out=y.reshape(-1, d_out), bias=b)
    return y


def linear_backward(dy, x, W, has_bias, overwrite_x=False, grads=None):
    """-> dx = dy W^T [..., D_in], dW = x^T dy [D_in, D_out], db [D_out] or None.

    On 2 threads the two products (the same FLOPs) run side by side, each whole on its own
    thread: one fork/join where splitting each would take two, and BLAS on full-size
    products; on more threads each product is split over all of them in turn.
    overwrite_x=True (x C-contiguous and no longer needed by the caller): dW is made first,
    then dx is written over x, one [..., D_in] array fewer at this point of the backward.
    grads=(gW [D_in, D_out], gb [D_out] or None): dW and db are added into these instead of
    returned (-> dx, None, None); each thread adds its share of dW while it is in its cache,
    rather than after the join (on 2 threads gb too, on dx's thread, which reads dy)."""
    d_in, d_out = W.shape
    dy_rows, x_rows = dy.reshape(-1, d_out), x.reshape(-1, d_in)  # [N, D_out], [N, D_in]
    overwrite_x = overwrite_x and x.flags.c_contiguous and x.dtype == dy.dtype
    dx = x if overwrite_x else np.empty(x.shape, dtype=dy.dtype)
    dW = np.empty(W.shape, dtype=np.result_type(x, dy))
    gW, gb = grads if grads is not None else (None, None)
    db = None
    flops = 2 * dy_rows.shape[0] * d_in * d_out                   # of each product
    if _threads() == 2 and flops >= MIN_GEMM_FLOPS_PER_THREAD and not overwrite_x:
        record_matmul("linear", dy_rows.shape, W.T.shape)
        record_matmul("linear", x_rows.T.shape, dy_rows.shape)
        with single_threaded_blas():
            _on_threads([(_input_gradient, (dy_rows, W, dx.reshape(-1, d_in), has_bias, gb)),
                         (_matmul_into, (x_rows.T, dy_rows, dW, None, gW))])
    else:
        matmul(x_rows.T, dy_rows, out=dW, into=gW)                # [D_in, N] @ [N, D_out]
        matmul(dy_rows, W.T, out=dx.reshape(-1, d_in))            # x is read by now
        if has_bias:
            db = _bias_gradient(dy_rows, gb)
    if grads is not None:
        return dx, None, None
    if has_bias and db is None:
        db = _bias_gradient(dy_rows)
    return dx, dW, db


def _input_gradient(dy_rows, W, dx_rows, has_bias, gb):
    """dx = dy W^T; gb += sum of dy's rows (when gb is given and there is a bias)."""
    np.matmul(dy_rows, W.T, out=dx_rows)
    if has_bias and gb is not None:
        _bias_gradient(dy_rows, gb)


def _bias_gradient(dy_rows, gb=None):
    """db [D_out] = the sum of dy's rows [N, D_out], added into gb when given (-> db)."""
    db = np.empty(dy_rows.shape[1], dtype=dy_rows.dtype)
    if dy_rows.dtype in _FLOATS and (gb is None or gb.dtype == db.dtype):
        _k().column_sums(dy_rows, db, np.empty(0, db.dtype) if gb is None else gb)
    else:
        db[...] = dy_rows.sum(axis=0)
        if gb is not None:
            gb += db
    return db


# -- attention: the matmuls stay BLAS; scale, mask and softmax become one in-place pass ------

def attention_forward(q, k, v, causal, scale, dropout_p, rng, training):
    """attention_forward of tfcore.functional without key_padding or mask (same cache).

    The output is written straight into the layout [B, S_q, H, D_v] that merge_heads reads,
    so merging the heads afterwards is a view, not a copy.
    """
    from ..functional.regularization import dropout_forward

    z = batched_matmul(q, np.swapaxes(k, -1, -2))                # [B, H, S_q, S_k]
    A = attention_softmax_(z, scale, causal)                     # in place: z is now A
    A_dropped, drop = dropout_forward(A, dropout_p, rng=rng, training=training)
    batch, heads, s_q, _ = A.shape
    merged = np.empty((batch, s_q, heads, v.shape[-1]), dtype=A.dtype)
    out = batched_matmul(A_dropped, v, out=np.swapaxes(merged, 1, 2))   # [B, H, S_q, D_v]
    return out, (q, k, v, A, drop, scale, (tuple(out.shape), out.dtype, namespace(q)))


def attention_backward(dout, cache):
    """attention_backward of tfcore.functional for a cache whose A is a contiguous array."""
    from ..functional.regularization import dropout_backward

    q, k, v, A, drop, scale, _ = cache
    batch, heads, s_q, d_h = q.shape
    s_k, d_v = k.shape[2], v.shape[3]
    if s_q == s_k and d_v == d_h:
        # dq, dk, dv are written into one [B, S, 3, H, D_h] buffer, the layout of the fused
        # qkv projection's gradient: qkv_merge_grads then returns it without a copy
        dqkv = np.empty((batch, s_q, 3, heads, d_h), dtype=q.dtype)
        outs = [np.swapaxes(dqkv[:, :, i], 1, 2) for i in range(3)]
    else:
        outs = [np.empty((batch, heads, s_q, d_h), dtype=q.dtype),
                np.empty((batch, heads, s_k, d_h), dtype=q.dtype),
                np.empty((batch, heads, s_k, d_v), dtype=q.dtype)]
    dq, dk, dv = outs
    # The [S_q, S_k] gradients are made for a quarter of the batch at a time, so that the
    # temporary dA is a quarter of A's size (the peak memory of a step is reached here).
    step = max(1, batch // 4)
    for lo in range(0, batch, step):
        b = slice(lo, min(lo + step, batch))
        keep = _batch_slice_of_dropout(drop, b)
        A_dropped = dropout_backward(A[b], keep)
        batched_matmul(np.swapaxes(A_dropped, -1, -2), dout[b], out=dv[b])   # [b, H, S_k, D_v]
        del A_dropped
        dA = dropout_backward(batched_matmul(dout[b], np.swapaxes(v[b], -1, -2)), keep)
        dz = attention_softmax_backward_(dA, A[b], scale, False)             # in place
        batched_matmul(dz, k[b], out=dq[b])                                  # [b, H, S_q, D_h]
        batched_matmul(np.swapaxes(dz, -1, -2), q[b], out=dk[b])             # [b, H, S_k, D_h]
        del dA, dz
    return dq, dk, dv


def _batch_slice_of_dropout(drop, b):
    """dropout_forward's cache (keep [B, ...] or None, scale, (shape, dtype, xp)) for the
    batch rows `b`."""
    if drop is None:
        return None
    keep, scale, (shape, dtype, xp) = drop
    rows = len(range(*b.indices(shape[0])))
    return (None if keep is None else keep[b], scale, ((rows,) + tuple(shape[1:]), dtype, xp))


def fused_qkv_grads(dq, dk, dv):
    """dqkv [B, S, 3D] when dq, dk, dv are the three views attention_backward wrote into one
    [B, S, 3, H, D_h] buffer (then no copy is needed), else None."""
    base = dq.base
    if base is None or dk.base is not base or dv.base is not base:
        return None
    batch, heads, seq, d_h = dq.shape
    if base.shape != (batch, seq, 3, heads, d_h) or not base.flags.c_contiguous:
        return None
    for i, grad in enumerate((dq, dk, dv)):
        view = np.swapaxes(base[:, :, i], 1, 2)
        if (grad.shape != view.shape or grad.strides != view.strides
                or grad.ctypes.data != view.ctypes.data):
            return None
    return base.reshape(batch, seq, 3 * heads * d_h)
