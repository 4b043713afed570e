"""The memory-sharing contract of tfcore.functional, stated in its docstring, checked exactly.

Caches hold references (not copies) to inputs and outputs; a few outputs and gradients are
their input itself; everything else is a new array, and no op writes into its arguments.
"""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import backend
from tfcore import functional as F
from tfcore.backend import asarray, to_numpy

pytestmark = pytest.mark.usefixtures("backend_name")


def _arrays(rng):
    x = asarray(rng.standard_normal((2, 3, 5)))
    return dict(
        x=x,
        dy=asarray(rng.standard_normal((2, 3, 5))),
        W=asarray(rng.standard_normal((5, 4))),
        b=asarray(rng.standard_normal(4)),
        dy4=asarray(rng.standard_normal((2, 3, 4))),
        g=asarray(rng.standard_normal(5)),
        beta=asarray(rng.standard_normal(5)),
        P=asarray(rng.standard_normal((4, 5))),
    )


def test_caches_keep_references_not_copies(rng):
    t = _arrays(rng)
    x = t["x"]
    y, cache = F.linear_forward(x, t["W"], t["b"])
    assert cache[0] is x and cache[1] is t["W"]
    y, cache = F.gelu_forward(x)
    assert cache[0] is x
    s, cache = F.softmax_forward(x)
    assert cache is s
    y, cache = F.log_softmax_forward(x)
    assert cache is y
    y, cache = F.layernorm_forward(x, t["g"], t["beta"])
    assert cache[2] is t["g"]
    y, cache = F.rmsnorm_forward(x, t["g"])
    assert cache[2] is t["g"]


def test_outputs_and_gradients_that_are_their_inputs(rng):
    t = _arrays(rng)
    x, dy = t["x"], t["dy"]
    y, cache = F.dropout_forward(x, 0.5, training=False)
    assert y is x and F.dropout_backward(dy, cache) is dy
    y, cache = F.dropout_forward(x, 0.0, backend.default_rng(0))
    assert y is x and F.dropout_backward(dy, cache) is dy
    _, cache = F.residual_forward(x, x)
    dx, dfx = F.residual_backward(dy, cache)
    assert dx is dy and dfx is dy
    _, cache = F.positional_forward(x, t["P"])
    dx, dP = F.positional_backward(dy, cache)
    assert dx is dy and dP is not dy


def _every_pair(t):
    x, dy = t["x"], t["dy"]
    return [
        ("linear", lambda: F.linear_forward(x, t["W"], t["b"]), F.linear_backward, t["dy4"]),
        ("relu", lambda: F.relu_forward(x), F.relu_backward, dy),
        ("gelu", lambda: F.gelu_forward(x), F.gelu_backward, dy),
        ("softmax", lambda: F.softmax_forward(x), F.softmax_backward, dy),
        ("log_softmax", lambda: F.log_softmax_forward(x), F.log_softmax_backward, dy),
        ("layernorm", lambda: F.layernorm_forward(x, t["g"], t["beta"]), F.layernorm_backward, dy),
        ("rmsnorm", lambda: F.rmsnorm_forward(x, t["g"]), F.rmsnorm_backward, dy),
        ("dropout", lambda: F.dropout_forward(x, 0.5, backend.default_rng(0)), F.dropout_backward,
         dy),
        ("positional", lambda: F.positional_forward(x, t["P"]), F.positional_backward, dy),
        ("residual", lambda: F.residual_forward(x, t["P"][:3, :] + x), F.residual_backward, dy),
    ]


def test_no_op_writes_into_its_arguments(rng):
    """Forwards leave their inputs, backwards their upstream gradient and cache, bit for bit."""
    t = _arrays(rng)
    before = {k: np.array(to_numpy(v)) for k, v in t.items()}
    for name, forward, backward, upstream in _every_pair(t):
        y, cache = forward()
        y_before = np.array(to_numpy(y))
        backward(upstream, cache)
        for k, v in t.items():
            assert np.array_equal(to_numpy(v), before[k]), f"{name} wrote into {k}"
        assert np.array_equal(to_numpy(y), y_before), f"{name}'s backward wrote into its output"


def test_new_arrays_share_no_memory(rng):
    """Apart from the aliases listed above, outputs and gradients are fresh arrays."""
    if backend.get_backend() != "numpy":
        pytest.skip("np.shares_memory needs NumPy arrays")
    t = _arrays(rng)
    aliased = {"positional": 1, "residual": 2}           # gradients that are dy by contract
    for name, forward, backward, upstream in _every_pair(t):
        y, cache = forward()
        grads = backward(upstream, cache)
        grads = grads if isinstance(grads, tuple) else (grads,)
        for k, v in t.items():
            assert not np.shares_memory(y, v), f"{name}'s output shares memory with {k}"
        fresh = [g for g in grads if g is not None and g is not upstream]
        assert len(fresh) == len([g for g in grads if g is not None]) - aliased.get(name, 0)
        for grad in fresh:
            for k, v in t.items():
                assert not np.shares_memory(grad, v), f"{name}'s gradient shares memory with {k}"


def test_editing_an_input_between_forward_and_backward_changes_the_gradient(rng):
    """Why the contract matters: linear's cache is x itself, so dW follows an in-place edit."""
    t = _arrays(rng)
    x = asarray(np.array(to_numpy(t["x"])))                  # a private copy to edit
    _, cache = F.linear_forward(x, t["W"])
    _, dW_before, _ = F.linear_backward(t["dy4"], cache)
    x *= 2.0
    _, dW_after, _ = F.linear_backward(t["dy4"], cache)
    assert np.allclose(to_numpy(dW_after), 2.0 * to_numpy(dW_before), rtol=1e-12, atol=0)
