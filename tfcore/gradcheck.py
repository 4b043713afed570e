"""Finite differences and relative errors: how every hand-written backward pass is checked.

The scalar that is differentiated is always L = sum(G * y) with a *random* upstream
gradient G. An all-ones G would hide errors that cancel when the gradient is summed (a
softmax backward that forgets a term, for example), so `random_upstream` never returns one.
Finite differences run on float64 NumPy copies of the inputs, whatever backend computes.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from .backend import asarray, to_numpy

TINY = 1e-300


def rel_error(actual, expected) -> float:
    """max |actual - expected| / max(max |actual|, max |expected|): 0 when equal, about 1 when unrelated."""
    a = np.asarray(to_numpy(actual), dtype=np.float64)
    e = np.asarray(to_numpy(expected), dtype=np.float64)
    if a.shape != e.shape:
        raise ValueError(f"cannot compare shapes {a.shape} and {e.shape}")
    if a.size == 0:
        return 0.0
    scale = max(np.max(np.abs(a)), np.max(np.abs(e)), TINY)
    return float(np.max(np.abs(a - e)) / scale)


def assert_close(name: str, actual, expected, tol: float = 1e-12) -> float:
    """Raise AssertionError naming `name` when rel_error(actual, expected) exceeds tol; return the error."""
    a = np.asarray(to_numpy(actual), dtype=np.float64)
    e = np.asarray(to_numpy(expected), dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {a.shape} differs from the expected {e.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(e))):
        raise AssertionError(f"{name}: non-finite values (actual {np.sum(~np.isfinite(a))}, expected {np.sum(~np.isfinite(e))})")
    err = rel_error(a, e)
    if not err <= tol:
        worst = np.unravel_index(np.argmax(np.abs(a - e)), a.shape) if a.ndim else ()
        raise AssertionError(
            f"{name}: relative error {err:.3e} exceeds {tol:.1e} "
            f"(worst at index {tuple(int(i) for i in worst)}: {a[worst]!r} vs expected {e[worst]!r})"
        )
    return err


def random_upstream(shape, rng: np.random.Generator) -> np.ndarray:
    """A standard-normal upstream gradient G of `shape` (float64): never all ones."""
    return rng.standard_normal(shape)


def numerical_gradient(f: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences (f(x + eps e_i) - f(x - eps e_i)) / 2 eps for every entry i of x.

    x is a float64 NumPy array that `f` reads; it is perturbed in place and restored.
    """
    if not (isinstance(x, np.ndarray) and x.dtype == np.float64):
        raise TypeError("numerical_gradient needs a float64 NumPy array to perturb")
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + eps
        plus = f()
        flat[i] = saved - eps
        minus = f()
        flat[i] = saved
        gflat[i] = (plus - minus) / (2 * eps)
    return grad


def numerical_vjp(
    forward: Callable[..., object], inputs: Mapping[str, np.ndarray], wrt: str, upstream, eps: float = 1e-6
) -> np.ndarray:
    """dL/d inputs[wrt] by central differences, for L = sum(upstream * forward(**inputs)).

    inputs: float64 NumPy arrays; `forward` receives them moved to the selected backend and
    may return an array of any backend. Nothing is asserted: this is the truth to compare with.
    """
    work = {k: np.array(v, dtype=np.float64) for k, v in inputs.items()}
    upstream = np.asarray(upstream, dtype=np.float64)

    def loss() -> float:
        y = forward(**{k: asarray(v) for k, v in work.items()})
        return float(np.sum(upstream * to_numpy(y)))

    return numerical_gradient(loss, work[wrt], eps)


def check_gradients(
    forward: Callable[..., object],
    inputs: Mapping[str, np.ndarray],
    grads: Mapping[str, object],
    upstream: np.ndarray,
    eps: float = 1e-6,
    tol: float = 1e-6,
) -> dict[str, float]:
    """Compare analytic gradients with central finite differences of L = sum(upstream * forward(**inputs)).

    inputs: float64 NumPy arrays; `forward` receives them moved to the selected backend.
    grads:  the analytic dL/d(input) for each name to check (a subset of `inputs`).
    Raises AssertionError naming the first tensor whose relative error exceeds tol;
    returns {name: relative error}.
    """
    return {
        name: assert_close(f"d{name}", analytic, numerical_vjp(forward, inputs, name, upstream, eps), tol)
        for name, analytic in grads.items()
    }
