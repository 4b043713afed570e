"""The worker thread's compiled half: it waits for work by spinning, not by sleeping, and runs
BLAS products without Python's lock.

Why. On a virtual machine whose idle CPUs halt at once (no polling), a thread that sleeps on
a lock costs its waker some 40 microseconds to wake, and so does every pass of Python's lock
(the GIL) to a thread that waited for it. A fork/join through Python threads paid that twice,
about 90 microseconds, against products of 100 microseconds to a few milliseconds. Here the
worker and the waiting caller poll a flag for a while instead (a few hundred microseconds of
CPU cycles, as OpenMP runtimes do) and only then sleep; and a product handed to the worker
is run from compiled code through the C interface of the BLAS that NumPy itself calls, so the
worker needs no GIL for it at all.

The control block is an int64 array shared by the two threads (see the slot names below). A
task is posted by writing its arguments, then its number into POSTED; the worker runs it and
writes the number into DONE. The stores and loads of those slots are atomic (sequentially
consistent), which is what makes the arguments visible before the number is, and the sleep
protocol of tfcore.kernels._Worker free of lost wake-ups.

Only BLAS libraries whose C interface takes 64-bit integers (NumPy's OpenBLAS builds:
scipy_cblas_sgemm64_, cblas_sgemm64_) are used; with any other BLAS, or where the symbols are
not found, products go to the worker as Python calls, as every other kind of task does.
"""
from __future__ import annotations

import ctypes
import os
import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# control block slots
POSTED, DONE, KIND, WORKER_SLEEPS, CALLER_SLEEPS = 0, 1, 2, 3, 4
CONTROL_SLOTS = 8
# task kinds (KIND) and what serve() returns besides a task's number
PRODUCT, PYTHON_CALL = 1, 2
IDLE, WAKE_CALLER = -1, -2
# a product's arguments (int64 slots), as cblas_?gemm takes them, then its epilogue
ORDER, TRANS_A, TRANS_B, M, N, K, A, LDA, B, LDB, C, LDC = range(12)
FUNCTION, DOUBLE, BIAS, INTO, LD_INTO = 12, 13, 14, 15, 16
ARG_SLOTS = 20
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@intrinsic
def _load(typingctx, array, index):
    """array[index], an atomic load (sequentially consistent): never hoisted out of a loop."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.load_atomic(ptr, ordering="seq_cst", align=8)
    return types.int64(array, index), codegen


@intrinsic
def _store(typingctx, array, index, value):
    """array[index] = value, an atomic store (sequentially consistent)."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        builder.store_atomic(args[2], ptr, ordering="seq_cst", align=8)
        return context.get_dummy_value()
    return types.void(array, index, value), codegen


@intrinsic
def _relax(typingctx):
    """The CPU's spin-wait hint (x86 PAUSE); nothing elsewhere."""
    def codegen(context, builder, signature, args):
        if _X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            name = "llvm.x86.sse2.pause"
            fn = builder.module.globals.get(name) or ir.Function(builder.module, fnty, name)
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _ticks(typingctx, polls):
    """A clock for the polling loops: the CPU's cycle counter on x86 (the TSC, through
    llvm.readcyclecounter); elsewhere, where reading it may not be allowed, 64 ticks a poll."""
    def codegen(context, builder, signature, args):
        if not _X86:
            return builder.mul(args[0], ir.Constant(ir.IntType(64), 64))
        fnty = ir.FunctionType(ir.IntType(64), [])
        name = "llvm.readcyclecounter"
        fn = builder.module.globals.get(name) or ir.Function(builder.module, fnty, name)
        return builder.call(fn, [])
    return types.int64(polls), codegen


def _gemm_intrinsic(real):
    """cblas_?gemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) through the
    function address `fn` (64-bit integers; addresses given as integers)."""
    @intrinsic
    def call(typingctx, fn, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        def codegen(context, builder, signature, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            flt = ir.FloatType() if real == "float32" else ir.DoubleType()
            ptr = ir.IntType(8).as_pointer()
            fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, flt, ptr, i64,
                                                   ptr, i64, flt, ptr, i64])
            (f, order_, ta_, tb_, m_, n_, k_, alpha_, a_, lda_, b_, ldb_, beta_, c_,
             ldc_) = args
            target = builder.inttoptr(f, fnty.as_pointer())
            builder.call(target, [builder.trunc(order_, i32), builder.trunc(ta_, i32),
                                  builder.trunc(tb_, i32), m_, n_, k_,
                                  builder.fptrunc(alpha_, flt) if real == "float32" else alpha_,
                                  builder.inttoptr(a_, ptr), lda_, builder.inttoptr(b_, ptr),
                                  ldb_,
                                  builder.fptrunc(beta_, flt) if real == "float32" else beta_,
                                  builder.inttoptr(c_, ptr), ldc_])
            return context.get_dummy_value()
        i = types.int64
        return types.void(i, i, i, i, i, i, i, types.float64, i, i, i, i, types.float64, i,
                          i), codegen
    return call


_sgemm = _gemm_intrinsic("float32")
_dgemm = _gemm_intrinsic("float64")


