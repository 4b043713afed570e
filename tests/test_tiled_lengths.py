"""Tiled attention at lengths that cross every internal threshold, against the dense op.

The fused kernel (tfcore.kernels._tiled) takes the queries in blocks of BLOCK = 64 rows and
meets each block's keys in spans of up to SPAN = 1024 columns: the running sums are rescaled
by exp(m_old - m_new) only from a block's second span on, that is past 1024 keys. Its
backward takes the keys in blocks of 64 and their queries in spans of BACKWARD_SPAN = 128:
dk and dv add over spans only past 128 queries. Its Python loops also take the batch a few
rows at a time (SCRATCH elements of scores). The reference op (kernels disabled) rescales
from the second key tile on and masks the tiles that cross the causal diagonal.

So the lengths here are 257 and 600 (three and five backward spans, the last partial), 1031
(one key past a forward span, odd, no multiple of 64), 2100 (three forward spans, the last
partial) and S_q != S_k (the causal offset), every one against chapter 6's dense op in
float64 at 1e-12: an omitted rescale misses by order 1.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tfcore import backend, kernels
from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.functional.tiled_attention import dropout_keep
from tfcore.gradcheck import assert_close
from tfcore.kernels import _tiled

TOL = 1e-12
LENGTHS = [(257, 257), (600, 600), (1031, 1031), (2100, 2100), (301, 1031)]  # (S_q, S_k)


def _inputs(rng, b, h, s_q, s_k, d_h=8, d_v=8):
    """q [b, h, S_q, D_h], k [b, h, S_k, D_h], v [b, h, S_k, D_v], dout [b, h, S_q, D_v]:
    scaled scores of standard deviation 3, so a row's maximum still moves in later spans."""
    q, k = (math.sqrt(3.0) * rng.standard_normal((b, h, s, d_h)) for s in (s_q, s_k))
    return q, k, rng.standard_normal((b, h, s_k, d_v)), rng.standard_normal((b, h, s_q, d_v))


def _dense(q, k, v, dout, **kw):
    """Chapter 6's dense op, reference path: out, (dq, dk, dv)."""
    with kernels.disabled():
        out, cache = F.attention_forward(q, k, v, training=False, **kw)
        return out, F.attention_backward(dout, cache)


def _lse(q, k, causal):
    z = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s_q, s_k = z.shape[-2:]
        z = np.where(np.arange(s_k)[None] > np.arange(s_q)[:, None] + s_k - s_q, -np.inf, z)
    top = z.max(-1)
    return top + np.log(np.exp(z - top[..., None]).sum(-1))


def _assert_all(label, got, want):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(f"{label} {name}", g, w, tol=TOL)


# --------------------------------------------------------------------------------------
# The fused kernel: compiled shares and Python loops, one thread and two


@pytest.fixture(params=[True, False], ids=["compiled", "python-loops"])
def compiled(request, monkeypatch):
    assert kernels.available(), "Numba is not installed: run `make setup` (requirements.txt)"
    monkeypatch.setattr(_tiled, "COMPILED", request.param)
    assert bool(_tiled._compiled(np.dtype("float64"))) == request.param
    return request.param


def test_the_thresholds_are_the_ones_these_lengths_cross():
    """If the kernel's blocks change, these lengths must be chosen again."""
    assert (_tiled.BLOCK, _tiled.SPAN, _tiled.SCRATCH) == (64, 1024, 2 ** 17)
    assert _tiled.BACKWARD_SPAN == 128
    s_q, s_k = LENGTHS[2]
    assert s_k == _tiled.SPAN + 7 and s_k % _tiled.BLOCK and s_q % 2
    assert 2 * _tiled.SPAN < LENGTHS[3][1] < 3 * _tiled.SPAN      # a third, partial span
    assert LENGTHS[0][0] > 2 * _tiled.BACKWARD_SPAN      # a third, one-query span


@pytest.mark.parametrize("causal, s_q, s_k",
                         [(c, s_q, s_k) for c in (False, True) for s_q, s_k in LENGTHS]
                         + [(False, 1031, 600)])        # more queries than keys: not causal
def test_kernel_equals_the_dense_op_across_spans(rng, compiled, causal, s_q, s_k):
    q, k, v, dout = _inputs(rng, 1, 2, s_q, s_k)
    scale = 1.0 / math.sqrt(q.shape[-1])
    threads = 2 if s_q == 600 else 1                 # the two shares of the heads, too
    out, lse = kernels.tiled_attention_forward(q, k, v, causal, scale, threads=threads)
    grads = kernels.tiled_attention_backward(dout, q, k, v, out, lse, causal, scale,
                                             threads=threads)
    want_out, want_grads = _dense(q, k, v, dout, causal=causal)
    _assert_all(f"kernel S_q={s_q} S_k={s_k}", (out, *grads), (want_out, *want_grads))
    assert_close("lse", lse, _lse(q, k, causal), tol=TOL)


