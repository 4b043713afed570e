"""Tiled attention (online softmax, recomputing backward) against the dense op, float64."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tfcore import backend
from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.functional.tiled_attention import attention_tiles, dropout_keep
from tfcore.gradcheck import assert_close, check_gradients, random_upstream

pytestmark = pytest.mark.usefixtures("backend_name")

CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal_kv_offset": dict(causal=True, s_q=3, s_k=8),
    "padding": dict(padding=True),
    "additive": dict(additive=True),
    "all_three": dict(causal=True, padding=True, additive=True, s_q=5, s_k=7),
    "more_queries": dict(padding=True, s_q=9, s_k=4),
}
BLOCKS = (1, 2, 3, 4, 64)        # 1, sizes that do not divide S, and one larger than S


def _case(rng, causal=False, padding=False, additive=False, s_q=7, s_k=7, d_h=3, d_v=4):
    q = rng.standard_normal((2, 2, s_q, d_h))
    k = rng.standard_normal((2, 2, s_k, d_h))
    v = rng.standard_normal((2, 2, s_k, d_v))
    kwargs = {"causal": causal}
    if padding:
        pad = np.zeros((2, s_k), dtype=bool)
        pad[0, s_k - 1] = True            # key 0 stays: the causal diagonal keeps it per row
        pad[1, 1] = pad[1, s_k - 2] = True
        kwargs["key_padding"] = pad
    if additive:
        mask = rng.standard_normal((1, 2, s_q, s_k))
        mask[0, 1, :, 2] = -math.inf      # head 1 never sees key 2
        kwargs["mask"] = mask
    return q, k, v, kwargs


def _on_backend(kwargs):
    return {n: asarray(x) if isinstance(x, np.ndarray) else x for n, x in kwargs.items()}


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("case", list(CASES))
def test_equals_dense_forward_and_backward(rng, case, block_size):
    q, k, v, kwargs = _case(rng, **CASES[case])
    moved = _on_backend(kwargs)
    q_, k_, v_ = asarray(q), asarray(k), asarray(v)
    out, cache = F.attention_forward(q_, k_, v_, **moved)
    G = asarray(random_upstream(tuple(out.shape), rng))
    grads = F.attention_backward(G, cache)
    t_out, t_cache = F.tiled_attention_forward(q_, k_, v_, **moved, block_size=block_size)
    t_grads = F.tiled_attention_backward(G, t_cache)
    assert_close("out", t_out, out)
    for name, t_grad, grad in zip(("dq", "dk", "dv"), t_grads, grads):
        assert_close(name, t_grad, grad)


def test_cache_is_out_and_lse_only(rng):
    """The cache is (q, k, v, out, lse, settings): the log-sum-exp of the scaled scores."""
    q, k, v, _ = _case(rng, s_q=6, s_k=9)
    out, cache = F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), block_size=4)
    assert len(cache) == 6
    c_q, c_k, c_v, c_out, lse, settings = cache
    assert c_q is not None and c_out is out and tuple(lse.shape) == (2, 2, 6)
    z = q @ np.swapaxes(k, -1, -2) / math.sqrt(3)
    top = z.max(-1)
    assert_close("lse", lse, top + np.log(np.exp(z - top[..., None]).sum(-1)))
    assert isinstance(settings, dict) and settings["seed"] is None
    assert not any(hasattr(x, "shape") and x.ndim == 4 and x.shape[-2:] == (6, 9)
                   for x in settings.values())


def test_backward_accepts_a_cache_of_views(rng):
    """A cache whose out and lse are views (a slice of a larger result, as ring attention
    keeps) gives the same gradients as one of arrays of their own."""
    q, k, v, _ = _case(rng, s_q=6, s_k=9)
    q, k, v = asarray(q), asarray(k), asarray(v)
    out, cache = F.tiled_attention_forward(q, k, v, causal=False, block_size=4)
    G = asarray(rng.standard_normal(tuple(out.shape)))
    wide_out = asarray(np.concatenate([to_numpy(out)] * 2, axis=-2))    # [B, H, 2 S_q, D]
    wide_lse = asarray(np.concatenate([to_numpy(cache[4])] * 2, axis=-1))
    views = (*cache[:3], wide_out[:, :, 6:, :], wide_lse[:, :, 6:], cache[5])
    for got, want in zip(F.tiled_attention_backward(G, views),
                         F.tiled_attention_backward(G, cache)):
        assert_close("grad", got, want)


def test_scale_argument(rng):
    q, k, v, _ = _case(rng)
    out, cache = F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), block_size=3,
                                           scale=0.25)
    G = random_upstream(tuple(out.shape), rng)
    # scale s on q k^T equals the default 1/sqrt(D_h) applied to q * s * sqrt(D_h)
    ref, ref_cache = F.attention_forward(asarray(q * 0.25 * math.sqrt(3)), asarray(k), asarray(v))
    assert_close("out", out, ref)
    dq, dk, dv = F.tiled_attention_backward(asarray(G), cache)
    rq, rk, rv = F.attention_backward(asarray(G), ref_cache)
    assert_close("dq", dq, to_numpy(rq) * 0.25 * math.sqrt(3))
    assert_close("dk", dk, rk)
    assert_close("dv", dv, rv)


@pytest.mark.parametrize("case", ["plain", "all_three"])
def test_gradients_match_finite_differences(rng, case):
    q, k, v, kwargs = _case(rng, **CASES[case])
    moved = _on_backend(kwargs)
    out, cache = F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), **moved,
                                           block_size=3)
    G = random_upstream(tuple(out.shape), rng)
    dq, dk, dv = F.tiled_attention_backward(asarray(G), cache)

    def forward(q, k, v):
        return F.tiled_attention_forward(q, k, v, **moved, block_size=3)[0]

    check_gradients(forward, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, G, tol=1e-8)


def test_causal_skips_the_tiles_above_the_diagonal():
    tiles = attention_tiles(8, 8, 2, causal=True)
    assert len(tiles) == 4 * 5 // 2                         # T_b (T_b + 1) / 2 of T_b^2
    assert all(j0 <= i1 - 1 for i0, i1, j0, j1, _ in tiles)
    assert [t[:4] for t in tiles if t[4]] == [(i, i + 2, i, i + 2) for i in range(0, 8, 2)]
    # the KV offset: 2 queries at the end of 6 keys see every tile left of the diagonal
    assert [t[2:4] for t in attention_tiles(2, 6, 2, causal=True)] == [(0, 2), (2, 4), (4, 6)]
    assert len(attention_tiles(7, 7, 3, causal=False)) == 9


def test_causal_tile_is_the_slice_of_the_whole_table():
    """Each diagonal tile's causal table, built from the tile's own index ranges, equals
    the same slice of the whole [S_q, S_k] table, with and without the KV offset."""
    from tfcore.functional.attention import _causal_table
    from tfcore.functional.tiled_attention import causal_tile

    xp = backend.namespace(asarray(np.zeros(1)))
    for s_q, s_k, block in ((8, 8, 3), (3, 11, 2), (7, 7, 7), (5, 9, 4)):
        whole = to_numpy(_causal_table(xp, s_q, s_k, xp.float64))
        for i0, i1, j0, j1, diagonal in attention_tiles(s_q, s_k, block, causal=True):
            tile = to_numpy(causal_tile(xp, s_q, s_k, (i0, i1), (j0, j1), xp.float64))
            assert tile.shape == (i1 - i0, j1 - j0)
            assert np.array_equal(tile, whole[i0:i1, j0:j1])
            assert diagonal == bool(np.isinf(tile).any())    # only diagonal tiles mask


# --------------------------------------------------------------------------------------
# Dropout: the tiled op's own mask, a pure function of (seed, b, h, i, j)


def _full_keep(seed, shape, p):
    return to_numpy(dropout_keep(seed, shape, (0, shape[2]), (0, shape[3]), p,
                                 asarray(np.zeros(1))))


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_equals_dense_computation_with_the_same_mask(rng, causal):
    q, k, v, _ = _case(rng, s_q=6, s_k=6)
    p = 0.3
    out, cache = F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), causal=causal,
                                           dropout_p=p, rng=backend.default_rng(3), block_size=4)
    seed = cache[5]["seed"]
    keep = _full_keep(seed, (2, 2, 6, 6), p)
    z = q @ np.swapaxes(k, -1, -2) / math.sqrt(3)
    if causal:
        z = z + np.where(np.triu(np.ones((6, 6), bool), 1), -np.inf, 0.0)
    A = np.exp(z - z.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    A_dropped = A * keep / (1 - p)
    assert_close("out", out, A_dropped @ v)
    G = random_upstream(tuple(out.shape), rng)
    dq, dk, dv = F.tiled_attention_backward(asarray(G), cache)
    dA = (G @ np.swapaxes(v, -1, -2)) * keep / (1 - p)
    dZ = A * (dA - np.sum(dA * A, axis=-1, keepdims=True)) / math.sqrt(3)
    assert_close("dv", dv, np.swapaxes(A_dropped, -1, -2) @ G)
    assert_close("dq", dq, dZ @ k)
    assert_close("dk", dk, np.swapaxes(dZ, -1, -2) @ q)
    # the mask does not depend on the block size, and the same seed repeats it
    again, _ = F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), causal=causal,
                                         dropout_p=p, rng=backend.default_rng(3), block_size=1)
    assert_close("block size 1", again, out)


def test_dropout_mask_statistics_and_eval():
    keep = _full_keep(12345, (4, 4, 64, 64), 0.25)
    assert abs(keep.mean() - 0.75) < 0.01                   # 65536 draws: sd 0.0017
    other = _full_keep(12346, (4, 4, 64, 64), 0.25)
    assert 0.5 < (keep == other).mean() < 0.7               # independent: 0.625 expected
    q = asarray(np.ones((1, 1, 3, 2)))
    out, cache = F.tiled_attention_forward(q, q, q, dropout_p=0.5, training=False)
    assert cache[5]["seed"] is None and cache[5]["dropout_p"] == 0.0


def test_dropout_gradients_match_finite_differences(rng):
    q, k, v, _ = _case(rng, s_q=5, s_k=5)

    def forward(q, k, v):
        return F.tiled_attention_forward(q, k, v, causal=True, dropout_p=0.4,
                                         rng=backend.default_rng(8), block_size=2)[0]

    out, cache = F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), causal=True,
                                           dropout_p=0.4, rng=backend.default_rng(8),
                                           block_size=2)
    G = random_upstream(tuple(out.shape), rng)
    dq, dk, dv = F.tiled_attention_backward(asarray(G), cache)
    check_gradients(forward, {"q": q, "k": k, "v": v}, {"q": dq, "k": dk, "v": dv}, G, tol=1e-8)


# --------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("bad, error, words", [
    (dict(block_size=0), ValueError, "block_size must be at least 1"),
    (dict(block_size=-3), ValueError, "block_size"),
    (dict(block_size=2.0), TypeError, "block_size must be an integer"),
    (dict(block_size=True), TypeError, "block_size"),
    (dict(scale=0.0), ValueError, "scale must be positive"),
    (dict(scale=math.nan), ValueError, "scale"),
    (dict(scale="1"), TypeError, "scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p=0.1), ValueError, "rng"),
    (dict(dropout_p=0.1, rng=3), TypeError, "rng"),
])
def test_bad_settings_are_refused(rng, bad, error, words):
    q, k, v, _ = _case(rng)
    with pytest.raises(error, match=words):
        F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), **bad)


def test_bad_arrays_are_refused(rng):
    q, k, v, _ = _case(rng, s_q=5, s_k=4)
    with pytest.raises(ValueError, match="S_k >= S_q"):
        F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), causal=True)
    with pytest.raises(ValueError, match="v must have shape"):
        F.tiled_attention_forward(asarray(q), asarray(k), asarray(v[:, :, :3]))
    with pytest.raises(TypeError, match="key_padding must be a bool"):
        F.tiled_attention_forward(asarray(q), asarray(k), asarray(v),
                                  key_padding=asarray(np.zeros((2, 4))))
    pad = np.ones((2, 4), dtype=bool)
    with pytest.raises(ValueError, match="every key masked"):
        F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), key_padding=asarray(pad),
                                  block_size=2)


def test_backward_checks_dout(rng):
    q, k, v, _ = _case(rng)
    out, cache = F.tiled_attention_forward(asarray(q), asarray(k), asarray(v), block_size=2)
    with pytest.raises(ValueError, match="dout must have shape"):
        F.tiled_attention_backward(asarray(np.ones((2, 2, 7, 3))), cache)
    with pytest.raises(TypeError, match="dout must have dtype"):
        F.tiled_attention_backward(asarray(np.ones(out.shape, dtype=np.float32)), cache)
    with pytest.raises(TypeError, match="dout"):
        F.tiled_attention_backward(np.ones(out.shape).tolist(), cache)


# --------------------------------------------------------------------------------------
# The decoder's switch


@pytest.mark.parametrize("llama", [False, True])
def test_decoder_with_tiled_attention_equals_dense(rng, llama):
    from tfcore.models import DecoderConfig, DecoderLM

    make = DecoderConfig.llama if llama else DecoderConfig
    extra = dict(multiple_of=8) if llama else {}
    models = []
    for attention in ("dense", "tiled"):
        cfg = make(vocab_size=11, max_seq_len=9, d_model=8, n_layers=2, n_heads=2,
                   attention=attention, attention_block_size=4, **extra)
        models.append(DecoderLM(cfg).init(seed=4))
    ids = asarray(rng.integers(0, 11, (2, 9)))
    targets = asarray(rng.integers(0, 11, (2, 9)))
    results = []
    for model in models:
        model.params.zero_grad()
        logits, loss = model.forward(ids, targets)
        model.backward()
        results.append((to_numpy(logits), float(loss), to_numpy(model.params.grad)))
    (dense_logits, dense_loss, dense_grad), (logits, loss, grad) = results
    assert_close("logits", logits, dense_logits)
    assert abs(loss - dense_loss) <= 1e-12 * abs(dense_loss)
    assert_close("grad", grad, dense_grad)


def test_decoder_refuses_bad_attention_settings():
    from tfcore.models import DecoderConfig, DecoderLM

    with pytest.raises(ValueError, match="attention must be one of"):
        DecoderLM(DecoderConfig(11, 8, 8, 1, 2, attention="flash"))
    with pytest.raises(ValueError, match="attention_block_size must be a positive integer"):
        DecoderLM(DecoderConfig(11, 8, 8, 1, 2, attention="tiled", attention_block_size=0))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_decoder_size_table_with_tiled_attention(rng, dropout):
    """The size table's tiled row (lse in place of A; the output is a view of the merged
    heads, kept for the projection anyway) is what the caches hold."""
    from tfcore.models import DecoderConfig, DecoderLM
    from tfcore.models.sizes import decoder_sizes, held_bytes

    sizes = {}
    for attention in ("dense", "tiled"):
        cfg = DecoderConfig.llama(vocab_size=13, max_seq_len=6, d_model=8, n_layers=2,
                                  n_heads=2, d_ff=12, dropout=dropout, attention=attention,
                                  attention_block_size=4)
        model = DecoderLM(cfg).init(0)
        ids = asarray(rng.integers(0, 13, (2, 6)), "int64")
        model.forward(ids, ids, training=True, rng=backend.default_rng(1))
        held = held_bytes(model._cache, [model.params.data, model.params.grad, ids]
                          + list(model._rope))
        table = decoder_sizes(cfg, 2, 6)
        assert held == table["activation_bytes"]
        sizes[attention] = table["activation_bytes_per_layer"]
    B, H, S = 2, 2, 6
    saved = (B * H * S * S - B * H * S) * 8 + (B * H * S * S if dropout else 0)
    assert sizes["dense"] - sizes["tiled"] == saved


def test_a_block_with_a_dropout_index_draws_the_whole_attentions_mask():
    """dropout_index: the attention of some rows and heads (a rank's block) draws its block
    of the whole attention's mask, so its output is the whole output's block, bit for bit."""
    import numpy as np

    from tfcore import backend
    from tfcore.functional.tiled_attention import tiled_attention_forward

    rng = np.random.default_rng(0)
    q, k, v = (backend.asarray(rng.standard_normal((3, 4, 6, 5))) for _ in range(3))
    whole, _ = tiled_attention_forward(q, k, v, causal=True, dropout_p=0.3,
                                       rng=backend.default_rng(7), block_size=4)
    block = (slice(1, 3), slice(2, 4), ...)                     # rows 1..2, heads 2..3
    part, cache = tiled_attention_forward(
        q[block], k[block], v[block], causal=True, dropout_p=0.3,
        rng=backend.default_rng(7), block_size=4,
        dropout_index=((3, 4, 6, 6), (1, 2, 0, 0)))
    assert np.array_equal(backend.to_numpy(part), backend.to_numpy(whole[block]))
    assert cache.settings["dropout_index"] == ((3, 4, 6, 6), (1, 2, 0, 0))
    import pytest
    with pytest.raises(ValueError, match="does not fit"):
        tiled_attention_forward(q, k, v, dropout_p=0.3, rng=backend.default_rng(7),
                                dropout_index=((3, 4, 6, 6), (1, 0, 0, 0)))
