"""Every fused kernel of tfcore.kernels against the reference path of the same op.

The ops of tfcore.ops run a kernel where it takes the arguments; the reference is the
array-API code of tfcore.functional, which the same ops run with the kernels switched off
(``kernels.disabled()``). float64 agrees to a relative 1e-12 (the kernels sum a row in
another order), float32 to its own precision (the kernels compute in float64). Where a kernel
does not apply (another backend, a strided view, mixed dtypes) the reference runs, and the
result is the reference's exactly.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tfcore import backend, kernels, ops, optim
from tfcore import functional as F
from tfcore.backend import asarray, to_numpy

# Numba is a dependency (requirements.txt): a missing one is a broken install, not a reason
# to skip the comparison of every kernel with its reference.
needs_numba = pytest.mark.usefixtures("numba_installed")


@pytest.fixture
def numba_installed():
    assert kernels.available(), "Numba is not installed: run `make setup` (requirements.txt)"
TOL = {"float64": 1e-12, "float32": 2e-6}


def rel(a, b):
    a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def both(fn, *args, **kwargs):
    """fn on the kernel path and on the reference path -> (fast, reference)."""
    fast = fn(*args, **kwargs)
    with kernels.disabled():
        reference = fn(*args, **kwargs)
    return fast, reference


def assert_close(fast, reference, dtype):
    fast = fast if isinstance(fast, tuple) else (fast,)
    reference = reference if isinstance(reference, tuple) else (reference,)
    assert len(fast) == len(reference)
    for a, b in zip(fast, reference):
        if a is None:
            assert b is None
            continue
        assert tuple(a.shape) == tuple(b.shape) and str(a.dtype) == str(b.dtype)
        assert rel(a, b) <= TOL[dtype], rel(a, b)


def randn(rng, shape, dtype, scale=1.0):
    return asarray(scale * rng.standard_normal(shape), dtype=dtype)


@pytest.fixture(autouse=True)
def numpy_backend(kernels_on_numpy):
    """The kernels are for NumPy: these tests run there (conftest's kernels_on_numpy)."""


DTYPES = pytest.mark.parametrize("dtype", ["float64", "float32"])
SHAPES = [(7,), (3, 5, 7), (2, 4, 33)]


# -- the switch ---------------------------------------------------------------------------

def test_applies_only_to_contiguous_numpy_floats():
    x = np.ones((4, 6))
    assert kernels.applies(x) == kernels.available()
    assert not kernels.applies(x[:, ::2])                    # strided
    assert kernels.applies(x[:, ::2], contiguous=False) == kernels.available()
    assert not kernels.applies(x.astype(np.int64))           # not a float
    assert not kernels.applies(x, x.astype(np.float32))      # mixed dtypes
    assert not kernels.applies(x.astype(np.float16))
    with kernels.disabled():
        assert not kernels.applies(x) and not kernels.enabled()
    assert kernels.applies(x) == kernels.available()
    previous = kernels.set_enabled(False)
    assert not kernels.applies(x)
    kernels.set_enabled(previous)


def test_other_backends_run_the_reference(backend_name, rng):
    x = randn(rng, (2, 3), "float64")
    assert kernels.applies(x) == (backend_name == "numpy" and kernels.available())


def test_environment_variable_selects_the_reference():
    code = "import tfcore.kernels as k; print(k.enabled())"
    for value, expected in (("0", "False"), ("off", "False"), ("1", str(kernels.available()))):
        env = dict(os.environ, TFCORE_KERNELS=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == expected


# -- element-wise and row-wise ops --------------------------------------------------------

@needs_numba
@DTYPES
@pytest.mark.parametrize("form", ["none", "tanh"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu(rng, dtype, form, shape):
    x, dy = randn(rng, shape, dtype, 2.0), randn(rng, shape, dtype)
    (y, cache), (y_ref, cache_ref) = both(ops.gelu_forward, x, form)
    assert_close(y, y_ref, dtype)
    assert_close(*both(ops.gelu_backward, dy, cache), dtype)
    assert_close(ops.gelu_backward(dy, cache_ref), ops.gelu_backward(dy, cache), dtype)


@needs_numba
@DTYPES
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax(rng, dtype, shape):
    z, ds = randn(rng, shape, dtype, 3.0), randn(rng, shape, dtype)
    (s, _), (s_ref, _) = both(ops.softmax_forward, z)
    assert_close(s, s_ref, dtype)
    assert_close(*both(ops.softmax_backward, ds, s_ref), dtype)


@needs_numba
@DTYPES
def test_softmax_with_a_mask(rng, dtype):
    z, ds = randn(rng, (2, 3, 6, 6), dtype), randn(rng, (2, 3, 6, 6), dtype)
    mask = F.causal_mask(6, dtype)
    (s, _), (s_ref, _) = both(ops.softmax_forward, z, mask)
    assert_close(s, s_ref, dtype)
    assert float(np.abs(np.triu(s, 1)).max()) == 0.0
    assert_close(*both(ops.softmax_backward, ds, s_ref), dtype)


@needs_numba
@DTYPES
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", SHAPES)
def test_norms(rng, dtype, kind, shape):
    x, dy = randn(rng, shape, dtype, 3.0) + 1.0, randn(rng, shape, dtype)
    g, b = randn(rng, shape[-1:], dtype), randn(rng, shape[-1:], dtype)
    forward = ops.layernorm_forward if kind == "layernorm" else ops.rmsnorm_forward
    backward = ops.layernorm_backward if kind == "layernorm" else ops.rmsnorm_backward
    args = (x, g, b) if kind == "layernorm" else (x, g)
    (y, cache), (y_ref, cache_ref) = both(forward, *args)
    assert_close(y, y_ref, dtype)
    assert_close((cache[0], cache[1]), (cache_ref[0], cache_ref[1]), dtype)
    assert_close(*both(backward, dy, cache_ref), dtype)
    assert_close(backward(dy, cache), backward(dy, cache_ref), dtype)


@needs_numba
def test_norm_of_huge_rows_falls_back_to_the_reference():
    x = np.array([[1e200, -1e200, 3.0], [1.0, 2.0, 4.0]])
    g, b = np.ones(3), np.zeros(3)
    (y, _), (y_ref, _) = both(ops.layernorm_forward, x, g, b)
    assert np.all(np.isfinite(y)) and rel(y, y_ref) <= 1e-12
    (y, _), (y_ref, _) = both(ops.rmsnorm_forward, x, g)
    assert np.all(np.isfinite(y)) and rel(y, y_ref) <= 1e-12
    with pytest.raises(ValueError, match="inf or nan"):
        ops.layernorm_forward(np.array([[np.inf, 1.0]]), np.ones(2), np.zeros(2))


@needs_numba
@DTYPES
def test_cross_entropy(rng, dtype):
    logits = randn(rng, (3, 5, 11), dtype, 2.0)
    labels = rng.integers(0, 11, size=(3, 5))
    labels[0, :2] = -100
    labels = asarray(labels, "int64")
    (loss, cache), (loss_ref, cache_ref) = both(ops.cross_entropy_forward, logits, labels)
    assert abs(float(loss) - float(loss_ref)) <= TOL[dtype] * abs(float(loss_ref))
    assert type(loss) is type(loss_ref)
    assert_close(*both(ops.cross_entropy_backward, 0.7, cache_ref), dtype)
    every = asarray(np.full((3, 5), -100), "int64")
    (loss, cache), _ = both(ops.cross_entropy_forward, logits, every)
    assert float(loss) == 0.0 and float(np.abs(ops.cross_entropy_backward(1.0, cache)).max()) == 0


@needs_numba
@DTYPES
@pytest.mark.parametrize("causal,s_q,s_k", [(True, 6, 6), (True, 1, 5), (True, 3, 7),
                                            (False, 4, 6)])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_attention(rng, dtype, causal, s_q, s_k, dropout):
    q = randn(rng, (2, 3, s_q, 4), dtype)
    k, v = randn(rng, (2, 3, s_k, 4), dtype), randn(rng, (2, 3, s_k, 4), dtype)
    dout = randn(rng, (2, 3, s_q, 4), dtype)

    def run(fast):
        with (kernels.disabled() if not fast else _nothing()):
            out, cache = ops.attention_forward(q, k, v, causal=causal, dropout_p=dropout,
                                             rng=backend.default_rng(5))
            return out, cache, ops.attention_backward(dout, cache)

    out, cache, grads = run(True)
    out_ref, cache_ref, grads_ref = run(False)
    assert_close(out, out_ref, dtype)
    assert_close(cache[3], cache_ref[3], dtype)          # the probabilities A
    assert_close(grads, grads_ref, dtype)
    with kernels.disabled():                             # caches go to either backward
        assert_close(ops.attention_backward(dout, cache), grads_ref, dtype)


@needs_numba
def test_attention_from_a_fused_qkv_view(rng):
    qkv = randn(rng, (2, 5, 3 * 8), "float64")
    q, k, v = F.qkv_split(qkv, 2)                        # strided views
    dout = randn(rng, (2, 2, 5, 4), "float64")
    (out, cache), (out_ref, cache_ref) = both(ops.attention_forward, q, k, v, causal=True)
    assert_close(out, out_ref, "float64")
    assert_close(*both(ops.attention_backward, dout, cache_ref), "float64")


@needs_numba
def test_attention_with_masks_runs_the_reference(rng):
    q = randn(rng, (1, 2, 4, 4), "float64")
    padding = asarray(np.array([[False, False, True, False]]), "bool")
    (out, cache), (out_ref, _) = both(ops.attention_forward, q, q, q, key_padding=padding)
    assert rel(out, out_ref) == 0.0


@needs_numba
@DTYPES
def test_embedding_backward(rng, dtype):
    W = randn(rng, (7, 5), dtype)
    ids = asarray(rng.integers(0, 7, size=(4, 9)), "int64")     # repeated ids
    dx = randn(rng, (4, 9, 5), dtype)
    _, cache = F.embedding_forward(ids, W)
    assert_close(*both(ops.embedding_backward, dx, cache), dtype)


@needs_numba
@DTYPES
@pytest.mark.parametrize("masked", [False, True])
def test_adamw_update(rng, dtype, masked):
    n = 1001
    p0, g = randn(rng, n, dtype), randn(rng, n, dtype)
    m0, v0 = randn(rng, n, dtype, 0.1), asarray(rng.random(n) * 0.01, dtype)
    mask = asarray(rng.integers(0, 2, n), dtype) if masked else None
    results = []
    for fast in (True, False):
        p, m, v = p0.copy(), m0.copy(), v0.copy()
        with (_nothing() if fast else kernels.disabled()):
            optim.adamw_update(p, g, m, v, 3, 1e-2, 0.9, 0.95, 1e-8, 0.1, mask)
        results.append((p, m, v))
    assert_close(results[0], results[1], dtype)


@needs_numba
def test_strided_inputs_run_the_reference(rng):
    x = randn(rng, (4, 10), "float64")[:, ::2]
    dy = randn(rng, (4, 5), "float64")
    assert not kernels.applies(x)
    (y, cache), (y_ref, _) = both(ops.gelu_forward, x)
    assert rel(y, y_ref) == 0.0
    g, b = np.ones(5), np.zeros(5)
    (y, cache), (y_ref, _) = both(ops.layernorm_forward, x, g, b)
    assert rel(y, y_ref) == 0.0
    assert rel(*both(ops.gelu_backward, dy, (x, "none"))) == 0.0


@needs_numba
def test_warm_up_runs_every_kernel():
    assert kernels.warm_up(("float64",)) >= 0.0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@needs_numba
def test_fused_qkv_gradient_needs_no_copy(rng):
    qkv = randn(rng, (2, 6, 3 * 8), "float64")
    q, k, v = F.qkv_split(qkv, 2)
    dout = randn(rng, (2, 2, 6, 4), "float64")
    _, cache = ops.attention_forward(q, k, v, causal=True)
    grads = ops.attention_backward(dout, cache)
    dqkv = ops.qkv_merge_grads(*grads)
    assert np.shares_memory(dqkv, grads[0])              # written in place by the backward
    with kernels.disabled():
        reference = ops.qkv_merge_grads(*ops.attention_backward(dout, cache))
    assert rel(dqkv, reference) <= 1e-12


@needs_numba
@pytest.mark.parametrize("fast", [True, False])
def test_gelu_backward_into_out(rng, fast):
    x, dy = randn(rng, (3, 8), "float64"), randn(rng, (3, 8), "float64")
    _, cache = ops.gelu_forward(x, "tanh")
    expected = ops.gelu_backward(dy, cache)
    with (_nothing() if fast else kernels.disabled()):
        dx = ops.gelu_backward(dy, cache, out=dy)
    assert dx is dy and rel(dx, expected) <= 1e-12


# -- GELU on NumPy's SIMD ufuncs, in cache-sized chunks shared among threads -----------------

@needs_numba
@DTYPES
@pytest.mark.parametrize("form", ["none", "tanh"])
@pytest.mark.parametrize("threads", [1, 2])
def test_gelu_in_chunks_over_threads(rng, dtype, form, threads):
    """Sizes that cross chunk boundaries and split among threads (8 chunks and a tail)."""
    import numba

    n = 8 * kernels.elementwise.CHUNK + 123
    x, dy = randn(rng, (n,), dtype, 3.0), randn(rng, (n,), dtype)
    previous = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        (y, cache), (y_ref, _) = both(ops.gelu_forward, x, form)
        assert_close(y, y_ref, dtype)
        assert_close(*both(ops.gelu_backward, dy, cache), dtype)
        expected = ops.gelu_backward(dy, cache)
        assert ops.gelu_backward(dy, cache, out=dy) is dy      # in place, chunk by chunk
        assert np.array_equal(dy, expected)        # another kernel, the same arithmetic
    finally:
        numba.set_num_threads(previous)


# -- tiled attention: online softmax over key blocks -------------------------------------------

def _dense(q, k, v, dout, causal):
    """The reference attention (kernels off): out, (dq, dk, dv), lse from its scores."""
    with kernels.disabled():
        out, cache = ops.attention_forward(q, k, v, causal=causal, training=False)
        grads = ops.attention_backward(dout, cache)
    z = np.matmul(q, np.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1])
    if causal:
        s_q, s_k = z.shape[-2:]
        z = np.where(np.arange(s_k)[None] > np.arange(s_q)[:, None] + s_k - s_q, -np.inf, z)
    m = z.max(axis=-1)
    lse = m + np.log(np.exp(z - m[..., None]).sum(axis=-1))
    return out, grads, lse


@needs_numba
@DTYPES
@pytest.mark.parametrize("causal,b,s_q,s_k", [(True, 2, 130, 130), (True, 1, 7, 150),
                                              (True, 3, 64, 64), (False, 2, 100, 70),
                                              (False, 1, 5, 200)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("compiled", [True, False])
def test_tiled_attention_equals_the_reference(rng, monkeypatch, dtype, causal, b, s_q, s_k,
                                              threads, compiled):
    """Sequence lengths off the block grid, S_q < S_k, a batch smaller than the threads; the
    compiled shares and the Python loops alike."""
    _use_compiled_shares(monkeypatch, compiled, dtype)
    d_h = 8
    q = randn(rng, (b, 3, s_q, d_h), dtype)
    k, v = randn(rng, (b, 3, s_k, d_h), dtype), randn(rng, (b, 3, s_k, d_h), dtype)
    dout = randn(rng, (b, 3, s_q, d_h), dtype)
    scale = 1.0 / np.sqrt(d_h)
    out, lse = kernels.tiled_attention_forward(q, k, v, causal, scale, threads=threads)
    grads = kernels.tiled_attention_backward(dout, q, k, v, out, lse, causal, scale,
                                             threads=threads)
    out_ref, grads_ref, lse_ref = _dense(q, k, v, dout, causal)
    tol = {"float64": 1e-12, "float32": 2e-5}[dtype]
    assert out.shape == out_ref.shape and lse.shape == (b, 3, s_q)
    assert out.dtype == lse.dtype == np.dtype(dtype)
    assert rel(out, out_ref) <= tol and rel(lse, lse_ref) <= tol
    for grad, ref in zip(grads, grads_ref):
        assert grad.shape == ref.shape and rel(grad, ref) <= tol, rel(grad, ref)


def _use_compiled_shares(monkeypatch, compiled, dtype):
    from tfcore.kernels import _tiled

    monkeypatch.setattr(_tiled, "COMPILED", compiled)
    assert bool(_tiled._compiled(np.dtype(dtype))) == compiled, \
        "NumPy's BLAS has no cblas gemm that the compiled shares can call"


@needs_numba
@DTYPES
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_attention_compiled_shares_equal_the_python_loops(rng, monkeypatch, dtype, causal):
    """The compiled shares make the products of the Python loops with the same arguments
    to the same gemm (beta = 1 where the loops add a product afterwards), so the bits are
    the same, and so are the counted FLOPs."""
    b, h, s_q, s_k, d_h, d_v = 3, 2, 150, 150 if causal else 200, 16, 24
    q, k = randn(rng, (b, h, s_q, d_h), dtype), randn(rng, (b, h, s_k, d_h), dtype)
    v, dout = randn(rng, (b, h, s_k, d_v), dtype), randn(rng, (b, h, s_q, d_v), dtype)
    results = []
    for compiled in (True, False):
        _use_compiled_shares(monkeypatch, compiled, dtype)
        with backend.count_matmuls() as count:
            out, lse = kernels.tiled_attention_forward(q, k, v, causal, 0.3, block=32, span=64)
            grads = kernels.tiled_attention_backward(dout, q, k, v, out, lse, causal, 0.3,
                                                     block=32, span=64)
        results.append(((out, lse) + tuple(grads), count.flops))
    (compiled_arrays, compiled_flops), (python_arrays, python_flops) = results
    assert compiled_flops == python_flops > 0
    for a, b_ in zip(compiled_arrays, python_arrays):
        assert np.array_equal(a, b_)


@needs_numba
@DTYPES
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("s", [70, 262])
def test_tiled_attention_reads_the_views_of_a_fused_qkv(rng, monkeypatch, dtype, compiled, s):
    """q, k, v as the [B, H, S, D_h] views of one [B, S, 3, H, D_h] projection (rows D_h
    long, 3 H D_h apart) give the bits of their C-contiguous copies: read in place, or, from
    PACK_FROM queries on, each head packed into contiguous rows by the compiled backward."""
    from tfcore.kernels import _tiled

    _use_compiled_shares(monkeypatch, compiled, dtype)
    b, h, d_h = 2, 3, 8
    qkv = randn(rng, (b, s, 3, h, d_h), dtype)
    views = [np.swapaxes(qkv[:, :, i], 1, 2) for i in range(3)]
    copies = [np.ascontiguousarray(x) for x in views]
    assert all(kernels.rows_apart(x) and not x.flags.c_contiguous for x in views)
    assert _tiled._worth_packing(*views) == (s >= _tiled.PACK_FROM)
    assert not _tiled._worth_packing(*copies)
    dout = randn(rng, (b, h, s, d_h), dtype)
    results = []
    for q, k, v in (views, copies):
        out, lse = kernels.tiled_attention_forward(q, k, v, True, 0.35, block=32, span=64)
        grads = kernels.tiled_attention_backward(dout, q, k, v, out, lse, True, 0.35,
                                                 block=32, span=64)
        results.append((out, lse) + tuple(grads))
    for a, b_ in zip(*results):
        assert np.array_equal(a, b_)


@needs_numba
def test_tiled_attention_skips_the_blocks_above_the_diagonal(rng):
    """Counted FLOPs: non-causal = the dense products (the backward recomputes the scores:
    5 products for the dense 4); causal = only the blocks on or below the diagonal."""
    b, h, s, d_h, block = 1, 2, 256, 16, 64
    q, k, v, dout = (randn(rng, (b, h, s, d_h), "float64") for _ in range(4))
    per_block = 2 * b * h * block * block * d_h              # one [block, block] product
    for causal, blocks in ((False, 16), (True, 10)):        # 4 x 4 blocks, 4 + 3 + 2 + 1
        with backend.count_matmuls() as count:
            count.phase = "forward"
            out, lse = kernels.tiled_attention_forward(q, k, v, causal, 0.25)
            count.phase = "backward"
            kernels.tiled_attention_backward(dout, q, k, v, out, lse, causal, 0.25)
        assert count.total("forward", "tiled attention") == 2 * blocks * per_block
        assert count.total("backward", "tiled attention") == 5 * blocks * per_block


@needs_numba
def test_tiled_attention_keeps_nothing_of_size_s_by_s(rng):
    import tracemalloc

    b, h, s, d_h = 1, 1, 1024, 16
    q, k, v, dout = (randn(rng, (b, h, s, d_h), "float64") for _ in range(4))
    for trace in (False, True):       # the first run loads the kernels (not the attention's)
        if trace:
            tracemalloc.start()
        try:
            out, lse = kernels.tiled_attention_forward(q, k, v, True, 0.25, threads=1)
            kernels.tiled_attention_backward(dout, q, k, v, out, lse, True, 0.25, threads=1)
            del out, lse
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < s * s * 8 / 8                      # an eighth of one [S, S] float64 matrix


@needs_numba
def test_tiled_attention_rejects_bad_input(rng):
    q = randn(rng, (1, 2, 6, 4), "float64")
    with pytest.raises(ValueError, match="q must be contiguous along its last axis"):
        kernels.tiled_attention_forward(np.swapaxes(q, 2, 3), q, q, False, 0.5)
    overlapping = np.lib.stride_tricks.as_strided(q, strides=q.strides[:2] + (8, 8))
    with pytest.raises(ValueError, match="k must be contiguous along its last axis, its rows"):
        kernels.tiled_attention_forward(q, overlapping, q, False, 0.5)
    with pytest.raises(TypeError, match="k has dtype float32"):
        kernels.tiled_attention_forward(q, q.astype(np.float32), q, False, 0.5)
    with pytest.raises(ValueError, match="S_k >= S_q"):
        kernels.tiled_attention_forward(q, q[:, :, :3].copy(), q[:, :, :3].copy(), True, 0.5)
    with pytest.raises(ValueError, match="lse must have shape"):
        kernels.tiled_attention_backward(q, q, q, q, q, np.zeros((1, 2, 5)), False, 0.5)
    lse = np.zeros((1, 2, 6))
    with pytest.raises(ValueError, match="dout must be contiguous along its last axis"):
        kernels.tiled_attention_backward(np.asfortranarray(q), q, q, q, q, lse, False, 0.5)
    with pytest.raises(ValueError, match="out must be contiguous along its last axis"):
        kernels.tiled_attention_backward(q, q, q, q, np.asfortranarray(q), lse, False, 0.5)


@needs_numba
@pytest.mark.parametrize("causal,s_q,s_k", [(True, 70, 70), (True, 33, 70), (False, 40, 70)])
def test_tiled_attention_op_dispatches_to_the_kernel(rng, causal, s_q, s_k):
    """ops.tiled_attention_* runs the kernel on views of a fused qkv (copied for the call, the
    cache keeping the views as the reference path does), equals its own reference path in
    float64, and either path's cache goes to either backward; masks other than the causal
    one, or dropout, run the reference."""
    qkv = randn(rng, (2, 3, s_k, 24), "float64")
    q = np.ascontiguousarray(qkv[:, :, s_k - s_q:, :8])
    k, v = qkv[:, :, :, 8:16], qkv[:, :, :, 16:]                     # strided views
    dout = randn(rng, (2, 3, s_q, 8), "float64")
    fast_out, fast_cache = ops.tiled_attention_forward(q, k, v, causal=causal, block_size=16)
    assert fast_cache[1] is k and fast_cache[2] is v                 # views, not copies
    with kernels.disabled():
        ref_out, ref_cache = ops.tiled_attention_forward(q, k, v, causal=causal, block_size=16)
        ref_grads = ops.tiled_attention_backward(dout, ref_cache)
        cross_ref = ops.tiled_attention_backward(dout, fast_cache)
    assert rel(fast_out, ref_out) <= 1e-12
    for grads in (ops.tiled_attention_backward(dout, fast_cache), cross_ref,
                  ops.tiled_attention_backward(dout, ref_cache)):
        for grad, ref in zip(grads, ref_grads):
            assert rel(grad, ref) <= 1e-12, rel(grad, ref)
    padding = np.zeros((2, s_k), dtype=bool)
    with_padding = ops.tiled_attention_forward(q, k, v, key_padding=padding, causal=causal)
    assert with_padding[1][5]["key_padding"] is not None            # the reference's cache
    assert rel(with_padding[0], ref_out) <= 1e-12                  # nothing padded here


# -- the thread policy: one pool, and a split only where the work pays for it --------------

def _step_grads(cfg, ids, targets, attention):
    """Loss, every gradient and the parameters after one AdamW step of a seeded decoder."""
    from tfcore.models import DecoderConfig, DecoderLM
    from tfcore.optim import AdamW

    model = DecoderLM(DecoderConfig(**cfg, attention=attention)).init(seed=3)
    opt = AdamW(model.params, lr=1e-2, weight_decay=0.1)
    _, loss = model.forward(ids, targets)
    model.backward()
    grads = to_numpy(model.params.grad).copy()
    opt.step()
    return float(loss), grads, to_numpy(model.params.data).copy()


@pytest.fixture
def fork_joins(monkeypatch):
    """Counts the fork/joins of the kernels (calls of _on_threads with more than one share)."""
    counted = {"fork_joins": 0}
    on_threads = kernels.pool._on_threads

    def counting(calls):
        counted["fork_joins"] += len(calls) > 1
        return on_threads(calls)

    monkeypatch.setattr(kernels.pool, "_on_threads", counting)
    return counted


@needs_numba
@DTYPES
@pytest.mark.parametrize("attention", ["dense", "tiled"])
def test_every_kernel_split_over_threads_equals_the_reference(rng, monkeypatch, fork_joins,
                                                                dtype, attention):
    """With the thresholds at 1 and 3 threads, every kernel of a decoder step (products, row
    shares, the causal softmax split over queries, partial sums of the norms' parameter
    gradients, the embedding's column shares, AdamW) runs in uneven shares on the pool, and
    the step equals the reference's: float64 to 1e-12; float32 to 2e-5 (one step of AdamW
    moves each weight by about lr = 1e-2 times a ratio m / sqrt(v) that float32 rounding of
    g changes by a few 1e-7 relative, and the loss's own float32 rounding is 1e-7)."""
    monkeypatch.setattr(kernels.pool, "MIN_GEMM_FLOPS_PER_THREAD", 1)
    monkeypatch.setattr(kernels.pool, "MIN_ELEMENTS_PER_THREAD", 1)
    monkeypatch.setattr(kernels.pool, "MIN_STREAM_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(kernels.pool, "_threads", lambda: 3)
    cfg = dict(vocab_size=13, max_seq_len=9, d_model=12, n_layers=2, n_heads=3, dtype=dtype)
    ids = asarray(rng.integers(0, 13, size=(2, 9)), "int64")
    targets = asarray(rng.integers(0, 13, size=(2, 9)), "int64")
    fast = _step_grads(cfg, ids, targets, attention)
    assert fork_joins["fork_joins"] > 20               # the shares really ran on the pool
    with kernels.disabled():
        reference = _step_grads(cfg, ids, targets, attention)
    tol = 1e-12 if dtype == "float64" else 2e-5
    assert abs(fast[0] - reference[0]) <= tol * abs(reference[0])
    assert rel(fast[1], reference[1]) <= tol
    assert rel(fast[2], reference[2]) <= tol


@needs_numba
@pytest.mark.parametrize("s_q", [1, 5])
def test_causal_softmax_split_over_queries(rng, monkeypatch, s_q):
    """One matrix (R = 1) shared among 3 threads by query rows: each share's causal limit is
    shifted by the row it starts at."""
    monkeypatch.setattr(kernels.pool, "MIN_ELEMENTS_PER_THREAD", 1)
    monkeypatch.setattr(kernels.pool, "_threads", lambda: 3)
    z = randn(rng, (1, 1, s_q, 7), "float64")
    dA = randn(rng, (1, 1, s_q, 7), "float64")
    A = kernels.attention_softmax_(z.copy(), 0.5, True)
    with kernels.disabled():
        hidden = np.arange(7)[None, :] > np.arange(s_q)[:, None] + 7 - s_q
        mask = np.where(hidden, -np.inf, 0.0)             # [S_q, S_k], keys past i + S_k - S_q
        A_ref, _ = ops.softmax_forward(0.5 * z, mask)
    assert rel(A, A_ref) <= 1e-12
    dz = kernels.attention_softmax_backward_(dA.copy(), A, 0.5, True)
    assert rel(dz, 0.5 * A_ref * (dA - (dA * A_ref).sum(-1, keepdims=True))) <= 1e-12


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_an_op_forks_only_when_each_share_is_worth_a_fork_join(monkeypatch, fork_joins, dtype):
    """At 2 threads a product is split only when each half has MIN_GEMM_FLOPS_PER_THREAD
    flops, an element-wise op only when each half has MIN_ELEMENTS_PER_THREAD elements (an
    op at memory speed, as the residual sum, MIN_STREAM_BYTES_PER_THREAD bytes); the tiny
    benchmark step then splits its products, attention and GELU."""
    from tfcore import bench

    monkeypatch.setattr(kernels.pool, "_threads", lambda: 2)
    rows = kernels.pool.MIN_GEMM_FLOPS_PER_THREAD // (2 * 64 * 64)  # [rows, 64] @ [64, 64]
    w = np.ones((64, 64), dtype=dtype)
    for n, splits in ((2 * rows - 1, 0), (2 * rows, 1)):
        fork_joins["fork_joins"] = 0
        kernels.matmul(np.ones((n, 64), dtype=dtype), w)
        assert fork_joins["fork_joins"] == splits, (n, fork_joins)
    half = kernels.pool.MIN_ELEMENTS_PER_THREAD
    for n, splits in ((2 * half - 1, 0), (2 * half, 1)):
        fork_joins["fork_joins"] = 0
        kernels.gelu_forward(np.ones(n, dtype=dtype), "tanh")
        assert fork_joins["fork_joins"] == splits, (n, fork_joins)
    rows = kernels.pool.MIN_STREAM_BYTES_PER_THREAD // np.dtype(dtype).itemsize // 64
    for n, splits in ((2 * rows - 1, 0), (2 * rows, 1)):          # [n, 64] + [n, 64]
        fork_joins["fork_joins"] = 0
        kernels.add(np.ones((n, 64), dtype=dtype), np.ones((n, 64), dtype=dtype))
        assert fork_joins["fork_joins"] == splits, (n, fork_joins)
    fork_joins["fork_joins"] = 0
    cfg, batch, seq = bench.decoder_config("tiny", dtype, tiled=True)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(batch, seq + 1))
    bench.TfcoreStep(cfg, tokens[:, :-1], tokens[:, 1:])()
    per_layer = 4 + 2 + 4 + 2      # products forward, attention, each backward (dx || dW), GELU
    assert fork_joins["fork_joins"] >= cfg.n_layers * per_layer, fork_joins


@needs_numba
def test_a_worker_error_reaches_the_caller():
    def fail():
        raise RuntimeError("worker failed")

    done = []
    with pytest.raises(RuntimeError, match="worker failed"):
        kernels.pool._on_threads([(done.append, (1,)), (fail, ())])
    assert done == [1]
    assert kernels.pool._bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert kernels.pool._parts(10 * 2 ** 17, 2 ** 17, 4, threads=2) == 2
    assert kernels.pool._parts(2 ** 17 - 1, 2 ** 17, 4, threads=2) == 1


@needs_numba
def test_tiled_gradient_of_the_fused_qkv_needs_no_copy(rng):
    """The tiled backward writes dq, dk, dv into one [B, S, 3, H, D_h] buffer, so the fused
    projection's gradient is that buffer (no copy), equal to the reference's."""
    qkv = randn(rng, (2, 70, 3 * 8), "float64")
    q, k, v = F.qkv_split(qkv, 2)
    dout = randn(rng, (2, 2, 70, 4), "float64")
    _, cache = ops.tiled_attention_forward(q, k, v, causal=True, block_size=16)
    grads = ops.tiled_attention_backward(dout, cache)
    dqkv = ops.qkv_merge_grads(*grads)
    assert np.shares_memory(dqkv, grads[0]) and np.shares_memory(dqkv, grads[2])
    with kernels.disabled():
        reference = ops.qkv_merge_grads(*ops.tiled_attention_backward(dout, cache))
    assert rel(dqkv, reference) <= 1e-12


@needs_numba
@DTYPES
def test_fused_tanh_gelu_is_the_reference_to_the_last_bit(rng, monkeypatch, dtype):
    """The two fused loops around NumPy's tanh make the reference's operations in its order
    and dtype: forward and backward equal the reference and the one-pass-per-operation
    chunks bit for bit, at ordinary values and at 0, huge, infinite and nan inputs."""
    x = randn(rng, (3, 40000), dtype, 3.0)                   # crosses chunk boundaries
    huge = np.finfo(dtype).max
    x.reshape(-1)[:8] = [0.0, -0.0, 1e19, -huge, huge, np.inf, -np.inf, np.nan]
    dy = randn(rng, (3, 40000), dtype)
    results = {}
    with np.errstate(all="ignore"):
        for fused in (True, False):
            monkeypatch.setattr(kernels.elementwise, "FUSED_GELU", fused)
            y, cache = ops.gelu_forward(x, "tanh")
            results[fused] = (y, ops.gelu_backward(dy, cache))
        with kernels.disabled():
            y, cache = ops.gelu_forward(x, "tanh")
            reference = (y, ops.gelu_backward(dy, cache))
    for fast, slow, ref in zip(results[True], results[False], reference):
        assert np.array_equal(fast, ref, equal_nan=True)
        assert np.array_equal(slow, ref, equal_nan=True)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("attention, norm, mlp", [("tiled", "layernorm", "gelu"),
                                                  ("dense", "rmsnorm", "relu"),
                                                  ("tiled", "layernorm", "swiglu")])
def test_the_model_shortcuts_give_the_checked_ops_results_bit_for_bit(
        rng, monkeypatch, dtype, attention, norm, mlp):
    """The decoder's hot path (nn's layer helpers and the block's steps, trusted calls of
    tfcore.ops) skips the ops' argument checks where the kernels take the arrays: loss,
    logits and every gradient must be the very numbers of the checked path
    (ops.CHECK_TRUSTED makes the trusted calls check), and the same kernels run."""
    from tfcore.models.decoder import DecoderConfig, DecoderLM

    cfg = DecoderConfig(vocab_size=37, max_seq_len=24, d_model=32, n_layers=2, n_heads=4,
                        d_ff=64, dtype=dtype, attention=attention, norm=norm, mlp=mlp)
    ids = rng.integers(0, 37, size=(3, 24))
    targets = rng.integers(0, 37, size=(3, 24))

    def run():
        model = DecoderLM(cfg).init(seed=3)
        logits, loss = model.forward(asarray(ids), asarray(targets), training=True)
        model.backward()
        return to_numpy(logits), float(loss), to_numpy(model.params.grad).copy()

    ran = []
    for op in ops.OPS:                      # count the kernels that run, op by op
        kernels_of = ops.registered(op)
        monkeypatch.setitem(ops._KERNELS, op, tuple(
            ops.Kernel(lambda *a, _run=k.run, _op=op, **kw: ran.append(_op) or _run(*a, **kw),
                       k.applies) for k in kernels_of))
    fast = run()
    fast_ran, ran[:] = list(ran), []
    monkeypatch.setattr(ops, "CHECK_TRUSTED", True)
    checked = run()
    assert ran == fast_ran and {"tiled_attention_forward" if attention == "tiled"
                                else "attention_forward", "residual_backward",
                                "dropout_forward", "dropout_backward", "add"} < set(ran)
    assert np.array_equal(fast[0], checked[0])
    assert fast[1] == checked[1]
    assert np.array_equal(fast[2], checked[2])


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_the_backward_frees_the_mlp_cache_before_the_attention_runs(monkeypatch, placement):
    """Memory: each block hands its sublayers' caches over, so the MLP's hidden activation
    [B, S, F] of a layer is freed before that layer's attention backward starts."""
    import weakref

    from tfcore.models import blocks
    from tfcore.models.decoder import DecoderConfig, DecoderLM

    cfg = DecoderConfig(vocab_size=29, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                        attention="tiled", norm_placement=placement)
    model = DecoderLM(cfg).init(seed=0)
    ids = np.arange(32).reshape(2, 16) % 29
    model.forward(asarray(ids), asarray(ids))
    hidden = [weakref.ref(c.block.ffn.proj.x) for c in model._cache.blocks]
    seen = []
    attention_backward = blocks.attention_sublayer_backward

    def watched(params, prefix, dout, cache, spec, parts):
        seen.append(hidden[int(prefix[1:].split(".")[0])]() is None)
        return attention_backward(params, prefix, dout, cache, spec, parts)

    monkeypatch.setattr(blocks, "attention_sublayer_backward", watched)
    model.backward()
    assert seen == [True, True]


def test_the_forward_frees_each_block_input_once_its_residual_sum_has_read_it(monkeypatch):
    """Memory: the decoder hands each block its input, so the residual stream entering a
    pre-norm block [B, S, D] (read by the first norm, which keeps xhat, and by the residual
    sum) is freed by the time the block's MLP runs, and none is kept by the caches. (In a
    post-norm block the input is the qkv projection's input, which its cache keeps.)"""
    import weakref

    from tfcore.models import blocks
    from tfcore.models.decoder import DecoderConfig, DecoderLM

    cfg = DecoderConfig(vocab_size=29, max_seq_len=16, d_model=32, n_layers=3, n_heads=4,
                        attention="tiled")
    model = DecoderLM(cfg).init(seed=0)
    ids = np.arange(32).reshape(2, 16) % 29
    skips, alive_at_mlp = [], []
    add, ffn_forward = blocks._add, blocks._ffn_forward

    def watched_add(x, fx):
        skips.append(weakref.ref(x))
        return add(x, fx)

    def watched_ffn(*args, **kwargs):
        alive_at_mlp.append(skips[-1]() is not None)       # the block's first sum's skip
        return ffn_forward(*args, **kwargs)

    monkeypatch.setattr(blocks, "_add", watched_add)
    monkeypatch.setattr(blocks, "_ffn_forward", watched_ffn)
    model.forward(asarray(ids), asarray(ids))
    assert alive_at_mlp == [False, False, False]
    assert all(ref() is None for ref in skips)                 # nor kept by the caches


def test_the_backward_frees_the_head_and_loss_caches_before_the_blocks_run():
    """Memory: the final norm's xhat and output [B, S, D] and the loss's probabilities
    [B, S, V] (the logits' gradient, written over them) are freed when the head's backward
    ends, not held through the blocks' backward by the forward's cache."""
    import weakref

    from tfcore.models.decoder import DecoderConfig, DecoderLM

    cfg = DecoderConfig(vocab_size=29, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
    model = DecoderLM(cfg).init(seed=0)
    ids = np.arange(32).reshape(2, 16) % 29
    model.forward(asarray(ids), asarray(ids))
    c_lnf, c_linear = model._cache.head
    watched = [weakref.ref(c_lnf.xhat), weakref.ref(c_linear.x),
               weakref.ref(model._cache.loss.probs)]
    del c_lnf, c_linear
    alive = {}
    model.backward(after_unit=lambda unit: alive.setdefault(
        unit, [ref() is not None for ref in watched]))
    assert alive["head"] == [False, False, False]
    assert model._cache is None


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_optimizer_finiteness_check_without_a_temporary(bad, dtype):
    """AdamW's check of the gradient (max and min, no [P] boolean array) refuses every nan
    or inf wherever it lies, and takes any finite gradient, however large."""
    from tfcore import nn

    params = nn.Parameters({"w": (5, 7)}, dtype)
    opt = optim.AdamW(params, skip_nonfinite=True)
    params.grad[...] = np.finfo(dtype).max
    params.grad[3] = -np.finfo(dtype).max
    opt.step()
    assert opt.skipped == 0 and opt.t == 1
    for where in (0, 17, 34):
        params.grad[...] = 1.0
        params.grad[where] = bad
        opt.step()
    assert opt.skipped == 3 and opt.t == 1


@needs_numba
@DTYPES
def test_the_vectorized_exp_matches_numpy_to_a_few_units_in_the_last_place(dtype):
    """exp_rows_into (the attention's and cross-entropy's exp): within 4 ulp of NumPy's exp
    over the range it serves, x * mul - sub as the argument, clamped below (no subnormal
    result) and above (no overflow), NaN kept, and only the first `limit` entries touched."""
    from numba import njit

    from tfcore.kernels import _numba

    @njit
    def exp_rows(row, limit, mul, sub):
        _numba.exp_rows_into(row, limit, mul, sub)

    kind = np.dtype(dtype).type
    floor, ceiling = {"float64": (-708.0, 709.0), "float32": (-87.0, 88.0)}[dtype]
    x = np.concatenate([np.linspace(floor, ceiling, 200001),
                        [0.0, -0.0, -1e-30, 1e-30, np.log(2.0), -np.log(2.0)]]).astype(dtype)
    got = x.copy()
    exp_rows(got, got.size, kind(1.0), kind(0.0))
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(np.abs(want).astype(dtype)).astype(np.float64)
    assert np.max(np.abs(got.astype(np.float64) - want) / ulp) <= 4
    shifted = x[:1000].copy()                                   # x * mul - sub
    exp_rows(shifted, shifted.size, kind(0.5), kind(-1.0))
    want = np.exp(x[:1000].astype(np.float64) * 0.5 + 1.0)
    assert np.max(np.abs(shifted / want - 1.0)) <= 8 * np.finfo(dtype).eps
    edges = np.array([-np.inf, -1e30, 1e30, np.nan, 7.0], dtype=dtype)
    exp_rows(edges, 4, kind(1.0), kind(0.0))
    tiny, huge = np.exp(np.float64(floor)), np.exp(np.float64(ceiling))
    assert edges[0] == edges[1] and abs(edges[0] / tiny - 1) < 1e-5      # clamped below
    assert np.isfinite(edges[2]) and abs(edges[2] / huge - 1) < 1e-5     # clamped above
    assert np.isnan(edges[3]) and edges[4] == 7.0                        # NaN; past limit


@needs_numba
@DTYPES
def test_cross_entropy_backward_can_overwrite_the_probabilities(rng, dtype):
    """overwrite=True: the same dlogits, written over the cache's probabilities (the label's
    entry read before its row is overwritten); an ignored row is 0 either way."""
    logits = randn(rng, (3, 5, 7), dtype)
    labels = rng.integers(0, 7, size=(3, 5))
    labels[1, 2] = -100
    _, cache = ops.cross_entropy_forward(logits, labels)
    fresh = ops.cross_entropy_backward(0.5, cache)
    spent = ops.cross_entropy_backward(0.5, cache, overwrite=True)
    assert np.shares_memory(spent, cache[0])
    assert np.array_equal(spent, fresh) and not spent[1, 2].any()
    with kernels.disabled():
        _, cache = ops.cross_entropy_forward(logits, labels)
        assert rel(ops.cross_entropy_backward(0.5, cache, overwrite=True), fresh) <= 1e-6
    with pytest.raises(TypeError, match="overwrite must be True or False"):
        ops.cross_entropy_backward(0.5, cache, overwrite="yes")


@needs_numba
@DTYPES
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_backward_can_overwrite_its_input(rng, monkeypatch, dtype, threads):
    """overwrite_x=True: the same dx, dW, db (dW made from x before dx is written over x),
    on one thread and on two (where dx and dW otherwise run side by side)."""
    monkeypatch.setattr(kernels.pool, "_threads", lambda: threads)
    monkeypatch.setattr(kernels.pool, "MIN_GEMM_FLOPS_PER_THREAD", 1)
    x, W = randn(rng, (3, 40, 24), dtype), randn(rng, (24, 16), dtype)
    dy = randn(rng, (3, 40, 16), dtype)
    fresh = kernels.linear_backward(dy, x, W, True)
    spent = kernels.linear_backward(dy, x.copy(), W, True, overwrite_x=True)
    x_again = x.copy()
    shared = kernels.linear_backward(dy, x_again, W, True, overwrite_x=True)
    assert np.shares_memory(shared[0], x_again)
    for a, b in zip(spent, fresh):
        assert np.array_equal(a, b)



@needs_numba
@DTYPES
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("overwrite", [False, True])
def test_linear_backward_adds_into_the_gradients_it_is_given(rng, monkeypatch, dtype,
                                                              threads, has_bias, overwrite):
    """grads=(gW, gb): dW and db are added into gW and gb (what was there is kept) and not
    returned; dx is the same as without grads. The additions run inside the threads'
    shares (of the two products side by side, or of dW's rows when dx overwrites x)."""
    monkeypatch.setattr(kernels.pool, "_threads", lambda: threads)
    monkeypatch.setattr(kernels.pool, "MIN_GEMM_FLOPS_PER_THREAD", 1)
    x, W = randn(rng, (3, 40, 24), dtype), randn(rng, (24, 16), dtype)
    dy = randn(rng, (3, 40, 16), dtype)
    dx, dW, db = kernels.linear_backward(dy, x, W, has_bias)
    gW, gb = randn(rng, (24, 16), dtype), randn(rng, (16,), dtype)
    gW_before, gb_before = gW.copy(), gb.copy()
    out = kernels.linear_backward(dy, x.copy(), W, has_bias, overwrite_x=overwrite,
                                  grads=(gW, gb if has_bias else None))
    assert out[1] is None and out[2] is None
    assert np.array_equal(out[0], dx)
    assert np.array_equal(gW, gW_before + dW)
    if has_bias:
        assert np.array_equal(gb, gb_before + db)
    else:
        assert db is None and np.array_equal(gb, gb_before)


@needs_numba
@DTYPES
@pytest.mark.parametrize("threads", [1, 2])
def test_add_and_matmul_into_split_over_threads(rng, monkeypatch, dtype, threads):
    """kernels.add(a, b) is a + b in a new array (the same bits: each element is one
    addition, on whichever thread), and matmul(a, b, into=c) adds the out it writes into c."""
    monkeypatch.setattr(kernels.pool, "_threads", lambda: threads)
    monkeypatch.setattr(kernels.pool, "MIN_STREAM_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(kernels.pool, "MIN_GEMM_FLOPS_PER_THREAD", 1)
    a, b = randn(rng, (5, 7, 3), dtype), randn(rng, (5, 7, 3), dtype)
    total = kernels.add(a, b)
    assert not np.shares_memory(total, a) and not np.shares_memory(total, b)
    assert np.array_equal(total, a + b)
    x, w, c = randn(rng, (9, 4), dtype), randn(rng, (4, 6), dtype), randn(rng, (9, 6), dtype)
    c_before, out = c.copy(), np.empty((9, 6), dtype)
    kernels.matmul(x, w, out=out, into=c)
    assert np.allclose(out, x @ w, rtol=1e-5, atol=1e-5)
    assert np.array_equal(c, c_before + out)


@needs_numba
def test_an_idle_worker_holds_no_reference_to_the_last_call():
    """Once a fork/join is done, the arrays of its shares are freed with the caller's
    references (a worker that kept its last call's arguments kept a [B, H, S, S] score
    matrix alive between steps)."""
    import gc
    import weakref

    data = np.ones(1000)
    alive = weakref.ref(data)
    kernels.pool._on_threads([(np.sum, (data[:500],)), (np.sum, (data[500:],))])
    del data
    gc.collect()
    assert alive() is None



@needs_numba
@DTYPES
def test_a_product_on_the_worker_has_the_bits_of_the_same_product_in_python(rng, monkeypatch,
                                                                            dtype):
    """The worker runs a share of a product from compiled code through the BLAS NumPy calls,
    with NumPy's own arguments: the same bits as np.matmul on that share, whatever the
    layout (transposed operands, a bias, an accumulation into another array), and shares
    BLAS would not take as they lie go to the worker as Python calls."""
    monkeypatch.setattr(kernels.pool, "_threads", lambda: 2)
    monkeypatch.setattr(kernels.pool, "MIN_GEMM_FLOPS_PER_THREAD", 1)
    kernels.pool._sp()
    if not kernels.pool._gemm_addresses:
        pytest.skip("NumPy's BLAS has no 64-bit-integer C interface here")
    x, w = randn(rng, (37, 19), dtype), randn(rng, (19, 23), dtype)
    bias, into = randn(rng, (23,), dtype), randn(rng, (37, 23), dtype)
    cases = [(x, w), (randn(rng, (19, 37), dtype).T, w), (x, randn(rng, (23, 19), dtype).T),
             (x[:, ::2], w[::2])]                      # no unit stride: a Python call
    slots = np.zeros_like(kernels.pool._thread_pool(2)[0].args)
    assert kernels.pool._product_args(slots, *cases[1], np.empty((37, 23), dtype))
    assert not kernels.pool._product_args(slots, *cases[3], np.empty((37, 23), dtype))
    for a, b in cases:
        results = []
        for native in (True, False):
            if not native:
                monkeypatch.setattr(kernels.pool, "_gemm_addresses", ())
            acc = into.copy()
            out = kernels.matmul(a, b, bias=bias, into=acc)
            results.append((out, acc))
        (out, acc), (out_py, acc_py) = results
        assert np.array_equal(out, out_py) and np.array_equal(acc, acc_py)
        half = a.shape[0] // 2
        assert np.array_equal(out[half:], np.matmul(a[half:], b) + bias)
        assert np.array_equal(acc, into + out)
        monkeypatch.undo()
        monkeypatch.setattr(kernels.pool, "_threads", lambda: 2)
        monkeypatch.setattr(kernels.pool, "MIN_GEMM_FLOPS_PER_THREAD", 1)


@needs_numba
@pytest.mark.parametrize("spin_cycles", [0, 2 ** 20])
def test_the_worker_and_its_caller_wake_each_other_from_sleep(monkeypatch, spin_cycles):
    """Without polling (SPIN_CYCLES = 0) every hand-over goes through the semaphores, and
    with polling a share longer than the poll puts the caller to sleep: either way each
    share runs once and the fork/join returns (a lost wake-up would leave it waiting)."""
    import threading
    import time

    monkeypatch.setattr(kernels.pool, "SPIN_CYCLES", spin_cycles)
    monkeypatch.setattr(kernels.pool, "MIN_GEMM_FLOPS_PER_THREAD", 1)
    ran, products = [], []

    def hand_overs():
        for pause in (0.0, 0.02, 0.0, 0.03):
            kernels.pool._on_threads([(ran.append, ("caller",)),
                                      (lambda p=pause: (time.sleep(p), ran.append("worker")),
                                       ())])
            time.sleep(0.01)                             # the worker goes idle, then sleeps
        a, b = np.ones((64, 32)), np.full((32, 48), 2.0)
        for pause in (0.0, 0.01) * 10:                   # products: compiled on the worker
            products.append(kernels.blas._split_matmul(a, b, np.empty((64, 48)), 0, 2))
            time.sleep(pause)

    runner = threading.Thread(target=hand_overs, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "a fork/join never returned"
    assert ran.count("caller") == 4 and ran.count("worker") == 4
    assert len(products) == 20
    assert all(np.array_equal(out, np.full((64, 48), 64.0)) for out in products)


_ROW_KERNELS = """
import sys
import numpy as np
from tfcore import kernels
rng = np.random.default_rng(5)
out = {}
for dtype in ("float32", "float64"):
    x = (rng.standard_normal((37, 203)) * 3 + 1).astype(dtype)
    g, b = rng.standard_normal(203).astype(dtype), rng.standard_normal(203).astype(dtype)
    y, cache = kernels.layernorm_forward(x, g, b, 1e-5)
    dx, dg, db = kernels.layernorm_backward(y, cache)
    r, rcache = kernels.rmsnorm_forward(x, g, 1e-5)
    labels = rng.integers(0, 203, 37)
    probs, total = kernels.cross_entropy_forward(x, labels, labels >= 0)
    out.update({f"{dtype}-{k}": v for k, v in dict(y=y, dx=dx, dg=dg, db=db, r=r,
                                                   rrms=rcache[1], probs=probs,
                                                   total=np.array(total)).items()})
np.savez(sys.argv[1], **out)
"""


@needs_numba
def test_row_kernels_give_the_same_bits_on_another_cpu(tmp_path):
    """The norms' and cross-entropy's sums (and the vectorized exp) are compiled for an AVX2
    CPU in a second process (tools/other-cpu.sh's settings): every result must equal this
    machine's bit for bit, whatever SIMD width each compiled for (the sums fix the order of
    their additions in the source)."""
    env_lines = subprocess.run(["bash", "tools/other-cpu.sh"], capture_output=True, text=True,
                               check=True).stdout.split()
    other = dict(os.environ, **dict(line.split("=", 1) for line in env_lines),
                 NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    here = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache-here"))
    results = {}
    for name, env in (("here", here), ("other", other)):
        path = tmp_path / f"{name}.npz"
        subprocess.run([sys.executable, "-c", _ROW_KERNELS, str(path)], env=env, check=True,
                       timeout=300)
        results[name] = dict(np.load(path))
    assert results["here"].keys() == results["other"].keys() and results["here"]
    for key, value in results["here"].items():
        assert np.array_equal(value, results["other"][key]), key
