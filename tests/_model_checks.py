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

    The stencil's truncation error is O(h^4), negligible at h = 1e-5, and its round-off about
    eps |L| / h ~ 1e-11; measured errors on the tiny models stay below 1e-8. A ReLU whose
    kink falls inside [-2h, 2h] spoils a difference (the function is not smooth there), so
    an error above `retry_above` is measured again at h / 10, then h / 100, and the smallest is
    kept: a wrong gradient is wrong at every step, a kink is left behind by a smaller stencil.
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
            for step in (h, h / 10, h / 100):
                numeric = five_point(params, loss_fn, base, u, step)
                err = abs(numeric - analytic) / max(abs(numeric), abs(analytic), 1e-300)
                errors[name] = min(err, errors.get(name, np.inf))
                if errors[name] <= retry_above:
                    break
    finally:
        params.load_flat(base)
    return errors
