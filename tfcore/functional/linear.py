"""Linear layer (chapter 2): forward/backward pairs."""
from __future__ import annotations

from .. import checks
from ..backend import matmul, namespace
from ._caches import LinearCache
from ._common import _flat_rows


def linear_forward(x, W, b=None):
    """y = x @ W + b.

    x [..., D_in], W [D_in, D_out], b [D_out] or None  ->  y [..., D_out]
    D_in and D_out must be at least 1; an empty batch (N = 0 rows) gives an empty y.
    The cache keeps x and W themselves (no copies): see the package docstring.
    """
    xp = _check_linear_forward(x, W, b)
    d_in, d_out = W.shape
    y = matmul(_flat_rows(x, d_in), W, "linear")                      # one GEMM [N, D_in] @ [D_in, D_out]
    y = xp.reshape(y, tuple(x.shape[:-1]) + (d_out,))
    if b is not None:
        y += b
    return y, LinearCache(x, W, b is not None)


def linear_backward(dy, cache):
    """dx = dy W^T;  dW = sum over all rows of x^T dy;  db = sum over all rows of dy.

    dy [..., D_out]  ->  dx [..., D_in], dW [D_in, D_out], db [D_out] (None without bias)
    """
    x, W, has_bias = _check_linear_backward(dy, cache)
    d_in, d_out = W.shape
    xp = namespace(dy, W)
    dy_rows = _flat_rows(dy, d_out)                                    # [N, D_out]
    dx = xp.reshape(matmul(dy_rows, W.T, "linear"), tuple(x.shape))    # [N, D_in] -> [..., D_in]
    dW = matmul(_flat_rows(x, d_in).T, dy_rows, "linear")              # [D_in, N] @ [N, D_out]
    db = xp.sum(dy_rows, axis=0) if has_bias else None                # [D_out]
    return dx, dW, db


# -- the checks each op makes before its work (tfcore.ops makes them before a kernel's) --------

def _check_linear_forward(x, W, b):
    """linear_forward's checks: x [..., D_in], W [D_in, D_out], b [D_out] or None of one float
    dtype and library, D_in, D_out >= 1 -> the array namespace."""
    xp = checks.float_inputs(x=x, W=W, b=b)
    checks.ndim("W", W, 2)
    checks.min_ndim("x", x, 1)
    d_in, d_out = W.shape
    checks.width("W", W, "D_out")
    checks.width("x", x, "D_in")
    checks.shape("x", x, (None,) * (x.ndim - 1) + (d_in,))
    if b is not None:
        checks.shape("b", b, (d_out,))
    return xp


def _check_linear_backward(dy, cache):
    """linear_backward's check: dy [..., D_out] like the forward's output -> (x, W, has_bias)."""
    x, W, has_bias = cache
    _, d_out = W.shape
    checks.upstream("dy", dy, tuple(x.shape[:-1]) + (d_out,), x.dtype, namespace(x))
    return x, W, has_bias
