"""Bad input fails loudly: each error names the argument, what it got and what was expected."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tfcore import backend
from tfcore import functional as F
from tfcore.backend import asarray

pytestmark = pytest.mark.usefixtures("backend_name")


def a(shape, dtype="float64", fill=None):
    """A float (or integer) array of `shape` on the selected backend."""
    host = np.zeros(shape) if fill is None else np.full(shape, fill)
    return asarray(host, dtype)


def ids(values):
    return asarray(np.array(values), "int64")


def m(text: str) -> str:
    """A literal piece of an error message, for pytest.raises(match=...)."""
    return re.escape(text)


# --------------------------------------------------------------------------------------
# Shapes and ranks


def test_linear_x_last_dim_mismatch():
    with pytest.raises(ValueError, match=m("x must have shape (*, *, 4), got (2, 3, 5)")):
        F.linear_forward(a((2, 3, 5)), a((4, 6)))


def test_linear_W_not_2d():
    with pytest.raises(ValueError, match=m("W must have 2 dimensions, got shape (4,)")):
        F.linear_forward(a((2, 4)), a((4,)))
    with pytest.raises(ValueError, match=m("W must have 2 dimensions, got shape (2, 4, 6)")):
        F.linear_forward(a((2, 4)), a((2, 4, 6)))


def test_linear_scalar_x():
    with pytest.raises(ValueError, match=m("x must have at least 1 dimension(s), got shape ()")):
        F.linear_forward(a(()), a((1, 3)))


def test_linear_bias_shape():
    with pytest.raises(ValueError, match=m("b must have shape (6,), got (4,)")):
        F.linear_forward(a((2, 4)), a((4, 6)), a((4,)))


def test_layernorm_gamma_and_beta_shapes():
    with pytest.raises(ValueError, match=m("gamma must have shape (4,), got (3,)")):
        F.layernorm_forward(a((2, 4)), a((3,)), a((4,)))
    with pytest.raises(ValueError, match=m("beta must have shape (4,), got (4, 1)")):
        F.layernorm_forward(a((2, 4)), a((4,)), a((4, 1)))


def test_rmsnorm_gain_shape():
    with pytest.raises(ValueError, match=m("gain must have shape (4,), got (5,)")):
        F.rmsnorm_forward(a((2, 4)), a((5,)))


def test_positional_P_too_short_or_too_narrow():
    with pytest.raises(ValueError, match=m("P must have shape (S_max >= 5, 4) to cover x of shape (2, 5, 4), got (3, 4)")):
        F.positional_forward(a((2, 5, 4)), a((3, 4)))
    with pytest.raises(ValueError, match=m("P must have shape (S_max >= 3, 4) to cover x of shape (2, 3, 4), got (8, 6)")):
        F.positional_forward(a((2, 3, 4)), a((8, 6)))


def test_positional_ranks():
    with pytest.raises(ValueError, match=m("x must have 3 dimensions, got shape (3, 4)")):
        F.positional_forward(a((3, 4)), a((3, 4)))
    with pytest.raises(ValueError, match=m("P must have 2 dimensions, got shape (1, 3, 4)")):
        F.positional_forward(a((2, 3, 4)), a((1, 3, 4)))


def test_embedding_W_rank():
    with pytest.raises(ValueError, match=m("W must have 2 dimensions, got shape (5,)")):
        F.embedding_forward(ids([0, 1]), a((5,)))


def test_cross_entropy_labels_shape():
    with pytest.raises(ValueError, match=m("labels must have shape (2, 3), got (2, 4)")):
        F.cross_entropy_forward(a((2, 3, 5)), ids(np.zeros((2, 4), dtype=int)))
    with pytest.raises(ValueError, match=m("labels must have shape (2, 3), got (6,)")):
        F.cross_entropy_forward(a((2, 3, 5)), ids(np.zeros(6, dtype=int)))


def test_mse_and_residual_shapes():
    with pytest.raises(ValueError, match=m("target must have shape (2, 3), got (3, 2)")):
        F.mse_forward(a((2, 3)), a((3, 2)))
    with pytest.raises(ValueError, match=m("fx must have shape (2, 3), got (2, 4)")):
        F.residual_forward(a((2, 3)), a((2, 4)))


def test_softmax_mask_does_not_broadcast():
    with pytest.raises(ValueError, match=m("mask of shape (3, 3) does not broadcast to the scores' shape (2, 3, 4)")):
        F.softmax_forward(a((2, 3, 4)), a((3, 3)))


# --------------------------------------------------------------------------------------
# Integer ids and labels


def test_embedding_ids_out_of_range():
    W = a((5, 3))
    with pytest.raises(ValueError, match=m("ids must lie in [0, 5), found 5")):
        F.embedding_forward(ids([[0, 5, 1]]), W)
    with pytest.raises(ValueError, match=m("ids must lie in [0, 5), found -1")):
        F.embedding_forward(ids([[0, 2], [-1, 1]]), W)


def test_embedding_float_ids():
    with pytest.raises(TypeError, match=m("ids must be an integer array, got float64")):
        F.embedding_forward(a((2, 3)), a((5, 3)))


def test_cross_entropy_labels_out_of_range():
    with pytest.raises(ValueError, match=m("labels must lie in [0, 4) (or -100 to ignore), found 4")):
        F.cross_entropy_forward(a((3, 4)), ids([0, 4, 1]))
    with pytest.raises(ValueError, match=m("labels must lie in [0, 4) (or -100 to ignore), found -1")):
        F.cross_entropy_forward(a((3, 4)), ids([-100, -1, 1]))
    with pytest.raises(ValueError, match=m("labels must lie in [0, 4) (or -1 to ignore), found -100")):
        F.cross_entropy_forward(a((3, 4)), ids([-1, -100, 1]), ignore_index=-1)


def test_cross_entropy_float_labels():
    with pytest.raises(TypeError, match=m("labels must be an integer array, got float64")):
        F.cross_entropy_forward(a((3, 4)), a((3,)))


# --------------------------------------------------------------------------------------
# Dtypes and array types


def test_mismatched_float_dtypes():
    with pytest.raises(TypeError, match=m("inputs must share one float dtype, got x=float32, W=float64")):
        F.linear_forward(a((2, 4), "float32"), a((4, 3), "float64"))
    with pytest.raises(TypeError, match=m("inputs must share one float dtype, got x=float64, gamma=float32, beta=float64")):
        F.layernorm_forward(a((2, 4)), a((4,), "float32"), a((4,)))
    with pytest.raises(TypeError, match=m("inputs must share one float dtype, got z=float32, mask=float64")):
        F.softmax_forward(a((2, 4), "float32"), a((2, 4)))


@pytest.mark.parametrize(
    "call",
    [
        lambda x: F.relu_forward(x),
        lambda x: F.gelu_forward(x),
        lambda x: F.softmax_forward(x),
        lambda x: F.log_softmax_forward(x),
        lambda x: F.dropout_forward(x, 0.5, backend.default_rng(0)),
    ],
    ids=["relu", "gelu", "softmax", "log_softmax", "dropout"],
)
def test_non_float_input(call):
    with pytest.raises(TypeError, match=r"must be float32 or float64, got int64"):
        call(a((2, 3), "int64"))
    with pytest.raises(TypeError, match=r"must be float32 or float64, got bool"):
        call(a((2, 3), "bool"))


def test_non_array_input():
    with pytest.raises(TypeError, match=m("x must be an array, got list")):
        F.relu_forward([1.0, -2.0])
    with pytest.raises(TypeError, match=m("W must be an array, got float")):
        F.linear_forward(a((2, 1)), 3.0)
    with pytest.raises(TypeError, match=m("logits must be float32 or float64, got int64")):
        F.cross_entropy_forward(a((2, 3), "int64"), ids([0, 1]))


def _foreign(host):
    """`host` on a library other than the selected backend's (array-api-strict, or NumPy when strict is selected)."""
    if backend.get_backend() == "strict":
        return np.asarray(host)
    import array_api_strict

    return array_api_strict.asarray(host)


