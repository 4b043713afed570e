"""Tiled attention with an online softmax (chapter 15): a forward/backward pair.

The same function as attention_forward (chapter 6), computed one [block, block] tile of the
score matrix at a time, so that no [B, H, S_q, S_k] array is ever held:

* the forward keeps, per query row, a running maximum m, a running sum l of exp(z - m) and
  the running weighted values acc = sum_j exp(z_j - m) v_j, rescaling the old ones by
  exp(m_old - m_new) whenever a tile raises the maximum; at the end out = acc / l and the
  row's log-sum-exp lse = m + log l is the only statistic kept for the backward;
* the backward rebuilds each tile's probabilities as P = exp(z - lse) and uses
  D = rowsum(dout * out) in place of rowsum(dP * P) (the two are equal: chapter 15).

With causal=True the tiles that lie entirely above the (offset) diagonal are never
computed, in either pass. Dropout draws one seed from `rng` and makes each tile's keep-mask
a pure function of (seed, b, h, i, j) (a counter-based hash), so the backward recomputes
the same mask tile by tile and the mask does not depend on the block size.

Shape letters: B batch, H heads, S_q queries, S_k keys (S_k >= S_q with causal, the
queries being the last S_q positions), D_h the width of a head, D_v the width of a value.
"""
from __future__ import annotations

import math

from .. import backend, checks
from ..backend import matmul
from ._caches import TiledAttentionCache
from .attention import (_check_causal_lengths, _check_every_query_keeps_a_key, _check_settings,
                        _float_table, _key_padding_table)
from .softmax import _check_mask

TILED = "tiled attention"   # the label of its products in backend.count_matmuls()

# splitmix64's constants: the golden-ratio increment and the two finalizer multipliers
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def attention_tiles(s_q: int, s_k: int, block_size: int, causal: bool):
    """The tiles both passes compute: a list of (i0, i1, j0, j1, diagonal), row-major.

    Query rows i0..i1-1 against keys j0..j1-1 (the last tiles may be smaller than
    block_size). With causal=True, query i sees key j <= i + (S_k - S_q): a tile whose first
    key lies beyond what its last query sees is skipped, and `diagonal` says whether the
    tile straddles the boundary (and so needs the causal table).
    """
    offset = s_k - s_q
    tiles = []
    for i0 in range(0, s_q, block_size):
        i1 = min(i0 + block_size, s_q)
        for j0 in range(0, s_k, block_size):
            j1 = min(j0 + block_size, s_k)
            if causal and j0 > i1 - 1 + offset:
                continue                      # every entry above the diagonal: skipped
            diagonal = causal and j1 - 1 > i0 + offset
            tiles.append((i0, i1, j0, j1, diagonal))
    return tiles


def dropout_keep(seed: int, shape: tuple, rows: tuple, cols: tuple, p: float, like,
                 index=None):
    """The keep-mask of one tile: bool [B, H, i1 - i0, j1 - j0], True where kept.

    Entry (b, h, i, j) of the full [B, H, S_q, S_k] = `shape` mask is kept when
    u = (z >> 11) * 2^-53 >= p, z = splitmix64(seed + (n + 1) * golden), n =
    ((b H + h) S_q + i) S_k + j its row-major index (uint64 arithmetic, wrapping): u is the
    top 53 bits of the hash as a float64 in [0, 1), exact. So the mask is the same whichever
    tiles it is computed in, and on every array library.

    index: None, or (whole, origin): the attention is a block of a larger one (a rank's rows
    and heads, a ring's pair of chunks), whole = (B, H, S_q, S_k) its shape and origin =
    (b0, h0, i0, j0) where the block starts in it; n is then the index in `whole` of the
    entry, so that the block draws the larger attention's mask.
    """
    xp = backend.namespace(like)
    u64 = xp.uint64
    batch, heads, s_q, s_k = shape
    (i0, i1), (j0, j1) = rows, cols
    b0, h0, q0, k0 = (0, 0, 0, 0) if index is None else index[1]
    _, heads_all, s_q, s_k = shape if index is None else index[0]   # the whole attention's
    b = xp.reshape(xp.arange(b0, b0 + batch, dtype=u64), (batch, 1, 1, 1))
    h = xp.reshape(xp.arange(h0, h0 + heads, dtype=u64), (1, heads, 1, 1))
    i = xp.reshape(xp.arange(q0 + i0, q0 + i1, dtype=u64), (1, 1, i1 - i0, 1))
    j = xp.reshape(xp.arange(k0 + j0, k0 + j1, dtype=u64), (1, 1, 1, j1 - j0))
    n = ((b * heads_all + h) * s_q + i) * s_k + j                   # [B, H, bq, bk]
    z = xp.asarray(seed, dtype=u64) + (n + 1) * xp.asarray(_GOLDEN, dtype=u64)
    z = (z ^ (z >> 30)) * xp.asarray(_MIX1, dtype=u64)
    z = (z ^ (z >> 27)) * xp.asarray(_MIX2, dtype=u64)
    z = z ^ (z >> 31)
    u = xp.astype(z >> 11, xp.float64) * (2.0 ** -53)               # uniform in [0, 1)
    return u >= p


