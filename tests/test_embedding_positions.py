"""Embedding lookup, learned positions and the sinusoidal table (float64)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close, check_gradients, random_upstream

pytestmark = pytest.mark.usefixtures("backend_name")


def _one_hot(ids: np.ndarray, vocab: int) -> np.ndarray:
    return (ids.reshape(-1)[:, None] == np.arange(vocab)[None, :]).astype(np.float64)  # [N, V]


# --------------------------------------------------------------------------------------
# Embedding


@pytest.mark.parametrize("shape, vocab, width", [((2, 3), 5, 4), ((2, 1), 4, 3), ((3, 2), 3, 1)],
                         ids=["B2-S3-D4", "S=1", "D=1"])
def test_embedding_forward_is_one_hot_matmul(rng, shape, vocab, width):
    ids = rng.integers(0, vocab, size=shape)
    W = rng.standard_normal((vocab, width))
    x, _ = F.embedding_forward(asarray(ids, "int64"), asarray(W))
    assert tuple(x.shape) == shape + (width,)
    assert_close("x", x, (_one_hot(ids, vocab) @ W).reshape(shape + (width,)), tol=0.0)


@pytest.mark.parametrize("shape, vocab, width", [((2, 3), 5, 4), ((2, 1), 4, 3), ((3, 2), 3, 1)],
                         ids=["B2-S3-D4", "S=1", "D=1"])
def test_embedding_gradient(rng, shape, vocab, width):
    ids_host = rng.integers(0, vocab, size=shape)
    ids = asarray(ids_host, "int64")
    W = rng.standard_normal((vocab, width))
    x, cache = F.embedding_forward(ids, asarray(W))
    G = random_upstream(tuple(x.shape), rng)
    dW = F.embedding_backward(asarray(G), cache)
    assert tuple(dW.shape) == (vocab, width)
    check_gradients(lambda W: F.embedding_forward(ids, W)[0], {"W": W}, {"W": dW}, G)


def test_embedding_backward_sums_repeated_ids(rng):
    """dW = one_hot(ids)^T @ dx: a repeated id accumulates every one of its rows; an unused id gets 0."""
    vocab, width = 6, 4
    ids_host = np.array([[1, 3, 1, 1], [3, 0, 1, 3]])  # 1 four times, 3 three times; 2, 4, 5 never
    W = rng.standard_normal((vocab, width))
    x, cache = F.embedding_forward(asarray(ids_host, "int64"), asarray(W))
    G = random_upstream(tuple(x.shape), rng)
    dW = F.embedding_backward(asarray(G), cache)
    expected = _one_hot(ids_host, vocab).T @ G.reshape(-1, width)
    assert_close("dW", dW, expected)
    assert np.all(to_numpy(dW)[[2, 4, 5]] == 0.0)
    check_gradients(lambda W: F.embedding_forward(asarray(ids_host, "int64"), W)[0], {"W": W}, {"W": dW}, G)


# --------------------------------------------------------------------------------------
# Learned positions


@pytest.mark.parametrize("extra", [0, 1, 3], ids=["S==S_max", "S_max=S+1", "S_max=S+3"])
def test_positional_forward_and_gradients(rng, extra):
    batch, seq, width = (int(n) for n in rng.integers(1, 4, size=3))
    x = rng.standard_normal((batch, seq, width))
    P = rng.standard_normal((seq + extra, width))
    y, cache = F.positional_forward(asarray(x), asarray(P))
    assert_close("y", y, x + P[None, :seq, :], tol=0.0)
    G = random_upstream(tuple(y.shape), rng)
    dx, dP = F.positional_backward(asarray(G), cache)
    assert tuple(dP.shape) == P.shape
    assert np.all(to_numpy(dP)[seq:] == 0.0)  # rows beyond S get exactly nothing
    assert_close("dP[:S]", to_numpy(dP)[:seq], G.sum(axis=0))
    check_gradients(lambda x, P: F.positional_forward(x, P)[0], {"x": x, "P": P}, {"x": dx, "P": dP}, G)


@pytest.mark.parametrize("batch, seq, width", [(2, 1, 4), (2, 3, 1)], ids=["S=1", "D=1"])
def test_positional_edge_shapes(rng, batch, seq, width):
    x = rng.standard_normal((batch, seq, width))
    P = rng.standard_normal((seq + 2, width))
    y, cache = F.positional_forward(asarray(x), asarray(P))
    G = random_upstream(tuple(y.shape), rng)
    dx, dP = F.positional_backward(asarray(G), cache)
    check_gradients(lambda x, P: F.positional_forward(x, P)[0], {"x": x, "P": P}, {"x": dx, "P": dP}, G)


# --------------------------------------------------------------------------------------
# Sinusoidal table


@pytest.mark.parametrize("length, width", [(7, 8), (5, 7), (1, 4), (4, 1), (50, 16)])
def test_sinusoidal_table_matches_formula(length, width):
    """P[p, 2i] = sin(p / 10000^(2i/D)), P[p, 2i+1] = cos(p / 10000^(2i/D)), entry by entry."""
    P = to_numpy(F.sinusoidal_positions(length, width))
    assert P.shape == (length, width) and P.dtype == np.float64
    expected = np.empty((length, width))
    for p in range(length):
        for j in range(width):
            i2 = j - j % 2  # the even index 2i shared by the pair (2i, 2i+1)
            angle = p / 10000.0 ** (i2 / width)
            expected[p, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    assert_close("P", P, expected, tol=1e-14)
    assert np.all(P[0, 0::2] == 0.0) and np.all(P[0, 1::2] == 1.0)  # position 0: sin 0, cos 0


def test_sinusoidal_table_other_base_and_float32():
    P64 = to_numpy(F.sinusoidal_positions(6, 4, base=100.0))
    angle = np.arange(6)[:, None] / 100.0 ** (np.array([0, 2]) / 4)[None, :]
    assert_close("P", P64[:, 0::2], np.sin(angle), tol=1e-14)
    assert_close("P", P64[:, 1::2], np.cos(angle), tol=1e-14)
    P32 = to_numpy(F.sinusoidal_positions(6, 4, dtype="float32", base=100.0))
    assert P32.dtype == np.float32
    assert_close("P32", P32, P64, tol=1e-7)


def test_causal_mask_values():
    for length in (1, 4):
        mask = to_numpy(F.causal_mask(length))
        expected = np.where(np.arange(length)[None, :] > np.arange(length)[:, None], -np.inf, 0.0)
        assert mask.dtype == np.float64
        assert np.array_equal(mask, expected)


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8"])
def test_embedding_accepts_every_integer_dtype(rng, dtype):
    """Ids are integers in [0, V) whatever their integer dtype: byte ids (uint8) with a byte
    vocabulary V = 256, or int8 ids below 128 with the same vocabulary, are valid input."""
    vocab, width = 256, 3
    ids_host = rng.integers(0, 128, size=(2, 5))
    ids_host[0, :2] = [0, 127]
    W = rng.standard_normal((vocab, width))
    x, cache = F.embedding_forward(asarray(ids_host, dtype), asarray(W))
    assert_close("x", x, W[ids_host], tol=0.0)
    G = random_upstream(tuple(x.shape), rng)
    dW = F.embedding_backward(asarray(G), cache)
    assert_close("dW", dW, _one_hot(ids_host, vocab).T @ G.reshape(-1, width))
