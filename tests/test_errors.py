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
    with pytest.raises(
        ValueError,
        match=m("P must have shape (S_max >= 5, 4) to cover x of shape (2, 5, 4), got (3, 4)"),
    ):
        F.positional_forward(a((2, 5, 4)), a((3, 4)))
    with pytest.raises(
        ValueError,
        match=m("P must have shape (S_max >= 3, 4) to cover x of shape (2, 3, 4), got (8, 6)"),
    ):
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
    with pytest.raises(
        ValueError,
        match=m("mask of shape (3, 3) does not broadcast to the scores' shape (2, 3, 4)"),
    ):
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
    with pytest.raises(
        ValueError,
        match=m("labels must lie in [0, 4) (or -100 to ignore), found 4"),
    ):
        F.cross_entropy_forward(a((3, 4)), ids([0, 4, 1]))
    with pytest.raises(
        ValueError,
        match=m("labels must lie in [0, 4) (or -100 to ignore), found -1"),
    ):
        F.cross_entropy_forward(a((3, 4)), ids([-100, -1, 1]))
    with pytest.raises(
        ValueError,
        match=m("labels must lie in [0, 4) (or -1 to ignore), found -100"),
    ):
        F.cross_entropy_forward(a((3, 4)), ids([-1, -100, 1]), ignore_index=-1)


def test_cross_entropy_float_labels():
    with pytest.raises(TypeError, match=m("labels must be an integer array, got float64")):
        F.cross_entropy_forward(a((3, 4)), a((3,)))


# --------------------------------------------------------------------------------------
# Dtypes and array types


def test_mismatched_float_dtypes():
    with pytest.raises(
        TypeError,
        match=m("inputs must share one float dtype, got x=float32, W=float64"),
    ):
        F.linear_forward(a((2, 4), "float32"), a((4, 3), "float64"))
    with pytest.raises(
        TypeError,
        match=m("inputs must share one float dtype, got x=float64, gamma=float32, beta=float64"),
    ):
        F.layernorm_forward(a((2, 4)), a((4,), "float32"), a((4,)))
    with pytest.raises(
        TypeError,
        match=m("inputs must share one float dtype, got z=float32, mask=float64"),
    ):
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
    """`host` on a library other than the selected backend's (NumPy when strict is selected)."""
    if backend.get_backend() == "strict":
        return np.asarray(host)
    import array_api_strict

    return array_api_strict.asarray(host)


def test_arrays_of_two_libraries():
    """Ops never move data silently between libraries."""
    x = asarray(np.ones((2, 4)))
    with pytest.raises(
        TypeError,
        match=r"inputs must be arrays of one library, got .*; move "
               r"them with tfcore\.backend\.asarray first",
    ):
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
    with pytest.raises(
        ValueError,
        match=m("every row of the mask must keep at least one entry; "
                "a fully masked row has no softmax"),
    ):
        F.softmax_forward(a((2, 3, 4)), asarray(mask))


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "+inf"])
def test_nan_or_plus_inf_mask(bad):
    mask = np.zeros((3, 4))
    mask[0, 2] = bad
    with pytest.raises(
        ValueError,
        match=m("mask must be additive: 0 (or any finite value) keeps an "
                "entry, -inf masks it; found nan or +inf"),
    ):
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
    with pytest.raises(
        ValueError,
        match=m("dropout in training needs an rng: pass tfcore.backend.default_rng(seed)"),
    ):
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
    with pytest.raises(
        ValueError,
        match=m("approximate must be one of ('none', 'tanh'), got 'fast'"),
    ):
        F.gelu_forward(a((2, 3)), approximate="fast")


def test_sinusoidal_bad_sizes():
    with pytest.raises(
        ValueError,
        match=m("length and width must be at least 1, got length=0, width=4"),
    ):
        F.sinusoidal_positions(0, 4)
    with pytest.raises(
        ValueError,
        match=m("length and width must be at least 1, got length=3, width=0"),
    ):
        F.sinusoidal_positions(3, 0)