def _draw_seed(rng, like) -> int:
    """One 53-bit seed from `rng` (validated as dropout_forward validates it)."""
    checks.generator("rng", rng)
    draw = backend.to_numpy(backend.uniform(rng, (1,), like=like))
    return int(float(draw[0]) * 2.0 ** 53)


def tiled_attention_forward(q, k, v, mask=None, key_padding=None, causal=False, dropout_p=0.0,
                            rng=None, training=True, *, block_size=64, scale=None,
                            dropout_index=None):
    """out = dropout(A) @ v with A = softmax(scale q k^T + M), one tile at a time.

    q [B, H, S_q, D_h], k [B, H, S_k, D_h], v [B, H, S_k, D_v]; the masks as
    attention_forward takes them (mask additive, broadcastable to [B, H, S_q, S_k];
    key_padding bool [B, S_k], True = padded; causal with the KV offset S_k - S_q).
    block_size  the tile's side (an integer >= 1; any S, a multiple of it or not)
    scale       the scores' factor, 1 / sqrt(D_h) when None (a positive finite number)
    dropout_p   inverted dropout on A with the counter-based mask of `dropout_keep`, seeded
                by one draw from `rng`; the identity when training=False or dropout_p == 0
    dropout_index  None, or (whole, origin): this attention is the block at origin
                (b0, h0, i0, j0) of a larger one of shape whole (B, H, S_q, S_k), whose mask
                it draws (dropout_keep's index): a rank's rows and heads, a ring's pair
    ->  out [B, H, S_q, D_v]

    The cache is exactly (q, k, v, out, lse, settings): lse [B, H, S_q] is the row
    log-sum-exp of the masked, scaled scores and settings a dict (causal, scale,
    block_size, mask, key_padding, dropout_p, seed; seed None without dropout). Nothing of
    size S_q * S_k is kept. A query whose keys are all masked raises ValueError.
    """
    xp, settings = _check_tiled_attention_forward(q, k, v, mask, key_padding, causal, dropout_p,
                                                  rng, training, block_size, scale,
                                                  dropout_index)
    causal, seed = settings["causal"], settings["seed"]
    batch, heads, s_q, _ = q.shape
    s_k, d_v = k.shape[2], v.shape[3]
    dtype = q.dtype
    full = (batch, heads, s_q, s_k)
    m = xp.full((batch, heads, s_q, 1), -math.inf, dtype=dtype)     # running row max
    l = xp.zeros((batch, heads, s_q, 1), dtype=dtype)               # running sum exp(z - m)
    acc = xp.zeros((batch, heads, s_q, d_v), dtype=dtype)           # running sum exp(z - m) v
    for i0, i1, j0, j1, diagonal in attention_tiles(s_q, s_k, settings["block_size"], causal):
        z = _scores(xp, q, k, settings, full, i0, i1, j0, j1, diagonal)  # [B, H, bq, bk]
        m_old = m[:, :, i0:i1, :]
        m_new = xp.maximum(m_old, xp.max(z, axis=-1, keepdims=True))
        # a row with no key seen yet has m_new = -inf: shift by 0 so exp gives 0, not nan
        shift = xp.where(m_new == -math.inf, xp.zeros_like(m_new), m_new)
        p = xp.exp(z - shift)                                       # [B, H, bq, bk]
        rescale = xp.exp(m_old - shift)                             # [B, H, bq, 1]
        l[:, :, i0:i1, :] = rescale * l[:, :, i0:i1, :] + xp.sum(p, axis=-1, keepdims=True)
        if seed is not None:
            p = p * _dropout_factor(xp, settings, full, i0, i1, j0, j1, dtype, q)
        pv = matmul(p, v[:, :, j0:j1, :], TILED)                    # [B, H, bq, D_v]
        acc[:, :, i0:i1, :] = rescale * acc[:, :, i0:i1, :] + pv
        m[:, :, i0:i1, :] = m_new
    if causal or key_padding is not None or mask is not None:
        _check_every_query_keeps_a_key(xp, m)                       # m: the row max
    out = acc / l                                                   # [B, H, S_q, D_v]
    lse = xp.reshape(m + xp.log(l), (batch, heads, s_q))            # [B, H, S_q]
    return out, TiledAttentionCache(q, k, v, out, lse, settings)


