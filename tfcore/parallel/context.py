"""Context parallelism: the sequence split over N_C ranks, attention computed as a ring.

Every op of a decoder but attention works on each token alone, so a sequence cut into
chunks can be processed chunk by chunk on different ranks. Attention is the exception: the
queries of one chunk need the keys and values of every chunk before it. Ring attention
(Liu et al., 2023) passes the key/value blocks around the ring r -> r+1: at step t rank r
holds the block of rank (r - t) mod N_C, computes its queries' attention against it with
the tiled op of chapter 15 (`tiled_attention_forward`, which returns the block's output and
row log-sum-exp), and merges the result into its running one with the online-softmax merge
(chapter 15 proves it), written here for summaries (Y, lse):

    lse = log(exp(lse_a) + exp(lse_b)),  Y = exp(lse_a - lse) Y_a + exp(lse_b - lse) Y_b

The backward pass keeps only the merged Y and lse per query (the tiled op's backward needs
nothing else: P = exp(Z - lse) and D = rowsum(dY * Y) with the *final* Y and lse give each
block's exact share of dQ, dK, dV). The key/value blocks go around the ring once more; the
partial dK, dV of a block travel with it, each rank adding its queries' share, and after
the last step they reach the block's owner.

Layouts (`ContextLayout`). Plain: rank r holds chunk r of N_C contiguous chunks. Causal
attention then loads the ranks unevenly (rank r computes r + 1 blocks, rank N_C - 1 all
N_C). Balanced: the sequence is cut into 2 N_C chunks and rank r holds chunks r and
2 N_C - 1 - r, so every rank computes the same number of score entries. Chunk sizes follow
chunk_bounds (S need not be a multiple of N_C); every chunk must hold a position.

Shape letters: B batch, H heads, S the whole sequence, S_r the positions rank r holds,
D_h the width of a head, N_C the size of the context-parallel group.

Bytes per rank (elements of K and V are B H D_h per position; c_r = S_r):
    forward   K, V blocks of every rank but r + 1:           2 B H D_h (S - c_{r+1})
    backward  K, V again, and the dK, dV partials of every
              block but r's own:                            2 B H D_h (2S - c_r - c_{r+1})
With S = N_C m: 2 (N_C - 1) B H m D_h forward and 4 (N_C - 1) B H m D_h backward, the
all-gather and the all-reduce of a ring collective (`ring_attention_bytes`). With
grouped-query attention the blocks carry the H_kv key/value heads: H becomes H_kv.
"""
from __future__ import annotations

import math

import numpy as np

from .. import checks, ops
from ..backend import namespace
from ..models.blocks import repeat_kv_heads, sum_kv_groups
from ..models.decoder import DecoderConfig
from .comm import chunk_bounds

FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


