"""Fused CPU kernels for the element-wise and row-wise ops of the training step: Numba loops
for the row-wise ones, NumPy's SIMD ufuncs on cache-sized chunks for GELU (Numba's tanh, exp
and erf are scalar calls), BLAS products split over threads, and a tiled causal attention
(``tiled_attention_forward`` / ``tiled_attention_backward``, see ``_tiled``).

The modules, one per job (a setting is read at each call from the module that holds it:
``kernels.pool.SPIN_CYCLES = 0``, ``kernels.elementwise.FUSED_GELU = False``):

    switch       whether a kernel may run (``applies``, ``set_enabled``, ``disabled``) and
                 the compiled loops of ``_numba``, loaded on first use
    pool         the one pool of worker threads, and the splits of an op into shares
                 (its settings: MIN_GEMM_FLOPS_PER_THREAD, MIN_ELEMENTS_PER_THREAD,
                 MIN_STREAM_BYTES_PER_THREAD, SPIN_CYCLES; ``_spin`` is its compiled side)
    blas         products on a single-threaded BLAS split over the pool; the linear layer
    elementwise  GELU, the residual sum, AdamW
    rowwise      softmax, LayerNorm and RMSNorm, cross-entropy, the embedding's backward
    attention    the dense op (an in-place causal softmax between BLAS products) and the
                 entry points of the tiled op (``_tiled``)
    memory       the C library's malloc settings for a training process

Threads. All of the kernels' parallel work goes through one pool of worker threads (see
``pool``): a Numba loop or a BLAS product runs single-threaded on a share of the rows, and an
op is split only when each thread gets at least MIN_GEMM_FLOPS_PER_THREAD or
MIN_ELEMENTS_PER_THREAD of work; below that it runs on the calling thread, with no fork/join
at all. The thread count is Numba's (``numba.set_num_threads``, NUMBA_NUM_THREADS).

The array-API functions of ``tfcore.functional`` are the reference: the book proves them, and
the tests compare every kernel here with them. They never call a kernel: ``tfcore.ops`` does,
for the kernels registered below, only where the kernel's predicate (``applies(...)`` and what
the kernel reads) says so:

* kernels are enabled: ``TFCORE_KERNELS`` is not ``0`` in the environment, and neither
  ``set_enabled(False)`` nor ``with kernels.disabled():`` switched them off;
* Numba is installed;
* every array is a NumPy array of float32 or float64 (one dtype), C-contiguous where the
  kernel reads it flat. Everything else (CuPy, array-api-strict, views with strides) runs
  the reference.

Every kernel returns what the reference returns, with caches of the same format, so a cache
made by either path can go to either backward. The Numba kernels compute in float64 whatever
the storage dtype; GELU runs the reference's own operations in the storage dtype. Compiled
code is cached on disk (``cache=True``): only the first use on a machine pays Numba's
compile time (see ``warm_up``).
"""
from __future__ import annotations

import numpy as np

from .. import ops as _ops
from . import _tiled, elementwise, pool  # noqa: F401  (the modules that hold settings)
from .attention import (  # noqa: F401
    as_rows_apart,
    attention_backward,
    attention_forward,
    attention_softmax_,
    attention_softmax_backward_,
    fused_qkv_grads,
    rows_apart,
    tiled_attention_backward,
    tiled_attention_forward,
)
from .blas import (  # noqa: F401
    batched_matmul,
    linear_backward,
    linear_forward,
    matmul,
    single_threaded_blas,
)
from .elementwise import (  # noqa: F401
    add,
    adamw_update,
    gelu_backward,
    gelu_forward,
)
from .memory import keep_freed_memory, set_malloc_thresholds  # noqa: F401
from .rowwise import (  # noqa: F401
    cross_entropy_backward,
    cross_entropy_forward,
    embedding_backward,
    layernorm_backward,
    layernorm_forward,
    rmsnorm_backward,
    rmsnorm_forward,
    softmax_backward,
    softmax_forward,
)
from .switch import (  # noqa: F401
    _writable_numba_cache,
    applies,
    available,
    disabled,
    enabled,
    set_enabled,
)