def _check_tiled_attention_forward(q, k, v, mask, key_padding, causal, dropout_p, rng, training,
                                   block_size, scale, dropout_index=None):
    """tiled_attention_forward's checks, and its settings: q, k, v and the masks as
    attention_forward takes them, block_size an integer >= 1, scale None or a positive
    finite number; with dropout, one seed drawn from rng -> (xp, settings): a dict of causal,
    scale, block_size, mask (broadcast to [B, H, S_q, S_k], a view), key_padding (the
    additive [B, 1, 1, S_k] table), dropout_p (0 without a seed) and seed (None without
    dropout)."""
    xp, causal, dropout_p, training = _check_settings(q, k, v, causal, dropout_p, training)
    block_size = checks.integer("block_size", block_size, least=1)
    batch, heads, s_q, d_h = q.shape
    s_k = k.shape[2]
    checks.width("q", q, "D_h")
    checks.width("v", v, "D_v")
    scale = 1.0 / math.sqrt(d_h) if scale is None else checks.positive("scale", scale)
    full = (batch, heads, s_q, s_k)
    if causal:
        _check_causal_lengths(s_q, s_k)
    padding = None
    if key_padding is not None:
        padding = _key_padding_table(xp, q, key_padding, batch, s_k)  # [B, 1, 1, S_k]
    if mask is not None:
        _check_mask(mask, xp.broadcast_to(xp.zeros((1, 1, 1, 1), dtype=q.dtype), full))
        mask = xp.broadcast_to(mask, full)                          # a view, never a copy
    seed = None
    if training and dropout_p > 0.0:
        seed = _draw_seed(rng, q)
    if dropout_index is not None:
        whole, origin = dropout_index
        if (len(whole) != 4 or len(origin) != 4
                or any(o + n > w for o, n, w in zip(origin, full, whole))):
            raise ValueError(f"dropout_index: a block of shape {full} at {tuple(origin)} does "
                             f"not fit in {tuple(whole)}")
    settings = dict(causal=causal, scale=scale, block_size=block_size, mask=mask,
                    key_padding=padding, dropout_p=dropout_p if seed is not None else 0.0,
                    seed=seed, dropout_index=dropout_index if seed is not None else None)
    return xp, settings



def causal_tile(xp, s_q: int, s_k: int, rows: tuple, cols: tuple, dtype):
    """The causal table of one tile: [i1 - i0, j1 - j0] additive, -inf where query i of
    rows = (i0, i1) does not see key j of cols = (j0, j1), i.e. j > i + (S_k - S_q); 0
    elsewhere. Built from the tile's own index ranges (an outer comparison), so a tile costs
    its own size: the slice [i0:i1, j0:j1] of the whole [S_q, S_k] table, never the table."""
    (i0, i1), (j0, j1) = rows, cols
    i = xp.reshape(xp.arange(i0, i1), (i1 - i0, 1))                 # [bq, 1]
    j = xp.reshape(xp.arange(j0, j1), (1, j1 - j0))                 # [1, bk]
    return _float_table(xp, j > i + (s_k - s_q), dtype)             # [bq, bk]


