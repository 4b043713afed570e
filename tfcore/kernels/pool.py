"""One pool of worker threads for every kernel, and the splits of an op into shares.

A Numba loop or a BLAS product runs single-threaded on a share of the rows (or of the batch),
the shares on the pool's threads; an op is split only when each thread gets at least
MIN_GEMM_FLOPS_PER_THREAD or MIN_ELEMENTS_PER_THREAD of work, and below that it runs on the
calling thread, with no fork/join at all. The thread count is Numba's
(``numba.set_num_threads``, NUMBA_NUM_THREADS). The settings below are read at each call
(``pool.SPIN_CYCLES = 0`` takes effect at once).
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .switch import _FLOATS, _writable_numba_cache

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
_gemm_addresses = None     # (sgemm, dgemm) addresses, or (), found by _sp()


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


def _thread_pool(threads: int) -> list:
    """The process's worker threads (grown to `threads` - 1 workers on demand)."""
    while len(_pool) < threads - 1:
        _pool.append(_Worker(f"tfcore-worker-{len(_pool)}"))
    return _pool


def _matmul_into(a, b, out, bias=None, into=None):
    """One share of a product: out = a @ b (+ bias; into += out). A worker handed this call
    runs it from compiled code where BLAS takes the arrays as they lie (_product_args)."""
    np.matmul(a, b, out=out)
    if bias is not None or into is not None:
        if out.ndim == 2 and out.dtype in _FLOATS:
            _sp().epilogue(out, bias, into)
        else:
            if bias is not None:
                out += bias
            if into is not None:
                into += out


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


def _rows(x, width):
    """[..., width] -> [N, width] (a view of a contiguous x)."""
    return x.reshape(-1, width)