class ContextLayout:
    """Which positions of a sequence of `seq_len` each of `size` ranks holds.

    balanced=False: chunk_bounds(S, N_C); rank r holds chunk r.
    balanced=True:  chunk_bounds(S, 2 N_C); rank r holds chunks r and 2 N_C - 1 - r.
    A rank's local rows are its chunks concatenated in increasing position order.
    """

    def __init__(self, seq_len: int, size: int, balanced: bool = False):
        self.size = checks.integer("size", size, least=1)
        self.seq_len = checks.integer("seq_len", seq_len, least=1)
        self.balanced = checks.boolean("balanced", balanced)
        self.n_chunks = 2 * size if self.balanced else size
        if seq_len < self.n_chunks:
            raise ValueError(
                f"seq_len ({seq_len}) must be at least the number of chunks "
                f"({self.n_chunks} = {'2 x ' if self.balanced else ''}{size} ranks): "
                "every chunk must hold a position")
        self.bounds = chunk_bounds(seq_len, self.n_chunks)      # [(start, stop)] per chunk

    def __repr__(self):
        kind = "balanced" if self.balanced else "plain"
        return f"ContextLayout(S={self.seq_len}, N_C={self.size}, {kind})"

    def chunks_of(self, rank: int) -> tuple:
        """The chunk indices rank `rank` holds, in increasing position order."""
        if self.balanced:
            return (rank, self.n_chunks - 1 - rank)
        return (rank,)

    def local_len(self, rank: int) -> int:
        """S_r: the number of positions rank `rank` holds."""
        return sum(self.bounds[c][1] - self.bounds[c][0] for c in self.chunks_of(rank))

    def positions(self, rank: int) -> np.ndarray:
        """int64 [S_r]: the global positions of rank `rank`'s local rows."""
        return np.concatenate([np.arange(*self.bounds[c]) for c in self.chunks_of(rank)])

    def shard(self, x, rank: int, axis: int = 1):
        """Rank `rank`'s rows of x along `axis` (a new array: its chunks concatenated)."""
        xp = namespace(x)
        index = [slice(None)] * x.ndim
        pieces = []
        for c in self.chunks_of(rank):
            index[axis] = slice(*self.bounds[c])
            pieces.append(x[tuple(index)])
        return xp.concat(pieces, axis=axis) if len(pieces) > 1 else xp.asarray(pieces[0],
                                                                                copy=True)

    def unshard(self, pieces, axis: int = 1):
        """The whole tensor from every rank's local rows (the inverse of shard)."""
        xp = namespace(pieces[0])
        parts = {}
        for rank, piece in enumerate(pieces):
            offset = 0
            for c in self.chunks_of(rank):
                n = self.bounds[c][1] - self.bounds[c][0]
                index = [slice(None)] * piece.ndim
                index[axis] = slice(offset, offset + n)
                parts[c] = piece[tuple(index)]
                offset += n
        return xp.concat([parts[c] for c in range(self.n_chunks)], axis=axis)

    def local_slices(self, rank: int) -> list:
        """[(chunk, local start, local stop)] of rank `rank`'s rows."""
        out, offset = [], 0
        for c in self.chunks_of(rank):
            n = self.bounds[c][1] - self.bounds[c][0]
            out.append((c, offset, offset + n))
            offset += n
        return out


def pair_kind(layout: ContextLayout, q_chunk: int, k_chunk: int, causal: bool) -> str:
    """How the queries of one chunk meet the keys of another: every key visible (full),
    the same chunk under the causal mask (diagonal), or every key in the future (skip)."""
    if not causal:
        return FULL
    if q_chunk == k_chunk:
        return DIAGONAL
    return FULL if k_chunk < q_chunk else SKIP


def ring_owner(rank: int, step: int, size: int) -> int:
    """Whose key/value block rank `rank` holds at step `step` of the ring."""
    return (rank - step) % size


# ---------------------------------------------------------------------------------------
# The ring exchange and the merge


def ring_exchange(comm, arrays, incoming_shapes):
    """Send `arrays` (one flat message) to the right neighbour and receive arrays of
    `incoming_shapes` from the left one (one flat message): the ring's only communication.
    Counted by the communicator as it moves (Communicator.send / recv)."""
    xp = namespace(arrays[0])
    n, r = comm.size, comm.rank
    flat = xp.concat([xp.reshape(a, (-1,)) for a in arrays], axis=0)
    handle = comm.send((r + 1) % n, flat)
    total = sum(math.prod(s) for s in incoming_shapes)
    got = comm.recv((r - 1) % n, total, flat)
    comm._wait(handle)
    out, start = [], 0
    for shape in incoming_shapes:
        size = math.prod(shape)
        out.append(xp.reshape(got[start:start + size], shape))
        start += size
    return out


def merge_partials(out_a, lse_a, out_b, lse_b):
    """The online-softmax merge (chapter 15) of two blocks' results for the same queries.

    out_* [B, H, n, D_v] the softmax-weighted values over each block's keys, lse_* [B, H, n]
    each block's row log-sum-exp  ->  (out, lse) over the union of the two blocks.
    A summary (Y, lse) is chapter 15's (m, u, a) with the shift m = lse, for which u = 1
    and a = Y; its merge, proved there for any shifts, is this one.
    """
    xp = namespace(out_a, out_b)
    top = xp.maximum(lse_a, lse_b)                                  # finite: a key is seen
    wa, wb = xp.exp(lse_a - top), xp.exp(lse_b - top)               # [B, H, n]
    total = wa + wb
    lse = top + xp.log(total)
    out = (wa / total)[..., None] * out_a + (wb / total)[..., None] * out_b
    return out, lse


