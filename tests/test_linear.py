"""Linear layer y = x @ W + b: forward values and finite-difference gradient checks (float64)."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close, check_gradients, random_upstream

pytestmark = pytest.mark.usefixtures("backend_name")


def _draw(rng, lead_ndim):
    """Random leading shape of `lead_ndim` axes and widths D_in, D_out, all small."""
    lead = tuple(int(n) for n in rng.integers(1, 4, size=lead_ndim))
    d_in, d_out = (int(n) for n in rng.integers(1, 6, size=2))
    return lead, d_in, d_out


def test_forward_matches_einsum(rng):
    lead, d_in, d_out = _draw(rng, 2)
    x = rng.standard_normal(lead + (d_in,))
    W = rng.standard_normal((d_in, d_out))
    b = rng.standard_normal(d_out)
    y, _ = F.linear_forward(asarray(x), asarray(W), asarray(b))
    expected = np.einsum("bsi,io->bso", x, W) + b[None, None, :]
    assert tuple(y.shape) == lead + (d_out,)
    assert_close("y", y, expected)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("lead_ndim", [1, 2], ids=["x2d", "x3d"])
def test_gradients(rng, with_bias, lead_ndim):
    lead, d_in, d_out = _draw(rng, lead_ndim)
    x = rng.standard_normal(lead + (d_in,))
    W = rng.standard_normal((d_in, d_out))
    inputs = {"x": x, "W": W}
    if with_bias:
        inputs["b"] = rng.standard_normal(d_out)
    y, cache = F.linear_forward(*(asarray(v) for v in inputs.values()))
    G = random_upstream(tuple(y.shape), rng)
    dx, dW, db = F.linear_backward(asarray(G), cache)

    # Parameter gradients are summed over every row, never kept per batch element.
    assert tuple(dx.shape) == x.shape
    assert tuple(dW.shape) == (d_in, d_out)
    grads = {"x": dx, "W": dW}
    if with_bias:
        assert tuple(db.shape) == (d_out,)
        grads["b"] = db
    else:
        assert db is None

    errors = check_gradients(lambda **t: F.linear_forward(**t)[0], inputs, grads, G)
    assert set(errors) == set(grads)


@pytest.mark.parametrize(
    "shape, d_out",
    [((2, 1, 4), 3), ((2, 3, 1), 4), ((1, 1, 1), 1), ((3, 2, 4), 1)],
    ids=["S=1", "D_in=1", "all-1", "D_out=1"],
)
def test_gradients_edge_shapes(rng, shape, d_out):
    x = rng.standard_normal(shape)
    W = rng.standard_normal((shape[-1], d_out))
    b = rng.standard_normal(d_out)
    y, cache = F.linear_forward(asarray(x), asarray(W), asarray(b))
    G = random_upstream(tuple(y.shape), rng)
    dx, dW, db = F.linear_backward(asarray(G), cache)
    check_gradients(
        lambda **t: F.linear_forward(**t)[0], {"x": x, "W": W, "b": b}, {"x": dx, "W": dW, "b": db}, G
    )


def test_backward_closed_forms(rng):
    """dx = G W^T, dW = sum_b x_b^T G_b, db = sum of G over batch and sequence, against einsum."""
    lead, d_in, d_out = _draw(rng, 2)
    x = rng.standard_normal(lead + (d_in,))
    W = rng.standard_normal((d_in, d_out))
    b = rng.standard_normal(d_out)
    _, cache = F.linear_forward(asarray(x), asarray(W), asarray(b))
    G = random_upstream(lead + (d_out,), rng)
    dx, dW, db = F.linear_backward(asarray(G), cache)
    assert_close("dx", dx, np.einsum("bso,io->bsi", G, W))
    assert_close("dW", dW, np.einsum("bsi,bso->io", x, G))
    assert_close("db", db, G.sum(axis=(0, 1)))


def test_backward_leaves_cache_intact(rng):
    """Calling backward twice gives the same gradients: the cache is not modified."""
    x = rng.standard_normal((2, 3, 4))
    W = rng.standard_normal((4, 5))
    _, cache = F.linear_forward(asarray(x), asarray(W))
    G = asarray(random_upstream((2, 3, 5), rng))
    first = [to_numpy(g).copy() for g in F.linear_backward(G, cache)[:2]]
    second = F.linear_backward(G, cache)[:2]
    for name, a, b in zip(("dx", "dW"), first, second):
        assert_close(name, b, a, tol=0.0)