def warm_up(dtypes=("float32", "float64")) -> float:
    """Run every kernel once on tiny inputs (compiles or loads from the disk cache); seconds."""
    import time

    start = time.perf_counter()
    for name in dtypes:
        x = np.linspace(-2, 2, 24, dtype=name).reshape(2, 3, 4)
        for form in ("none", "tanh"):
            gelu_backward(x, x, form)
            dy = x.copy()
            gelu_backward(dy, x, form, out=dy)           # in place: another kernel
            gelu_forward(x, form)
        s = softmax_forward(x)
        softmax_backward(x, s)
        z = np.ones((1, 2, 3, 4), dtype=name)
        attention_softmax_backward_(z.copy(), attention_softmax_(z, 0.5, True), 0.5, True)
        qkv = np.linspace(-1, 1, 3 * 2 * 5 * 4, dtype=name).reshape(3, 1, 2, 5, 4)
        out, lse = tiled_attention_forward(*qkv, True, 0.5, block=2, span=4)
        tiled_attention_backward(out, *qkv, out, lse, True, 0.5, block=2, span=4)
        g = np.ones(4, dtype=name)
        layernorm_backward(x, layernorm_forward(x, g, g, 1e-5)[1])
        rmsnorm_backward(x, rmsnorm_forward(x, g, 1e-5)[1])
        labels = np.zeros(6, dtype=np.int64)
        probs, _ = cross_entropy_forward(x.reshape(6, 4), labels, labels == 0)
        cross_entropy_backward(1.0, (probs, labels, labels == 0, 6, (6, 4)))
        cross_entropy_backward(1.0, (probs, labels, labels == 0, 6, (6, 4)), out=probs)
        flat = x.reshape(-1).copy()
        adamw_update(flat, flat, flat.copy(), flat * 0, 1e-3, 0.9, 0.99, 1e-8, 0.1, 0.1, 0.01,
                     None)
        adamw_update(flat, flat, flat.copy(), flat * 0, 1e-3, 0.9, 0.99, 1e-8, 0.1, 0.1, 0.01,
                     np.ones_like(flat))
        embedding_backward(x, labels, (3, 4))
        w = np.ones((4, 5), dtype=name)              # a linear layer with a bias, both ways
        y = linear_forward(x, w, w[0])
        linear_backward(y, x, w, True, grads=(w.copy(), w[0].copy()))
        linear_backward(y, x, w, True)
        if pool._threads() > 1:              # the worker's compiled half, on a split product
            a, b, out = x.reshape(6, 4), x.reshape(4, 6), np.empty((6, 6), dtype=name)
            share = pool._matmul_into
            pool._on_threads([(share, (a[:3], b, out[:3])), (share, (a[3:], b, out[3:]))])
    return time.perf_counter() - start



# -- what the kernels accelerate, registered with tfcore.ops (whose docstring has the table) -----
# Each predicate takes the op's arguments as tfcore.ops passes them and answers False, never
# raises, for anything the kernel does not take: ops then runs the reference, which checks.
# Where it holds, ops makes the reference's checks first (unless a trusted caller vouches for
# the arrays), so a predicate asks only what the kernel needs beyond valid arguments.

def _fields(cache, n):
    """The cache when it is a tuple of n fields (a named tuple or a plain one), else None."""
    return cache if isinstance(cache, tuple) and len(cache) == n else None


def _positive(eps) -> bool:
    return isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < np.inf


def _takes_linear_forward(x, W, b):
    return (applies(x, W, b, contiguous=False) and W.ndim == 2 and x.ndim >= 1
            and x.shape[-1] == W.shape[0])


def _takes_linear_backward(dy, cache, *_):
    c = _fields(cache, 3)
    return (c is not None and applies(dy, c[0], c[1], contiguous=False) and c[1].ndim == 2
            and c[0].ndim >= 1 and dy.shape == c[0].shape[:-1] + (c[1].shape[1],))


def _linear_backward_into(dy, x, W, has_bias, overwrite_input, grads):
    return linear_backward(dy, x, W, has_bias, overwrite_x=overwrite_input, grads=grads)[0]


def _takes_gelu_forward(x, approximate):
    return applies(x) and isinstance(approximate, str) and approximate in ("none", "tanh")


def _takes_gelu_backward(dy, cache, out):
    c = _fields(cache, 2)
    return (c is not None and applies(dy, c[0], out) and dy.shape == c[0].shape
            and (out is None or out.shape == dy.shape)
            and isinstance(c[1], str) and c[1] in ("none", "tanh"))


def _takes_softmax_forward(z, mask):
    if mask is None:
        return applies(z) and z.ndim >= 1
    return applies(z, mask, contiguous=False) and z.ndim >= 1    # z + mask: a new array


def _takes_softmax_backward(ds, s):
    return applies(ds, s) and ds.shape == s.shape and s.ndim >= 1


def _takes_layernorm_forward(x, gamma, beta, eps):
    return (applies(x, gamma, beta) and _positive(eps) and x.ndim >= 1 and gamma.ndim == 1
            and gamma.shape == beta.shape and x.shape[-1] == gamma.shape[0] > 0)


def _takes_rmsnorm_forward(x, gain, eps):
    return (applies(x, gain) and _positive(eps) and x.ndim >= 1 and gain.ndim == 1
            and x.shape[-1] == gain.shape[0] > 0)


def _takes_norm_backward(dy, cache):
    c = _fields(cache, 3)
    return c is not None and applies(dy, *c) and dy.shape == c[0].shape


def _takes_cross_entropy_forward(logits, labels, ignore_index):
    return applies(logits) and logits.ndim >= 1


def _takes_cross_entropy_backward(dloss, cache, overwrite):
    c = _fields(cache, 5)
    return c is not None and applies(c[0]) and c[0].ndim == 2


def _takes_embedding_backward(dx, cache):
    c = _fields(cache, 4)
    return c is not None and applies(dx) and dx.shape == tuple(c[1])


def _takes_attention_forward(q, k, v, mask, key_padding, causal, dropout_p, rng, training):
    return (mask is None and key_padding is None and applies(q, k, v, contiguous=False)
            and q.ndim == k.ndim == 4 and q.shape[2] <= k.shape[2])


