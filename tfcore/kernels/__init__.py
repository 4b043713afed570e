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
the tests compare every kernel here with them. A reference op hands its work to a kernel only
when ``applies(...)`` says so:

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