def test_arrays_of_two_libraries():
    """Ops never move data silently between libraries."""
    x = asarray(np.ones((2, 4)))
    with pytest.raises(TypeError, match=r"inputs must be arrays of one library, got .*; move them with tfcore\.backend\.asarray first"):
        F.linear_forward(x, _foreign(np.ones((4, 3))))
    with pytest.raises(TypeError, match=r"inputs must be arrays of one library"):
        F.residual_forward(x, _foreign(np.ones((2, 4))))
    with pytest.raises(TypeError, match=r"inputs must be arrays of one library"):
        F.embedding_forward(_foreign(np.array([0, 1])), asarray(np.ones((3, 2))))
    with pytest.raises(TypeError, match=r"inputs must be arrays of one library"):
        F.softmax_forward(x, _foreign(np.zeros((2, 4))))


# --------------------------------------------------------------------------------------
# Masks


def test_fully_masked_softmax_row():
    mask = np.zeros((3, 4))
    mask[1, :] = -np.inf
    with pytest.raises(ValueError, match=m("every row of the mask must keep at least one entry; a fully masked row has no softmax")):
        F.softmax_forward(a((2, 3, 4)), asarray(mask))


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "+inf"])
def test_nan_or_plus_inf_mask(bad):
    mask = np.zeros((3, 4))
    mask[0, 2] = bad
    with pytest.raises(ValueError, match=m("mask must be additive: 0 (or any finite value) keeps an entry, -inf masks it; found nan or +inf")):
        F.softmax_forward(a((2, 3, 4)), asarray(mask))


# --------------------------------------------------------------------------------------
# Hyper-parameters


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_p_outside_unit_interval(p):
    with pytest.raises(ValueError, match=m(f"dropout probability p must lie in [0, 1), got {p}")):
        F.dropout_forward(a((2, 3)), p, backend.default_rng(0))
    with pytest.raises(ValueError, match=m(f"dropout probability p must lie in [0, 1), got {p}")):
        F.dropout_forward(a((2, 3)), p, training=False)


def test_dropout_missing_rng():
    with pytest.raises(ValueError, match=m("dropout in training needs an rng: pass tfcore.backend.default_rng(seed)")):
        F.dropout_forward(a((2, 3)), 0.5)


@pytest.mark.parametrize("eps", [0.0, -1e-5])
def test_nonpositive_eps(eps):
    with pytest.raises(ValueError, match=m(f"eps must be positive, got {eps}")):
        F.layernorm_forward(a((2, 4)), a((4,)), a((4,)), eps=eps)
    with pytest.raises(ValueError, match=m(f"eps must be positive, got {eps}")):
        F.rmsnorm_forward(a((2, 4)), a((4,)), eps=eps)


def test_nan_eps():
    with pytest.raises(ValueError, match=m("eps must be positive, got nan")):
        F.layernorm_forward(a((2, 4)), a((4,)), a((4,)), eps=float("nan"))


def test_unknown_gelu_approximation():
    with pytest.raises(ValueError, match=m("approximate must be one of ('none', 'tanh'), got 'fast'")):
        F.gelu_forward(a((2, 3)), approximate="fast")


def test_sinusoidal_bad_sizes():
    with pytest.raises(ValueError, match=m("length and width must be at least 1, got length=0, width=4")):
        F.sinusoidal_positions(0, 4)
    with pytest.raises(ValueError, match=m("length and width must be at least 1, got length=3, width=0")):
        F.sinusoidal_positions(3, 0)
