"""tfcore.symbolic: the proof recipe's helpers give the known answers and fail on wrong ones."""
from __future__ import annotations

import re

import numpy as np
import pytest
import sympy as sp

from tfcore import functional as F
from tfcore import symbolic as sym
from tfcore.gradcheck import assert_close


def test_matrix_vector_and_upstream_symbols():
    X = sym.matrix("X", 2, 3)
    assert X.shape == (2, 3)
    assert str(X[0, 1]) == "X_{0,1}"
    assert all(s.is_real for s in X)
    v = sym.vector("b", 4)
    assert v.shape == (1, 4) and str(v[0, 2]) == "b_{2}"
    G = sym.upstream_like(X)
    assert G.shape == (2, 3) and str(G[1, 2]) == "G_{1,2}"
    assert sym.matrix("P", 1, 1, positive=True)[0].is_positive


def test_vjp_of_a_tiny_product():
    """Y = X W: dL/dX = G W^T and dL/dW = X^T G."""
    X, W = sym.matrix("X", 2, 3), sym.matrix("W", 3, 2)
    Y = X * W
    G = sym.upstream_like(Y)
    dX, dW = sym.vjp(Y, X, G), sym.vjp(Y, W, G)
    assert (dX - G * W.T).expand() == sp.zeros(2, 3)
    assert (dW - X.T * G).expand() == sp.zeros(3, 2)
    sym.assert_equal("dX", dX, G * W.T)
    sym.assert_equal("dW", dW, X.T * G)


def test_vjp_of_an_elementwise_op():
    X = sym.matrix("X", 2, 2)
    Y = X.applyfunc(sp.tanh)
    G = sym.upstream_like(Y)
    closed = G.multiply_elementwise(X.applyfunc(lambda x: 1 - sp.tanh(x) ** 2))
    sym.assert_equal("dX", sym.vjp(Y, X, G), closed)


def test_vjp_rejects_a_wrong_upstream_shape():
    X = sym.matrix("X", 2, 2)
    with pytest.raises(ValueError, match=re.escape("upstream G must have Y's shape (2, 2), got (2, 3)")):
        sym.vjp(X, X, sym.matrix("G", 2, 3))


def test_assert_equal_names_the_wrong_entry():
    X, W = sym.matrix("X", 2, 2), sym.matrix("W", 2, 2)
    Y = X * W
    G = sym.upstream_like(Y)
    truth = sym.vjp(Y, X, G)
    wrong = truth.copy()
    wrong[1, 0] += X[0, 0]
    with pytest.raises(AssertionError, match=re.escape("dX: entry (1, 0) differs from the truth by X_{0,0}")):
        sym.assert_equal("dX", truth, wrong)
    # The classic slip: G W instead of G W^T is wrong from the first entry on.
    with pytest.raises(AssertionError, match=re.escape("dX: entry (0, 0) differs from the truth by")):
        sym.assert_equal("dX", truth, G * W)


def test_assert_equal_shape_mismatch():
    X = sym.matrix("X", 2, 3)
    with pytest.raises(AssertionError, match=re.escape("dX: closed form has shape (3, 2), the truth (2, 3)")):
        sym.assert_equal("dX", X, X.T)


def test_is_zero_needs_simplify_only_when_expansion_is_not_enough():
    x = sp.Symbol("x", real=True)
    assert sym.is_zero((x + 1) ** 2 - x**2 - 2 * x - 1)
    assert sym.is_zero(sp.sin(x) ** 2 + sp.cos(x) ** 2 - 1)
    assert not sym.is_zero(x)
    assert not sym.is_zero(sp.sin(x) ** 2 - 1)


def test_lambdify_shapes_and_values():
    rng = np.random.default_rng(3)
    X, W = sym.matrix("X", 2, 3), sym.matrix("W", 3, 4)
    f = sym.lambdify([X, W], X * W)
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((3, 4))
    out = f(x, w)
    assert out.shape == (2, 4) and out.dtype == np.float64
    assert_close("X W", out, x @ w)
    # a column result keeps its shape too
    g = sym.lambdify([X], X.T * sp.ones(2, 1))
    assert g(x).shape == (3, 1)
    assert_close("X^T 1", g(x), x.sum(axis=0)[:, None])


def test_lambdify_rejects_a_wrong_shaped_input():
    X, W = sym.matrix("X", 2, 3), sym.matrix("W", 3, 4)
    f = sym.lambdify([X, W], X * W)
    with pytest.raises(ValueError, match=re.escape("expected an array of shape (2, 3), got (3, 2)")):
        f(np.zeros((3, 2)), np.zeros((3, 4)))
    with pytest.raises(ValueError, match=re.escape("expected an array of shape (3, 4), got (12,)")):
        f(np.zeros((2, 3)), np.zeros(12))


def test_softmax_vjp_closed_form_matches_tfcore():
    """The book's recipe end to end on a 1 x 3 softmax: sympy truth = closed form = tfcore to 1e-12."""
    z = sym.vector("z", 3)
    e = z.applyfunc(sp.exp)
    s = e / sum(e)
    G = sym.upstream_like(s)
    truth = sym.vjp(s, z, G)
    closed = s.multiply_elementwise(G - sp.ones(1, 3) * (G.multiply_elementwise(s)).dot(sp.ones(1, 3)))
    sym.assert_equal("dz", truth, closed)
    rng = np.random.default_rng(5)
    zv, gv = rng.standard_normal((1, 3)), rng.standard_normal((1, 3))
    expected = sym.lambdify([z, G], closed)(zv, gv)
    sv, cache = F.softmax_forward(zv)
    assert_close("dz", F.softmax_backward(gv, cache), expected)


def test_show_typesets_lhs_equals_latex(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    x = sp.Symbol("x")
    sym.show("y", x**2)
    assert len(shown) == 1 and shown[0].data == "y = x^{2}"