def test_kernel_python_loops_take_the_batch_in_chunks(rng, monkeypatch):
    """Batch rows of [H, BLOCK, SPAN] scores beyond SCRATCH go in several chunks."""
    monkeypatch.setattr(_tiled, "COMPILED", False)
    b, h, s = 3, 3, 300
    assert b * h * _tiled.BLOCK * _tiled.SPAN > _tiled.SCRATCH
    q, k, v, dout = _inputs(rng, b, h, s, s)
    out, lse = kernels.tiled_attention_forward(q, k, v, True, 0.35, threads=1)
    grads = kernels.tiled_attention_backward(dout, q, k, v, out, lse, True, 0.35, threads=1)
    want_out, want_grads = _dense(q * 0.35 * math.sqrt(8), k, v, dout, causal=True)
    want_grads = (want_grads[0] * 0.35 * math.sqrt(8), *want_grads[1:])
    _assert_all("kernel, batch in chunks", (out, *grads), (want_out, *want_grads))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_op_dispatches_to_the_kernel_at_long_lengths(rng, causal):
    """F.tiled_attention_* with kernels on (the kernel) and off (the reference) agree."""
    q, k, v, dout = _inputs(rng, 1, 2, 600, 600)
    results = []
    for enabled in (True, False):
        previous = kernels.set_enabled(enabled)
        try:
            out, cache = F.tiled_attention_forward(q, k, v, causal=causal)
            results.append((out, *F.tiled_attention_backward(dout, cache)))
        finally:
            kernels.set_enabled(previous)
    want_out, want_grads = _dense(q, k, v, dout, causal=causal)
    _assert_all("kernel path", results[0], (want_out, *want_grads))
    _assert_all("reference path", results[1], (want_out, *want_grads))


# --------------------------------------------------------------------------------------
# The reference op (kernels disabled), every mask kind, on every backend

KINDS = ["none", "causal", "key padding", "additive", "all three", "dropout"]


def _mask_kwargs(rng, kind, b, h, s_q, s_k):
    kw = {}
    if kind in ("causal", "all three", "dropout"):
        kw["causal"] = True
    if kind in ("key padding", "all three"):
        pad = rng.random((b, s_k)) < 0.3
        pad[:, 0] = False                        # every query keeps key 0
        pad[0, -70:] = True                      # a whole tile of padded keys
        kw["key_padding"] = pad
    if kind in ("additive", "all three"):
        mask = rng.standard_normal((1, h, s_q, s_k))
        mask[0, 0, :, 1::7] = -math.inf          # head 0 never sees every 7th key
        kw["mask"] = mask
    return kw


@pytest.mark.usefixtures("backend_name")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("s_q, s_k", [(600, 600), (257, 1031)], ids=str)
def test_reference_op_equals_the_dense_op_for_every_mask_kind(rng, kind, s_q, s_k):
    b, h = 2, 2
    q, k, v, dout = _inputs(rng, b, h, s_q, s_k, d_h=4, d_v=4)
    kw = _mask_kwargs(rng, kind, b, h, s_q, s_k)
    moved = {n: asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    q_, k_, v_, dout_ = (asarray(x) for x in (q, k, v, dout))
    with kernels.disabled():
        if kind == "dropout":
            p = 0.2
            out, cache = F.tiled_attention_forward(q_, k_, v_, dropout_p=p,
                                                   rng=backend.default_rng(7), **moved)
        else:
            out, cache = F.tiled_attention_forward(q_, k_, v_, **moved)
        grads = F.tiled_attention_backward(dout_, cache)
    if kind != "dropout":
        want_out, want_grads = _dense(q_, k_, v_, dout_, **moved)
        _assert_all(f"reference {kind}", (out, *grads), (want_out, *want_grads))
        return
    # dropout: a dense computation with the tiled op's own keep-mask (its seed)
    keep = to_numpy(dropout_keep(cache[5]["seed"], (b, h, s_q, s_k), (0, s_q), (0, s_k), p,
                                 q_)) / (1 - p)
    z = q @ np.swapaxes(k, -1, -2) / 2.0                                  # D_h = 4
    z = np.where(np.arange(s_k)[None] > np.arange(s_q)[:, None] + s_k - s_q, -np.inf, z)
    A = np.exp(z - z.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    dA = (dout @ np.swapaxes(v, -1, -2)) * keep
    dZ = A * (dA - np.sum(dA * A, axis=-1, keepdims=True)) / 2.0
    want = ((A * keep) @ v, dZ @ k, np.swapaxes(dZ, -1, -2) @ q,
            np.swapaxes(A * keep, -1, -2) @ dout)
    assert 0.15 < 1 - np.mean(keep > 0) < 0.25                           # p of them dropped
    _assert_all("reference dropout", (out, *grads), want)
