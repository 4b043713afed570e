"""Fused CPU kernels (Numba) for the element-wise and row-wise ops of the training step.

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
made by either path can go to either backward. The kernels compute in float64 whatever the
storage dtype. Compiled code is cached on disk (``cache=True``): only the first use on a
machine pays Numba's compile time (see ``warm_up``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import numpy as np

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_enabled = os.environ.get("TFCORE_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no")
_have_numba = importlib.util.find_spec("numba") is not None
_nb = None  # the compiled module, imported on first use


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
        from . import _numba

        _nb = _numba
    return _nb


def _rows(x, width):
    return x.reshape(-1, width)


def _chunks(n_rows: int) -> int:
    """How many row chunks a reduction over rows is split into (a few per thread)."""
    from numba import get_num_threads

    return max(1, min(n_rows, 4 * get_num_threads()))


# -- GELU -------------------------------------------------------------------------------

def gelu_forward(x, approximate):
    """x [...] -> y [...] (the reference's cache is (x, approximate))."""
    y = np.empty_like(x)
    kernel = _k().gelu_tanh_forward if approximate == "tanh" else _k().gelu_exact_forward
    kernel(x.reshape(-1), y.reshape(-1))
    return y


def gelu_backward(dy, x, approximate, out=None):
    """dy, x [...] -> dx [...] (out may be dy itself)."""
    dx = np.empty_like(x) if out is None else out
    kernel = _k().gelu_tanh_backward if approximate == "tanh" else _k().gelu_exact_backward
    kernel(dy.reshape(-1), x.reshape(-1), dx.reshape(-1))
    return dx


# -- softmax ----------------------------------------------------------------------------

def softmax_forward(z):
    """z [..., K] -> s [..., K]."""
    s = np.empty_like(z)
    _k().softmax_rows(_rows(z, z.shape[-1]), _rows(s, z.shape[-1]))
    return s


def softmax_backward(ds, s, scale=1.0, out=None):
    """ds, s [..., K] -> dz = scale * s * (ds - rowsum(ds * s)) (out may be ds itself)."""
    dz = np.empty_like(s) if out is None else out
    k = s.shape[-1]
    _k().softmax_backward_rows(_rows(ds, k), _rows(s, k), _rows(dz, k), float(scale))
    return dz


def attention_softmax_(z, scale, causal):
    """In place: scores z [B, H, S_q, S_k] -> A = softmax(scale * z + causal mask)."""
    s_q, s_k = z.shape[-2:]
    offset = s_k - s_q if causal else s_k
    _k().causal_softmax_inplace(z.reshape(-1, s_q, s_k), float(scale), offset)
    return z


def attention_softmax_backward_(dA, A, scale, causal):
    """In place: dA [B, H, S_q, S_k] -> dZ = scale * A * (dA - rowsum(dA * A))."""
    s_q, s_k = A.shape[-2:]
    offset = s_k - s_q if causal else s_k
    _k().causal_softmax_backward_inplace(
        dA.reshape(-1, s_q, s_k), A.reshape(-1, s_q, s_k), float(scale), offset)
    return dA


# -- normalization ----------------------------------------------------------------------

def layernorm_forward(x, gamma, beta, eps):
    """x [..., D] -> y [..., D], cache (xhat [..., D], rstd [..., 1], gamma); None when a row's
    variance overflows or x is not finite (the reference handles those rows)."""
    d = x.shape[-1]
    y, xhat = np.empty_like(x), np.empty_like(x)
    rstd = np.empty(x.shape[:-1] + (1,), dtype=x.dtype)
    _k().layernorm_forward(_rows(x, d), gamma, beta, float(eps), _rows(y, d), _rows(xhat, d),
                           rstd.reshape(-1))
    if np.isnan(rstd).any():
        return None
    return y, (xhat, rstd, gamma)


def rmsnorm_forward(x, gain, eps):
    """x [..., D] -> y [..., D], cache (xhat [..., D], rrms [..., 1], gain); None as above."""
    d = x.shape[-1]
    y, xhat = np.empty_like(x), np.empty_like(x)
    rrms = np.empty(x.shape[:-1] + (1,), dtype=x.dtype)
    _k().rmsnorm_forward(_rows(x, d), gain, float(eps), _rows(y, d), _rows(xhat, d),
                         rrms.reshape(-1))
    if np.isnan(rrms).any():
        return None
    return y, (xhat, rrms, gain)


def _norm_backward(dy, cache, centered):
    xhat, rstd, gamma = cache
    d = dy.shape[-1]
    n = dy.size // d
    chunks = _chunks(n)
    dgamma = np.zeros((chunks, d))
    dbeta = np.zeros((chunks, d))
    dx = np.empty_like(dy)
    _k().norm_backward(_rows(dy, d), _rows(xhat, d), rstd.reshape(-1), gamma, centered,
                       _rows(dx, d), dgamma, dbeta)
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
    _k().cross_entropy_forward(z, safe, valid, probs, nll)
    return probs, float(nll.sum())


def cross_entropy_backward(dloss, cache):
    """The reference's cache -> dlogits [..., V]."""
    probs, safe, valid, n_valid, shape = cache
    dz = np.empty_like(probs)
    _k().cross_entropy_backward(probs, safe, valid, float(dloss) / max(n_valid, 1), dz)
    return dz.reshape(shape)


# -- optimizer and embedding ------------------------------------------------------------

_NO_MASK = {np.dtype(np.float32): np.zeros(0, np.float32), np.dtype(np.float64): np.zeros(0)}


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias1, bias2, decay_mask):
    """In place on p, m, v [P]: the reference adamw_update's arithmetic, one pass."""
    mask = _NO_MASK[p.dtype] if decay_mask is None else decay_mask
    _k().adamw_update(p, g, m, v, float(lr), float(beta1), float(beta2), float(eps),
                      float(weight_decay), float(bias1), float(bias2), mask)


