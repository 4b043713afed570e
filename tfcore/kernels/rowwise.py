"""Row-wise kernels (Numba loops over shares of the rows): softmax, LayerNorm and RMSNorm,
the cross-entropy loss, and the embedding's scatter-add."""
from __future__ import annotations

import numpy as np

from . import pool
from .pool import _bounds, _parts, _rows, _split, _split_rows, _streaming
from .switch import _k


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
    parts = _parts(n * d, pool.MIN_ELEMENTS_PER_THREAD, n)
    dgamma = np.zeros((parts, d))                 # one row of partial sums per thread's share
    dbeta = np.zeros((parts, d))
    dx = np.empty_like(dy)
    rows = (_rows(dy, d), _rows(xhat, d), rstd.reshape(-1), _rows(dx, d))
    kernel = _k().norm_backward

    def share(c, lo, hi):
        dy_, xhat_, rstd_, dx_ = (a[lo:hi] for a in rows)
        kernel(dy_, xhat_, rstd_, gamma, centered, dx_, dgamma[c:c + 1], dbeta[c:c + 1])

    pool._on_threads([(share, (c, lo, hi)) for c, (lo, hi) in enumerate(_bounds(n, parts))])
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


# -- embedding --------------------------------------------------------------------------

def embedding_backward(dx, flat_ids, w_shape):
    """dx [..., D], ids [N] -> dW [V, D] (zeros, then every row of dx added at its id)."""
    dW = np.zeros(w_shape, dtype=dx.dtype)
    rows, kernel, d = _rows(dx, w_shape[1]), _k().embedding_backward, w_shape[1]
    # each thread adds every row into its own share of the columns
    parts = _parts(rows.size, pool.MIN_ELEMENTS_PER_THREAD, d)
    pool._on_threads([(kernel, (flat_ids, rows[:, lo:hi], dW[:, lo:hi], 1))
                      for lo, hi in _bounds(d, parts)])
    return dW