def test_infinite_eps():
    with pytest.raises(ValueError, match=m("eps must be finite, got inf")):
        F.layernorm_forward(a((2, 4)), a((4,)), a((4,)), eps=float("inf"))
    with pytest.raises(ValueError, match=m("eps must be finite, got inf")):
        F.rmsnorm_forward(a((2, 4)), a((4,)), eps=float("inf"))
    with pytest.raises(TypeError, match=m("eps must be a real number, got str '1e-5'")):
        F.rmsnorm_forward(a((2, 4)), a((4,)), eps="1e-5")


# --------------------------------------------------------------------------------------
# Settings: sizes, dtypes, probabilities, generators


@pytest.mark.parametrize(
    "length, error, text",
    [
        (2.5, TypeError, "length must be an integer, got float 2.5"),
        (-2, ValueError, "length must be at least 1, got -2"),
        (0, ValueError, "length must be at least 1, got 0"),
        (True, TypeError, "length must be an integer, got bool True"),
    ],
)
def test_causal_mask_length(length, error, text):
    with pytest.raises(error, match=m(text)):
        F.causal_mask(length)


def test_causal_mask_accepts_dtype_objects():
    xp = backend.xp()
    for dtype in ("float32", xp.float32, np.float32, np.dtype("float32")):
        mask = F.causal_mask(3, dtype)
        assert mask.dtype == xp.float32
        assert np.array_equal(backend.to_numpy(mask), np.triu(np.full((3, 3), -np.inf), 1))
    for bad in ("int64", np.int64, xp.int64, "float16", None, 3):
        with pytest.raises(TypeError, match=r"dtype must be 'float32' or 'float64'"):
            F.causal_mask(3, bad)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(base=0.0), ValueError, "base must be positive, got 0.0"),
        (dict(base=-3.0), ValueError, "base must be positive, got -3.0"),
        (dict(base=float("inf")), ValueError, "base must be finite, got inf"),
        (dict(base=float("nan")), ValueError, "base must be positive, got nan"),
        (dict(dtype="int64"), TypeError, "dtype must be 'float32' or 'float64'"),
        (dict(length=2.0), TypeError, "length must be an integer, got float 2.0"),
        (dict(width=4.5), TypeError, "width must be an integer, got float 4.5"),
    ],
)
def test_sinusoidal_bad_settings(kwargs, error, text):
    args = dict(length=3, width=4) | kwargs
    with pytest.raises(error, match=m(text)):
        F.sinusoidal_positions(**args)


def test_sinusoidal_dtype_object():
    xp = backend.xp()
    table = F.sinusoidal_positions(3, 4, dtype=xp.float32)
    assert table.dtype == xp.float32
    assert np.allclose(backend.to_numpy(table), backend.to_numpy(F.sinusoidal_positions(3, 4)))


@pytest.mark.parametrize("p", [True, "0.1", None, float("nan")])
def test_dropout_p_not_a_probability(p):
    error = ValueError if isinstance(p, float) else TypeError
    with pytest.raises(error, match=r"\bp must"):
        F.dropout_forward(a((2, 3)), p, backend.default_rng(0))


def test_dropout_int_seed_is_rejected():
    """An int seed would make the same mask at every call: ask for a generator instead."""
    with pytest.raises(
        TypeError,
        match=m("rng must be a generator from tfcore.backend.default_rng(seed), got int 0"),
    ):
        F.dropout_forward(a((2, 3)), 0.1, 0)
    with pytest.raises(TypeError, match=m("training must be True or False, got str 'yes'")):
        F.dropout_forward(a((2, 3)), 0.1, backend.default_rng(0), training="yes")


def test_gelu_approximate_must_be_a_name():
    with pytest.raises(
        ValueError,
        match=m("approximate must be one of ('none', 'tanh'), got None"),
    ):
        F.gelu_forward(a((2, 3)), approximate=None)