@intrinsic
def _rows_view(typingctx, address, rows, cols, ld, dtype_of):
    """A [rows, cols] array over the memory at `address` whose rows are `ld` elements apart
    (the dtype is that of the array `dtype_of`)."""
    element = dtype_of.dtype
    result = types.Array(element, 2, "A")

    def codegen(context, builder, signature, args):
        address_, rows_, cols_, ld_, _ = args
        ary = context.make_array(result)(context, builder)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(
            context.get_data_type(element)))
        data = builder.inttoptr(address_, context.get_data_type(element).as_pointer())
        shape = [rows_, cols_]
        strides = [builder.mul(ld_, itemsize), itemsize]
        context.populate_array(ary, data=data, shape=shape, strides=strides,
                               itemsize=itemsize, meminfo=None)
        return ary._getvalue()
    return result(types.int64, types.int64, types.int64, types.int64, dtype_of), codegen


@njit(nogil=True, cache=True)
def epilogue(out, bias, into):
    """out [m, n] += bias [n] on each row (unless bias is None), then into [m, n] += out
    (unless into is None): what follows a product, on the rows just made (each element one
    addition, as NumPy's out += bias and into += out, so the same bits, 2-3 times faster)."""
    m, n = out.shape
    if bias is not None:
        for i in range(m):
            for j in range(n):
                out[i, j] += bias[j]
    if into is not None:
        for i in range(m):
            for j in range(n):
                into[i, j] += out[i, j]


@njit(nogil=True, cache=True)
def _epilogue(args, like):
    """The epilogue of a posted product (like: an array of the product's dtype)."""
    m, n = args[M], args[N]
    out = _rows_view(args[C], m, n, args[LDC], like)
    if args[BIAS] != 0 and args[INTO] != 0:
        epilogue(out, _rows_view(args[BIAS], 1, n, n, like)[0],
                 _rows_view(args[INTO], m, n, args[LD_INTO], like))
    elif args[BIAS] != 0:
        epilogue(out, _rows_view(args[BIAS], 1, n, n, like)[0], None)
    elif args[INTO] != 0:
        epilogue(out, None, _rows_view(args[INTO], m, n, args[LD_INTO], like))


@njit(nogil=True, cache=True)
def _run_product(args, like32, like64):
    if args[DOUBLE]:
        _dgemm(args[FUNCTION], args[ORDER], args[TRANS_A], args[TRANS_B], args[M], args[N],
               args[K], 1.0, args[A], args[LDA], args[B], args[LDB], 0.0, args[C], args[LDC])
        _epilogue(args, like64)
    else:
        _sgemm(args[FUNCTION], args[ORDER], args[TRANS_A], args[TRANS_B], args[M], args[N],
               args[K], 1.0, args[A], args[LDA], args[B], args[LDB], 0.0, args[C], args[LDC])
        _epilogue(args, like32)


@njit(nogil=True, cache=True)
def serve(control, args, done, spin_cycles, like32, like64):
    """The worker's wait, without the GIL: first marks task `done` done (0: none), then polls
    for the next task for up to spin_cycles CPU cycles. Runs products itself (and goes on
    polling); returns the number of a task that needs Python (a call), IDLE when
    nothing came, WAKE_CALLER when the caller went to sleep waiting for a product it ran."""
    if done:
        _store(control, DONE, done)
        if _load(control, CALLER_SLEEPS):
            return WAKE_CALLER
    seen = _load(control, DONE)
    polls = 0
    start = _ticks(polls)
    while True:
        posted = _load(control, POSTED)
        if posted != seen:
            if _load(control, KIND) != PRODUCT:
                return posted
            _run_product(args, like32, like64)
            _store(control, DONE, posted)
            seen = posted
            if _load(control, CALLER_SLEEPS):
                return WAKE_CALLER
            polls = 0
            start = _ticks(polls)
        elif _ticks(polls) - start > spin_cycles:
            return IDLE
        else:
            _relax()
            polls += 1


@njit(nogil=True, cache=True)
def wait_done(control, task, spin_cycles):
    """The caller's wait for task `task`, without the GIL: True once it is done, False after
    spin_cycles CPU cycles without it."""
    polls = 0
    start = _ticks(polls)
    while _load(control, DONE) != task:
        if _ticks(polls) - start > spin_cycles:
            return False
        _relax()
        polls += 1
    return True


@njit(nogil=True, cache=True)
def load(control, slot):
    return _load(control, slot)


@njit(nogil=True, cache=True)
def store(control, slot, value):
    _store(control, slot, value)


# -- the BLAS NumPy calls, through its C interface ------------------------------------------

_GEMM_SYMBOLS = (("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_"),
                 ("cblas_sgemm64_", "cblas_dgemm64_"))


def blas_gemm_addresses():
    """(sgemm, dgemm) function addresses of the 64-bit-integer C interface of the OpenBLAS
    that NumPy was built with, or None where it cannot be found for sure."""
    try:
        from threadpoolctl import ThreadpoolController

        numpy_dir = os.path.dirname(os.path.dirname(os.path.abspath(np.__file__)))
        for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
            path = os.path.abspath(lib.filepath)
            if lib.internal_api != "openblas" or not path.startswith(numpy_dir):
                continue
            if not os.path.basename(os.path.dirname(path)).startswith("numpy"):
                continue
            handle = ctypes.CDLL(path)
            for names in _GEMM_SYMBOLS:
                if all(hasattr(handle, name) for name in names):
                    return tuple(ctypes.cast(getattr(handle, name), ctypes.c_void_p).value
                                 for name in names)
    except Exception:  # no threadpoolctl, an unreadable library: the Python path
        return None
    return None
