"""Softmax, log-softmax and the losses (chapter 3): forward/backward pairs."""
from __future__ import annotations

import math

from .. import backend, checks
from ..backend import namespace
from ._caches import CrossEntropyCache
from ._common import _flat_rows


def causal_mask(length: int, dtype="float64"):
    """The additive causal mask, 0 on and below the diagonal and -inf above it.

    length an integer >= 1; dtype 'float32' / 'float64' or the backend's float dtype object.
    -> mask [length, length]; one table broadcast over batch and heads, never one per batch.
    """
    length = checks.integer("length", length, least=1)
    xp = backend.xp()
    dt = checks.float_dtype("dtype", dtype, xp)
    rows = xp.arange(length)[:, None]
    cols = xp.arange(length)[None, :]
    return xp.where(cols > rows, xp.asarray(-math.inf, dtype=dt), xp.asarray(0.0, dtype=dt))


def _check_rows(name, z, m):
    """m = max of z (plus mask) over the last axis; a row that is all -inf has no softmax."""
    xp = namespace(m)
    if bool(xp.any(m == -math.inf)):
        raise ValueError(
            f"{name} has a row whose entries are all -inf: its softmax is 0/0; "
            "keep at least one finite entry per row (mask with -inf, never every entry)"
        )


def _check_mask(mask, z):
    checks.float_inputs(z=z, mask=mask)
    xp = namespace(mask)
    if bool(xp.any(xp.isnan(mask) | (mask == math.inf))):
        raise ValueError("mask must be additive: 0 (or any finite value) keeps an entry, -inf masks it; found nan or +inf")
    try:
        xp.broadcast_to(mask, tuple(z.shape))
    except ValueError as err:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape {tuple(z.shape)}") from err
    masked = mask == -math.inf
    if mask.ndim:                        # a 0-d mask is one entry of every row (CuPy's all
        masked = xp.all(masked, axis=-1)  # refuses axis=-1 on 0-d, where NumPy's takes it)
    if bool(xp.any(masked)):
        raise ValueError("every row of the mask must keep at least one entry; a fully masked row has no softmax")


def softmax_forward(z, mask=None):
    """s = softmax(z + mask) along the last axis, shifted by the row maximum so exp never overflows.

    z [..., K]; mask (optional) broadcastable to z: 0 keeps, -inf masks  ->  s [..., K]
    K must be at least 1; an empty batch gives an empty s. A row that is all -inf (after
    the mask) is an error. The cache is s itself: the same array as the output.
    """
    xp, z, m = _check_softmax_forward(z, mask)                          # z + mask; m [..., 1]
    e = xp.exp(z - m)
    e /= xp.sum(e, axis=-1, keepdims=True)
    return e, e


def softmax_backward(ds, s):
    """dz = s * (ds - sum(ds * s)) row by row: the VJP with the Jacobian diag(s) - s s^T.

    ds [..., K], cache s [..., K]  ->  dz [..., K]  (masked entries get 0 because s is 0 there)
    """
    _check_softmax_backward(ds, s)
    xp = namespace(ds, s)
    return s * (ds - xp.sum(ds * s, axis=-1, keepdims=True))


def log_softmax_forward(z):
    """y = z - logsumexp(z) along the last axis, computed as (z - m) - log(sum(exp(z - m))).

    z [..., K]  ->  y [..., K]; K >= 1, a row of z that is all -inf is an error.
    The cache is y itself: the same array as the output.
    """
    xp = checks.float_inputs(z=z)
    checks.width("z", z, "K")
    m = xp.max(z, axis=-1, keepdims=True)                               # [..., 1]
    _check_rows("z", z, m)
    shifted = z - m
    y = shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))
    return y, y


def log_softmax_backward(dy, y):
    """dz = dy - softmax(z) * sum(dy), with softmax(z) = exp(y).

    dy [..., K], cache y [..., K]  ->  dz [..., K]
    """
    checks.upstream_like("dy", dy, y)
    xp = namespace(dy, y)
    return dy - xp.exp(y) * xp.sum(dy, axis=-1, keepdims=True)


def cross_entropy_forward(logits, labels, ignore_index: int = -100):
    """Mean negative log-likelihood of integer labels under softmax(logits), fused with the softmax.

    logits [..., V] float; labels [...] integers in [0, V) or equal to ignore_index
    ->  loss [] (a 0-d array): the mean over the N_valid labels that are not ignored.
    With every label ignored there is nothing to average: the loss is 0 and so is the gradient
    (an empty batch likewise). V must be at least 1; ignore_index is an integer.
    """
    xp, z, safe, valid, n_valid, m = _check_cross_entropy_forward(logits, labels, ignore_index)
    shifted = z - m                                                     # [N, V]
    probs = xp.exp(shifted)
    sum_exp = xp.sum(probs, axis=-1)                                    # [N]
    probs /= sum_exp[:, None]
    picked = xp.take_along_axis(shifted, safe[:, None], axis=-1)[:, 0]  # z[n, y_n] - m_n
    nll = xp.where(valid, xp.log(sum_exp) - picked, xp.zeros_like(picked))
    loss = xp.sum(nll) / max(n_valid, 1)
    return loss, CrossEntropyCache(probs, safe, valid, n_valid, tuple(logits.shape))


