"""Stateless forward/backward pairs, one pair per op, written against the array API standard.

The contract every pair follows:

* ``<op>_forward(...)`` returns ``(out, cache)``; the cache holds only what the backward
  pass needs, and nothing is kept anywhere else.
* ``<op>_backward(dout, cache)`` returns the gradient of the scalar loss with respect to
  each differentiable input, in the order of the forward's arguments. Parameter gradients
  are *returned*, never stored: a module that owns parameters adds them into its own
  gradient buffers with ``+=``, so tied and shared weights just work.

Shape letters: B batch, S sequence, D width, D_in/D_out a linear layer's widths, V the
vocabulary (or number of classes), "..." any leading shape, N the number of rows once
the leading axes are flattened. The book proves every backward formula here, one
chapter per family of ops; the chapter is named beside each pair.
"""
from __future__ import annotations

import math

from . import backend, checks
from .backend import namespace


def _flat_rows(x, width: int):
    """[..., width] -> [N, width] (a view when x is contiguous)."""
    return namespace(x).reshape(x, (-1, width))


def _sum_over_leading(x):
    """[..., D] -> [D]: the sum over every axis but the last (a bias or gain gradient)."""
    return namespace(x).sum(_flat_rows(x, x.shape[-1]), axis=0)


# --------------------------------------------------------------------------------------
# Linear layer (chapter 2)


def linear_forward(x, W, b=None):
    """y = x @ W + b.

    x [..., D_in], W [D_in, D_out], b [D_out] or None  ->  y [..., D_out]
    """
    checks.float_inputs(x=x, W=W, b=b)
    checks.ndim("W", W, 2)
    checks.min_ndim("x", x, 1)
    d_in, d_out = W.shape
    checks.shape("x", x, (None,) * (x.ndim - 1) + (d_in,))
    if b is not None:
        checks.shape("b", b, (d_out,))
    xp = namespace(x, W, b)
    y = xp.reshape(_flat_rows(x, d_in) @ W, tuple(x.shape[:-1]) + (d_out,))  # one GEMM [N, D_in] @ [D_in, D_out]
    if b is not None:
        y += b
    return y, (x, W, b is not None)


def linear_backward(dy, cache):
    """dx = dy W^T;  dW = sum over all rows of x^T dy;  db = sum over all rows of dy.

    dy [..., D_out]  ->  dx [..., D_in], dW [D_in, D_out], db [D_out] (None without bias)
    """
    x, W, has_bias = cache
    d_in, d_out = W.shape
    xp = namespace(dy, W)
    dy_rows = _flat_rows(dy, d_out)                                    # [N, D_out]
    dx = xp.reshape(dy_rows @ W.T, tuple(x.shape))                    # [N, D_in] -> [..., D_in]
    dW = _flat_rows(x, d_in).T @ dy_rows                              # [D_in, N] @ [N, D_out]
    db = xp.sum(dy_rows, axis=0) if has_bias else None                # [D_out]
    return dx, dW, db


# --------------------------------------------------------------------------------------
# Embedding lookup and positions (chapter 2)


def embedding_forward(ids, W):
    """x[b, s] = W[ids[b, s]]: a gather, the same as one_hot(ids) @ W without building the one-hot.

    ids [...] integers in [0, V), W [V, D]  ->  x [..., D]
    """
    checks.float_inputs(W=W)
    checks.ndim("W", W, 2)
    vocab, width = W.shape
    checks.integer_ids("ids", ids, vocab)
    xp = namespace(ids, W)
    flat_ids = xp.reshape(ids, (-1,))                                  # [N]
    x = xp.reshape(xp.take(W, flat_ids, axis=0), tuple(ids.shape) + (width,))
    return x, (flat_ids, tuple(W.shape))


def embedding_backward(dx, cache):
    """dW[v] = sum of dx over every position whose id is v (a scatter-add; ids may repeat).

    dx [..., D]  ->  dW [V, D]   (integer ids have no gradient)
    """
    flat_ids, w_shape = cache
    xp = namespace(dx)
    dW = xp.zeros(w_shape, dtype=dx.dtype)
    return backend.scatter_add(dW, flat_ids, _flat_rows(dx, w_shape[1]))