def test_ignore_index_is_an_integer():
    with pytest.raises(TypeError, match=m("ignore_index must be an integer, got float -100.0")):
        F.cross_entropy_forward(a((3, 4)), ids([0, 1, 2]), ignore_index=-100.0)


# --------------------------------------------------------------------------------------
# Upstream gradients: every backward checks shape, dtype and library against its forward


def _forward_backward_pairs():
    """(name, forward output, cache, backward) for every array-valued op pair."""
    x = asarray(np.random.default_rng(0).standard_normal((2, 3, 5)))
    W, g = a((5, 4), fill=0.1), a((5,), fill=1.0)
    rows = [
        ("linear", *F.linear_forward(x, W, a((4,))), F.linear_backward),
        ("relu", *F.relu_forward(x), F.relu_backward),
        ("gelu", *F.gelu_forward(x), F.gelu_backward),
        ("softmax", *F.softmax_forward(x), F.softmax_backward),
        ("log_softmax", *F.log_softmax_forward(x), F.log_softmax_backward),
        ("layernorm", *F.layernorm_forward(x, g, a((5,))), F.layernorm_backward),
        ("rmsnorm", *F.rmsnorm_forward(x, g), F.rmsnorm_backward),
        ("dropout", *F.dropout_forward(x, 0.5, backend.default_rng(0)), F.dropout_backward),
        ("dropout_eval", *F.dropout_forward(x, 0.5, training=False), F.dropout_backward),
        ("residual", *F.residual_forward(x, x), F.residual_backward),
        ("positional", *F.positional_forward(x, a((4, 5))), F.positional_backward),
        ("embedding", *F.embedding_forward(ids([[0, 1, 2], [2, 1, 0]]), a((3, 5))),
         F.embedding_backward),
    ]
    return rows


@pytest.mark.parametrize("row", range(12))
def test_backward_checks_upstream(row):
    name, y, cache, backward = _forward_backward_pairs()[row]
    shape = tuple(y.shape)
    host = np.ones(shape)
    gname = r"d[a-z]+"
    # the right number of elements in the wrong layout
    swapped = (shape[1], shape[0]) + shape[2:]
    with pytest.raises(
        ValueError,
        match=gname + m(f" must have shape {shape} like the forward's output, got {swapped}"),
    ):
        backward(asarray(host.reshape(swapped)), cache)
    # a smaller gradient that would broadcast
    with pytest.raises(
        ValueError,
        match=gname + m(f" must have shape {shape} like the forward's output, got {shape[-1:]}"),
    ):
        backward(asarray(np.ones(shape[-1:])), cache)
    with pytest.raises(
        TypeError,
        match=gname + m(" must have dtype float64 like the forward's output, got float32"),
    ):
        backward(asarray(host, "float32"), cache)
    with pytest.raises(
        TypeError,
        match=gname + r" must be an array of the forward's library \(.*\), got ",
    ):
        backward(_foreign(host), cache)
    with pytest.raises(TypeError, match=gname + m(" must be an array, got list")):
        backward(host.tolist(), cache)
    backward(asarray(host), cache)  # and the right one passes


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_scalar_loss_backward_takes_a_scalar(loss):
    if loss == "cross_entropy":
        _, cache = F.cross_entropy_forward(a((2, 3), fill=0.5), ids([0, 2]))
        backward = F.cross_entropy_backward
    else:
        _, cache = F.mse_forward(a((2, 3), fill=0.5), a((2, 3)))
        backward = F.mse_backward
    reference = backend.to_numpy(backward(1.0, cache))
    for scalar in (1, np.float32(1.0), np.float64(1.0), asarray(np.array(1.0)), np.array(1.0)):
        assert np.array_equal(backend.to_numpy(backward(scalar, cache)), reference)
    with pytest.raises(
        ValueError,
        match=m("dloss must be a scalar (a number or a 0-d array) because "
                "the loss is a scalar, got shape (2, 3)"),
    ):
        backward(a((2, 3)), cache)
    with pytest.raises(
        TypeError,
        match=m("dloss must be a scalar (a number or a 0-d array), got list"),
    ):
        backward([1.0], cache)
    with pytest.raises(
        TypeError,
        match=m("dloss must be a scalar (a number or a 0-d array), got bool"),
    ):
        backward(True, cache)
    with pytest.raises(TypeError, match=m("dloss must be float32 or float64, got int64")):
        backward(asarray(np.array(1), "int64"), cache)