def check_local_qkv(q, k, v, positions: int | None = None):
    """A rank's q [B, H, S_r, D_h], k [B, H_kv, S_r, D_h], v [B, H_kv, S_r, D_v]: float
    arrays of one library, H_kv dividing H (grouped-query attention), S_r = positions
    (None: q's own). ValueError naming the first that does not fit; -> the namespace."""
    xp = checks.float_inputs(q=q, k=k, v=v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.ndim(name, x, 4)
    batch, heads, local, d_h = q.shape
    local = local if positions is None else positions
    checks.shape("q", q, (batch, heads, local, d_h))
    kv_heads = k.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"k must have a number of heads dividing q's {heads} (grouped-query "
                         f"attention), got shape {tuple(k.shape)}")
    checks.shape("k", k, (batch, kv_heads, local, d_h))
    checks.shape("v", v, (batch, kv_heads, local, None))
    return xp


def _check_qkv(q, k, v, layout, comm):
    if layout.size != comm.size:
        raise ValueError(f"layout is for {layout.size} ranks but the group has {comm.size}")
    return check_local_qkv(q, k, v, layout.local_len(comm.rank))


def _block_shapes(layout, owner, batch, heads, d_h, d_v):
    s = layout.local_len(owner)
    return [(batch, heads, s, d_h), (batch, heads, s, d_v)]


# ---------------------------------------------------------------------------------------
# Ring attention: forward and backward


class _SameDraw:
    """A generator that hands every caller the one draw it was made with: each pair of
    chunks of the ring seeds its tiles' dropout from the attention's one seed."""

    def __init__(self, draw):
        self.draw = draw

    def random(self, shape):
        return self.draw


def ring_attention_forward(q, k, v, comm, layout: ContextLayout, causal: bool = False, *,
                           block_size: int = 64, scale=None, log=None, dropout_p: float = 0.0,
                           rng=None, training: bool = False, dropout_origin=None):
    """Attention over the whole sequence from this rank's rows, the K/V blocks passed round.

    q [B, H, S_r, D_h], k [B, H_kv, S_r, D_h], v [B, H_kv, S_r, D_v]: this rank's rows
             (layout.shard of the whole); H_kv divides H (grouped-query attention: the
             ring moves H_kv heads, each block is repeated to H on arrival)
    comm     the context-parallel group (any Communicator); layout its ContextLayout
    causal   query at position i sees keys at positions j <= i (global positions)
    block_size, scale   passed to tiled_attention_forward (scale default 1 / sqrt(D_h))
    log      a list to append, per step, dict(step, owner, pairs=[(q chunk, k chunk,
             kind, rows, cols)]) for the pictures and the work counts
    dropout_p, rng, training   dropout on the probabilities: one seed drawn from rng, and
             each pair of chunks draws its block of the mask of the whole attention
             [B_all, H_all, S, S] (the tiled op's dropout_index), dropout_origin =
             (B_all, H_all, b0, h0) placing this rank's rows and heads in it (default: all)
    ->  out [B, H, S_r, D_v], cache (for ring_attention_backward: q, k, v, out, lse, the
        settings of each block pair, nothing of size S_r x S)
    """
    xp = _check_qkv(q, k, v, layout, comm)
    causal = checks.boolean("causal", causal)
    batch, heads, _, d_h = q.shape
    d_v = v.shape[-1]
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    scale = 1.0 / math.sqrt(d_h) if scale is None else checks.positive("scale", scale)
    n, r = comm.size, comm.rank
    mine = layout.local_slices(r)
    dropout = {}
    if training and dropout_p > 0:
        checks.generator("rng", rng)
        B_all, H_all, b0, h0 = dropout_origin or (batch, heads, 0, 0)
        same = _SameDraw(rng.random((1,)))       # the attention's one seed, for every pair
        dropout = dict(dropout_p=dropout_p, rng=same, training=True)
    out = [None] * len(mine)                     # per local query chunk: [B, H, n_i, D_v]
    lse = [None] * len(mine)                     # [B, H, n_i]
    settings = {}
    held_k, held_v = k, v
    for step in range(n):
        owner = ring_owner(r, step, n)
        if step > 0:                             # the block of rank r - step arrives
            held_k, held_v = ring_exchange(comm, [held_k, held_v],
                                           _block_shapes(layout, owner, batch, kv_heads,
                                                         d_h, d_v))
        pairs = []
        for i, (qc, q0, q1) in enumerate(mine):
            for kc, k0, k1 in layout.local_slices(owner):
                kind = pair_kind(layout, qc, kc, causal)
                pairs.append((qc, kc, kind, q1 - q0, k1 - k0))
                if kind == SKIP:
                    continue
                if dropout:                      # this pair's block of the whole mask
                    dropout["dropout_index"] = (
                        (B_all, H_all, layout.seq_len, layout.seq_len),
                        (b0, h0, layout.bounds[qc][0], layout.bounds[kc][0]))
                o, cache = ops.tiled_attention_forward(
                    q[:, :, q0:q1, :], repeat_kv_heads(held_k[:, :, k0:k1, :], groups),
                    repeat_kv_heads(held_v[:, :, k0:k1, :], groups),
                    causal=kind == DIAGONAL, block_size=block_size, scale=scale, **dropout)
                settings[(qc, kc)] = cache[5]
                if out[i] is None:
                    out[i], lse[i] = o, cache[4]
                else:
                    out[i], lse[i] = merge_partials(out[i], lse[i], o, cache[4])
        if log is not None:
            log.append(dict(step=step, owner=owner, pairs=pairs))
    out = xp.concat(out, axis=2) if len(out) > 1 else out[0]          # [B, H, S_r, D_v]
    lse = xp.concat(lse, axis=2) if len(lse) > 1 else lse[0]          # [B, H, S_r]
    return out, (q, k, v, out, lse, settings, layout, comm, causal)


