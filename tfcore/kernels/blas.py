"""BLAS products split over the pool's threads: matmul and batched_matmul on a
single-threaded BLAS (one fork/join per product, not one per GEMM of a batch), and the linear
layer's forward and backward (the bias added, and the gradients accumulated, by each thread
on its own rows while they are in its cache)."""
from __future__ import annotations

import contextlib

import numpy as np

from ..backend import record_matmul
from . import pool
from .pool import _bounds, _parts
from .switch import _FLOATS, _k

_blas = None     # threadpoolctl's controllers of the process's BLAS libraries, found on first use


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



def batched_matmul(a, b, out=None, label="attention"):
    """a [B, H, m, k] @ b [B, H, k, n] -> out [B, H, m, n] (out may be a strided view)."""
    record_matmul(label, a.shape, b.shape)
    if out is None:
        out = np.empty(a.shape[:-1] + b.shape[-1:], dtype=np.result_type(a, b))
    threads = pool._threads()
    axis = 0 if a.shape[0] >= threads else 1
    return _split_matmul(a, b, out, axis, threads)


def matmul(a, b, out=None, label="linear", bias=None, into=None):
    """a [m, k] @ b [k, n] (+ bias [n]) -> out [m, n], the rows of a split over the threads
    (each thread adds the bias to its own rows, while they are in its cache); into [m, n]:
    each thread then adds its rows of out into it too."""
    record_matmul(label, a.shape, b.shape)
    if out is None:
        out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    return _split_matmul(a, b, out, 0, pool._threads(), bias, into)


def _split_matmul(a, b, out, axis, threads, bias=None, into=None):
    """np.matmul(a, b, out=out) (+ bias; into += out) on a single-threaded BLAS, with axis
    `axis` of a and out (and into) split into shares of at least MIN_GEMM_FLOPS_PER_THREAD
    flops, one per thread (b is shared when it is 2-D)."""
    flops = 2 * a.size * b.shape[-1]
    parts = _parts(flops, pool.MIN_GEMM_FLOPS_PER_THREAD, a.shape[axis], threads)
    with single_threaded_blas():
        if parts == 1:
            pool._matmul_into(a, b, out, bias, into)
            return out
        shared_b = b.ndim == 2
        calls = []
        for lo, hi in _bounds(a.shape[axis], parts):
            p = (slice(lo, hi),) if axis == 0 else (slice(None), slice(lo, hi))
            calls.append((pool._matmul_into, (a[p], b if shared_b else b[p], out[p], bias,
                                              None if into is None else into[p])))
        pool._on_threads(calls)
    return out



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
    if pool._threads() == 2 and flops >= pool.MIN_GEMM_FLOPS_PER_THREAD and not overwrite_x:
        record_matmul("linear", dy_rows.shape, W.T.shape)
        record_matmul("linear", x_rows.T.shape, dy_rows.shape)
        with single_threaded_blas():
            pool._on_threads([(_input_gradient, (dy_rows, W, dx.reshape(-1, d_in), has_bias,
                                                 gb)),
                              (pool._matmul_into, (x_rows.T, dy_rows, dW, None, gW))])
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

