"""The one dispatch seat: each accelerated op runs a registered kernel where the kernel's
predicate holds, and the proved op of tfcore.functional otherwise.

``tfcore.functional.X`` is the reference, the readable array-API code the book proves;
``tfcore.ops.X`` has its signature and its result (the same output, a cache of the same
named tuple that either path's backward takes) and is what a caller that wants speed calls.
A kernel library registers what it accelerates when it is imported (``tfcore.kernels``,
imported with the package, registers its NumPy/Numba kernels):

    ops.register("gelu_forward", kernel, applies=predicate)

``predicate`` is called with the op's arguments, positionally in the order of the table's
signature, and says whether the kernel takes them (kernels enabled, NumPy float arrays of one
dtype, the layouts and shapes it reads); it must answer False, never raise, for any input.
Where it holds, the op makes the reference's checks of its arguments and then calls the
kernel as the table says; otherwise it calls the reference op, which checks them itself.
So each argument is checked once on either path, and bad input raises the same error.

Kernels are on unless ``TFCORE_KERNELS=0`` is in the environment; ``set_kernels_enabled``
and ``with reference_only():`` switch every registered kernel off for the whole process
(``tfcore.kernels.set_enabled`` and ``kernels.disabled()`` are the same switch).

``trusted=True`` (offered by the ops marked "trusted" below, those whose checks are not
also their preparation of the work): the caller vouches that the arrays are ones the checks
accept (a model's own activations, parameters and caches), and where a kernel takes the call
the checks are skipped; the reference path checks as ever.
``CHECK_TRUSTED = True`` makes trusted calls check too (a test compares the two).

The table: each op (the signature and result of tfcore.functional's), then how the seat
calls its kernel and what tfcore.kernels' predicate asks beyond valid arguments (every one
asks for NumPy float32/float64 arrays of one dtype, and kernels on):

linear_forward(x, W, b=None) -> y [..., D_out], LinearCache                        trusted
    kernel(x, W, b) -> y                                   any strides
linear_backward(dy, cache) -> dx, dW, db (None without a bias)                     trusted
    kernel(dy, x, W, has_bias) -> dx, dW, db               any strides
linear_backward_into(dy, cache, gW, gb=None, overwrite_input=False) -> dx          trusted
    (no reference op: linear_backward, then gW += dW, gb += db)
    kernel(dy, x, W, has_bias, overwrite_input, (gW, gb)) -> dx, adding into gW, gb
gelu_forward(x, approximate="none") -> y, GeluCache                                trusted
    kernel(x, approximate) -> y                            C-contiguous
gelu_backward(dy, cache, out=None) -> dx (out itself when given)                   trusted
    kernel(dy, x, approximate, out) -> dx                  C-contiguous
softmax_forward(z, mask=None) -> s, s
    kernel(z + mask) -> s                                  C-contiguous z (or any, with a mask)
softmax_backward(ds, s) -> dz                                                      trusted
    kernel(ds, s) -> dz                                    C-contiguous
layernorm_forward(x, gamma, beta, eps=1e-5) -> y, NormCache                        trusted
    kernel(x, gamma, beta, eps) -> (y, (xhat, rstd, gamma)), or None where a row
    overflows (then the reference runs)                    C-contiguous
layernorm_backward(dy, cache) -> dx, dgamma, dbeta                                 trusted
    kernel(dy, cache) -> dx, dgamma, dbeta                 C-contiguous
rmsnorm_forward(x, gain, eps=1e-6), rmsnorm_backward(dy, cache): as LayerNorm's   trusted
cross_entropy_forward(logits, labels, ignore_index=-100) -> loss [], CrossEntropyCache
    kernel(z [N, V], safe labels [N], valid [N]) -> probs [N, V], the kept rows' summed
    loss                                                   C-contiguous logits
cross_entropy_backward(dloss, cache, overwrite=False) -> dlogits [..., V]          trusted
    kernel(dloss, cache, out) -> dlogits (out: the cache's probs when overwrite)
embedding_backward(dx, cache) -> dW [V, D]                                         trusted
    kernel(dx, ids [N], W's shape) -> dW                   C-contiguous dx
attention_forward(q, k, v, mask=None, key_padding=None, causal=False, dropout_p=0.0,
                  rng=None, training=True) -> out, AttentionCache
    kernel(q, k, v, causal, scale, dropout_p, rng, training) -> out, the cache's fields
                                                           no mask nor padding, S_q <= S_k
attention_backward(dout, cache) -> dq, dk, dv                                      trusted
    kernel(dout, cache) -> dq, dk, dv                      A C-contiguous
tiled_attention_forward(q, k, v, mask=None, key_padding=None, causal=False, dropout_p=0.0,
                        rng=None, training=True, *, block_size=64, scale=None)
                        -> out, TiledAttentionCache
    kernel(q, k, v, causal, scale) -> out, lse             no mask, padding nor dropout
tiled_attention_backward(dout, cache) -> dq, dk, dv                                trusted
    kernel(dout, q, k, v, out, lse, causal, scale) -> dq, dk, dv    as the forward
qkv_merge_grads(dq, dk, dv) -> dqkv [B, S, 3D]                                     trusted
    kernel(dq, dk, dv) -> dqkv without a copy, or None where they are not the views of one
    buffer (then the reference copies)                     any strides
residual_forward(x, fx) -> y, Spec                                                 trusted
    kernel(x, fx) -> x + fx                                C-contiguous, one shape
residual_backward(dy, cache=None) -> dy, dy (dy itself, twice)                     trusted
    kernel(dy) -> dy, dy                                   any strides; like the cache's y
dropout_forward(x, p, rng=None, training=True) -> y, DropoutCache                  trusted
    kernel(x) -> x (itself)                                where it draws no mask: p == 0
                                                           or training is False; any strides
dropout_backward(dy, cache) -> dx                                                  trusted
    kernel(dy) -> dy (itself)                              a cache with no mask; any strides
add(a, b) -> a + b, unchecked (no reference op: a + b itself)
    kernel(a, b) -> a + b                                  C-contiguous, one shape
adamw_update: no function here; tfcore.optim.adamw_update, the reference and its checks,
    asks kernel_for("adamw_update", p, g, m, v, step, lr, beta1, beta2, eps, weight_decay,
    decay_mask) and calls kernel(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias1,
    bias2, decay_mask), in place                           C-contiguous

Layering: backend -> checks -> functional -> ops -> nn -> models -> optim. This module imports
tfcore.functional and never tfcore.kernels; the kernels import it to register.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, NamedTuple

from .backend import namespace
# modules only, never names from them: the reference ops and their checks are looked up at
# each call, so that a test or a profiler that replaces one is seen here too
from .functional import _caches, activations as _act, attention as _att, embedding as _emb
from .functional import linear as _lin, normalization as _norm, regularization as _reg
from .functional import softmax as _soft, tiled_attention as _tiled

OPS = ("linear_forward", "linear_backward", "linear_backward_into", "gelu_forward",
       "gelu_backward", "softmax_forward", "softmax_backward", "layernorm_forward",
       "layernorm_backward", "rmsnorm_forward", "rmsnorm_backward", "cross_entropy_forward",
       "cross_entropy_backward", "embedding_backward", "attention_forward",
       "attention_backward", "tiled_attention_forward", "tiled_attention_backward",
       "qkv_merge_grads", "residual_forward", "residual_backward", "dropout_forward",
       "dropout_backward", "add", "adamw_update")

CHECK_TRUSTED = False      # True: trusted calls make the checks as well

_kernels_on = os.environ.get("TFCORE_KERNELS", "1").strip().lower() not in ("0", "false",
                                                                             "off", "no")


class Kernel(NamedTuple):
    """A registered kernel: run(...) as the table says, where applies(op's arguments)."""

    run: Callable
    applies: Callable


_KERNELS: dict[str, tuple[Kernel, ...]] = {}     # op -> its kernels, the first registered first


# -- the registry and the switch --------------------------------------------------------------

def register(op: str, kernel: Callable, *, applies: Callable) -> None:
    """Register `kernel` for `op` (one of OPS), to run where applies(op's arguments) holds.
    The kernels of one op are asked in the order they were registered; registering a kernel
    again replaces its entry, which is then asked last."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    for name, fn in (("kernel", kernel), ("applies", applies)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    others = tuple(k for k in _KERNELS.get(op, ()) if k.run is not kernel)
    _KERNELS[op] = others + (Kernel(kernel, applies),)


def registered(op: str) -> tuple[Kernel, ...]:
    """The kernels registered for `op`, in the order they are asked."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    return _KERNELS.get(op, ())


def kernel_for(op: str, *args):
    """The first kernel of `op` whose predicate holds for args (the op's arguments), or None:
    where kernels are switched off, or none takes them."""
    if not _kernels_on:
        return None
    for kernel in _KERNELS.get(op, ()):
        if kernel.applies(*args):
            return kernel.run
    return None


def kernels_enabled() -> bool:
    """The registered kernels may run (TFCORE_KERNELS, set_kernels_enabled)."""
    return _kernels_on


def set_kernels_enabled(flag: bool) -> bool:
    """Switch every registered kernel on or off for the whole process; -> the previous setting."""
    global _kernels_on
    previous, _kernels_on = _kernels_on, bool(flag)
    return previous


@contextlib.contextmanager
def reference_only():
    """``with ops.reference_only():`` every op inside the block runs its reference."""
    previous = set_kernels_enabled(False)
    try:
        yield
    finally:
        set_kernels_enabled(previous)


def _checks(trusted: bool) -> bool:
    return not trusted or CHECK_TRUSTED


# -- the ops ----------------------------------------------------------------------------------

def linear_forward(x, W, b=None, *, trusted=False):
    """functional.linear_forward: x [..., D_in] @ W [D_in, D_out] + b -> y, LinearCache."""
    run = kernel_for("linear_forward", x, W, b)
    if run is None:
        return _lin.linear_forward(x, W, b)
    if _checks(trusted):
        _lin._check_linear_forward(x, W, b)
    return run(x, W, b), _caches.LinearCache(x, W, b is not None)


def linear_backward(dy, cache, *, trusted=False):
    """functional.linear_backward: dy [..., D_out] -> dx [..., D_in], dW, db (or None)."""
    run = kernel_for("linear_backward", dy, cache)
    if run is None:
        return _lin.linear_backward(dy, cache)
    x, W, has_bias = _lin._check_linear_backward(dy, cache) if _checks(trusted) else cache
    return run(dy, x, W, has_bias)


def linear_backward_into(dy, cache, gW, gb=None, overwrite_input=False, *, trusted=False):
    """linear_backward with dW added into gW [D_in, D_out] and db into gb [D_out] (with a
    bias) -> dx [..., D_in]. overwrite_input=True: the cached x is needed no more, and a
    kernel may write dx over it (one input-sized array fewer at the backward's peak)."""
    run = kernel_for("linear_backward_into", dy, cache, gW, gb, overwrite_input)
    if run is not None:
        x, W, has_bias = _lin._check_linear_backward(dy, cache) if _checks(trusted) else cache
        return run(dy, x, W, has_bias, overwrite_input, (gW, gb if has_bias else None))
    dx, dW, db = _lin.linear_backward(dy, cache)
    gW += dW
    if db is not None:
        gb += db
    return dx


def gelu_forward(x, approximate="none", *, trusted=False):
    """functional.gelu_forward: x [...] -> y [...], GeluCache."""
    run = kernel_for("gelu_forward", x, approximate)
    if run is None:
        return _act.gelu_forward(x, approximate)
    if _checks(trusted):
        _act._check_gelu_forward(x, approximate)
    return run(x, approximate), _caches.GeluCache(x, approximate)


def gelu_backward(dy, cache, out=None, *, trusted=False):
    """functional.gelu_backward: dy [...] -> dx [...] (written into out when given)."""
    run = kernel_for("gelu_backward", dy, cache, out)
    if run is None:
        return _act.gelu_backward(dy, cache, out)
    x, approximate = _act._check_gelu_backward(dy, cache, out) if _checks(trusted) else cache
    return run(dy, x, approximate, out)


def softmax_forward(z, mask=None):
    """functional.softmax_forward: z [..., K] (+ mask) -> s, s."""
    run = kernel_for("softmax_forward", z, mask)
    if run is None:
        return _soft.softmax_forward(z, mask)
    _, z, _ = _soft._check_softmax_forward(z, mask)                     # z + mask
    s = run(z)
    return s, s


def softmax_backward(ds, s, *, trusted=False):
    """functional.softmax_backward: ds [..., K], s [..., K] -> dz [..., K]."""
    run = kernel_for("softmax_backward", ds, s)
    if run is None:
        return _soft.softmax_backward(ds, s)
    if _checks(trusted):
        _soft._check_softmax_backward(ds, s)
    return run(ds, s)


def layernorm_forward(x, gamma, beta, eps=1e-5, *, trusted=False):
    """functional.layernorm_forward: x [..., D] -> y [..., D], NormCache."""
    run = kernel_for("layernorm_forward", x, gamma, beta, eps)
    if run is not None:
        if _checks(trusted):
            _, eps = _norm._check_layernorm_forward(x, gamma, beta, eps)
        done = run(x, gamma, beta, eps)
        if done is not None:                    # None: a row overflowed, the reference's
            return done[0], _caches.NormCache(*done[1])
    return _norm.layernorm_forward(x, gamma, beta, eps)


def layernorm_backward(dy, cache, *, trusted=False):
    """functional.layernorm_backward: dy [..., D] -> dx [..., D], dgamma [D], dbeta [D]."""
    run = kernel_for("layernorm_backward", dy, cache)
    if run is None:
        return _norm.layernorm_backward(dy, cache)
    if _checks(trusted):
        _norm._check_norm_backward(dy, cache)
    return run(dy, cache)


def rmsnorm_forward(x, gain, eps=1e-6, *, trusted=False):
    """functional.rmsnorm_forward: x [..., D] -> y [..., D], NormCache."""
    run = kernel_for("rmsnorm_forward", x, gain, eps)
    if run is not None:
        if _checks(trusted):
            _, eps = _norm._check_rmsnorm_forward(x, gain, eps)
        done = run(x, gain, eps)
        if done is not None:
            return done[0], _caches.NormCache(*done[1])
    return _norm.rmsnorm_forward(x, gain, eps)


def rmsnorm_backward(dy, cache, *, trusted=False):
    """functional.rmsnorm_backward: dy [..., D] -> dx [..., D], dgain [D]."""
    run = kernel_for("rmsnorm_backward", dy, cache)
    if run is None:
        return _norm.rmsnorm_backward(dy, cache)
    if _checks(trusted):
        _norm._check_norm_backward(dy, cache)
    return run(dy, cache)


def cross_entropy_forward(logits, labels, ignore_index=-100):
    """functional.cross_entropy_forward: logits [..., V], labels [...] -> loss [],
    CrossEntropyCache."""
    run = kernel_for("cross_entropy_forward", logits, labels, ignore_index)
    if run is None:
        return _soft.cross_entropy_forward(logits, labels, ignore_index)
    _, z, safe, valid, n_valid, _ = _soft._check_cross_entropy_forward(logits, labels,
                                                                        ignore_index)
    probs, total = run(z, safe, valid)                                  # [N, V], a float
    loss = z.dtype.type(total / max(n_valid, 1))
    return loss, _caches.CrossEntropyCache(probs, safe, valid, n_valid, tuple(logits.shape))


def cross_entropy_backward(dloss, cache, overwrite=False, *, trusted=False):
    """functional.cross_entropy_backward: dloss a scalar -> dlogits [..., V]."""
    run = kernel_for("cross_entropy_backward", dloss, cache, overwrite)
    if run is None:
        return _soft.cross_entropy_backward(dloss, cache, overwrite)
    if _checks(trusted):
        dloss = _soft._check_cross_entropy_backward(dloss, overwrite)
    return run(dloss, cache, cache[0] if overwrite else None)


def embedding_backward(dx, cache, *, trusted=False):
    """functional.embedding_backward: dx [..., D] -> dW [V, D]."""
    run = kernel_for("embedding_backward", dx, cache)
    if run is None:
        return _emb.embedding_backward(dx, cache)
    if _checks(trusted):
        ids, w_shape = _emb._check_embedding_backward(dx, cache)
    else:
        ids, w_shape = cache[0], cache[3]
    return run(dx, ids, w_shape)


def attention_forward(q, k, v, mask=None, key_padding=None, causal=False, dropout_p=0.0,
                      rng=None, training=True):
    """functional.attention_forward: q [B, H, S_q, D_h], k, v [B, H, S_k, .] -> out
    [B, H, S_q, D_v], AttentionCache."""
    run = kernel_for("attention_forward", q, k, v, mask, key_padding, causal, dropout_p, rng,
                     training)
    if run is None:
        return _att.attention_forward(q, k, v, mask, key_padding, causal, dropout_p, rng,
                                      training)
    _, causal, dropout_p, training, scale = _att._check_attention_forward(q, k, v, causal,
                                                                          dropout_p, training)
    out, cache = run(q, k, v, causal, scale, dropout_p, rng, training)
    return out, _caches.AttentionCache(*cache)


def attention_backward(dout, cache, *, trusted=False):
    """functional.attention_backward: dout [B, H, S_q, D_v] -> dq, dk, dv."""
    run = kernel_for("attention_backward", dout, cache)
    if run is None:
        return _att.attention_backward(dout, cache)
    if _checks(trusted):
        _att._check_attention_backward(dout, cache)
    return run(dout, cache)


def tiled_attention_forward(q, k, v, mask=None, key_padding=None, causal=False, dropout_p=0.0,
                            rng=None, training=True, *, block_size=64, scale=None,
                            dropout_index=None):
    """functional.tiled_attention_forward -> out [B, H, S_q, D_v], TiledAttentionCache."""
    run = kernel_for("tiled_attention_forward", q, k, v, mask, key_padding, causal, dropout_p,
                     rng, training, block_size, scale)
    if run is None:
        return _tiled.tiled_attention_forward(q, k, v, mask, key_padding, causal, dropout_p,
                                              rng, training, block_size=block_size,
                                              scale=scale, dropout_index=dropout_index)
    _, settings = _tiled._check_tiled_attention_forward(q, k, v, mask, key_padding, causal,
                                                        dropout_p, rng, training, block_size,
                                                        scale)
    out, lse = run(q, k, v, settings["causal"], settings["scale"])
    return out, _caches.TiledAttentionCache(q, k, v, out, lse, settings)


def tiled_attention_backward(dout, cache, *, trusted=False):
    """functional.tiled_attention_backward: dout [B, H, S_q, D_v] -> dq, dk, dv."""
    run = kernel_for("tiled_attention_backward", dout, cache)
    if run is None:
        return _tiled.tiled_attention_backward(dout, cache)
    if _checks(trusted):
        _tiled._check_tiled_attention_backward(dout, cache)
    q, k, v, out, lse, settings = cache
    return run(dout, q, k, v, out, lse, settings["causal"], settings["scale"])


def qkv_merge_grads(dq, dk, dv, *, trusted=False):
    """functional.qkv_merge_grads: dq, dk, dv [B, H, S, D_h] -> dqkv [B, S, 3D]."""
    run = kernel_for("qkv_merge_grads", dq, dk, dv)
    if run is not None:
        if _checks(trusted):
            _att._check_qkv_merge_grads(dq, dk, dv)
        fused = run(dq, dk, dv)
        if fused is not None:                   # None: not the views of one buffer
            return fused
    return _att.qkv_merge_grads(dq, dk, dv)


def residual_forward(x, fx, *, trusted=False):
    """functional.residual_forward: x [...] + fx [...] -> y [...], Spec."""
    run = kernel_for("residual_forward", x, fx)
    if run is None:
        return _reg.residual_forward(x, fx)
    if _checks(trusted):
        _reg._check_residual_forward(x, fx)
    y = run(x, fx)
    return y, _caches.Spec(tuple(y.shape), y.dtype, namespace(y))


def residual_backward(dy, cache=None, *, trusted=False):
    """functional.residual_backward: the sum's gradient dy [...] to the skip and to the
    branch alike -> dy, dy (dy itself, not copies)."""
    run = kernel_for("residual_backward", dy, cache)
    if run is None:
        return _reg.residual_backward(dy, cache)
    if _checks(trusted):
        _reg._check_residual_backward(dy, cache)
    return run(dy)


def dropout_forward(x, p, rng=None, training=True, *, trusted=False):
    """functional.dropout_forward: x [...] -> y [...], DropoutCache (x itself and no mask
    where nothing is dropped: p == 0 or training=False)."""
    run = kernel_for("dropout_forward", x, p, rng, training)
    if run is None:
        return _reg.dropout_forward(x, p, rng, training)
    if _checks(trusted):
        _reg._check_dropout_forward(x, p, training)
    y = run(x)
    return y, _caches.DropoutCache(None, 1.0, _caches.Spec(tuple(x.shape), x.dtype,
                                                           namespace(x)))


def dropout_backward(dy, cache, *, trusted=False):
    """functional.dropout_backward: dy [...] -> dx [...] (dy itself where the forward drew
    no mask)."""
    run = kernel_for("dropout_backward", dy, cache)
    if run is None:
        return _reg.dropout_backward(dy, cache)
    if _checks(trusted):
        _reg._check_dropout_backward(dy, cache)
    return run(dy)


def add(a, b):
    """a + b [...] (a residual sum, or a sum of two gradients), unchecked: a new array."""
    run = kernel_for("add", a, b)
    return a + b if run is None else run(a, b)
