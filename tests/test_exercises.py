"""tfcore.exercises.check_backward: right backwards pass, planted mistakes fail by name."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import erf

from tfcore.exercises import EXERCISES, check_backward, describe


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def linear_backward(G, x, W, b):
    rows_x, rows_G = x.reshape(-1, x.shape[-1]), G.reshape(-1, G.shape[-1])
    return G @ W.T, rows_x.T @ rows_G, rows_G.sum(axis=0)


def softmax_backward(G, z):
    s = _softmax(z)
    return s * (G - np.sum(G * s, axis=-1, keepdims=True))


def log_softmax_backward(G, z):
    return G - _softmax(z) * G.sum(axis=-1, keepdims=True)


def gelu_backward(G, x):
    Phi = 0.5 * (1.0 + erf(x / math.sqrt(2.0)))
    return G * (Phi + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))


def gelu_tanh_backward(G, x):
    c = math.sqrt(2.0 / math.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    return G * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x))


def relu_backward(G, x):
    return G * (x > 0)


def layernorm_backward(G, x, gamma, beta, eps):
    mu = x.mean(axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
    xhat = (x - mu) * r
    g = G * gamma
    dx = r * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = (-1, x.shape[-1])
    return dx, (G * xhat).reshape(rows).sum(0), G.reshape(rows).sum(0)


def rmsnorm_backward(G, x, gain, eps):
    rho = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xhat = x * rho
    g = G * gain
    dx = rho * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, (G * xhat).reshape(-1, x.shape[-1]).sum(0)


def cross_entropy_backward(G, logits, labels, ignore_index):
    kept = labels != ignore_index
    onehot = np.eye(logits.shape[-1])[np.where(kept, labels, 0)]
    return G * (_softmax(logits) - onehot) * kept[..., None] / kept.sum()


def attention_backward(G, q, k, v, causal):
    scale = 1.0 / math.sqrt(q.shape[-1])
    z = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        z = z + np.triu(np.full(z.shape[-2:], -np.inf), 1)
    A = _softmax(z)
    dA = G @ np.swapaxes(v, -1, -2)
    dz = A * (dA - np.sum(A * dA, axis=-1, keepdims=True)) * scale
    return dz @ k, np.swapaxes(dz, -1, -2) @ q, np.swapaxes(A, -1, -2) @ G


def tiled_attention_backward(G, q, k, v, out, lse, causal, block_size,
                             delta_of_the_tile=False):
    scale, s = 1.0 / math.sqrt(q.shape[-1]), q.shape[2]
    delta = np.sum(G * out, axis=-1, keepdims=True)           # [B, H, S, 1]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for i0 in range(0, s, block_size):
        I = slice(i0, min(i0 + block_size, s))
        for j0 in range(0, s, block_size):
            J = slice(j0, min(j0 + block_size, s))
            z = q[:, :, I] @ np.swapaxes(k[:, :, J], -1, -2) * scale
            if causal:
                z = np.where(np.arange(s)[J] > np.arange(s)[I, None], -np.inf, z)
            P = np.exp(z - lse[:, :, I, None])
            dP = G[:, :, I] @ np.swapaxes(v[:, :, J], -1, -2)
            if delta_of_the_tile:  # a planted mistake: rowsum(P * dP) of this tile alone
                dZ = P * (dP - np.sum(P * dP, axis=-1, keepdims=True)) * scale
            else:
                dZ = P * (dP - delta[:, :, I]) * scale
            dv[:, :, J] += np.swapaxes(P, -1, -2) @ G[:, :, I]
            dq[:, :, I] += dZ @ k[:, :, J]
            dk[:, :, J] += np.swapaxes(dZ, -1, -2) @ q[:, :, I]
    return dq, dk, dv


RIGHT = {
    "linear": linear_backward,
    "softmax": softmax_backward,
    "log_softmax": log_softmax_backward,
    "gelu": gelu_backward,
    "gelu_tanh": gelu_tanh_backward,
    "relu": relu_backward,
    "layernorm": layernorm_backward,
    "rmsnorm": rmsnorm_backward,
    "cross_entropy": cross_entropy_backward,
    "attention": attention_backward,
    "tiled_attention": tiled_attention_backward,
}


def test_every_exercise_has_a_reference_here():
    assert set(RIGHT) == set(EXERCISES)


@pytest.mark.usefixtures("backend_name")  # tfcore's side on every available backend
@pytest.mark.parametrize("op", sorted(RIGHT))
def test_the_right_backward_passes(op):
    errors = check_backward(op, RIGHT[op], trials=4, seed=1)
    assert set(errors) == set(EXERCISES[op].grads)
    assert max(errors.values()) <= 1e-12
    assert describe(op).startswith("backward(G, ")


def _planted(op):
    """A wrong backward for `op` and the name of the gradient it gets wrong."""
    if op == "linear":  # dW forgets to sum over the batch: only the first example's rows
        def wrong(G, x, W, b):
            dx, dW, db = linear_backward(G, x, W, b)
            return dx, x[0].T @ G[0], db
        return wrong, "dW"
    if op == "softmax":  # note 004's slip: the factor s dropped from the first term
        def wrong(G, z):
            s = _softmax(z)
            return G - s * np.sum(G * s, axis=-1, keepdims=True)
        return wrong, "dz"
    if op == "layernorm":  # the mean's gradient without its sum (note 002)
        def wrong(G, x, gamma, beta, eps):
            dx, dgamma, dbeta = layernorm_backward(G, x, gamma, beta, eps)
            return dx, dgamma, 2.0 * dbeta
        return wrong, "dbeta"
    if op == "cross_entropy":  # the ignored label counted in the mean
        def wrong(G, logits, labels, ignore_index):
            right = cross_entropy_backward(G, logits, labels, ignore_index)
            kept = labels != ignore_index
            return right * kept.sum() / labels.size
        return wrong, "dlogits"
    if op == "attention":  # dk without the 1/sqrt(D_h) scale
        def wrong(G, q, k, v, causal):
            dq, dk, dv = attention_backward(G, q, k, v, causal)
            return dq, dk * math.sqrt(q.shape[-1]), dv
        return wrong, "dk"
    if op == "tiled_attention":  # Delta summed over each tile's keys, not the whole row's
        def wrong(G, q, k, v, out, lse, causal, block_size):
            return tiled_attention_backward(G, q, k, v, out, lse, causal, block_size,
                                            delta_of_the_tile=True)
        return wrong, "dq"
    right = RIGHT[op]

    def wrong(G, **inputs):  # every other op: the first gradient 1 % too large
        grads = right(G, **inputs)
        if isinstance(grads, tuple):
            return (1.01 * grads[0],) + grads[1:]
        return 1.01 * grads
    return wrong, EXERCISES[op].grads[0]


@pytest.mark.parametrize("op", sorted(RIGHT))
def test_a_planted_mistake_fails_naming_the_gradient(op):
    wrong, name = _planted(op)
    seed = 2
    if op == "attention":  # a D_h of 1 leaves the scale at 1: find a draw with D_h > 1
        seed = 5
    with pytest.raises(AssertionError, match=rf"{op}: {name} is wrong: relative error"):
        check_backward(op, wrong, trials=6, seed=seed)


def test_a_tiny_error_is_caught_at_the_exact_bar():
    def off_by_1e_10(G, x, W, b):
        dx, dW, db = linear_backward(G, x, W, b)
        return dx * (1 + 1e-10), dW, db
    with pytest.raises(AssertionError, match="linear: dx is wrong"):
        check_backward("linear", off_by_1e_10)


def test_wrong_count_and_shape_are_named():
    with pytest.raises(AssertionError, match="expected 3 gradients, in this order: dx, dW, db"):
        check_backward("linear", lambda G, x, W, b: (G @ W.T, x))
    with pytest.raises(AssertionError, match=r"dgain has shape"):
        check_backward("rmsnorm", lambda G, x, gain, eps: (
            rmsnorm_backward(G, x, gain, eps)[0], np.zeros(1 + gain.size)))
    with pytest.raises(AssertionError, match="non-finite"):
        check_backward("relu", lambda G, x: np.full_like(x, np.nan))


@pytest.mark.parametrize("bad", ["Linear", "softmax_backward", "", None, 3])
def test_bad_op_names_are_refused(bad):
    with pytest.raises(ValueError, match=r"op_name must be one of \('linear', "):
        check_backward(bad, linear_backward)
    with pytest.raises(ValueError, match="op_name must be one of"):
        describe(bad)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="your_backward must be a function"):
        check_backward("linear", "G @ W.T")
    with pytest.raises((TypeError, ValueError), match="trials"):
        check_backward("linear", linear_backward, trials=0)
    with pytest.raises((TypeError, ValueError), match="tol"):
        check_backward("linear", linear_backward, tol=-1.0)
