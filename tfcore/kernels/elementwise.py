"""Element-wise kernels: GELU on NumPy's SIMD ufuncs in cache-sized chunks, the residual sum,
and the AdamW update, each split over the pool's threads."""
from __future__ import annotations

import numpy as np

from . import pool
from .pool import _chunked, _rows, _split, _split_rows, _streaming
from .switch import _k


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


# -- the residual sum ---------------------------------------------------------------------

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


# -- GELU's entry points -------------------------------------------------------------------

def gelu_forward(x, approximate):
    """x [...] -> y [...] (the reference's cache is (x, approximate))."""
    y = np.empty_like(x)
    _chunked(_gelu_forward_chunk, x.size, pool._threads(), x.dtype, 0,
             (x.reshape(-1), y.reshape(-1)), (approximate,), CHUNK)
    return y


def gelu_backward(dy, x, approximate, out=None):
    """dy, x [...] -> dx [...] (out may be dy itself)."""
    dx = np.empty_like(x) if out is None else out
    scratch = 1 if approximate == "tanh" and FUSED_GELU else 3
    _chunked(_gelu_backward_chunk, x.size, pool._threads(), x.dtype, scratch,
             (dy.reshape(-1), x.reshape(-1), dx.reshape(-1)), (approximate,), BACKWARD_CHUNK)
    return dx


# -- AdamW --------------------------------------------------------------------------------

_NO_MASK = {np.dtype(np.float32): np.zeros(0, np.float32), np.dtype(np.float64): np.zeros(0)}


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias1, bias2, decay_mask):
    """In place on p, m, v [P]: the reference adamw_update's arithmetic, one pass."""
    mask = _NO_MASK[p.dtype] if decay_mask is None else decay_mask
    kernel = _k().adamw_update
    scalars = tuple(float(a) for a in (lr, beta1, beta2, eps, weight_decay, bias1, bias2))
    _split(lambda lo, hi: kernel(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], *scalars,
                                 mask[lo:hi]), p.shape[0], 1)
