"""tfcore.gradcheck: the checker itself must pass right gradients and fail wrong ones."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tfcore import functional as F
from tfcore.backend import asarray, namespace, to_numpy
from tfcore.gradcheck import assert_close, check_gradients, numerical_gradient, numerical_vjp, random_upstream, rel_error

# --------------------------------------------------------------------------------------
# rel_error and assert_close


def test_rel_error_values():
    assert rel_error(np.array([1.0, -2.0]), np.array([1.0, -2.0])) == 0.0
    assert rel_error(np.array([1.0, 2.0]), np.array([1.0, 2.2])) == pytest.approx(0.2 / 2.2, rel=1e-12)
    assert rel_error(np.zeros(3), np.zeros(3)) == 0.0
    assert rel_error(np.zeros((0, 2)), np.zeros((0, 2))) == 0.0
    assert rel_error(np.array([1.0, 0.0]), np.array([-1.0, 0.0])) == pytest.approx(2.0)


def test_rel_error_shape_mismatch():
    with pytest.raises(ValueError, match=re.escape("cannot compare shapes (2,) and (3,)")):
        rel_error(np.zeros(2), np.zeros(3))


def test_assert_close_passes_and_returns_the_error():
    err = assert_close("dW", np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-13]))
    assert 0.0 < err < 1e-12


def test_assert_close_names_the_tensor_and_the_worst_entry():
    actual = np.array([[1.0, 2.0], [3.0, 4.0]])
    expected = actual.copy()
    expected[1, 0] = 3.5
    with pytest.raises(AssertionError, match=r"^dW: relative error 1\.250e-01 exceeds 1\.0e-12 \(worst at index \(1, 0\)"):
        assert_close("dW", actual, expected)
    assert_close("dW", actual, expected, tol=0.2)  # the same pair passes a looser tolerance


def test_assert_close_shape_and_non_finite():
    with pytest.raises(AssertionError, match=re.escape("dgamma: shape (2, 3) differs from the expected (3, 2)")):
        assert_close("dgamma", np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(AssertionError, match=re.escape("dx: non-finite values (actual 1, expected 0)")):
        assert_close("dx", np.array([1.0, np.nan]), np.array([1.0, 2.0]))
    with pytest.raises(AssertionError, match=re.escape("dx: non-finite values (actual 0, expected 1)")):
        assert_close("dx", np.array([1.0, 2.0]), np.array([np.inf, 2.0]))


def test_assert_close_fails_on_a_wrong_gradient(rng):
    """The batch-shaped weight gradient of the errata: only one batch element's x^T dy, not the sum."""
    x = rng.standard_normal((2, 3, 4))
    W = rng.standard_normal((4, 5))
    _, cache = F.linear_forward(x, W)
    G = random_upstream((2, 3, 5), rng)
    _, dW, _ = F.linear_backward(G, cache)
    wrong = x[0].T @ G[0]
    assert_close("dW", dW, np.einsum("bsi,bso->io", x, G))
    with pytest.raises(AssertionError, match=r"^dW: relative error"):
        assert_close("dW", wrong, np.einsum("bsi,bso->io", x, G))


# --------------------------------------------------------------------------------------
# numerical_gradient and random_upstream


def test_numerical_gradient_restores_its_input_and_is_accurate(rng):
    x = rng.standard_normal((3, 4))
    c = rng.standard_normal((3, 4))
    before = x.copy()
    grad = numerical_gradient(lambda: float(np.sum(c * np.sin(x))), x)
    assert np.array_equal(x, before)  # bit for bit
    assert_close("dx", grad, c * np.cos(x), tol=1e-8)


def test_numerical_gradient_needs_float64_numpy():
    with pytest.raises(TypeError, match="numerical_gradient needs a float64 NumPy array to perturb"):
        numerical_gradient(lambda: 0.0, np.zeros(3, dtype=np.float32))
    with pytest.raises(TypeError, match="numerical_gradient needs a float64 NumPy array to perturb"):
        numerical_gradient(lambda: 0.0, [0.0, 1.0])


def test_random_upstream_is_random_not_ones():
    G = random_upstream((2, 3, 4), np.random.default_rng(0))
    assert G.shape == (2, 3, 4) and G.dtype == np.float64
    assert not np.allclose(G, 1.0)
    assert len(np.unique(G)) == G.size
    assert np.array_equal(G, random_upstream((2, 3, 4), np.random.default_rng(0)))


# --------------------------------------------------------------------------------------
# check_gradients