def cross_entropy_backward(dloss, cache, overwrite: bool = False):
    """dlogits = dloss * (softmax(logits) - onehot(labels)) / N_valid on kept rows, 0 on ignored rows.

    dloss a scalar (1.0 when the loss is the final output)  ->  dlogits [..., V]
    overwrite=True lets the fused kernel (tfcore.ops.cross_entropy_backward) write dlogits
    over the cache's probabilities (one [N, V] array fewer at the start of a model's
    backward); the cache is then spent. The reference here always makes a new array.
    """
    probs, safe, valid, n_valid, shape = cache
    dloss = _check_cross_entropy_backward(dloss, overwrite)
    xp = namespace(probs)
    n_rows, vocab = probs.shape
    weight = xp.astype(valid, probs.dtype) * (dloss / max(n_valid, 1))          # [N]
    dz = probs * weight[:, None]                                                # [N, V]
    flat = backend.scatter_add(xp.reshape(dz, (-1,)), xp.arange(n_rows) * vocab + safe, -weight)
    return xp.reshape(flat, shape)


# -- the checks each op makes before its work (tfcore.ops makes them before a kernel's) --------

def _check_softmax_forward(z, mask):
    """softmax_forward's checks: z [..., K] a float array, K >= 1, the mask additive and
    broadcastable to z, no row of z + mask all -inf -> (xp, z + mask, its row max [..., 1])."""
    xp = checks.float_inputs(z=z)
    checks.width("z", z, "K")
    if mask is not None:
        _check_mask(mask, z)
        z = z + mask
    m = xp.max(z, axis=-1, keepdims=True)                               # [..., 1]
    _check_rows("z" if mask is None else "z + mask", z, m)
    return xp, z, m


def _check_softmax_backward(ds, s):
    """softmax_backward's check: ds like the forward's output s."""
    checks.upstream_like("ds", ds, s)


def _check_cross_entropy_forward(logits, labels, ignore_index):
    """cross_entropy_forward's checks, and the rows it works on: logits [..., V] float,
    labels [...] integers in [0, V) or ignore_index, no row of logits all -inf ->
    (xp, z [N, V], safe [N] int64 (an ignored row pointing at class 0), valid [N] bool,
    N_valid, the rows' max m [N, 1])."""
    checks.float_inputs(logits=logits)
    vocab = checks.width("logits", logits, "V")
    ignore_index = checks.integer("ignore_index", ignore_index)
    checks.array("labels", labels)
    checks.shape("labels", labels, tuple(logits.shape[:-1]))
    checks.integer_ids("labels", labels, vocab, allowed=ignore_index)
    xp = checks.same_library(logits=logits, labels=labels)
    z = _flat_rows(logits, vocab)                                       # [N, V]
    y = xp.astype(xp.reshape(labels, (-1,)), xp.int64, copy=False)      # [N]; wide enough for ignore_index
    valid = y != ignore_index                                           # [N]
    n_valid = int(xp.sum(xp.astype(valid, xp.int64)))
    safe = xp.where(valid, y, xp.zeros_like(y))                         # an ignored row points at class 0, then is zeroed
    m = xp.max(z, axis=-1, keepdims=True)                               # [N, 1]
    _check_rows("logits", z, m)
    return xp, z, safe, valid, n_valid, m


def _check_cross_entropy_backward(dloss, overwrite):
    """cross_entropy_backward's checks: dloss a real scalar, overwrite a bool -> dloss."""
    dloss = checks.scalar_upstream("dloss", dloss)
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
    return dloss


def mse_forward(pred, target):
    """loss = mean((pred - target)^2) over every element.

    pred [...], target [...] of the same shape, at least one element  ->  loss []
    """
    xp = checks.float_inputs(pred=pred, target=target)
    checks.shape("target", target, tuple(pred.shape))
    if math.prod(pred.shape) == 0:
        raise ValueError(f"pred must have at least one element (a mean of none is undefined), "
                         f"got shape {tuple(pred.shape)}")
    diff = pred - target
    return xp.sum(diff * diff) / math.prod(diff.shape), diff


def mse_backward(dloss, diff):
    """dpred = dloss * 2 (pred - target) / (number of elements).   ->  dpred [...]"""
    dloss = checks.scalar_upstream("dloss", dloss)
    return diff * (2.0 * dloss / math.prod(diff.shape))
