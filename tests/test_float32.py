"""The float32 fast path: every op takes float32 and returns float32, forward and backward,
and agrees with the float64 result to about 1e-5 relative."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import backend
from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.checks import dtype_name
from tfcore.gradcheck import rel_error

pytestmark = pytest.mark.usefixtures("backend_name")

TOL = 1e-5
B, S, D, V = 2, 3, 4, 5


# Each case: (float inputs drawn from rng as float64 NumPy arrays, function of those inputs on
# the backend in one dtype that returns every forward output and backward gradient).
def _linear(t, G):
    y, c = F.linear_forward(t["x"], t["W"], t["b"])
    return (y, *F.linear_backward(G((B, S, 3)), c))


def _embedding(t, G):
    ids = asarray(np.array([[0, 4, 4], [1, 0, 3]]), "int64")
    x, c = F.embedding_forward(ids, t["W"])
    return x, F.embedding_backward(G((B, S, D)), c)


def _positional(t, G):
    y, c = F.positional_forward(t["x"], t["P"])
    return (y, *F.positional_backward(G((B, S, D)), c))


def _softmax(t, G):
    s, c = F.softmax_forward(t["z"], F.causal_mask(S, dtype=dtype_name(t["z"])))
    return s, F.softmax_backward(G(tuple(s.shape)), c)


def _log_softmax(t, G):
    y, c = F.log_softmax_forward(t["z"])
    return y, F.log_softmax_backward(G(tuple(y.shape)), c)


def _cross_entropy(t, G):
    labels = asarray(np.array([[0, -100, 4], [2, 2, 1]]), "int64")
    loss, c = F.cross_entropy_forward(t["logits"], labels)
    return loss, F.cross_entropy_backward(0.7, c)


def _mse(t, G):
    loss, c = F.mse_forward(t["x"], t["y"])
    return loss, F.mse_backward(0.7, c)


def _relu(t, G):
    y, c = F.relu_forward(t["x"])
    return y, F.relu_backward(G((B, S, D)), c)


def _gelu(approximate):
    def run(t, G):
        y, c = F.gelu_forward(t["x"], approximate=approximate)
        return y, F.gelu_backward(G((B, S, D)), c)
    return run


def _layernorm(t, G):
    y, c = F.layernorm_forward(t["x"], t["g"], t["b"])
    return (y, *F.layernorm_backward(G((B, S, D)), c))


def _rmsnorm(t, G):
    y, c = F.rmsnorm_forward(t["x"], t["g"])
    return (y, *F.rmsnorm_backward(G((B, S, D)), c))


def _dropout(t, G):
    y, c = F.dropout_forward(t["x"], 0.3, backend.default_rng(5))
    return y, F.dropout_backward(G((B, S, D)), c)


def _residual(t, G):
    y, c = F.residual_forward(t["x"], t["y"])
    return (y, *F.residual_backward(G((B, S, D)), c))


CASES = {
    "linear": ({"x": (B, S, D), "W": (D, 3), "b": (3,)}, _linear),
    "embedding": ({"W": (V, D)}, _embedding),
    "positional": ({"x": (B, S, D), "P": (S + 2, D)}, _positional),
    "softmax-causal": ({"z": (B, 2, S, S)}, _softmax),
    "log_softmax": ({"z": (B, S, V)}, _log_softmax),
    "cross_entropy": ({"logits": (B, S, V)}, _cross_entropy),
    "mse": ({"x": (B, S, D), "y": (B, S, D)}, _mse),
    "relu": ({"x": (B, S, D)}, _relu),
    "gelu-none": ({"x": (B, S, D)}, _gelu("none")),
    "gelu-tanh": ({"x": (B, S, D)}, _gelu("tanh")),
    "layernorm": ({"x": (B, S, D), "g": (D,), "b": (D,)}, _layernorm),
    "rmsnorm": ({"x": (B, S, D), "g": (D,)}, _rmsnorm),
    "dropout": ({"x": (B, S, D)}, _dropout),
    "residual": ({"x": (B, S, D), "y": (B, S, D)}, _residual),
}


@pytest.mark.parametrize("case", list(CASES))
def test_float32_matches_float64(rng, case):
    shapes, run = CASES[case]
    # Values exactly representable in float32, so both runs see the same inputs.
    host = {k: rng.standard_normal(shape).astype(np.float32).astype(np.float64) for k, shape in shapes.items()}
    upstream = {}

    def G_for(dtype):
        def G(shape):
            if shape not in upstream:
                upstream[shape] = rng.standard_normal(shape).astype(np.float32).astype(np.float64)
            return asarray(upstream[shape], dtype)
        return G

    out64 = run({k: asarray(v, "float64") for k, v in host.items()}, G_for("float64"))
    out32 = run({k: asarray(v, "float32") for k, v in host.items()}, G_for("float32"))
    assert len(out32) == len(out64)
    for i, (a32, a64) in enumerate(zip(out32, out64)):
        if a64 is None:
            assert a32 is None
            continue
        assert dtype_name(a64) == "float64", f"{case} output {i}"
        assert dtype_name(a32) == "float32", f"{case} output {i} is {dtype_name(a32)}, expected float32"
        err = rel_error(to_numpy(a32), to_numpy(a64))
        assert err < TOL, f"{case} output {i}: float32 differs from float64 by {err:.2e} relative"


def test_sinusoidal_and_mask_dtypes():
    assert dtype_name(F.sinusoidal_positions(4, 6, dtype="float32")) == "float32"
    assert dtype_name(F.causal_mask(4, dtype="float32")) == "float32"
    assert dtype_name(F.sinusoidal_positions(4, 6)) == "float64"
