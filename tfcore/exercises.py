"""An exact checker for "write this backward yourself" exercises.

    from tfcore.exercises import check_backward

    def my_linear_backward(G, x, W, b):
        # G [B, S, D_out], x [B, S, D_in], W [D_in, D_out], b [D_out]
        ...
        return dx, dW, db

    check_backward("linear", my_linear_backward)

`check_backward` draws random float64 inputs of random sizes, runs tfcore's forward and
backward pair for the named op, calls the reader's function with a random upstream gradient
G and the same inputs (float64 NumPy arrays, passed by keyword after G), and compares every
returned gradient with tfcore's at a relative error of 1e-12 (the error of
`tfcore.gradcheck.rel_error`). A wrong gradient raises AssertionError naming the op, the
gradient, the relative error, the sizes drawn and the worst entry. The reader's function
gets the forward's *inputs*, not its output or cache: recomputing the forward is part of
the exercise (the tiled attention's gets the forward's `out` and `lse` too: what its
backward keeps in place of the probabilities). `describe(op)` prints the signature each op
expects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import checks
from . import functional as F
from .backend import asarray, to_numpy
from .gradcheck import random_upstream, rel_error


@dataclass(frozen=True)
class _Exercise:
    signature: str  # what the reader's function receives and returns
    grads: tuple[str, ...]  # names of the gradients it returns, in order
    draw: Callable  # rng -> (arrays: dict, settings: dict, sizes: dict)
    run: Callable  # (arrays on the backend, settings, G) -> tfcore's gradients (tuple)
    scalar_upstream: bool = False  # the op's output is a scalar (a loss)


def _sizes(rng, **ranges):
    return {k: int(rng.integers(lo, hi + 1)) for k, (lo, hi) in ranges.items()}


def _draw_linear(rng):
    n = _sizes(rng, B=(1, 3), S=(1, 5), D_in=(1, 6), D_out=(1, 6))
    arrays = {
        "x": rng.standard_normal((n["B"], n["S"], n["D_in"])),  # [B, S, D_in]
        "W": rng.standard_normal((n["D_in"], n["D_out"])),  # [D_in, D_out]
        "b": rng.standard_normal(n["D_out"]),  # [D_out]
    }
    return arrays, {}, n


def _run_linear(a, s, G):
    _, cache = F.linear_forward(a["x"], a["W"], a["b"])
    return F.linear_backward(G, cache)


def _draw_rows(rng):  # a [B, S, K] tensor of scores or activations
    n = _sizes(rng, B=(1, 3), S=(1, 5), K=(2, 7))
    return {"z": 2.0 * rng.standard_normal((n["B"], n["S"], n["K"]))}, {}, n


def _run_softmax(a, s, G):
    _, cache = F.softmax_forward(a["z"])
    return (F.softmax_backward(G, cache),)


def _run_log_softmax(a, s, G):
    _, cache = F.log_softmax_forward(a["z"])
    return (F.log_softmax_backward(G, cache),)


def _draw_elementwise(rng):
    n = _sizes(rng, B=(1, 3), S=(1, 5), D=(1, 7))
    return {"x": 2.0 * rng.standard_normal((n["B"], n["S"], n["D"]))}, {}, n


def _run_gelu(a, s, G):
    _, cache = F.gelu_forward(a["x"], approximate="none")
    return (F.gelu_backward(G, cache),)


def _run_gelu_tanh(a, s, G):
    _, cache = F.gelu_forward(a["x"], approximate="tanh")
    return (F.gelu_backward(G, cache),)


def _run_relu(a, s, G):
    _, cache = F.relu_forward(a["x"])
    return (F.relu_backward(G, cache),)


def _draw_norm(rng, with_beta):
    n = _sizes(rng, B=(1, 3), S=(1, 5), D=(2, 8))
    arrays = {"x": rng.standard_normal((n["B"], n["S"], n["D"]))}  # [B, S, D]
    if with_beta:
        arrays["gamma"] = 1.0 + 0.1 * rng.standard_normal(n["D"])  # [D]
        arrays["beta"] = 0.1 * rng.standard_normal(n["D"])  # [D]
    else:
        arrays["gain"] = 1.0 + 0.1 * rng.standard_normal(n["D"])  # [D]
    return arrays, {"eps": 1e-5}, n


def _run_layernorm(a, s, G):
    _, cache = F.layernorm_forward(a["x"], a["gamma"], a["beta"], eps=s["eps"])
    return F.layernorm_backward(G, cache)


def _run_rmsnorm(a, s, G):
    _, cache = F.rmsnorm_forward(a["x"], a["gain"], eps=s["eps"])
    return F.rmsnorm_backward(G, cache)


def _draw_cross_entropy(rng):
    n = _sizes(rng, B=(1, 3), S=(2, 5), V=(2, 7))
    labels = rng.integers(0, n["V"], size=(n["B"], n["S"]))  # [B, S]
    labels[0, 0] = -100  # one ignored label: it must get no gradient
    arrays = {"logits": 2.0 * rng.standard_normal((n["B"], n["S"], n["V"])), "labels": labels}
    return arrays, {"ignore_index": -100}, n


def _run_cross_entropy(a, s, G):
    _, cache = F.cross_entropy_forward(a["logits"], a["labels"], s["ignore_index"])
    return (F.cross_entropy_backward(G, cache),)


def _draw_attention(rng):
    n = _sizes(rng, B=(1, 2), H=(1, 3), S=(1, 5), D_h=(1, 4))
    shape = (n["B"], n["H"], n["S"], n["D_h"])  # [B, H, S, D_h]
    arrays = {name: rng.standard_normal(shape) for name in ("q", "k", "v")}
    return arrays, {"causal": bool(rng.integers(0, 2))}, n


def _run_attention(a, s, G):
    _, cache = F.attention_forward(a["q"], a["k"], a["v"], causal=s["causal"])
    return F.attention_backward(G, cache)


def _draw_tiled_attention(rng):
    n = _sizes(rng, B=(1, 2), H=(1, 2), S=(2, 9), D_h=(1, 4), block_size=(1, 4))
    shape = (n["B"], n["H"], n["S"], n["D_h"])  # [B, H, S, D_h]
    arrays = {name: rng.standard_normal(shape) for name in ("q", "k", "v")}
    settings = {"causal": bool(rng.integers(0, 2)), "block_size": n["block_size"]}
    # what the forward keeps: out [B, H, S, D_h] and the row log-sum-exp lse [B, H, S]
    out, cache = F.tiled_attention_forward(*(asarray(arrays[x]) for x in "qkv"), **settings)
    arrays["out"], arrays["lse"] = to_numpy(out), to_numpy(cache[4])
    return arrays, settings, n


def _run_tiled_attention(a, s, G):
    _, cache = F.tiled_attention_forward(a["q"], a["k"], a["v"], causal=s["causal"],
                                         block_size=s["block_size"])
    return F.tiled_attention_backward(G, cache)


EXERCISES = {
    "linear": _Exercise(
        "backward(G, x, W, b) -> (dx, dW, db); y = x @ W + b, x [B, S, D_in], "
        "W [D_in, D_out], b [D_out], G [B, S, D_out]",
        ("dx", "dW", "db"), _draw_linear, _run_linear,
    ),
    "softmax": _Exercise(
        "backward(G, z) -> dz; s = softmax(z) over the last axis, z and G [B, S, K]",
        ("dz",), _draw_rows, _run_softmax,
    ),
    "log_softmax": _Exercise(
        "backward(G, z) -> dz; y = log softmax(z) over the last axis, z and G [B, S, K]",
        ("dz",), _draw_rows, _run_log_softmax,
    ),
    "gelu": _Exercise(
        "backward(G, x) -> dx; y = x Phi(x) (exact, erf), x and G [B, S, D]",
        ("dx",), _draw_elementwise, _run_gelu,
    ),
    "gelu_tanh": _Exercise(
        "backward(G, x) -> dx; y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), "
        "x and G [B, S, D]",
        ("dx",), _draw_elementwise, _run_gelu_tanh,
    ),
    "relu": _Exercise(
        "backward(G, x) -> dx; y = max(x, 0), x and G [B, S, D]",
        ("dx",), _draw_elementwise, _run_relu,
    ),
    "layernorm": _Exercise(
        "backward(G, x, gamma, beta, eps) -> (dx, dgamma, dbeta); "
        "y = gamma (x - mean) / sqrt(var + eps) + beta over the last axis, x and G [B, S, D], "
        "gamma and beta [D]",
        ("dx", "dgamma", "dbeta"), lambda rng: _draw_norm(rng, True), _run_layernorm,
    ),
    "rmsnorm": _Exercise(
        "backward(G, x, gain, eps) -> (dx, dgain); y = gain x / sqrt(mean(x^2) + eps) over "
        "the last axis, x and G [B, S, D], gain [D]",
        ("dx", "dgain"), lambda rng: _draw_norm(rng, False), _run_rmsnorm,
    ),
    "cross_entropy": _Exercise(
        "backward(G, logits, labels, ignore_index) -> dlogits; the loss is the mean over "
        "the labels not equal to ignore_index of -log softmax(logits)[label], logits "
        "[B, S, V], labels [B, S] integers, G a Python float",
        ("dlogits",), _draw_cross_entropy, _run_cross_entropy, scalar_upstream=True,
    ),
    "attention": _Exercise(
        "backward(G, q, k, v, causal) -> (dq, dk, dv); out = softmax(q k^T / sqrt(D_h) "
        "+ M) v, M = -inf above the diagonal when causal, q, k, v and G [B, H, S, D_h]",
        ("dq", "dk", "dv"), _draw_attention, _run_attention,
    ),
    "tiled_attention": _Exercise(
        "backward(G, q, k, v, out, lse, causal, block_size) -> (dq, dk, dv), one "
        "[block_size, block_size] tile of scores at a time; out = softmax(Z) v with "
        "Z = q k^T / sqrt(D_h) + M, M = -inf above the diagonal when causal, lse [B, H, S] "
        "the row log-sum-exp of Z; q, k, v, out and G [B, H, S, D_h]",
        ("dq", "dk", "dv"), _draw_tiled_attention, _run_tiled_attention,
    ),
}


def _exercise(op_name) -> _Exercise:
    if not isinstance(op_name, str) or op_name not in EXERCISES:
        raise ValueError(f"op_name must be one of {tuple(EXERCISES)}, got {op_name!r}")
    return EXERCISES[op_name]


def describe(op_name: str) -> str:
    """The signature the reader's backward for `op_name` must have, and what it returns."""
    return _exercise(op_name).signature


