"""tfcore.nn.Parameters: one flat buffer of values, one of gradients, every tensor a view."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import backend, nn
from tfcore.backend import asarray, to_numpy

pytestmark = pytest.mark.usefixtures("backend_name")

SHAPES = {"wte": (5, 3), "h0.attn.qkv.W": (3, 9), "h0.attn.qkv.b": (9,), "h0.ln1.g": (3,),
          "h0.attn.proj.W": (3, 3), "head.W": (3, 5)}


def test_layout_offsets_and_views():
    p = nn.Parameters(SHAPES, "float64")
    assert p.names == list(SHAPES)
    assert p.size == p.numel() == sum(int(np.prod(s)) for s in SHAPES.values())
    assert tuple(p.data.shape) == tuple(p.grad.shape) == (p.size,)
    assert p.nbytes == 8 * p.size
    start = 0
    for name, shape in SHAPES.items():
        assert p.offsets[name] == (start, start + int(np.prod(shape)))
        start += int(np.prod(shape))
        assert tuple(p[name].shape) == shape and tuple(p.grad_of(name).shape) == shape
    # a write through a view lands in the flat buffer, and the other way round
    view = p["h0.attn.qkv.b"]
    view += 1.0
    a, b = p.offsets["h0.attn.qkv.b"]
    flat = to_numpy(p.data)
    assert np.all(flat[a:b] == 1.0) and np.sum(flat) == 9.0
    grad = p.grad_of("wte")
    grad += asarray(np.ones((5, 3)))
    assert float(np.sum(to_numpy(p.grad))) == 15.0
    p.zero_grad()
    assert not np.any(to_numpy(p.grad))
    assert float(np.sum(to_numpy(p["h0.attn.qkv.b"]))) == 9.0   # values untouched


def test_accumulate_adds_twice_into_one_view():
    p = nn.Parameters(SHAPES)
    g = np.arange(15.0).reshape(5, 3)
    nn.accumulate(p, "wte", asarray(g))
    nn.accumulate(p, "wte", asarray(g))
    assert np.array_equal(to_numpy(p.grad_of("wte")), 2 * g)


def test_decay_mask_only_weight_matrices():
    p = nn.Parameters(SHAPES)
    mask = to_numpy(p.decay_mask())
    for name in SHAPES:
        a, b = p.offsets[name]
        assert np.all(mask[a:b] == (1.0 if name.endswith(".W") else 0.0)), name
    only = to_numpy(p.decay_mask(["wte"]))
    assert only.sum() == 15 and np.all(only[:15] == 1)
    with pytest.raises(KeyError, match="unknown parameter"):
        p.decay_mask(["nope"])


def test_state_dict_round_trip_and_mismatch():
    p = nn.Parameters(SHAPES)
    nn.gpt2_init(p, seed=3, n_layers=1)
    state = p.state_dict()
    q = nn.Parameters(SHAPES)
    q.load_state_dict(state)
    assert np.array_equal(to_numpy(q.data), to_numpy(p.data))
    other = nn.Parameters({**SHAPES, "wte": (6, 3)})
    before = to_numpy(other.data).copy()
    with pytest.raises(ValueError, match=r"wte: \(5, 3\) vs \(6, 3\)"):
        other.load_state_dict(state)
    assert np.array_equal(to_numpy(other.data), before)
    with pytest.raises(ValueError, match="1-D array of"):
        p.load_flat(np.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        p.load_flat(np.full(p.size, np.nan))


def test_gpt2_init_is_seeded_and_scaled():
    p = nn.Parameters({"wte": (400, 50), "h0.attn.proj.W": (400, 50), "h0.ln1.g": (50,),
                       "h0.attn.qkv.b": (50,)})
    nn.gpt2_init(p, seed=0, n_layers=8)
    q = nn.Parameters(p.shapes)
    nn.gpt2_init(q, seed=0, n_layers=8)
    assert np.array_equal(to_numpy(p.data), to_numpy(q.data))
    assert abs(np.std(to_numpy(p["wte"])) - 0.02) < 0.001
    assert abs(np.std(to_numpy(p["h0.attn.proj.W"])) - 0.02 / 4.0) < 0.0002
    assert np.all(to_numpy(p["h0.ln1.g"]) == 1) and np.all(to_numpy(p["h0.attn.qkv.b"]) == 0)


def test_bad_layouts():
    with pytest.raises(ValueError, match="dtype must be one of"):
        nn.Parameters(SHAPES, "float16")
    with pytest.raises(ValueError, match="positive sizes"):
        nn.Parameters({"w": (0, 3)})
    with pytest.raises(KeyError, match="no parameter named 'x'"):
        nn.Parameters(SHAPES)["x"]


def test_float32_buffers():
    p = nn.Parameters(SHAPES, "float32")
    assert "float32" in str(p.data.dtype) and p.nbytes == 4 * p.size
    assert backend.get_backend() in backend.BACKENDS