def test_check_gradients_passes_a_right_backward_and_keeps_inputs(rng):
    x = rng.standard_normal((2, 3, 4))
    W = rng.standard_normal((4, 2))
    x0, W0 = x.copy(), W.copy()
    y, cache = F.linear_forward(asarray(x), asarray(W))
    G = random_upstream(tuple(y.shape), rng)
    dx, dW, _ = F.linear_backward(asarray(G), cache)
    errors = check_gradients(lambda x, W: F.linear_forward(x, W)[0], {"x": x, "W": W}, {"x": dx, "W": dW}, G)
    assert set(errors) == {"x", "W"} and max(errors.values()) < 1e-8
    assert np.array_equal(x, x0) and np.array_equal(W, W0)


def _softmax_backward_errata(ds, s):
    """The source notes' softmax backward: dZ = dA - A * sum(A * dA), the first s * missing."""
    xp = namespace(ds, s)
    return ds - s * xp.sum(ds * s, axis=-1, keepdims=True)


@pytest.mark.usefixtures("backend_name")
def test_check_gradients_catches_the_softmax_errata(rng):
    z = rng.standard_normal((2, 3, 4))
    s, cache = F.softmax_forward(asarray(z))
    G = random_upstream(z.shape, rng)
    forward = lambda z: F.softmax_forward(z)[0]  # noqa: E731
    check_gradients(forward, {"z": z}, {"z": F.softmax_backward(asarray(G), cache)}, G)
    with pytest.raises(AssertionError, match=r"^dz: relative error"):
        check_gradients(forward, {"z": z}, {"z": _softmax_backward_errata(asarray(G), cache)}, G)


@pytest.mark.usefixtures("backend_name")
def test_check_gradients_catches_logits_minus_onehot(rng):
    """The cross-entropy errata: z - y where the gradient is softmax(z) - y."""
    logits = rng.standard_normal((4, 3))
    labels = np.array([0, 2, 1, 1])
    _, cache = F.cross_entropy_forward(asarray(logits), asarray(labels, "int64"))
    G = random_upstream((), rng)
    wrong = G * (logits - np.eye(3)[labels]) / 4
    forward = lambda logits: F.cross_entropy_forward(logits, asarray(labels, "int64"))[0]  # noqa: E731
    check_gradients(forward, {"logits": logits}, {"logits": F.cross_entropy_backward(G, cache)}, G)
    with pytest.raises(AssertionError, match=r"^dlogits: relative error"):
        check_gradients(forward, {"logits": logits}, {"logits": wrong}, G)


def test_check_gradients_catches_averaged_paths(rng):
    """y = x + x W: averaging the skip and branch gradients instead of adding them fails."""
    x = rng.standard_normal((2, 3))
    W = rng.standard_normal((3, 3))
    G = random_upstream(x.shape, rng)
    forward = lambda x: x + x @ asarray(W)  # noqa: E731
    check_gradients(forward, {"x": x}, {"x": G + G @ W.T}, G)
    with pytest.raises(AssertionError, match=r"^dx: relative error"):
        check_gradients(forward, {"x": x}, {"x": (G + G @ W.T) / 2}, G)


def test_check_gradients_names_the_first_wrong_tensor(rng):
    x = rng.standard_normal((2, 4))
    W = rng.standard_normal((4, 3))
    b = rng.standard_normal(3)
    y, cache = F.linear_forward(x, W, b)
    G = random_upstream(y.shape, rng)
    dx, dW, db = F.linear_backward(G, cache)
    forward = lambda x, W, b: F.linear_forward(x, W, b)[0]  # noqa: E731
    with pytest.raises(AssertionError, match=r"^db: relative error"):
        check_gradients(forward, {"x": x, "W": W, "b": b}, {"x": dx, "W": dW, "b": db * 1.01}, G)
    with pytest.raises(AssertionError, match=r"^dW: relative error"):
        check_gradients(forward, {"x": x, "W": W, "b": b}, {"x": dx, "W": np.ones_like(dW), "b": db}, G)
    with pytest.raises(AssertionError, match=re.escape("dx: shape (4, 2) differs from the expected (2, 4)")):
        check_gradients(forward, {"x": x, "W": W, "b": b}, {"x": to_numpy(dx).T}, G)


def test_numerical_vjp_is_the_exact_vjp_of_a_linear_map(rng):
    # For y = x @ W the VJP is G W^T exactly; central differences are exact up to rounding.
    x, W = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    G = random_upstream((3, 2), rng)
    numeric = numerical_vjp(lambda x, W: x @ W, {"x": x, "W": W}, "x", G)
    assert rel_error(numeric, G @ W.T) < 1e-9
    numeric_W = numerical_vjp(lambda x, W: x @ W, {"x": x, "W": W}, "W", G)
    assert rel_error(numeric_W, x.T @ G) < 1e-9
