"""Scaled dot-product attention, its masks and dropout, and the head reshapes (float64)."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tfcore import backend
from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close, check_gradients, random_upstream

pytestmark = pytest.mark.usefixtures("backend_name")


def _qkv(rng, batch=2, heads=3, s_q=4, s_k=4, d_h=5, d_v=None):
    q = rng.standard_normal((batch, heads, s_q, d_h))
    k = rng.standard_normal((batch, heads, s_k, d_h))
    v = rng.standard_normal((batch, heads, s_k, d_v or d_h))
    return q, k, v


def _reference(q, k, v, mask=None, key_padding=None, causal=False):
    """Attention one (batch, head, query) at a time, with plain Python loops over keys."""
    batch, heads, s_q, d_h = q.shape
    s_k = k.shape[2]
    out = np.zeros((batch, heads, s_q, v.shape[3]))
    probs = np.zeros((batch, heads, s_q, s_k))
    full = np.zeros((batch, heads, s_q, s_k)) if mask is None else np.broadcast_to(
        mask, (batch, heads, s_q, s_k)
    )
    for b in range(batch):
        for h in range(heads):
            for i in range(s_q):
                scores = []
                for j in range(s_k):
                    hidden = (causal and j > i + s_k - s_q) or (
                        key_padding is not None and key_padding[b, j]
                    )
                    score = sum(q[b, h, i, d] * k[b, h, j, d] for d in range(d_h))
                    score = score / math.sqrt(d_h) + full[b, h, i, j]
                    scores.append(-math.inf if hidden else score)
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                probs[b, h, i] = [w / total for w in weights]
                out[b, h, i] = probs[b, h, i] @ v[b, h]
    return out, probs


# --------------------------------------------------------------------------------------
# Forward


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal_kv_offset": dict(causal=True, s_q=2, s_k=5),
    "padding": dict(padding=True),
    "additive": dict(additive=True),
    "all_three": dict(causal=True, padding=True, additive=True, s_q=3, s_k=5),
}


def _case(rng, causal=False, padding=False, additive=False, s_q=4, s_k=4):
    q, k, v = _qkv(rng, heads=2, s_q=s_q, s_k=s_k, d_h=3)
    kwargs = {"causal": causal}
    if padding:
        pad = np.zeros((2, s_k), dtype=bool)
        pad[0, 0] = True  # key 0 of batch element 0 (the causal diagonal keeps a key per row)
        pad[1, s_k - 1] = True
        if causal:
            pad[0, 0] = False
            pad[0, s_k - 1] = True
            pad[1, s_k - 1] = False
            pad[1, 1] = True
        kwargs["key_padding"] = pad
    if additive:
        mask = rng.standard_normal((1, 2, s_q, s_k))
        mask[0, 1, :, 2] = -math.inf  # head 1 never sees key 2
        kwargs["mask"] = mask
    return q, k, v, kwargs


def _on_backend(kwargs):
    moved = dict(kwargs)
    for name in ("mask", "key_padding"):
        if name in moved:
            moved[name] = asarray(moved[name])
    return moved


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_loop_reference(rng, case):
    q, k, v, kwargs = _case(rng, **CASES[case])
    out, cache = F.attention_forward(asarray(q), asarray(k), asarray(v), **_on_backend(kwargs))
    ref_out, ref_probs = _reference(q, k, v, **kwargs)
    assert_close("out", out, ref_out)
    assert_close("A", cache[3], ref_probs)


def test_unequal_value_width(rng):
    q, k, v = _qkv(rng, d_v=7)
    out, cache = F.attention_forward(asarray(q), asarray(k), asarray(v))
    assert_close("out", out, _reference(q, k, v)[0])
    dq, dk, dv = F.attention_backward(asarray(np.ones(out.shape)), cache)
    assert tuple(dv.shape) == v.shape and tuple(dq.shape) == q.shape


def test_kv_cached_step_equals_last_row_of_full_causal(rng):
    """A query at the last position attending to all S_k cached keys (S_q = 1, causal)
    gives the last row of the full causal attention."""
    q, k, v = _qkv(rng, s_q=6, s_k=6)
    full, _ = F.attention_forward(asarray(q), asarray(k), asarray(v), causal=True)
    step, _ = F.attention_forward(asarray(q[:, :, -1:]), asarray(k), asarray(v), causal=True)
    assert_close("last row", step, to_numpy(full)[:, :, -1:])


# --------------------------------------------------------------------------------------
# Backward


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_finite_differences(rng, case):
    q, k, v, kwargs = _case(rng, **CASES[case])
    moved = _on_backend(kwargs)
    out, cache = F.attention_forward(asarray(q), asarray(k), asarray(v), **moved)
    G = random_upstream(tuple(out.shape), rng)
    dq, dk, dv = F.attention_backward(asarray(G), cache)

    def forward(q, k, v):
        return F.attention_forward(q, k, v, **moved)[0]

    check_gradients(forward, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, G, tol=1e-8)


def test_closed_form_backward(rng):
    """dV = A^T G, dZ = A * (G V^T - rowsum(G V^T * A)),
    dQ = dZ K / sqrt(d), dK = dZ^T Q / sqrt(d)."""
    q, k, v = _qkv(rng, s_q=3, s_k=5)
    out, cache = F.attention_forward(asarray(q), asarray(k), asarray(v))
    _, A = _reference(q, k, v)
    G = random_upstream(tuple(out.shape), rng)
    dq, dk, dv = F.attention_backward(asarray(G), cache)
    dA = G @ np.swapaxes(v, -1, -2)
    dZ = A * (dA - np.sum(dA * A, axis=-1, keepdims=True))
    assert_close("dv", dv, np.swapaxes(A, -1, -2) @ G)
    assert_close("dq", dq, dZ @ k / math.sqrt(5))
    assert_close("dk", dk, np.swapaxes(dZ, -1, -2) @ q / math.sqrt(5))


def test_padded_keys_get_zero_gradient(rng):
    """A padded key has probability 0 for every query, so dk and dv are exactly 0 there."""
    q, k, v = _qkv(rng, s_k=5)
    pad = np.zeros((2, 5), dtype=bool)
    pad[0, 3] = pad[1, 0] = pad[1, 4] = True
    out, cache = F.attention_forward(
        asarray(q), asarray(k), asarray(v), key_padding=asarray(pad)
    )
    _, dk, dv = F.attention_backward(asarray(random_upstream(tuple(out.shape), rng)), cache)
    for b, j in zip(*np.nonzero(pad)):
        assert np.all(to_numpy(dk)[b, :, j] == 0.0) and np.all(to_numpy(dv)[b, :, j] == 0.0)
    assert np.all(to_numpy(cache[3])[0, :, :, 3] == 0.0)


def test_causal_future_keys_get_zero_probability(rng):
    q, k, v = _qkv(rng, s_q=3, s_k=5)
    _, cache = F.attention_forward(asarray(q), asarray(k), asarray(v), causal=True)
    A = to_numpy(cache[3])
    future = np.arange(5)[None, :] > np.arange(3)[:, None] + 2
    assert np.all(A[:, :, future] == 0.0)
    assert np.all(A[:, :, ~future] > 0.0)


# --------------------------------------------------------------------------------------
# Dropout on the probabilities


def test_dropout_same_seed_same_output_and_eval_identity(rng):
    q, k, v = (asarray(t) for t in _qkv(rng))
    one, _ = F.attention_forward(q, k, v, dropout_p=0.3, rng=backend.default_rng(5))
    two, _ = F.attention_forward(q, k, v, dropout_p=0.3, rng=backend.default_rng(5))
    other, _ = F.attention_forward(q, k, v, dropout_p=0.3, rng=backend.default_rng(6))
    plain, _ = F.attention_forward(q, k, v)
    evaluated, _ = F.attention_forward(q, k, v, dropout_p=0.3, training=False)
    assert np.array_equal(to_numpy(one), to_numpy(two))
    assert not np.array_equal(to_numpy(one), to_numpy(other))
    assert np.array_equal(to_numpy(evaluated), to_numpy(plain))


def test_dropout_applies_to_probabilities_and_gradients_match(rng):
    q, k, v = _qkv(rng, heads=2, s_q=3, s_k=6, d_h=3)
    p = 0.4
    out, cache = F.attention_forward(
        asarray(q), asarray(k), asarray(v), causal=True, dropout_p=p, rng=backend.default_rng(9)
    )
    keep = to_numpy(cache[4][0])  # the cache's dropout entry: (keep-mask, scale)
    assert keep.shape == (2, 2, 3, 6) and 0 < keep.sum() < keep.size
    _, A = _reference(q, k, v, causal=True)
    assert_close("out", out, (A * keep / (1.0 - p)) @ v)
    G = random_upstream(tuple(out.shape), rng)
    dq, dk, dv = F.attention_backward(asarray(G), cache)

    def forward(q, k, v):  # the same seed draws the same mask: one fixed function
        return F.attention_forward(
            q, k, v, causal=True, dropout_p=p, rng=backend.default_rng(9)
        )[0]

    check_gradients(forward, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, G, tol=1e-8)


# --------------------------------------------------------------------------------------
# float32


def test_float32_path(rng):
    q, k, v = _qkv(rng)
    G = random_upstream((2, 3, 4, 5), rng)
    results = {}
    for dtype in ("float32", "float64"):
        out, cache = F.attention_forward(
            asarray(q, dtype), asarray(k, dtype), asarray(v, dtype), causal=True
        )
        grads = F.attention_backward(asarray(G, dtype), cache)
        assert all(str(t.dtype).endswith(dtype) for t in (out, *grads))
        results[dtype] = (out, *grads)
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["float32"], results["float64"]):
        assert_close(name, a, b, tol=1e-5)


# --------------------------------------------------------------------------------------
# Errors


def m(text: str) -> str:
    return re.escape(text)


def test_fully_masked_query_raises(rng):
    q, k, v = (asarray(t) for t in _qkv(rng, s_k=3))
    pad = np.zeros((2, 3), dtype=bool)
    pad[1, :] = True
    with pytest.raises(ValueError, match=m("query 0 of batch element 1, head 0 has every key")):
        F.attention_forward(q, k, v, key_padding=asarray(pad))
    pad = np.zeros((2, 3), dtype=bool)
    pad[0, 0] = True  # with causal, query 0 of batch element 0 sees only key 0
    q4 = asarray(rng.standard_normal((2, 3, 3, 5)))
    with pytest.raises(ValueError, match=m("query 0 of batch element 0, head 0 has every key")):
        F.attention_forward(q4, k, v, key_padding=asarray(pad), causal=True)


def test_bad_inputs_raise_clear_errors(rng):
    q, k, v = (asarray(t) for t in _qkv(rng, s_k=3))
    with pytest.raises(ValueError, match=m("k must have shape (2, 3, *, 5), got (2, 3, 3, 4)")):
        F.attention_forward(q, asarray(np.zeros((2, 3, 3, 4))), v)
    with pytest.raises(ValueError, match=m("v must have shape (2, 3, 3, *), got (2, 3, 2, 5)")):
        F.attention_forward(q, k, asarray(np.zeros((2, 3, 2, 5))))
    with pytest.raises(ValueError, match=m("q must have 4 dimensions, got shape (3, 4, 5)")):
        F.attention_forward(asarray(np.zeros((3, 4, 5))), k, v)
    with pytest.raises(ValueError, match=m("causal attention needs S_k >= S_q")):
        F.attention_forward(q, k, v, causal=True)
    with pytest.raises(ValueError, match=m("key_padding must have shape (2, 3), got (2, 4)")):
        F.attention_forward(q, k, v, key_padding=asarray(np.zeros((2, 4), dtype=bool)))
    with pytest.raises(TypeError, match=m("key_padding must be a bool array")):
        F.attention_forward(q, k, v, key_padding=asarray(np.zeros((2, 3)), "int64"))
    with pytest.raises(ValueError, match=m("does not broadcast to the scores' shape")):
        F.attention_forward(q, k, v, mask=asarray(np.zeros((4, 4))))
    with pytest.raises(ValueError, match=m("dropout in training needs an rng")):
        F.attention_forward(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match=m("inputs must share one float dtype")):
        F.attention_forward(q, k, asarray(np.zeros((2, 3, 3, 5)), "float32"))
    out, cache = F.attention_forward(q, k, v)
    expected = "dout must have the forward output's shape (2, 3, 4, 5) and dtype float64"
    with pytest.raises(ValueError, match=m(expected + ", got shape (2, 3, 5, 4)")):
        F.attention_backward(asarray(np.zeros((2, 3, 5, 4))), cache)
    with pytest.raises(ValueError, match=m("got shape (2, 3, 4, 5) and dtype float32")):
        F.attention_backward(asarray(np.zeros((2, 3, 4, 5)), "float32"), cache)


# --------------------------------------------------------------------------------------
# Heads: split, merge, the fused QKV layout


def test_split_merge_round_trip_and_layout(rng):
    x = rng.standard_normal((2, 5, 12))
    heads = F.split_heads(asarray(x), 3)
    assert tuple(heads.shape) == (2, 3, 5, 4)
    assert np.array_equal(to_numpy(heads)[:, 1], x[:, :, 4:8])  # head 1 owns columns 4..8
    assert np.array_equal(to_numpy(F.merge_heads(heads)), x)
    if backend.get_backend() == "numpy":
        assert np.shares_memory(to_numpy(heads), x)  # split is a view


def test_qkv_split_layout_and_its_backward(rng):
    batch, seq, heads, d_h = 2, 3, 2, 4
    width = heads * d_h
    qkv = rng.standard_normal((batch, seq, 3 * width))
    q, k, v = F.qkv_split(asarray(qkv), heads)
    for index, part in enumerate((q, k, v)):
        block = qkv[:, :, index * width:(index + 1) * width]
        for h in range(heads):
            assert np.array_equal(to_numpy(part)[:, h], block[:, :, h * d_h:(h + 1) * d_h])
    if backend.get_backend() == "numpy":
        assert np.shares_memory(to_numpy(q), qkv) and np.shares_memory(to_numpy(v), qkv)
    # qkv_merge_grads is the adjoint of the split: <split(x), g> = <x, merge(g)>
    grads = [rng.standard_normal((batch, heads, seq, d_h)) for _ in range(3)]
    dqkv = F.qkv_merge_grads(*(asarray(g) for g in grads))
    lhs = sum(np.sum(to_numpy(p) * g) for p, g in zip((q, k, v), grads))
    assert_close("<x, merge(g)>", np.sum(qkv * to_numpy(dqkv)), lhs)
    assert np.array_equal(to_numpy(F.qkv_merge_grads(q, k, v)), qkv)


def test_head_errors():
    expected = "n_heads must be a positive integer dividing the width 12, got 5"
    with pytest.raises(ValueError, match=m(expected)):
        F.split_heads(asarray(np.zeros((2, 3, 12))), 5)
    with pytest.raises(ValueError, match=m("qkv must have 3 * D columns (q | k | v), got 10")):
        F.qkv_split(asarray(np.zeros((2, 3, 10))), 1)
    with pytest.raises(ValueError, match=m("dv must have shape (1, 2, 3, 4), got (1, 2, 3, 5)")):
        F.qkv_merge_grads(*(asarray(np.zeros(s)) for s in [(1, 2, 3, 4)] * 2 + [(1, 2, 3, 5)]))
