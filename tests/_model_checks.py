"""Shared helpers of the model tests: directional finite differences over a flat buffer."""
from __future__ import annotations

import numpy as np

from tfcore.backend import to_numpy


def randomize(params, rng, scale=0.3):
    """Move every parameter away from its initial value (gains off 1, biases off 0), so that no
    gradient vanishes by symmetry and each tensor's check means something."""
    base = np.array(to_numpy(params.data), dtype=np.float64)
    params.load_flat(base + scale * rng.standard_normal(base.shape))


def five_point(params, loss_fn, base, u, h):
    """(-L(t + 2h u) + 8 L(t + h u) - 8 L(t - h u) + L(t - 2h u)) / 12h with t = base."""
    values = []
    for step in (2, 1, -1, -2):
        params.load_flat(base + step * h * u)
        values.append(float(loss_fn()))
    return (-values[0] + 8 * values[1] - 8 * values[2] + values[3]) / (12 * h)


def directional_errors(params, loss_fn, rng, names=None, h=1e-5, retry_above=1e-7):
    """{name: relative error} of grad . u against the five-point central difference along a
    random direction u restricted to each named tensor (and '*' for one over all of them).

    The error is |numeric - analytic| divided by the largest of |numeric|, |analytic| and
    |grad restricted to the tensor| (the typical size of grad . u for a standard normal u; it
    keeps a direction that happens to be nearly orthogonal to the gradient from turning
    round-off into a large relative error), with 1e-8 as a floor for an all-zero gradient.

    The stencil's truncation error is O(h^4), negligible at h = 1e-5, and its round-off about
    eps |L| / h ~ 1e-11; measured errors on the tiny models stay below 1e-8. A ReLU whose
    kink falls inside [-2h, 2h] spoils a difference (the function is not smooth there), and a
    tensor whose directional derivative is tiny against the loss suffers round-off, so an
    error above `retry_above` is measured again at 4h (less round-off), then h / 10 and h / 100
    (past the kink), and the smallest is kept: a wrong gradient is wrong at every step.
    params.grad must hold the analytic gradient of loss_fn at params.data, which is restored.
    """
    base = np.array(to_numpy(params.data), dtype=np.float64)
    grad = np.array(to_numpy(params.grad), dtype=np.float64)
    directions = {}
    for name in params.names if names is None else names:
        u = np.zeros_like(base)
        start, stop = params.offsets[name]
        u[start:stop] = rng.standard_normal(stop - start)
        directions[name] = u
    directions["*"] = rng.standard_normal(base.shape)
    errors = {}
    try:
        for name, u in directions.items():
            analytic = float(grad @ u)
            typical = float(np.linalg.norm(grad[u != 0]))
            for step in (h, 4 * h, h / 10, h / 100):
                numeric = five_point(params, loss_fn, base, u, step)
                err = abs(numeric - analytic) / max(abs(numeric), abs(analytic), typical, 1e-8)
                errors[name] = min(err, errors.get(name, np.inf))
                if errors[name] <= retry_above:
                    break
    finally:
        params.load_flat(base)
    return errors

