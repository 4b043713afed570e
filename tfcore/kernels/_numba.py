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
from numba import njit

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715

# error_model="numpy": a float division by zero gives inf or nan, as in NumPy (and as in the
# parallel loops these were), instead of a test and a raise per division, which keeps LLVM
# from vectorizing a loop: AdamW's ran 4.5 times slower with it.
_JIT = dict(cache=True, nogil=True, error_model="numpy")


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
    """z [R, S_q, S_k] scores -> in place A = softmax(scale * z + causal mask) over the keys.

    Query i sees keys j <= i + offset (offset = S_k - S_q); the masked entries become 0
    without an exp. Without a causal mask pass offset >= S_k.
    """
    n_mat, s_q, s_k = z.shape
    for index in range(n_mat * s_q):
        r = index // s_q
        i = index - r * s_q
        limit = min(i + offset + 1, s_k)
        m = -np.inf
        for j in range(limit):
            m = max(m, np.float64(z[r, i, j]))
        total = 0.0
        for j in range(limit):
            e = math.exp((np.float64(z[r, i, j]) - m) * scale)
            z[r, i, j] = e
            total += e
        inv = 1.0 / total
        for j in range(limit):
            z[r, i, j] = z[r, i, j] * inv
        for j in range(limit, s_k):
            z[r, i, j] = 0.0


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

@njit(**_JIT)
def layernorm_forward(x, gamma, beta, eps, y, xhat, rstd):
    """y = gamma * xhat + beta, xhat = (x - mean) * rstd, rstd = 1 / sqrt(var + eps)."""
    n, d = x.shape
    for r in range(n):
        mean = 0.0
        for j in range(d):
            mean += np.float64(x[r, j])
        mean /= d
        var = 0.0
        for j in range(d):
            c = np.float64(x[r, j]) - mean
            var += c * c
        var /= d
        inv = 1.0 / math.sqrt(var + eps)
        rstd[r] = inv if math.isfinite(var) else np.nan     # the caller falls back
        for j in range(d):
            h = (np.float64(x[r, j]) - mean) * inv
            xhat[r, j] = h
            y[r, j] = h * np.float64(gamma[j]) + np.float64(beta[j])


@njit(**_JIT)
def rmsnorm_forward(x, gain, eps, y, xhat, rrms):
    """y = gain * xhat, xhat = x * rrms, rrms = 1 / sqrt(mean(x^2) + eps)."""
    n, d = x.shape
    for r in range(n):
        ms = 0.0
        for j in range(d):
            v = np.float64(x[r, j])
            ms += v * v
        inv = 1.0 / math.sqrt(ms / d + eps)
        rrms[r] = inv if math.isfinite(ms) else np.nan      # the caller falls back
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
            mean_g = 0.0
            mean_gx = 0.0
            for j in range(d):
                dyj = np.float64(dy[r, j])
                hj = np.float64(xhat[r, j])
                g = dyj * np.float64(gamma[j])
                mean_g += g
                mean_gx += g * hj
                partial_dgamma[c, j] += dyj * hj
                partial_dbeta[c, j] += dyj
            mean_g /= d
            mean_gx /= d
            if not centered:
                mean_g = 0.0
            inv = np.float64(rstd[r])
            for j in range(d):
                g = np.float64(dy[r, j]) * np.float64(gamma[j])
                dx[r, j] = inv * (g - mean_g - np.float64(xhat[r, j]) * mean_gx)


# -- cross-entropy fused with its softmax: logits [N, V], safe labels [N], valid [N] -------

@njit(**_JIT)
def cross_entropy_forward(z, safe, valid, probs, nll):
    """probs = softmax rows of z; nll[n] = logsumexp(z[n]) - z[n, y_n] (0 on ignored rows)."""
    n, v = z.shape
    for r in range(n):
        m = -np.inf
        for j in range(v):
            m = max(m, np.float64(z[r, j]))
        total = 0.0
        for j in range(v):
            e = math.exp(np.float64(z[r, j]) - m)
            probs[r, j] = e
            total += e
        inv = 1.0 / total
        for j in range(v):
            probs[r, j] = probs[r, j] * inv
        if valid[r]:
            nll[r] = math.log(total) - (np.float64(z[r, safe[r]]) - m)
        else:
            nll[r] = 0.0


@njit(**_JIT)
def cross_entropy_backward(probs, safe, valid, scale, dz):
    """dz = scale * (probs - onehot(label)) on valid rows, 0 on ignored rows.

    The label's entry is formed in float64 and rounded once: read back from float32
    storage, scale * p would keep its rounding error, and with V = 1 (p = 1) the exact 0
    would come out as about 1e-9 times scale.
    """
    n, v = probs.shape
    for r in range(n):
        if valid[r]:
            for j in range(v):
                dz[r, j] = scale * np.float64(probs[r, j])
            dz[r, safe[r]] = scale * np.float64(probs[r, safe[r]]) - scale
        else:
            for j in range(v):
                dz[r, j] = 0.0


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


@njit(**_JIT)
def gelu_tanh_grad(dy, x, t, dx, c):
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