def sinusoidal_positions(length: int, width: int, dtype: str = "float64", base: float = 10000.0):
    """The fixed table P[p, 2i] = sin(p / base^(2i/D)), P[p, 2i+1] = cos(p / base^(2i/D)).

    -> P [length, width] on the selected backend. An odd width keeps its last sine column.
    """
    if length < 1 or width < 1:
        raise ValueError(f"length and width must be at least 1, got length={length}, width={width}")
    xp = backend.xp()
    dt = getattr(xp, dtype)
    pos = xp.astype(xp.arange(length), xp.float64)[:, None]             # [length, 1]
    even = xp.astype(xp.arange(0, width, 2), xp.float64)                # [ceil(width/2)]
    angle = pos / (base ** (even / width))                              # [length, ceil(width/2)]
    table = xp.stack([xp.sin(angle), xp.cos(angle)], axis=-1)           # [length, ceil(width/2), 2]
    table = xp.reshape(table, (length, 2 * even.shape[0]))[:, :width]    # interleave sin, cos
    return xp.astype(table, dt)


def positional_forward(x, P):
    """y = x + P[:S], broadcast over the batch (P learned, or the fixed sinusoidal table).

    x [B, S, D], P [S_max, D] with S <= S_max  ->  y [B, S, D]
    """
    checks.float_inputs(x=x, P=P)
    checks.ndim("x", x, 3)
    checks.ndim("P", P, 2)
    seq, width = x.shape[1], x.shape[2]
    if P.shape[1] != width or P.shape[0] < seq:
        raise ValueError(
            f"P must have shape (S_max >= {seq}, {width}) to cover x of shape {tuple(x.shape)}, "
            f"got {tuple(P.shape)}"
        )
    return x + P[:seq, :], (seq, tuple(P.shape))


def positional_backward(dy, cache):
    """dx = dy;  dP[:S] = sum over the batch of dy, zero beyond S.

    dy [B, S, D]  ->  dx [B, S, D] (dy itself, not a copy), dP [S_max, D]
    """
    seq, p_shape = cache
    xp = namespace(dy)
    summed = xp.sum(dy, axis=0)                                         # [S, D]
    if p_shape[0] == seq:
        return dy, summed
    pad = xp.zeros((p_shape[0] - seq, p_shape[1]), dtype=dy.dtype)
    return dy, xp.concat([summed, pad], axis=0)


# --------------------------------------------------------------------------------------
# Softmax, log-softmax and the losses (chapter 3)


def causal_mask(length: int, dtype: str = "float64"):
    """The additive causal mask, 0 on and below the diagonal and -inf above it.

    -> mask [length, length]; one table broadcast over batch and heads, never one per batch.
    """
    xp = backend.xp()
    rows = xp.arange(length)[:, None]
    cols = xp.arange(length)[None, :]
    return xp.where(cols > rows, xp.asarray(-math.inf, dtype=getattr(xp, dtype)), xp.asarray(0.0, dtype=getattr(xp, dtype)))


def _check_mask(mask, z):
    checks.float_inputs(z=z, mask=mask)
    xp = namespace(mask)
    if bool(xp.any(xp.isnan(mask) | (mask == math.inf))):
        raise ValueError("mask must be additive: 0 (or any finite value) keeps an entry, -inf masks it; found nan or +inf")
    try:
        xp.broadcast_to(mask, tuple(z.shape))
    except ValueError as err:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape {tuple(z.shape)}") from err
    if bool(xp.any(xp.all(mask == -math.inf, axis=-1))):
        raise ValueError("every row of the mask must keep at least one entry; a fully masked row has no softmax")


def softmax_forward(z, mask=None):
    """s = softmax(z + mask) along the last axis, shifted by the row maximum so exp never overflows.

    z [..., K]; mask (optional) broadcastable to z: 0 keeps, -inf masks  ->  s [..., K]
    """
    checks.float_inputs(z=z)
    xp = namespace(z, mask)
    if mask is not None:
        _check_mask(mask, z)
        z = z + mask
    e = xp.exp(z - xp.max(z, axis=-1, keepdims=True))
    e /= xp.sum(e, axis=-1, keepdims=True)
    return e, e