def embedding_backward(dx, flat_ids, w_shape):
    """dx [..., D], ids [N] -> dW [V, D] (zeros, then every row of dx added at its id)."""
    dW = np.zeros(w_shape, dtype=dx.dtype)
    _k().embedding_backward(flat_ids, _rows(dx, w_shape[1]), dW, _chunks(w_shape[1]))
    return dW


def warm_up(dtypes=("float32", "float64")) -> float:
    """Run every kernel once on tiny inputs (compiles or loads from the disk cache); seconds."""
    import time

    start = time.perf_counter()
    for name in dtypes:
        x = np.linspace(-2, 2, 24, dtype=name).reshape(2, 3, 4)
        for form in ("none", "tanh"):
            gelu_backward(x, x, form)
            gelu_forward(x, form)
        s = softmax_forward(x)
        softmax_backward(x, s)
        z = np.ones((1, 2, 3, 4), dtype=name)
        attention_softmax_backward_(z.copy(), attention_softmax_(z, 0.5, True), 0.5, True)
        g = np.ones(4, dtype=name)
        layernorm_backward(x, layernorm_forward(x, g, g, 1e-5)[1])
        rmsnorm_backward(x, rmsnorm_forward(x, g, 1e-5)[1])
        labels = np.zeros(6, dtype=np.int64)
        probs, _ = cross_entropy_forward(x.reshape(6, 4), labels, labels == 0)
        cross_entropy_backward(1.0, (probs, labels, labels == 0, 6, (6, 4)))
        flat = x.reshape(-1).copy()
        adamw_update(flat, flat, flat.copy(), flat * 0, 1e-3, 0.9, 0.99, 1e-8, 0.1, 0.1, 0.01,
                     None)
        adamw_update(flat, flat, flat.copy(), flat * 0, 1e-3, 0.9, 0.99, 1e-8, 0.1, 0.1, 0.01,
                     np.ones_like(flat))
        embedding_backward(x, labels, (3, 4))
    return time.perf_counter() - start


# -- attention: the matmuls stay BLAS; scale, mask and softmax become one in-place pass ------

def attention_forward(q, k, v, causal, scale, dropout_p, rng, training):
    """attention_forward of tfcore.functional without key_padding or mask (same cache)."""
    from ..functional.regularization import dropout_forward

    z = np.matmul(q, np.swapaxes(k, -1, -2))                     # [B, H, S_q, S_k]
    A = attention_softmax_(z, scale, causal)                     # in place: z is now A
    A_dropped, drop = dropout_forward(A, dropout_p, rng=rng, training=training)
    out = np.matmul(A_dropped, v)                                # [B, H, S_q, D_v]
    return out, (q, k, v, A, drop, scale, tuple(out.shape), out.dtype.name)


def attention_backward(dout, cache):
    """attention_backward of tfcore.functional for a cache whose A is a contiguous array."""
    from ..functional.regularization import dropout_backward

    q, k, v, A, drop, scale, _, _ = cache
    A_dropped = dropout_backward(A, drop)
    dv = np.matmul(np.swapaxes(A_dropped, -1, -2), dout)        # [B, H, S_k, D_v]
    del A_dropped
    dA = dropout_backward(np.matmul(dout, np.swapaxes(v, -1, -2)), drop)  # a new array
    dz = attention_softmax_backward_(dA, A, scale, False)        # in place
    dq = np.matmul(dz, k)                                        # [B, H, S_q, D_h]
    dk = np.matmul(np.swapaxes(dz, -1, -2), q)                   # [B, H, S_k, D_h]
    return dq, dk, dv