# --------------------------------------------------------------------------------------
# Input classes: lists, 0-d arrays, zero widths, empty batches, uint64, masked arrays


def test_list_and_zero_dim_inputs():
    with pytest.raises(TypeError, match=m("ids must be an array, got list")):
        F.embedding_forward([0, 1], a((3, 2)))
    with pytest.raises(TypeError, match=m("labels must be an array, got tuple")):
        F.cross_entropy_forward(a((2, 3)), (0, 1))
    with pytest.raises(ValueError, match=m("z must have at least 1 dimension(s), got shape ()")):
        F.softmax_forward(a(()))
    with pytest.raises(ValueError, match=m("x must have at least 1 dimension(s), got shape ()")):
        F.layernorm_forward(a(()), a((1,)), a((1,)))


def test_zero_width_is_an_error():
    with pytest.raises(
        ValueError,
        match=m("x must have a nonzero last axis (D), got shape (2, 0)"),
    ):
        F.layernorm_forward(a((2, 0)), a((0,)), a((0,)))
    with pytest.raises(
        ValueError,
        match=m("z must have a nonzero last axis (K), got shape (2, 0)"),
    ):
        F.softmax_forward(a((2, 0)))
    with pytest.raises(
        ValueError,
        match=m("x must have a nonzero last axis (D_in), got shape (2, 0)"),
    ):
        F.linear_forward(a((2, 0)), a((0, 3)))
    with pytest.raises(
        ValueError,
        match=m("logits must have a nonzero last axis (V), got shape (2, 0)"),
    ):
        F.cross_entropy_forward(a((2, 0)), ids([0, 0]))


def test_empty_batch_gives_an_empty_result():
    x = a((0, 4))
    y, cache = F.linear_forward(x, a((4, 3), fill=1.0), a((3,)))
    dx, dW, db = F.linear_backward(a((0, 3)), cache)
    assert tuple(y.shape) == (0, 3) and tuple(dx.shape) == (0, 4)
    assert np.array_equal(backend.to_numpy(dW), np.zeros((4, 3)))
    s, cache = F.softmax_forward(x)
    assert tuple(F.softmax_backward(a((0, 4)), cache).shape) == (0, 4)
    y, cache = F.layernorm_forward(x, a((4,)), a((4,)))
    dx, dg, dbeta = F.layernorm_backward(a((0, 4)), cache)
    assert tuple(dx.shape) == (0, 4) and np.array_equal(backend.to_numpy(dg), np.zeros(4))
    loss, cache = F.cross_entropy_forward(x, ids(np.zeros(0, dtype=int)))
    assert float(loss) == 0.0
    with pytest.raises(ValueError, match=m("pred must have at least one element")):
        F.mse_forward(x, x)


def test_uint64_ids_beyond_int64():
    big = np.array([0, 2**63 + 5], dtype=np.uint64)
    with pytest.raises(ValueError, match=m(f"ids must lie in [0, 3), found {2**63 + 5}")):
        F.embedding_forward(asarray(big), a((3, 2)))
    x, _ = F.embedding_forward(asarray(np.array([2, 0], dtype=np.uint64)), a((3, 2), fill=1.0))
    assert tuple(x.shape) == (2, 2)