def softmax_backward(ds, s):
    """dz = s * (ds - sum(ds * s)) row by row: the VJP with the Jacobian diag(s) - s s^T.

    ds [..., K], cache s [..., K]  ->  dz [..., K]  (masked entries get 0 because s is 0 there)
    """
    xp = namespace(ds, s)
    return s * (ds - xp.sum(ds * s, axis=-1, keepdims=True))


def log_softmax_forward(z):
    """y = z - logsumexp(z) along the last axis, computed as (z - m) - log(sum(exp(z - m))).

    z [..., K]  ->  y [..., K]
    """
    checks.float_inputs(z=z)
    xp = namespace(z)
    shifted = z - xp.max(z, axis=-1, keepdims=True)
    y = shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))
    return y, y


def log_softmax_backward(dy, y):
    """dz = dy - softmax(z) * sum(dy), with softmax(z) = exp(y).

    dy [..., K], cache y [..., K]  ->  dz [..., K]
    """
    xp = namespace(dy, y)
    return dy - xp.exp(y) * xp.sum(dy, axis=-1, keepdims=True)


def cross_entropy_forward(logits, labels, ignore_index: int = -100):
    """Mean negative log-likelihood of integer labels under softmax(logits), fused with the softmax.

    logits [..., V] float; labels [...] integers in [0, V) or equal to ignore_index
    ->  loss [] (a 0-d array): the mean over the N_valid labels that are not ignored.
    With every label ignored there is nothing to average: the loss is 0 and so is the gradient.
    """
    checks.float_inputs(logits=logits)
    checks.min_ndim("logits", logits, 1)
    vocab = logits.shape[-1]
    checks.shape("labels", labels, tuple(logits.shape[:-1]))
    checks.integer_ids("labels", labels, vocab, allowed=ignore_index)
    xp = namespace(logits, labels)
    z = _flat_rows(logits, vocab)                                       # [N, V]
    y = xp.astype(xp.reshape(labels, (-1,)), xp.int64, copy=False)      # [N]; wide enough for ignore_index
    valid = y != ignore_index                                           # [N]
    n_valid = int(xp.sum(xp.astype(valid, xp.int64)))
    safe = xp.where(valid, y, xp.zeros_like(y))                         # an ignored row points at class 0, then is zeroed
    shifted = z - xp.max(z, axis=-1, keepdims=True)                     # [N, V]
    probs = xp.exp(shifted)
    sum_exp = xp.sum(probs, axis=-1)                                    # [N]
    probs /= sum_exp[:, None]
    picked = xp.take_along_axis(shifted, safe[:, None], axis=-1)[:, 0]  # z[n, y_n] - m_n
    nll = xp.where(valid, xp.log(sum_exp) - picked, xp.zeros_like(picked))
    loss = xp.sum(nll) / max(n_valid, 1)
    return loss, (probs, safe, valid, n_valid, tuple(logits.shape))


def cross_entropy_backward(dloss, cache):
    """dlogits = dloss * (softmax(logits) - onehot(labels)) / N_valid on kept rows, 0 on ignored rows.

    dloss a scalar (1.0 when the loss is the final output)  ->  dlogits [..., V]
    """
    probs, safe, valid, n_valid, shape = cache
    xp = namespace(probs)
    n_rows, vocab = probs.shape
    weight = xp.astype(valid, probs.dtype) * (float(dloss) / max(n_valid, 1))   # [N]
    dz = probs * weight[:, None]                                                # [N, V]
    flat = backend.scatter_add(xp.reshape(dz, (-1,)), xp.arange(n_rows) * vocab + safe, -weight)
    return xp.reshape(flat, shape)