def check_backward(op_name: str, your_backward: Callable, *, trials: int = 3, seed: int = 0,
                   tol: float = 1e-12) -> dict[str, float]:
    """Compare `your_backward` with tfcore's backward of `op_name` on `trials` random draws.

    Each trial draws new sizes and float64 inputs (seeded by `seed`) and a random upstream
    gradient G, and calls ``your_backward(G, **inputs, **settings)`` with NumPy arrays (see
    `describe(op_name)`). It must return the gradients in the documented order (a single
    array when there is one). Returns {gradient name: the largest relative error over the
    trials}; raises AssertionError naming the first gradient that misses by more than `tol`.
    """
    ex = _exercise(op_name)
    if not callable(your_backward):
        raise TypeError(f"your_backward must be a function, got {type(your_backward).__name__}")
    trials = checks.integer("trials", trials, least=1)
    seed = checks.integer("seed", seed, least=0)
    tol = checks.positive("tol", tol)
    rng = np.random.default_rng(seed)
    worst = dict.fromkeys(ex.grads, 0.0)
    for trial in range(trials):
        arrays, settings, sizes = ex.draw(rng)
        on_backend = {k: asarray(v) for k, v in arrays.items()}
        if ex.scalar_upstream:
            G = G_backend = float(rng.uniform(0.5, 2.0))  # dloss, a scalar
        else:
            out_shape = _output_shape(op_name, arrays)
            G = random_upstream(out_shape, rng)
            G_backend = asarray(G)
        expected = ex.run(on_backend, settings, G_backend)
        inputs = {k: np.array(v, copy=True) for k, v in arrays.items()}  # theirs to keep
        got = your_backward(G, **inputs, **settings)
        if len(ex.grads) == 1 and not isinstance(got, (tuple, list)):
            got = (got,)
        if not isinstance(got, (tuple, list)) or len(got) != len(ex.grads):
            count = len(got) if isinstance(got, (tuple, list)) else "a single array"
            raise AssertionError(
                f"{op_name}: your backward returned {count}; expected "
                f"{len(ex.grads)} gradients, in this order: {', '.join(ex.grads)}"
            )
        where = ", ".join(f"{k}={v}" for k, v in sizes.items())
        for name, mine, truth in zip(ex.grads, got, expected):
            truth = to_numpy(truth)
            mine = np.asarray(to_numpy(mine), dtype=np.float64)
            if mine.shape != truth.shape:
                raise AssertionError(
                    f"{op_name}: {name} has shape {mine.shape}, expected {truth.shape} "
                    f"(trial {trial}, sizes {where})"
                )
            if not np.all(np.isfinite(mine)):
                raise AssertionError(
                    f"{op_name}: {name} has {int(np.sum(~np.isfinite(mine)))} non-finite "
                    f"entries (trial {trial}, sizes {where})"
                )
            err = rel_error(mine, truth)
            if not err <= tol:
                i = np.unravel_index(np.argmax(np.abs(mine - truth)), truth.shape)
                raise AssertionError(
                    f"{op_name}: {name} is wrong: relative error {err:.3e} exceeds {tol:.0e} "
                    f"(trial {trial}, sizes {where}; worst entry {tuple(int(j) for j in i)}: "
                    f"yours {mine[i]!r}, tfcore's {truth[i]!r})"
                )
            worst[name] = max(worst[name], err)
    return worst


def _output_shape(op_name: str, arrays: dict) -> tuple:
    if op_name == "linear":
        return arrays["x"].shape[:-1] + arrays["W"].shape[1:]
    if op_name == "tiled_attention":
        return arrays["q"].shape
    if op_name == "attention":
        return arrays["q"].shape[:-1] + arrays["v"].shape[-1:]
    return next(iter(arrays.values())).shape  # element-wise and row-wise ops
