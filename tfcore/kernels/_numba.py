"""The fused CPU kernels, compiled by Numba (single-threaded, cached on disk).

Each kernel works on whatever rows it is given and releases the GIL (nogil), so the caller
(tfcore.kernels) splits the rows over its one pool of threads, and only when the work pays for
the fork/join. A Numba parallel loop would start a second pool (OpenMP's), whose idle workers
spin for milliseconds after every loop: on a 2-core machine they took the core that the BLAS
halves or the next kernel needed.

Each function fills output arrays that the caller allocates (so NumPy's allocations stay
visible to tracemalloc and no memory is owned by Numba). The arithmetic is done in float64
whatever the storage dtype, and follows the reference formulas of tfcore.functional line by
line; only the order of additions inside a row differs, so float64 results agree with the
reference to a few units in the last place.

Shape letters as in tfcore.functional: N rows, D or K or V the row width, R = B * H.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._spin import NO_TRANS, ROW_MAJOR, TRANS, _dgemm, _sgemm

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715

# error_model="numpy": a float division by zero gives inf or nan, as in NumPy (and as in the
# parallel loops these were), instead of a test and a raise per division, which keeps LLVM
# from vectorizing a loop: AdamW's ran 4.5 times slower with it.
_JIT = dict(cache=True, nogil=True, error_model="numpy")


# -- exp in plain arithmetic, so that the loops calling it are SIMD loops -------------------
# Numba's math.exp is a scalar libm call per element (2-4 ns); this one is arithmetic that
# LLVM vectorizes (0.4-1 ns per element on AVX-512): exp(x) = 2^n exp(r), with
# n = round(x / ln 2) and r = x - n ln 2 in [-ln2 / 2, ln2 / 2] (ln 2 in two parts, Cody and
# Waite, so that r is exact to the last bits), exp(r) by Horner's rule on its Taylor
# polynomial (degree 12 in float64, 7 in float32: truncation error below a unit in the last
# place), and 2^n added to the exponent bits of the result through an integer view of the
# row. Inputs are clamped to [-708, 709] (float64) or [-87, 88] (float32), so that 2^n and
# the result stay normal numbers (no subnormal operands, which cost a hundred cycles each,
# and no overflowed bits); NaN stays NaN. The constants are typed in the storage dtype:
# one implementation per dtype, chosen when Numba compiles the caller. Each multiply-add is
# LLVM's fmuladd (_fma): one FMA instruction, one rounding, on a CPU that has them (x86-64-v3
# and up, every AVX2 and AVX-512 CPU: the same bits on all of them), a multiply and an add on
# an older one; the loop makes half the instructions, and took 0.37 ns per element in
# float32 on AVX-512 against 0.59 as separate multiplies and adds. (LLVM's strict fma would
# be a library call per element where there is no FMA.)

@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c, fused where the CPU can (LLVM's llvm.fmuladd), for float32 or float64."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        kind = args[0].type
        fma = builder.module.declare_intrinsic("llvm.fmuladd", [kind],
                                               ir.FunctionType(kind, [kind] * 3))
        return builder.call(fma, args)
    return a(a, b, c), codegen


def exp_rows_into(row, limit, mul, sub):
    """row[j] = exp(row[j] * mul - sub) for j < limit, in place (row: 1-D, contiguous)."""
    raise NotImplementedError("compiled only: see the overload below")


def _exp_implementation(dtype, log2e, ln2_hi, ln2_lo, floor, ceiling, degree, int_type,
                        mantissa):
    log2e, ln2_hi, ln2_lo, floor, ceiling = (dtype(x) for x in (log2e, ln2_hi, ln2_lo, floor,
                                                                 ceiling))
    taylor = tuple(dtype(1.0 / math.factorial(n)) for n in range(degree + 1))
    half = dtype(0.5)
    k = taylor + (dtype(0.0),) * (12 - degree)      # unused terms: folded away at compile time
    minus_ln2_hi, minus_ln2_lo = -ln2_hi, -ln2_lo
    short = degree == 7

    def implementation(row, limit, mul, sub):
        bits = row.view(int_type)
        times, minus = dtype(mul), dtype(-sub)      # storage-dtype values, as the callers'
        for j in range(limit):
            x = _fma(row[j], times, minus)
            y = min(max(x, floor), ceiling)
            n = np.floor(_fma(y, log2e, half))      # a float: no int64 lanes
            r = _fma(n, minus_ln2_lo, _fma(n, minus_ln2_hi, y))
            if short:
                p = _fma(_fma(_fma(_fma(_fma(_fma(_fma(k[7], r, k[6]), r, k[5]), r, k[4]), r,
                                            k[3]), r, k[2]), r, k[1]), r, k[0])
            else:
                p = _fma(_fma(_fma(_fma(k[12], r, k[11]), r, k[10]), r, k[9]), r, k[8])
                p = _fma(_fma(_fma(_fma(p, r, k[7]), r, k[6]), r, k[5]), r, k[4])
                p = _fma(_fma(_fma(_fma(p, r, k[3]), r, k[2]), r, k[1]), r, k[0])
            row[j] = p if x == x else x
            bits[j] += int_type(n) << mantissa
    return implementation


_EXP = {
    "float64": _exp_implementation(np.float64, 1.0 / math.log(2.0), 6.93147180369123816490e-01,
                                   1.90821492927058770002e-10, -708.0, 709.0, 12, np.int64,
                                   52),
    "float32": _exp_implementation(np.float32, 1.0 / math.log(2.0), 0.693359375,
                                   -2.12194440e-4, -87.0, 88.0, 7, np.int32, 23),
}


@overload(exp_rows_into, jit_options=dict(nogil=True, error_model="numpy"))
def _exp_rows_into(row, limit, mul, sub):
    return _EXP.get(str(row.dtype))


@njit(cache=True, nogil=True, error_model="numpy")
def _row_max(row, limit):
    """max(row[:limit]) in a tree of pairs (a running max is one long dependency chain)."""
    m = -np.inf
    j = 0
    while j + 8 <= limit:
        a = max(max(row[j], row[j + 1]), max(row[j + 2], row[j + 3]))
        b = max(max(row[j + 4], row[j + 5]), max(row[j + 6], row[j + 7]))
        m = max(m, max(a, b))
        j += 8
    for jj in range(j, limit):
        m = max(m, row[jj])
    return m


# The row sums below keep 8 (or 4) running sums, element j going to sum j mod 8, and add
# them in a fixed tree at the end. The running sums are the lanes of an LLVM vector: every
# lane makes the additions of a scalar loop in the source's order, so the result is the same
# on every CPU (a sum that LLVM may reorder, fastmath's reassoc, follows whatever vector
# width it picks for the CPU; and LLVM does not vectorise 8 separate scalar sums). Each
# returns float64 whatever the storage dtype.

def _load_float64s(context, builder, data, index, width):
    """<width x double> from data[index:index + width] (float32 storage widened)."""
    element = data.type.pointee
    at = builder.gep(data, [index])
    v = builder.load(builder.bitcast(at, ir.VectorType(element, width).as_pointer()),
                     align=context.get_abi_sizeof(element))
    return v if element == ir.DoubleType() else builder.fpext(v, ir.VectorType(ir.DoubleType(),
                                                                               width))


def _lanes(builder, vector, width):
    """The `width` elements of an LLVM vector, as a list of scalars."""
    return [builder.extract_element(vector, ir.Constant(ir.IntType(32), i))
            for i in range(width)]


def _lane_sums(squares):
    """An intrinsic: (row, limit, center) -> 8 float64 partial sums of row[:limit // 8 * 8]
    (of (row - center)^2 with squares=True), lane i summing the elements j = i mod 8 in
    order. Written as LLVM vector code, <8 x double>: element-wise adds and multiplies, so
    every lane makes the additions of the scalar loop it replaces, on any vector width (LLVM
    splits the vector into the registers the CPU has, but never re-associates a lane)."""
    @intrinsic
    def lane_sums(typingctx, row, limit, center):
        if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C"
                and row.dtype in (types.float32, types.float64)):
            return None
        result = types.UniTuple(types.float64, 8)

        def codegen(context, builder, signature, args):
            row_, limit_, center_ = args
            data = context.make_array(signature.args[0])(context, builder, row_).data
            f64 = ir.DoubleType()
            vec = ir.VectorType(f64, 8)
            acc = cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 8))
            if squares:
                middle = builder.insert_element(ir.Constant(vec, ir.Undefined), center_,
                                                ir.Constant(ir.IntType(32), 0))
                splat = builder.shuffle_vector(middle, ir.Constant(vec, ir.Undefined),
                                               ir.Constant(ir.VectorType(ir.IntType(32), 8),
                                                           [0] * 8))
            blocks = builder.sdiv(limit_, ir.Constant(limit_.type, 8))
            with cgutils.for_range(builder, blocks) as loop:
                index = builder.mul(loop.index, ir.Constant(loop.index.type, 8))
                v = _load_float64s(context, builder, data, index, 8)
                if squares:
                    c = builder.fsub(v, splat)
                    v = builder.fmul(c, c)
                builder.store(builder.fadd(builder.load(acc), v), acc)
            return context.make_tuple(builder, result, _lanes(builder, builder.load(acc), 8))
        return result(row, limit, center), codegen
    return lane_sums


_lane_sum = _lane_sums(squares=False)
_lane_square_sum = _lane_sums(squares=True)


@njit(cache=True, nogil=True, error_model="numpy")
def _row_sum(row, limit):
    """sum(row[:limit]) in float64, in 8 interleaved partial sums."""
    limit = max(limit, 0)
    s0, s1, s2, s3, s4, s5, s6, s7 = _lane_sum(row, limit, 0.0)
    for jj in range(limit - limit % 8, limit):
        s0 += row[jj]
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@njit(cache=True, nogil=True, error_model="numpy")
def _row_squares(row, center):
    """sum((row - center)^2) in float64, in 8 interleaved partial sums."""
    n = row.shape[0]
    s0, s1, s2, s3, s4, s5, s6, s7 = _lane_square_sum(row, n, center)
    for jj in range(n - n % 8, n):
        c = np.float64(row[jj]) - center
        s0 += c * c
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@intrinsic
def _lane_gain_sums(typingctx, dy, xhat, gamma):
    """(dy, xhat, gamma) -> 4 + 4 float64 partial sums of a = dy * gamma and of a * xhat
    over the first n // 4 * 4 elements, lane i taking the elements j = i mod 4 in order
    (LLVM vector code, as _lane_sums)."""
    arrays = (dy, xhat, gamma)
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
               and a.dtype in (types.float32, types.float64) for a in arrays):
        return None
    result = types.UniTuple(types.float64, 8)

    def codegen(context, builder, signature, args):
        f64 = ir.DoubleType()
        vec = ir.VectorType(f64, 4)
        views = [context.make_array(t)(context, builder, a)
                 for t, a in zip(signature.args, args)]
        n = cgutils.unpack_tuple(builder, views[0].shape, 1)[0]
        acc_g = cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 4))
        acc_h = cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 4))
        blocks = builder.sdiv(n, ir.Constant(n.type, 4))
        with cgutils.for_range(builder, blocks) as loop:
            index = builder.mul(loop.index, ir.Constant(loop.index.type, 4))
            dy_, xhat_, gamma_ = (_load_float64s(context, builder, view.data, index, 4)
                                  for view in views)
            a = builder.fmul(dy_, gamma_)
            builder.store(builder.fadd(builder.load(acc_g), a), acc_g)
            builder.store(builder.fadd(builder.load(acc_h), builder.fmul(a, xhat_)), acc_h)
        lanes = _lanes(builder, builder.load(acc_g), 4) + _lanes(builder, builder.load(acc_h), 4)
        return context.make_tuple(builder, result, lanes)
    return result(dy, xhat, gamma), codegen


@njit(cache=True, nogil=True, error_model="numpy")
def _row_gain_sums(dy, xhat, gamma):
    """(sum(dy * gamma), sum(dy * gamma * xhat)) in float64, 4 interleaved partial sums each."""
    g0, g1, g2, g3, h0, h1, h2, h3 = _lane_gain_sums(dy, xhat, gamma)
    n = dy.shape[0]
    for jj in range(n - n % 4, n):
        a = np.float64(dy[jj]) * np.float64(gamma[jj])
        g0 += a
        h0 += a * np.float64(xhat[jj])
    return (g0 + g1) + (g2 + g3), (h0 + h1) + (h2 + h3)


# -- GELU: x [n] -> y [n]; dy, x [n] -> dx [n] (flat views of contiguous arrays) ----------

@njit(**_JIT)
def gelu_exact_forward(x, y):
    for i in range(x.shape[0]):
        xi = np.float64(x[i])
        y[i] = 0.5 * xi * (1.0 + math.erf(xi * _INV_SQRT_2))


@njit(**_JIT)
def gelu_tanh_forward(x, y):
    for i in range(x.shape[0]):
        xi = np.float64(x[i])
        t = math.tanh(_SQRT_2_OVER_PI * xi * (1.0 + _GELU_CUBIC * xi * xi))
        y[i] = 0.5 * xi * (1.0 + t)


@njit(**_JIT)
def gelu_exact_backward(dy, x, dx):
    for i in range(x.shape[0]):
        xi = np.float64(x[i])
        cdf = 0.5 * (1.0 + math.erf(xi * _INV_SQRT_2))
        pdf = _INV_SQRT_2PI * math.exp(-0.5 * xi * xi)
        dx[i] = dy[i] * (cdf + xi * pdf)


@njit(**_JIT)
def gelu_tanh_backward(dy, x, dx):
    for i in range(x.shape[0]):
        xi = np.float64(x[i])
        x2 = xi * xi
        t = math.tanh(_SQRT_2_OVER_PI * xi * (1.0 + _GELU_CUBIC * x2))
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * x2)
        dx[i] = dy[i] * (0.5 * (1.0 + t) + 0.5 * xi * (1.0 - t * t) * du)


# -- softmax over rows ----------------------------------------------------------------------

@njit(**_JIT)
def softmax_rows(z, s):
    """z [N, K] -> s [N, K] = softmax of each row (shifted by the row maximum)."""
    n, k = z.shape
    for r in range(n):
        m = -np.inf
        for j in range(k):
            m = max(m, np.float64(z[r, j]))
        total = 0.0
        for j in range(k):
            e = math.exp(np.float64(z[r, j]) - m)
            s[r, j] = e
            total += e
        inv = 1.0 / total
        for j in range(k):
            s[r, j] = s[r, j] * inv


@njit(**_JIT)
def softmax_backward_rows(ds, s, dz, scale):
    """dz = scale * s * (ds - sum(ds * s)) row by row; dz may be ds itself (in place)."""
    n, k = s.shape
    for r in range(n):
        dot = 0.0
        for j in range(k):
            dot += np.float64(ds[r, j]) * np.float64(s[r, j])
        for j in range(k):
            dz[r, j] = scale * np.float64(s[r, j]) * (np.float64(ds[r, j]) - dot)


@njit(**_JIT)
def causal_softmax_inplace(z, scale, offset):
    """z [R, S_q, S_k] scores (C-contiguous) -> in place A = softmax(scale * z + causal mask)
    over the keys.

    Query i sees keys j <= i + offset (offset = S_k - S_q); the masked entries become 0
    without an exp. Without a causal mask pass offset >= S_k. The exp is exp_rows_into's, in
    the storage dtype, of scale z - scale m (m the row's maximum; the reference's
    scale (z - m) up to the last bits), to the causal limit rounded up to whole vectors (see
    _round_up): 3-4 times faster than a libm exp an element.
    """
    n_mat, s_q, s_k = z.shape
    mul = z.dtype.type(scale)
    for index in range(n_mat * s_q):
        r = index // s_q
        i = index - r * s_q
        limit = min(i + offset + 1, s_k)
        row = z[r, i]
        sub = z.dtype.type(scale * _row_max(row, limit))
        exp_rows_into(row, _round_up(limit, 64 // z.itemsize, s_k), mul, sub)
        row[limit:] = 0.0
        inv = 1.0 / _row_sum(row, _round_up(limit, 8, s_k))
        for j in range(limit):
            row[j] = row[j] * inv


@njit(**_JIT)
def causal_softmax_backward_inplace(dA, A, scale, offset):
    """dA [R, S_q, S_k] -> in place dZ = scale * A * (dA - rowsum(dA * A)); 0 where masked."""
    n_mat, s_q, s_k = A.shape
    for index in range(n_mat * s_q):
        r = index // s_q
        i = index - r * s_q
        limit = min(i + offset + 1, s_k)
        dot = 0.0
        for j in range(limit):
            dot += np.float64(dA[r, i, j]) * np.float64(A[r, i, j])
        for j in range(limit):
            dA[r, i, j] = scale * np.float64(A[r, i, j]) * (np.float64(dA[r, i, j]) - dot)
        for j in range(limit, s_k):
            dA[r, i, j] = 0.0


# -- LayerNorm and RMSNorm over rows: x [N, D] --------------------------------------------
# A row's outputs wait on its sums, a square root and a division, some hundred cycles of
# steps that each wait on the one before. So the rows go in blocks of _ROW_BLOCK: first the
# statistics of every row of the block (whose chains the CPU overlaps, row with row), then
# their outputs. Row by row, a [1024, 64] float32 LayerNorm forward took 69 us; so, 49 us.

_ROW_BLOCK = 32


@njit(**_JIT)
def layernorm_forward(x, gamma, beta, eps, y, xhat, rstd):
    """y = gamma * xhat + beta, xhat = (x - mean) * rstd, rstd = 1 / sqrt(var + eps)."""
    n, d = x.shape
    means, invs = np.empty(_ROW_BLOCK), np.empty(_ROW_BLOCK)
    for r0 in range(0, n, _ROW_BLOCK):
        r1 = min(r0 + _ROW_BLOCK, n)
        for r in range(r0, r1):
            mean = _row_sum(x[r], d) / d
            var = _row_squares(x[r], mean) / d
            inv = 1.0 / math.sqrt(var + eps)
            rstd[r] = inv if math.isfinite(var) else np.nan     # the caller falls back
            means[r - r0], invs[r - r0] = mean, inv
        for r in range(r0, r1):
            mean, inv = means[r - r0], invs[r - r0]
            for j in range(d):
                h = (np.float64(x[r, j]) - mean) * inv
                xhat[r, j] = h
                y[r, j] = h * np.float64(gamma[j]) + np.float64(beta[j])


@njit(**_JIT)
def rmsnorm_forward(x, gain, eps, y, xhat, rrms):
    """y = gain * xhat, xhat = x * rrms, rrms = 1 / sqrt(mean(x^2) + eps)."""
    n, d = x.shape
    invs = np.empty(_ROW_BLOCK)
    for r0 in range(0, n, _ROW_BLOCK):
        r1 = min(r0 + _ROW_BLOCK, n)
        for r in range(r0, r1):
            ms = _row_squares(x[r], 0.0)
            inv = 1.0 / math.sqrt(ms / d + eps)
            rrms[r] = inv if math.isfinite(ms) else np.nan      # the caller falls back
            invs[r - r0] = inv
        for r in range(r0, r1):
            inv = invs[r - r0]
            for j in range(d):
                h = np.float64(x[r, j]) * inv
                xhat[r, j] = h
                y[r, j] = h * np.float64(gain[j])


@njit(**_JIT)
def norm_backward(dy, xhat, rstd, gamma, centered, dx, partial_dgamma, partial_dbeta):
    """LayerNorm (centered=True) or RMSNorm backward over rows, in chunks of rows.

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma (RMSNorm: no mean(g)).
    partial_dgamma, partial_dbeta [C, D] float64: one row of sums per chunk of rows (the
    caller adds the C rows).
    """
    n, d = dy.shape
    chunks = partial_dgamma.shape[0]
    for c in range(chunks):
        start = (n * c) // chunks
        stop = (n * (c + 1)) // chunks
        for r in range(start, stop):
            for j in range(d):
                dyj = np.float64(dy[r, j])
                partial_dgamma[c, j] += dyj * np.float64(xhat[r, j])
                partial_dbeta[c, j] += dyj
            mean_g, mean_gx = _row_gain_sums(dy[r], xhat[r], gamma)
            mean_g /= d
            mean_gx /= d
            if not centered:
                mean_g = 0.0
            inv = np.float64(rstd[r])
            for j in range(d):
                g = np.float64(dy[r, j]) * np.float64(gamma[j])
                dx[r, j] = inv * (g - mean_g - np.float64(xhat[r, j]) * mean_gx)


# -- the bias gradient: sums over the rows ------------------------------------------------

@njit(**_JIT)
def column_sums(x, total, into):
    """total [D] = sum of the rows of x [N, D], row after row (NumPy's x.sum(axis=0) makes
    the same additions in the same order: the same bits); into [D] += total unless into is
    empty."""
    n, d = x.shape
    total[:] = 0.0
    for r in range(n):
        for j in range(d):
            total[j] += x[r, j]
    if into.shape[0] == d:
        for j in range(d):
            into[j] += total[j]


# -- cross-entropy fused with its softmax: logits [N, V], safe labels [N], valid [N] -------

@njit(**_JIT)
def cross_entropy_forward(z, safe, valid, probs, nll):
    """probs = softmax rows of z; nll[n] = logsumexp(z[n]) - z[n, y_n] (0 on ignored rows)."""
    n, v = z.shape
    one = z.dtype.type(1.0)
    for r in range(n):
        m = one * _row_max(z[r], v)                # the storage dtype, as the exp wants
        row = probs[r]
        for j in range(v):
            row[j] = z[r, j]
        exp_rows_into(row, v, one, m)              # exp(z - m) in the storage dtype
        total = _row_sum(row, v)
        inv = 1.0 / total
        for j in range(v):
            row[j] = row[j] * inv
        if valid[r]:
            nll[r] = math.log(total) - (np.float64(z[r, safe[r]]) - np.float64(m))
        else:
            nll[r] = 0.0


@njit(inline="always", **_JIT)
def _cross_entropy_backward(probs, safe, valid, scale, dz):
    """dz = scale * (probs - onehot(label)) on valid rows, 0 on ignored rows (dz may be probs).

    The label's entry is formed in float64 and rounded once: read back from float32
    storage, scale * p would keep its rounding error, and with V = 1 (p = 1) the exact 0
    would come out as about 1e-9 times scale.
    """
    n, v = probs.shape
    for r in range(n):
        if valid[r]:
            picked = np.float64(probs[r, safe[r]])     # read first: dz may be probs itself
            for j in range(v):
                dz[r, j] = scale * np.float64(probs[r, j])
            dz[r, safe[r]] = scale * picked - scale
        else:
            for j in range(v):
                dz[r, j] = 0.0


@njit(**_JIT)
def cross_entropy_backward(probs, safe, valid, scale, dz):
    """_cross_entropy_backward into dz, another array than probs."""
    _cross_entropy_backward(probs, safe, valid, scale, dz)


@njit(**_JIT)
def cross_entropy_backward_in_place(probs, safe, valid, scale):
    """_cross_entropy_backward into probs itself (see gelu_tanh_grad_in_place)."""
    _cross_entropy_backward(probs, safe, valid, scale, probs)


# -- AdamW over flat buffers [P] ----------------------------------------------------------

@njit(**_JIT)
def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias1, bias2, mask):
    """The reference's arithmetic element by element; mask [P] (or [0] meaning all ones)."""
    step_size = lr / bias1
    use_mask = mask.shape[0] == p.shape[0]
    for i in range(p.shape[0]):
        pi = np.float64(p[i])
        if weight_decay != 0.0:
            if use_mask:
                pi *= np.float64(mask[i]) * (-lr * weight_decay) + 1.0
            else:
                pi *= 1.0 - lr * weight_decay
        gi = np.float64(g[i])
        mi = np.float64(m[i]) * beta1 + gi * (1.0 - beta1)
        vi = np.float64(v[i]) * beta2 + gi * gi * (1.0 - beta2)
        m[i] = mi
        v[i] = vi
        p[i] = pi - (mi / (math.sqrt(vi / bias2) + eps)) * step_size


# -- embedding backward: dW[ids[n]] += dx[n] ------------------------------------------------

@njit(**_JIT)
def embedding_backward(ids, dx, dW, chunks):
    """dW [V, D] += rows of dx [N, D] at ids [N], one chunk of columns after another (every
    chunk visits the rows in order, so repeated ids add in the reference's order; the caller
    may give each thread a share of the columns)."""
    n, d = dx.shape
    for c in range(chunks):
        start = (d * c) // chunks
        stop = (d * (c + 1)) // chunks
        for r in range(n):
            row = ids[r]
            for j in range(start, stop):
                dW[row, j] += dx[r, j]


# -- tanh-GELU around NumPy's SIMD tanh: the reference's arithmetic fused into two loops -----
# The reference (and the chunked kernel) makes one in-place pass per operation; here each run
# of plain arithmetic between two tanh calls is one loop. The operations, their order and
# their dtype are the reference's (no float64 here: the constants come in `c`, an array of
# the storage dtype, and Numba contracts nothing into FMAs), so the result is the same to
# the last bit. c = [0.044715, sqrt(2/pi), 1, 0.5, 3 * 0.044715, -1, the clip of x].

@njit(**_JIT)
def gelu_tanh_argument(x, t, c):
    """x [n] -> t [n] = sqrt(2/pi) x (1 + 0.044715 x^2), in the reference's order."""
    for i in range(x.shape[0]):
        xi = x[i]
        t[i] = (((xi * xi) * c[0] + c[2]) * xi) * c[1]


@njit(**_JIT)
def gelu_tanh_output(x, t, y, c):
    """t = tanh(...) [n] -> y [n] = (0.5 (1 + t)) x."""
    for i in range(x.shape[0]):
        y[i] = ((t[i] + c[2]) * c[3]) * x[i]


@njit(inline="always", **_JIT)
def _gelu_tanh_grad(dy, x, t, dx, c):
    """t = tanh(...) [n] -> dx [n] = dy (0.5 x (1 - t^2) du/dx + 0.5 (1 + t)), with
    du/dx = sqrt(2/pi) (1 + 3 * 0.044715 clip(x)^2): the reference's order (dx may be dy)."""
    clip = c[6]
    for i in range(x.shape[0]):
        xi = x[i]
        w = xi
        if w > clip:
            w = clip
        elif w < -clip:
            w = -clip
        du = ((w * w) * c[4] + c[2]) * c[1]
        ti = t[i]
        u = ((((ti * ti) * c[5] + c[2]) * xi) * du) * c[3]
        u = u + (ti + c[2]) * c[3]
        dx[i] = u * dy[i]


@njit(**_JIT)
def gelu_tanh_grad(dy, x, t, dx, c):
    """_gelu_tanh_grad into dx, another array than dy."""
    _gelu_tanh_grad(dy, x, t, dx, c)


@njit(**_JIT)
def gelu_tanh_grad_in_place(dy, x, t, c):
    """_gelu_tanh_grad into dy itself. One array, so LLVM knows that the loop's loads and
    stores of an element do not cross others: given dx and dy that alias, it checks their
    ranges at run time, finds that they overlap and runs the scalar loop (3 times slower)."""
    _gelu_tanh_grad(dy, x, t, dy, c)


# -- tiled attention: the element-wise work of one block of scores ------------------------
# s [b, H, bq, bk] is one block of scores q_i k_j^T (C-contiguous; the other arrays may be
# strided views); query row i of the block sees key column c when c <= i + shift (causal;
# shift >= bk for no mask). scale > 0, a scalar of the storage dtype.

@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _keys_seen(i, shift, bk):
    """How many of the block's bk keys query row i sees: those c <= i + shift."""
    return min(max(i + shift + 1, 0), bk)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _round_up(limit, multiple, width):
    """limit rounded up to a multiple of `multiple`, at most `width`. An exp to there runs
    whole vectors (multiple: the elements of 64 bytes) with no scalar remainder, which in
    rows of a few dozen keys cost as much as the vector part; a row sum to there (multiple:
    its 8 lanes) adds the zeros past the limit to no lane, so its bits are those of the
    whole row's. The entries past the limit are zeroed as a slice (an element loop there
    cost as much again)."""
    return min(width, (limit + multiple - 1) // multiple * multiple)


@njit(cache=True, nogil=True, error_model="numpy")
def attention_forward_block(s, scale, shift, m, l, alpha):
    """The online softmax's step over one key block, in place: s -> p = exp(scale s - m_new)
    (0 where masked); m, l [b, H, bq] the running maximum and sum, alpha [b, H, bq] the
    factor exp(m_old - m_new) that rescales what was summed before.

    Three passes over the block (maxima; exp; masks and sums): as one pass over each row,
    LLVM kept the exp loop from running at full width (1.6 times slower). The exp stops at
    the causal limit of each row, rounded up to whole vectors (see _round_up); the entries
    past the limit are zeroed, not computed."""
    batch, heads, bq, bk = s.shape
    for b in range(batch):
        for h in range(heads):
            for i in range(bq):
                limit = _keys_seen(i, shift, bk)
                m_old = m[b, h, i]
                m_new = max(m_old, _row_max(s[b, h, i], limit) * scale)
                alpha[b, h, i] = math.exp(m_old - m_new) if m_new > -np.inf else 1.0
                m[b, h, i] = m_new
    for b in range(batch):
        for h in range(heads):
            for i in range(bq):
                stop = _round_up(_keys_seen(i, shift, bk), 64 // s.itemsize, bk)
                exp_rows_into(s[b, h, i], stop, scale, m[b, h, i])   # one SIMD loop a row
    for b in range(batch):
        for h in range(heads):
            for i in range(bq):
                row = s[b, h, i]
                limit = _keys_seen(i, shift, bk)
                row[limit:] = 0.0
                stop = _round_up(limit, 8, bk)        # the sum's lanes: the bits of bk's
                l[b, h, i] = l[b, h, i] * alpha[b, h, i] + _row_sum(row, stop)


@njit(cache=True, nogil=True, error_model="numpy")
def attention_rescale_add(acc, alpha, product):
    """acc [b, H, bq, D] = acc * alpha [b, H, bq] + product [b, H, bq, D] (the online sum)."""
    batch, heads, bq, d = acc.shape
    for b in range(batch):
        for h in range(heads):
            for i in range(bq):
                a = alpha[b, h, i]
                for j in range(d):
                    acc[b, h, i, j] = acc[b, h, i, j] * a + product[b, h, i, j]


@njit(cache=True, nogil=True, error_model="numpy")
def attention_forward_finish(acc, m, l, lse):
    """out = acc / l, in place on acc [b, H, bq, D]; lse [b, H, bq] = m + log l."""
    batch, heads, bq, d = acc.shape
    for b in range(batch):
        for h in range(heads):
            for i in range(bq):
                total = l[b, h, i]
                for j in range(d):
                    acc[b, h, i, j] = acc[b, h, i, j] / total
                lse[b, h, i] = m[b, h, i] + math.log(total)


@njit(cache=True, nogil=True, error_model="numpy")
def attention_backward_block(s, dp, lse, delta, scale, shift):
    """In place on one block: s -> p = exp(scale s - lse) and dp -> dZ = scale p (dp - delta),
    both 0 where masked; lse, delta [b, H, bq] (delta_i = dout_i . out_i)."""
    batch, heads, bq, bk = s.shape
    for b in range(batch):
        for h in range(heads):
            for i in range(bq):
                row, drow = s[b, h, i], dp[b, h, i]
                limit = _keys_seen(i, shift, bk)
                exp_rows_into(row, _round_up(limit, 64 // s.itemsize, bk), scale, lse[b, h, i])
                d = delta[b, h, i]
                for j in range(limit):
                    drow[j] = (row[j] * (drow[j] - d)) * scale
                row[limit:] = 0.0
                drow[limit:] = 0.0


# -- tiled attention: a whole share of the batch, compiled ----------------------------------
# The block loops of tfcore.kernels._tiled without Python: each product is a call of the
# cblas gemm that NumPy itself calls (its address found by _spin), with the arguments
# np.matmul would pass for the same arrays; each block's element-wise work is the kernels
# above. A share then takes Python's lock once, to start, instead of at each of its few dozen
# small products: on two threads both shares wanted the lock at every one of them.
# Addresses are integers (an array's data pointer plus the byte offset of a block).

@njit(cache=True, nogil=True, inline="always")
def _product(function, trans_a, trans_b, m, n, k, a, lda, b, ldb, accumulate, c, ldc, size,
             counted):
    """c [m, n] (+)= op(a) @ op(b) in the row-major cblas convention (trans: TRANS or
    NO_TRANS; leading dimensions in elements); counted[0] += m n k, counted[1] += 1."""
    beta = 1.0 if accumulate else 0.0
    if size == 4:
        _sgemm(function, ROW_MAJOR, trans_a, trans_b, m, n, k, 1.0, a, lda, b, ldb, beta, c,
               ldc)
    else:
        _dgemm(function, ROW_MAJOR, trans_a, trans_b, m, n, k, 1.0, a, lda, b, ldb, beta, c,
               ldc)
    counted[0] += m * n * k
    counted[1] += 1


@njit(cache=True, nogil=True, inline="always")
def _ld(x):
    """The leading dimension of the [S, D] matrices of x [b, H, S, D] (rows apart: see
    _tiled.rows_apart), at least D as BLAS wants it (with S = 1 the stride may be less)."""
    return max(x.strides[2] // x.itemsize, x.shape[3])


@njit(cache=True, nogil=True, inline="always")
def _at(x, b, h, row):
    """The address of x[b, h, row] (x 4-D)."""
    return x.ctypes.data + b * x.strides[0] + h * x.strides[1] + row * x.strides[2]


@njit(cache=True, nogil=True, inline="always")
def _pack(x, b, h, packed, start):
    """x[b, h] [S, D] copied into packed[start:start + S D] as contiguous rows -> its address.
    The rows of a head of a fused projection lie a row of all heads apart (3 H D_h elements):
    read in place, the backward's span of such rows falls on few cache sets and evicts itself
    when it is re-read for every key block (see _tiled.PACK_FROM)."""
    s, d = x.shape[2], x.shape[3]
    rows = packed[start:start + s * d].reshape((s, d))
    rows[...] = x[b, h]
    return rows.ctypes.data


@njit(cache=True, nogil=True, error_model="numpy")
def tiled_forward_share(q, k_t, v, out, lse, causal, scale, block, span, scores, product,
                        running, function, counted):
    """_tiled._forward_rows for every (batch row, head) of a share, one after the other.

    q [b, H, S_q, D_h], v [b, H, S_k, D_v], out [b, H, S_q, D_v]: rows apart (see
    _tiled.rows_apart); k_t [b, H, D_h, S_k] (k transposed): C-contiguous; lse [b, H, S_q];
    scratch: scores [>= block * span], product [>= block * D_v], running [3, 1, 1, >= block]
    (m, l, alpha); function: the gemm's address; counted [2]: products made (see _product)."""
    batch, heads, s_q, d_h = q.shape
    s_k, d_v, size = k_t.shape[3], v.shape[3], q.itemsize
    offset = s_k - s_q
    ld_q, ld_v, ld_out = _ld(q), _ld(v), _ld(out)
    for b in range(batch):
        for h in range(heads):
            for i0 in range(0, s_q, block):
                i1 = min(i0 + block, s_q)
                bq = i1 - i0
                m_i = running[0, :, :, :bq]             # the running max, sum and factor
                l_i = running[1, :, :, :bq]
                alpha_i = running[2, :, :, :bq]
                m_i[...] = -np.inf
                l_i[...] = 0.0
                acc = out[b:b + 1, h:h + 1, i0:i1]
                stop = min(s_k, i1 + offset) if causal else s_k
                for j0 in range(0, stop, span):
                    j1 = min(j0 + span, stop)
                    bk = j1 - j0
                    s = scores[:bq * bk].reshape((1, 1, bq, bk))
                    _product(function, NO_TRANS, NO_TRANS, bq, bk, d_h, _at(q, b, h, i0), ld_q,
                             _at(k_t, b, h, 0) + j0 * size, s_k, False, s.ctypes.data, bk,
                             size, counted)
                    shift = i0 + offset - j0 if causal else bk
                    attention_forward_block(s, scale, shift, m_i, l_i, alpha_i)   # s is p
                    if j0 == 0:           # the first block: written in place, no rescale
                        _product(function, NO_TRANS, NO_TRANS, bq, d_v, bk, s.ctypes.data, bk,
                                 _at(v, b, h, j0), ld_v, False, _at(out, b, h, i0), ld_out,
                                 size, counted)
                    else:
                        pv = product[:bq * d_v].reshape((1, 1, bq, d_v))
                        _product(function, NO_TRANS, NO_TRANS, bq, d_v, bk, s.ctypes.data, bk,
                                 _at(v, b, h, j0), ld_v, False, pv.ctypes.data, d_v, size,
                                 counted)
                        attention_rescale_add(acc, alpha_i, pv)
                attention_forward_finish(acc, m_i, l_i, lse[b:b + 1, h:h + 1, i0:i1])


@njit(cache=True, nogil=True, error_model="numpy")
def tiled_backward_share(dout, q, k, v, lse, delta, dq, dk, dv, causal, scale, block, span,
                         probs, dscores, transposed, packed, function, counted):
    """_tiled._backward_rows for every (batch row, head) of a share, one after the other.

    q [b, H, S_q, D_h], k [b, H, S_k, D_h], v [b, H, S_k, D_v], dout, dq, dk, dv: rows apart
    (see _tiled.rows_apart); lse, delta [b, H, S_q]; scratch: probs and dscores
    [>= span * block], transposed [>= block * (D_h + D_v)] (k_j^T and v_j^T of a key
    block), packed: empty, or [>= S_q (D_h + D_v) + S_k D_h] to read q, dout and k of each
    head packed (see _pack); function, counted as in tiled_forward_share. The products that
    add into dq, dk and dv (after a key's or a query's first block) add in the gemm (beta = 1)."""
    batch, heads, s_q, d_h = q.shape
    s_k, d_v, size = k.shape[2], v.shape[3], q.itemsize
    offset = s_k - s_q
    ld_dq, ld_dk, ld_dv = _ld(dq), _ld(dk), _ld(dv)
    pack = packed.size > 0
    ld_q, ld_do, ld_k = (d_h, d_v, d_h) if pack else (_ld(q), _ld(dout), _ld(k))
    for b in range(batch):
        for h in range(heads):
            if pack:
                q_at = _pack(q, b, h, packed, 0)
                do_at = _pack(dout, b, h, packed, s_q * d_h)
                k_at = _pack(k, b, h, packed, s_q * (d_h + d_v))
            else:
                q_at, do_at, k_at = _at(q, b, h, 0), _at(dout, b, h, 0), _at(k, b, h, 0)
            for j0 in range(0, s_k, block):
                j1 = min(j0 + block, s_k)
                bk = j1 - j0
                first = max(0, j0 - offset) if causal else 0   # the first query seeing j0
                if first >= s_q:          # no query sees these keys (S_q < S_k, causal)
                    dk[b, h, j0:j1] = 0.0
                    dv[b, h, j0:j1] = 0.0
                    continue
                kj_t = transposed[:d_h * bk].reshape((d_h, bk))
                vj_t = transposed[d_h * bk:(d_h + d_v) * bk].reshape((d_v, bk))
                kj_t[...] = k[b, h, j0:j1].T
                vj_t[...] = v[b, h, j0:j1].T
                for i0 in range(first, s_q, span):
                    i1 = min(i0 + span, s_q)
                    bq = i1 - i0
                    p = probs[:bq * bk].reshape((1, 1, bq, bk))
                    dp = dscores[:bq * bk].reshape((1, 1, bq, bk))
                    q_i, do_i = q_at + i0 * ld_q * size, do_at + i0 * ld_do * size
                    _product(function, NO_TRANS, NO_TRANS, bq, bk, d_h, q_i, ld_q,
                             kj_t.ctypes.data, bk, False, p.ctypes.data, bk, size, counted)
                    _product(function, NO_TRANS, NO_TRANS, bq, bk, d_v, do_i, ld_do,
                             vj_t.ctypes.data, bk, False, dp.ctypes.data, bk, size, counted)
                    shift = i0 + offset - j0 if causal else bk
                    attention_backward_block(p, dp, lse[b:b + 1, h:h + 1, i0:i1],
                                             delta[b:b + 1, h:h + 1, i0:i1], scale, shift)
                    later = i0 != first
                    _product(function, TRANS, NO_TRANS, bk, d_v, bq, p.ctypes.data, bk,  # p^T do
                             do_i, ld_do, later, _at(dv, b, h, j0), ld_dv, size, counted)
                    _product(function, TRANS, NO_TRANS, bk, d_h, bq, dp.ctypes.data, bk,  # dZ^T q
                             q_i, ld_q, later, _at(dk, b, h, j0), ld_dk, size, counted)
                    _product(function, NO_TRANS, NO_TRANS, bq, d_h, bk, dp.ctypes.data, bk,
                             k_at + j0 * ld_k * size, ld_k, j0 != 0, _at(dq, b, h, i0), ld_dq,
                             size, counted)                                          # dZ k