def mse_forward(pred, target):
    """loss = mean((pred - target)^2) over every element.

    pred [...], target [...] of the same shape  ->  loss []
    """
    checks.float_inputs(pred=pred, target=target)
    checks.shape("target", target, tuple(pred.shape))
    xp = namespace(pred, target)
    diff = pred - target
    return xp.sum(diff * diff) / math.prod(diff.shape), diff


def mse_backward(dloss, diff):
    """dpred = dloss * 2 (pred - target) / (number of elements).   ->  dpred [...]"""
    return diff * (2.0 * float(dloss) / math.prod(diff.shape))


# --------------------------------------------------------------------------------------
# Activations (chapter 4)


def relu_forward(x):
    """y = max(x, 0).   x [...]  ->  y [...]; the cache is the boolean mask x > 0."""
    checks.float_inputs(x=x)
    xp = namespace(x)
    return xp.maximum(x, 0.0), x > 0


def relu_backward(dy, positive):
    """dx = dy where x > 0, else 0 (the derivative at exactly 0 is taken as 0)."""
    xp = namespace(dy)
    dx = xp.astype(positive, dy.dtype)  # a multiply by the 0/1 mask is several times faster than where()
    dx *= dy
    return dx


_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715
GELU_APPROXIMATIONS = ("none", "tanh")

# GELU runs on the widest activation of the block ([B, S, D_ff]): its forms below update one
# buffer in place instead of allocating a temporary per arithmetic operation.


def _normal_cdf(x):
    """Phi(x) = (1 + erf(x / sqrt 2)) / 2, in one new buffer."""
    cdf = backend.erf(x * _INV_SQRT_2)
    cdf += 1.0
    cdf *= 0.5
    return cdf


def _gelu_tanh_t(x):
    """t = tanh(sqrt(2/pi) (x + 0.044715 x^3)), with the argument as sqrt(2/pi) x (1 + 0.044715 x^2)."""
    u = x * x
    u *= _GELU_CUBIC
    u += 1.0
    u *= x
    u *= _SQRT_2_OVER_PI
    return namespace(x).tanh(u)


def gelu_forward(x, approximate: str = "none"):
    """GELU(x) = x * Phi(x), exactly (erf) or with the tanh approximation.

    exact: Phi(x) = (1 + erf(x / sqrt 2)) / 2
    tanh:  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    x [...]  ->  y [...]; the cache is x.
    """
    checks.float_inputs(x=x)
    if approximate == "none":
        y = _normal_cdf(x)                  # Phi(x)
        y *= x
    elif approximate == "tanh":
        y = _gelu_tanh_t(x)                 # t
        y += 1.0
        y *= x
        y *= 0.5                            # 0.5 x (1 + t)
    else:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    return y, (x, approximate)


def gelu_backward(dy, cache):
    """dx = dy * GELU'(x).

    exact: GELU'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi) the normal density
    tanh:  0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(...)
    dy [...]  ->  dx [...]
    """
    x, approximate = cache
    xp = namespace(dy, x)
    if approximate == "none":
        grad = x * x
        grad *= -0.5
        grad = xp.exp(grad)
        grad *= _INV_SQRT_2PI
        grad *= x                           # x phi(x)
        grad += _normal_cdf(x)              # Phi(x) + x phi(x)
    else:
        t = _gelu_tanh_t(x)
        du = x * x
        du *= 3.0 * _GELU_CUBIC
        du += 1.0
        du *= _SQRT_2_OVER_PI               # du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
        grad = t * t
        grad *= -1.0
        grad += 1.0                         # 1 - t^2
        grad *= x
        grad *= du
        grad *= 0.5                         # 0.5 x (1 - t^2) du/dx
        t += 1.0
        t *= 0.5                            # 0.5 (1 + t)
        grad += t
    grad *= dy
    return grad


# --------------------------------------------------------------------------------------
# Normalization (chapter 5)