def _takes_attention_backward(dout, cache):
    c = _fields(cache, 7)
    return (c is not None and applies(dout, *c[:4], contiguous=False)
            and c[3].flags.c_contiguous and dout.shape == c[0].shape[:3] + c[2].shape[3:])


def _takes_tiled_attention_forward(q, k, v, mask, key_padding, causal, dropout_p, rng,
                                   training, block_size, scale):
    no_dropout = training is False or (isinstance(dropout_p, (int, float)) and dropout_p == 0)
    return (mask is None and key_padding is None and no_dropout
            and applies(q, k, v, contiguous=False) and q.ndim == k.ndim == v.ndim == 4)


def _tiled_forward(q, k, v, causal, scale):
    """tiled_attention_forward on views of q, k, v whose rows lie apart (a fused qkv's go as
    they are; anything else is copied for the call only)."""
    return tiled_attention_forward(*as_rows_apart(q, k, v), causal, scale)


def _takes_tiled_attention_backward(dout, cache):
    c = _fields(cache, 6)
    if c is None or not isinstance(c[5], dict):
        return False
    settings = c[5]
    return (settings.get("mask") is None and settings.get("key_padding") is None
            and settings.get("seed") is None and applies(dout, *c[:3], contiguous=False)
            and dout.shape == getattr(c[3], "shape", None))


def _tiled_backward(dout, q, k, v, out, lse, causal, scale):
    q, k, v, dout, out = as_rows_apart(q, k, v, dout, out)
    return tiled_attention_backward(dout, q, k, v, out, np.ascontiguousarray(lse), causal,
                                    scale)


def _takes_qkv_merge_grads(dq, dk, dv):
    return applies(dq, dk, dv, contiguous=False)


def _takes_sum(a, b):
    return applies(a, b) and a.shape == b.shape


def _spec_of(dy, spec) -> bool:
    """dy has the shape and dtype of a forward output's Spec (shape, dtype, library)."""
    return (isinstance(spec, tuple) and len(spec) == 3 and isinstance(spec[0], tuple)
            and dy.shape == spec[0] and dy.dtype == spec[1])


def _both(dy):
    """The residual sum's backward: dy to the skip and to the branch (itself, no copy)."""
    return dy, dy


def _takes_residual_backward(dy, cache):
    return applies(dy, contiguous=False) and (cache is None or _spec_of(dy, cache))


def _identity(x):
    """Dropout that drops nothing (p == 0, or evaluation): x itself, no copy."""
    return x


def _takes_dropout_forward(x, p, rng, training):
    nothing_dropped = training is False or (isinstance(p, (int, float))
                                            and not isinstance(p, bool) and p == 0)
    return nothing_dropped and applies(x, contiguous=False)


def _takes_dropout_backward(dy, cache):
    c = _fields(cache, 3)
    return (c is not None and c[0] is None and applies(dy, contiguous=False)
            and _spec_of(dy, c[2]))


def _takes_adamw_update(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, decay_mask):
    return applies(p, g, m, v, decay_mask)


def _register():
    register = _ops.register
    register("linear_forward", linear_forward, applies=_takes_linear_forward)
    register("linear_backward", linear_backward, applies=_takes_linear_backward)
    register("linear_backward_into", _linear_backward_into, applies=_takes_linear_backward)
    register("gelu_forward", gelu_forward, applies=_takes_gelu_forward)
    register("gelu_backward", gelu_backward, applies=_takes_gelu_backward)
    register("softmax_forward", softmax_forward, applies=_takes_softmax_forward)
    register("softmax_backward", softmax_backward, applies=_takes_softmax_backward)
    register("layernorm_forward", layernorm_forward, applies=_takes_layernorm_forward)
    register("layernorm_backward", layernorm_backward, applies=_takes_norm_backward)
    register("rmsnorm_forward", rmsnorm_forward, applies=_takes_rmsnorm_forward)
    register("rmsnorm_backward", rmsnorm_backward, applies=_takes_norm_backward)
    register("cross_entropy_forward", cross_entropy_forward,
             applies=_takes_cross_entropy_forward)
    register("cross_entropy_backward", cross_entropy_backward,
             applies=_takes_cross_entropy_backward)
    register("embedding_backward", embedding_backward, applies=_takes_embedding_backward)
    register("attention_forward", attention_forward, applies=_takes_attention_forward)
    register("attention_backward", attention_backward, applies=_takes_attention_backward)
    register("tiled_attention_forward", _tiled_forward, applies=_takes_tiled_attention_forward)
    register("tiled_attention_backward", _tiled_backward,
             applies=_takes_tiled_attention_backward)
    register("qkv_merge_grads", fused_qkv_grads, applies=_takes_qkv_merge_grads)
    register("residual_forward", add, applies=_takes_sum)
    register("residual_backward", _both, applies=_takes_residual_backward)
    register("dropout_forward", _identity, applies=_takes_dropout_forward)
    register("dropout_backward", _identity, applies=_takes_dropout_backward)
    register("add", add, applies=_takes_sum)
    register("adamw_update", adamw_update, applies=_takes_adamw_update)


_register()