def _scores(xp, q, k, settings, full, i0, i1, j0, j1, diagonal):
    """One tile of the masked, scaled scores: z [B, H, i1 - i0, j1 - j0]."""
    s_q, s_k = full[2], full[3]
    z = matmul(q[:, :, i0:i1, :], xp.matrix_transpose(k[:, :, j0:j1, :]), TILED)
    z *= settings["scale"]
    if diagonal:
        z += causal_tile(xp, s_q, s_k, (i0, i1), (j0, j1), z.dtype)
    if settings["key_padding"] is not None:
        z += settings["key_padding"][:, :, :, j0:j1]
    if settings["mask"] is not None:
        z += settings["mask"][:, :, i0:i1, j0:j1]
    return z


def _dropout_factor(xp, settings, full, i0, i1, j0, j1, dtype, like):
    """keep / (1 - p) of one tile, [B, H, bq, bk] in the inputs' dtype."""
    keep = dropout_keep(settings["seed"], full, (i0, i1), (j0, j1), settings["dropout_p"], like,
                        settings.get("dropout_index"))
    return xp.astype(keep, dtype) * (1.0 / (1.0 - settings["dropout_p"]))


def tiled_attention_backward(dout, cache):
    """The VJP of tiled_attention_forward, tile by tile, from (q, k, v, out, lse) only:

    P   = exp(z - lse)                     the tile's probabilities, rebuilt
    P'  = P * keep / (1 - p)               dropout's mask recomputed from the seed
    dV += P'^T dout,   dP = (dout V^T) * keep / (1 - p)
    D   = rowsum(dout * out)               (= rowsum(dP * P), chapter 15)
    dZ  = P * (dP - D),   dQ += scale dZ K,   dK += scale dZ^T Q

    dout [B, H, S_q, D_v]  ->  dq [B, H, S_q, D_h], dk [B, H, S_k, D_h], dv [B, H, S_k, D_v]
    """
    q, k, v, out, lse, settings = _check_tiled_attention_backward(dout, cache)
    xp = backend.namespace(q, k, v, dout)
    batch, heads, s_q, d_h = q.shape
    s_k = k.shape[2]
    full = (batch, heads, s_q, s_k)
    dtype = q.dtype
    scale = settings["scale"]
    lse = xp.reshape(lse, (batch, heads, s_q, 1))                   # [B, H, S_q, 1]
    big_d = xp.sum(dout * out, axis=-1, keepdims=True)              # [B, H, S_q, 1]
    dq = xp.zeros(q.shape, dtype=dtype)
    dk = xp.zeros(k.shape, dtype=dtype)
    dv = xp.zeros(v.shape, dtype=dtype)
    for i0, i1, j0, j1, diagonal in attention_tiles(s_q, s_k, settings["block_size"],
                                                    settings["causal"]):
        z = _scores(xp, q, k, settings, full, i0, i1, j0, j1, diagonal)  # [B, H, bq, bk]
        p = xp.exp(z - lse[:, :, i0:i1, :])                         # masked entries: 0
        g = dout[:, :, i0:i1, :]                                    # [B, H, bq, D_v]
        dp = matmul(g, xp.matrix_transpose(v[:, :, j0:j1, :]), TILED)  # [B, H, bq, bk]
        if settings["seed"] is not None:
            factor = _dropout_factor(xp, settings, full, i0, i1, j0, j1, dtype, q)
            dv[:, :, j0:j1, :] += matmul(xp.matrix_transpose(p * factor), g, TILED)
            dp *= factor
        else:
            dv[:, :, j0:j1, :] += matmul(xp.matrix_transpose(p), g, TILED)
        dz = p * (dp - big_d[:, :, i0:i1, :])
        dz *= scale
        dq[:, :, i0:i1, :] += matmul(dz, k[:, :, j0:j1, :], TILED)
        dk[:, :, j0:j1, :] += matmul(xp.matrix_transpose(dz), q[:, :, i0:i1, :], TILED)
    return dq, dk, dv


def _check_tiled_attention_backward(dout, cache):
    """tiled_attention_backward's check (tfcore.ops makes it before a kernel's work): dout
    like the forward's output -> (q, k, v, out, lse, settings)."""
    q, k, v, out, lse, settings = cache
    checks.upstream_like("dout", dout, out)
    return q, k, v, out, lse, settings