def ring_attention_backward(dout, cache):
    """The VJP of ring_attention_forward: dout [B, H, S_r, D_v] -> dq [B, H, S_r, D_h],
    dk [B, H_kv, S_r, D_h], dv [B, H_kv, S_r, D_v] (this rank's rows). K, V go round the ring again; each block's dK, dV partial travels with it and
    reaches its owner after the last step. Every block pair calls tiled_attention_backward
    with the merged out and lse, which gives that pair's exact share."""
    q, k, v, out, lse, settings, layout, comm, causal = cache
    checks.upstream_like("dout", dout, out)
    xp = namespace(q, dout)
    batch, heads, _, d_h = q.shape
    d_v = v.shape[-1]
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    n, r = comm.size, comm.rank
    mine = layout.local_slices(r)
    dq = xp.zeros(q.shape, dtype=q.dtype)
    held_k, held_v = k, v
    own_dk = own_dv = acc_dk = acc_dv = None
    kept = [(out[:, :, q0:q1, :], lse[:, :, q0:q1]) for _, q0, q1 in mine]  # each chunk's
    for step in range(n):
        owner = ring_owner(r, step, n)
        shapes = _block_shapes(layout, owner, batch, kv_heads, d_h, d_v)
        if step == 1:
            held_k, held_v = ring_exchange(comm, [held_k, held_v], shapes)
        elif step > 1:                           # the block and the partials of its owner
            held_k, held_v, acc_dk, acc_dv = ring_exchange(
                comm, [held_k, held_v, acc_dk, acc_dv], shapes + shapes)
        dk_blk = xp.zeros(shapes[0], dtype=q.dtype) if step < 2 else acc_dk
        dv_blk = xp.zeros(shapes[1], dtype=q.dtype) if step < 2 else acc_dv
        for (qc, q0, q1), (out_i, lse_i) in zip(mine, kept):
            for kc, k0, k1 in layout.local_slices(owner):
                if pair_kind(layout, qc, kc, causal) == SKIP:
                    continue
                sub = (q[:, :, q0:q1, :], repeat_kv_heads(held_k[:, :, k0:k1, :], groups),
                       repeat_kv_heads(held_v[:, :, k0:k1, :], groups), out_i, lse_i,
                       settings[(qc, kc)])
                g_q, g_k, g_v = ops.tiled_attention_backward(dout[:, :, q0:q1, :], sub,
                                                             trusted=True)
                dq[:, :, q0:q1, :] += g_q
                dk_blk[:, :, k0:k1, :] += sum_kv_groups(g_k, groups)     # [B, H_kv, .]
                dv_blk[:, :, k0:k1, :] += sum_kv_groups(g_v, groups)
        if step == 0:
            own_dk, own_dv = dk_blk, dv_blk
        else:
            acc_dk, acc_dv = dk_blk, dv_blk
    if n == 1:
        return dq, own_dk, own_dv
    # after the last step rank r holds the partials of block r + 1: send them home
    home = _block_shapes(layout, r, batch, kv_heads, d_h, d_v)
    back_dk, back_dv = ring_exchange(comm, [acc_dk, acc_dv], home)
    return dq, own_dk + back_dk, own_dv + back_dv