def test_masked_arrays_are_refused():
    if backend.get_backend() != "numpy":
        pytest.skip("masked arrays are NumPy's")
    masked = np.ma.masked_array(np.ones((2, 3)), mask=[[0, 1, 0], [0, 0, 0]])
    with pytest.raises(
        TypeError,
        match=m("x: masked arrays are not supported, pass x.filled(...) or x.data"),
    ):
        F.relu_forward(masked)
    with pytest.raises(TypeError, match=m("ids: masked arrays are not supported")):
        F.embedding_forward(np.ma.masked_array([0, 1]), a((3, 2)))


def test_float16_is_refused():
    with pytest.raises(TypeError, match=m("x must be float32 or float64, got float16")):
        F.gelu_forward(np.ones(3, dtype=np.float16))  # strict has no float16


def test_mixed_libraries_name_the_arguments():
    with pytest.raises(
        TypeError,
        match=r"inputs must be arrays of one library, got x=.*, W=.*; move them",
    ):
        F.linear_forward(a((2, 4)), _foreign(np.ones((4, 3))))


# --------------------------------------------------------------------------------------
# Values: dead ReLU units, huge rows, rows with no finite score


def test_relu_dead_unit_is_exactly_zero_under_inf_and_nan():
    x = asarray(np.array([-1.0, 0.0, 2.0, -3.0, 4.0]))
    dy = asarray(np.array([np.inf, np.nan, 5.0, -np.inf, np.nan]))
    _, cache = F.relu_forward(x)
    with np.errstate(invalid="ignore"):
        dx = backend.to_numpy(F.relu_backward(dy, cache))
    assert dx[0] == 0.0 and dx[1] == 0.0 and dx[3] == 0.0 and dx[2] == 5.0 and np.isnan(dx[4])


@pytest.mark.parametrize(
    "dtype, scale", [("float64", 1e200), ("float32", 2e19), ("float64", 1e307)]
)
def test_norms_of_huge_rows(dtype, scale, rng):
    host = rng.standard_normal((3, 8))
    host[1] = 1.0                                          # a constant row: y = beta exactly
    gamma, beta = rng.standard_normal(8), rng.standard_normal(8)
    centered = host - host.mean(-1, keepdims=True)
    var = (centered**2).mean(-1, keepdims=True)
    expect_ln = gamma * centered / np.sqrt(var + 1e-5 / scale / scale) + beta
    expect_ln[1] = beta                                    # 0 / sqrt(0 + eps) on the constant row
    expect_rms = gamma * host / np.sqrt((host**2).mean(-1, keepdims=True))
    x = asarray(host * scale, dtype)
    y, cache = F.layernorm_forward(x, asarray(gamma, dtype), asarray(beta, dtype))
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert np.allclose(backend.to_numpy(y), expect_ln, rtol=tol, atol=tol)
    dx, _, _ = F.layernorm_backward(asarray(np.ones((3, 8)), dtype), cache)
    assert np.all(np.isfinite(backend.to_numpy(dx)))
    y, cache = F.rmsnorm_forward(x, asarray(gamma, dtype))
    assert np.allclose(backend.to_numpy(y), expect_rms, rtol=tol, atol=tol)


def test_norms_refuse_non_finite_rows():
    host = np.ones((2, 4))
    host[0, 1] = np.inf
    with pytest.raises(
        ValueError,
        match=m("x has inf or nan entries: its normalization is undefined"),
    ):
        F.layernorm_forward(asarray(host), a((4,)), a((4,)))
    with pytest.raises(ValueError, match=m("x has inf or nan entries")):
        F.rmsnorm_forward(asarray(host), a((4,)))


def test_softmax_row_of_minus_inf():
    host = np.zeros((2, 3))
    host[1] = -np.inf
    with pytest.raises(
        ValueError,
        match=m("z has a row whose entries are all -inf: its softmax is 0/0"),
    ):
        F.softmax_forward(asarray(host))
    with pytest.raises(ValueError, match=m("z has a row whose entries are all -inf")):
        F.log_softmax_forward(asarray(host))
    with pytest.raises(ValueError, match=m("logits has a row whose entries are all -inf")):
        F.cross_entropy_forward(asarray(host), ids([0, 1]))