def layernorm_forward(x, gamma, beta, eps: float = 1e-5):
    """y = gamma * (x - mu) / sqrt(var + eps) + beta, mu and var (biased) over the last axis.

    x [..., D], gamma [D], beta [D]  ->  y [..., D]; cache: xhat [..., D], rstd [..., 1], gamma.
    """
    checks.float_inputs(x=x, gamma=gamma, beta=beta)
    checks.positive("eps", eps)
    width = x.shape[-1]
    checks.shape("gamma", gamma, (width,))
    checks.shape("beta", beta, (width,))
    xp = namespace(x)
    centered = x - xp.mean(x, axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(xp.mean(centered * centered, axis=-1, keepdims=True) + eps)  # [..., 1]
    xhat = centered * rstd
    return xhat * gamma + beta, (xhat, rstd, gamma)


def layernorm_backward(dy, cache):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma, row by row.

    dy [..., D]  ->  dx [..., D], dgamma [D] = sum(dy * xhat), dbeta [D] = sum(dy)
    """
    xhat, rstd, gamma = cache
    xp = namespace(dy)
    g = dy * gamma
    dx = rstd * (g - xp.mean(g, axis=-1, keepdims=True) - xhat * xp.mean(g * xhat, axis=-1, keepdims=True))
    return dx, _sum_over_leading(dy * xhat), _sum_over_leading(dy)


def rmsnorm_forward(x, gain, eps: float = 1e-6):
    """y = gain * x / sqrt(mean(x^2) + eps) over the last axis; eps keeps an all-zero row finite.

    x [..., D], gain [D]  ->  y [..., D]; cache: xhat [..., D], rrms [..., 1], gain.
    """
    checks.float_inputs(x=x, gain=gain)
    checks.positive("eps", eps)
    checks.shape("gain", gain, (x.shape[-1],))
    xp = namespace(x)
    rrms = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps)          # [..., 1]
    xhat = x * rrms
    return xhat * gain, (xhat, rrms, gain)


def rmsnorm_backward(dy, cache):
    """dx = rrms * (g - xhat * mean(g * xhat)) with g = dy * gain, row by row.

    dy [..., D]  ->  dx [..., D], dgain [D] = sum(dy * xhat)
    """
    xhat, rrms, gain = cache
    xp = namespace(dy)
    g = dy * gain
    dx = rrms * (g - xhat * xp.mean(g * xhat, axis=-1, keepdims=True))
    return dx, _sum_over_leading(dy * xhat)


# --------------------------------------------------------------------------------------
# Dropout and the residual connection


def dropout_forward(x, p: float, rng=None, training: bool = True):
    """Inverted dropout: keep each entry with probability 1 - p and scale it by 1 / (1 - p).

    E[y] = x, so evaluation needs no rescaling: with training=False (or p == 0) it is the identity.
    `rng` comes from tfcore.backend.default_rng(seed); the same seed gives the same mask.
    x [...]  ->  y [...]; the cache is the boolean keep-mask and the scale (None at eval).
    """
    checks.float_inputs(x=x)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must lie in [0, 1), got {p}")
    if not training or p == 0.0:
        return x, None
    if rng is None:
        raise ValueError("dropout in training needs an rng: pass tfcore.backend.default_rng(seed)")
    xp = namespace(x)
    keep = backend.uniform(rng, tuple(x.shape), like=x) >= p
    scale = 1.0 / (1.0 - p)
    y = xp.astype(keep, x.dtype)
    y *= x * scale
    return y, (keep, scale)


def dropout_backward(dy, cache):
    """dx = dy * keep / (1 - p): the same mask and scale as the forward pass (identity at eval)."""
    if cache is None:
        return dy
    keep, scale = cache
    xp = namespace(dy)
    dx = xp.astype(keep, dy.dtype)
    dx *= dy * scale
    return dx


def residual_forward(x, fx):
    """y = x + f(x): the skip connection.   x [...], fx [...] (same shape)  ->  y [...]"""
    checks.float_inputs(x=x, fx=fx)
    checks.shape("fx", fx, tuple(x.shape))
    return x + fx, None


def residual_backward(dy, cache=None):
    """The sum copies its gradient to both branches: dx = dy (the skip), dfx = dy (into f).

    Both are `dy` itself, not copies (the sum costs no memory): add them into other
    gradients out of place, never with an in-place update of one branch.
    """
    return dy, dy