# ---------------------------------------------------------------------------------------
# What each rank computes and sends, as formulas of the layout


def ring_work(layout: ContextLayout, causal: bool = True) -> list:
    """Score entries each rank computes (a diagonal pair counted whole, as one tile of the
    tiled op computes it when block_size >= the chunk): [sum over computed pairs of
    rows x cols] per rank."""
    sizes = [b - a for a, b in layout.bounds]
    work = []
    for r in range(layout.size):
        total = 0
        for owner in range(layout.size):
            for qc in layout.chunks_of(r):
                for kc in layout.chunks_of(owner):
                    if pair_kind(layout, qc, kc, causal) != SKIP:
                        total += sizes[qc] * sizes[kc]
        work.append(total)
    return work


def ring_work_formula(seq_len: int, size: int, balanced: bool) -> list:
    """The closed forms of causal ring_work when 2 N_C (balanced) or N_C divides S:
    plain    rank r: (r + 1) m^2,        m = S / N_C
    balanced rank r: (2 N_C + 1) c^2,    c = S / (2 N_C)   (the same on every rank)"""
    parts = 2 * size if balanced else size
    if seq_len % parts:
        raise ValueError(f"the closed form needs seq_len ({seq_len}) divisible by {parts}")
    if balanced:
        c = seq_len // parts
        return [(2 * size + 1) * c * c for _ in range(size)]
    m = seq_len // size
    return [(r + 1) * m * m for r in range(size)]


def ring_attention_bytes(layout: ContextLayout, batch: int, heads: int, d_h: int,
                         d_v: int | None = None, itemsize: int = 8) -> dict:
    """Bytes each rank sends in one ring_attention_forward and one backward:
    {'forward': [per rank], 'backward': [per rank]}.

    forward_r  = (S - c_{r+1}) B H (D_h + D_v) b      every K, V block but rank r+1's
    backward_r = (S - c_{r+1}) B H (D_h + D_v) b      K, V again
               + (S - c_r)     B H (D_h + D_v) b      the dK, dV partials of every block
                                                      but rank r's own
    heads: the key/value heads the ring moves (H_kv with grouped-query attention).
    (c_r = S_r; with D_v = D_h and S = N_C m: 2 (N_C - 1) B H m D_h b forward and
    4 (N_C - 1) B H m D_h b backward). A group of one rank sends nothing."""
    d_v = d_h if d_v is None else d_v
    n, S = layout.size, layout.seq_len
    c = [layout.local_len(r) for r in range(n)]
    width = batch * heads * (d_h + d_v) * itemsize
    if n == 1:
        return dict(forward=[0], backward=[0])
    forward = [(S - c[(r + 1) % n]) * width for r in range(n)]
    backward = [forward[r] + (S - c[r]) * width for r in range(n)]
    return dict(forward=forward, backward=backward)


# ---------------------------------------------------------------------------------------
# A decoder with context parallelism


def ContextParallelDecoder(config: DecoderConfig, cp, balanced: bool = True, dp=None):
    """The one decoder on a rank of the ring `cp` (context parallelism alone): every
    parameter on every rank, the rank's chunks of each sequence, ring attention.

        model = ContextParallelDecoder(config, cp)
        logits, loss = model.forward(ids, targets)     # whole sequences [B, S] in, the
        model.backward()                               # logits of the rank's positions out

    The loss is the mean over every counted token of the whole sequences (and of the dp
    group's rows, when given); each rank's gradient is its tokens' share, summed over the
    group by the optimizer (Replicated over cp, or over dp x cp)."""
    from .model import TensorParallelDecoder

    solo = cp.split(color=cp.rank, key=0, name="tp")             # no tensor parallelism
    return TensorParallelDecoder(config, solo, cp if dp is None else dp, cp=cp,
                                 balanced=balanced)


