"""The parallel parts of the one decoder: tensor, sequence and context parallelism as seams.

models/parts.py names the seams and gives the one-device parts; `ParallelParts` gives the
same methods for a rank of a layout, and DecoderLM runs them unchanged:

    seam                 tensor parallel (tp)            + sequence parallel (sp)
    enter / exit         f / g (identity, all-reduce)    all-gather / reduce-scatter along S
    row linear           exit(x_r W_r) + b               (b added once, after the exit)
    embedding            vocab-parallel rows, exit       reduce-scatter: [B, S/N, D]
    head                 column-parallel, V_r columns    the sequence gathered first
    loss                 vocab-parallel cross-entropy, the count summed over `loss_group`

    seam                 context parallel (cp, the ring; or Ulysses)
    positions            the ring's chunks of the sequence (plain or balanced, ContextLayout;
                         Ulysses: plain, contiguous); with sp as well, block t of them on
                         tensor-parallel rank t
    attention            ring attention (context.py) over the cp group, this rank's heads;
                         Ulysses (ulysses.py): all-to-alls to H/(N_T N_C) heads of the whole
                         sequence, one device's dense or tiled op, and back
    embedding, loss      the ids and targets of the rank's positions

Sharding by parameter name (`shard_rule`, `shard_tensor`, `unshard_tensor`): rank t of N
holds

    wte [V_t, D], head.W [D, V_t], head.b [V_t]   vocabulary rows (uneven when N does not
                                                    divide V: vocab_partition)
    attn.qkv.W [D, (H + 2 H_kv) D_h / N], .b      query heads t H/N ..; key/value heads
                                                    t H_kv/N .. (H_kv >= N), or the one head
                                                    t H_kv // N that its query heads read
                                                    (H_kv < N: copies, gradients summed
                                                    over the N / H_kv ranks sharing it)
    attn.proj.W [H D_h / N, D]                     the matching rows; attn.proj.b replicated
    mlp.fc.W, mlp.gate.W [D, F/N] (and .b)         columns; mlp.proj.W [F/N, D] rows
    norms, wpe, row-parallel biases                replicated
    moe.experts.* [N_E, ...]                       experts e E_l .. (e+1) E_l - 1 on
                                                    expert-parallel rank e of n_ep
                                                    (E_l = N_E / n_ep), whole on every tp
                                                    rank; the router, the selection bias
                                                    and the shared experts replicated

What each rank computes from its share of a replicated tensor's input (under sequence
parallelism the norms see S/N rows) or of a shared key/value head is summed over the
ranks that share it after the backward (`reduce_grads`, one all-reduce per group).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import backend, checks, nn
from ..models.decoder import DecoderConfig
from ..models.parts import IGNORE_INDEX, OneDevice, count_rows, rows_at, sub_rows
from . import layers as L
from .context import ContextLayout, ring_attention_backward, ring_attention_forward
from .experts import ExpertGroups
from .ulysses import ulysses_attention_backward, ulysses_attention_forward


# ---------------------------------------------------------------------------------------
# Sharding by name


def shard_rule(name: str) -> str:
    """How the tensor `name` is split over the tensor-parallel ranks ('experts': over the
    expert-parallel ranks instead, along its first axis)."""
    if ".moe.experts." in name:
        return "experts"
    if name == "wte":
        return "vocab_rows"
    if name in ("head.W", "head.b"):
        return "vocab_cols"
    if name.endswith(("attn.qkv.W", "attn.qkv.b")):
        return "qkv_cols"
    if name.endswith(("mlp.fc.W", "mlp.fc.b", "mlp.gate.W", "mlp.gate.b")):
        return "cols"
    if name.endswith(("attn.proj.W", "mlp.proj.W")):
        return "rows"
    return "replicated"


def kv_heads_of(config: DecoderConfig, tp: int, rank: int) -> tuple[int, int]:
    """The key/value heads [start, stop) tensor-parallel rank `rank` holds: its block of
    H_kv / N heads, or, with fewer key/value heads than ranks, the one head its query
    heads read (rank t: head t H_kv // N)."""
    kv = config.n_kv_heads
    if kv >= tp:
        return rank * kv // tp, (rank + 1) * kv // tp
    head = rank * kv // tp
    return head, head + 1


def qkv_columns(config: DecoderConfig, tp: int, rank: int) -> np.ndarray:
    """int64: the columns of attn.qkv.W [D, (H + 2 H_kv) D_h] rank `rank` holds, in its
    order: its query heads', then its key heads', then its value heads'."""
    d_h, H, kv = config.head_dim, config.n_heads, config.n_kv_heads
    q0, q1 = rank * H // tp, (rank + 1) * H // tp
    k0, k1 = kv_heads_of(config, tp, rank)
    q = np.arange(q0 * d_h, q1 * d_h)
    k = H * d_h + np.arange(k0 * d_h, k1 * d_h)
    v = (H + kv) * d_h + np.arange(k0 * d_h, k1 * d_h)
    return np.concatenate([q, k, v])


def _blocks(config, tp, rank):
    """Index ranges of rank `rank`: vocab rows, query-head rows (of H D_h), MLP columns."""
    v0, v1 = L.vocab_partition(config.vocab_size, tp)[rank]
    d = config.d_model // tp
    f = config.d_ff // tp
    return (v0, v1), (rank * d, (rank + 1) * d), (rank * f, (rank + 1) * f)


def shard_tensor(name, full, config: DecoderConfig, tp: int, rank: int, ep: int = 1,
                 ep_rank: int = 0):
    """Rank `rank`'s block of the full tensor `name` (any array library, returns a copy);
    an expert tensor's block is expert-parallel rank `ep_rank`'s of `ep`."""
    xp = backend.namespace(full)
    (v0, v1), (c0, c1), (f0, f1) = _blocks(config, tp, rank)
    rule = shard_rule(name)
    if rule == "experts":
        n_local = full.shape[0] // ep
        out = full[ep_rank * n_local:(ep_rank + 1) * n_local, ...]
    elif rule == "vocab_rows":
        out = full[v0:v1, ...]
    elif rule == "vocab_cols":
        out = full[..., v0:v1]
    elif rule == "qkv_cols":
        out = xp.take(full, xp.asarray(qkv_columns(config, tp, rank)), axis=full.ndim - 1)
    elif rule == "cols":
        out = full[..., f0:f1]
    elif rule == "rows":
        out = full[c0:c1, ...] if name.endswith("attn.proj.W") else full[f0:f1, ...]
    else:
        out = full
    return xp.asarray(out, copy=True)


def unshard_tensor(name, pieces, config: DecoderConfig):
    """The full tensor from the list of every rank's block (the inverse of shard_tensor)."""
    xp = backend.namespace(pieces[0])
    rule = shard_rule(name)
    tp = len(pieces)
    if rule == "replicated":
        return pieces[0]
    if rule in ("vocab_rows", "rows", "experts"):     # experts: pieces of the ep ranks
        return xp.concat(pieces, axis=0)
    if rule in ("vocab_cols", "cols"):
        return xp.concat(pieces, axis=-1)
    width = config.head_dim * (config.n_heads + 2 * config.n_kv_heads)
    where = np.full(width, -1, dtype=np.int64)     # column -> its place in the pieces side by
    offset = 0                                     # side (a shared head: its first copy)
    for rank in range(tp):
        columns = qkv_columns(config, tp, rank)
        fresh = where[columns] < 0
        where[columns[fresh]] = offset + np.arange(len(columns))[fresh]
        offset += len(columns)
    side_by_side = xp.concat(list(pieces), axis=-1)
    return xp.take(side_by_side, xp.asarray(where), axis=side_by_side.ndim - 1)


def local_shapes(config: DecoderConfig, names, tp: int, rank: int, ep: int = 1) -> dict:
    """{name: shape} of rank `rank`'s blocks of the tensors `names` (an expert tensor's:
    N_E / ep experts)."""
    full = config.param_shapes()
    return {n: tuple(shard_tensor(n, np.empty(full[n], dtype=np.int8), config, tp,
                                  rank, ep).shape) for n in names}


def check_tensor_parallel(config: DecoderConfig, tp: int, seq_len: int | None = None,
                          sequence_parallel: bool = False) -> None:
    """Raise ValueError, before any work, for a model that cannot be split tp ways (the
    sizes; which combinations train is Layout.validate's)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"the tensor-parallel degree must be a positive integer, got {tp!r}")
    if config.n_heads % tp:
        raise ValueError(f"n_heads ({config.n_heads}) must be divisible by the tensor-parallel "
                         f"degree ({tp}): each rank computes whole heads")
    kv = config.n_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"n_kv_heads ({kv}) and the tensor-parallel degree ({tp}) must "
                         "divide one another: each rank holds whole key/value heads, or "
                         "shares one with the ranks whose query heads read it")
    if config.d_ff % tp:
        raise ValueError(f"d_ff ({config.d_ff}) must be divisible by the tensor-parallel "
                         f"degree ({tp}): each rank holds d_ff / tp MLP columns")
    if config.d_model % tp:
        raise ValueError(f"d_model ({config.d_model}) must be divisible by the tensor-parallel "
                         f"degree ({tp})")
    L.vocab_partition(config.vocab_size, tp)
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(f"with sequence parallelism the sequence length ({seq_len}) must be "
                         f"divisible by the tensor-parallel degree ({tp})")


# ---------------------------------------------------------------------------------------
# Dropout draws of a rank


class LayoutDraws:
    """Stands in for the generator in a sharded model: each `random(shape)` draws the
    uniforms of the whole tensor of one device (same seed on every rank, the same calls in
    the same order) and returns this rank's block, so the masks equal one device's.

    A [B, S, D] request (the residual stream) keeps rows `rows` and positions `stream`; a
    [B, H, S, S] one (dense attention's probabilities) keeps rows `rows` and heads `heads`."""

    def __init__(self, rng, rows, seq, d_model, n_heads, stream, heads):
        self.rng, self.rows, self.seq = rng, rows, seq
        self.d_model, self.n_heads, self.stream, self.heads = d_model, n_heads, stream, heads

    def random(self, shape):
        b0, b1, batch = self.rows
        if tuple(shape) == (1,):        # the tiled op's seed: one draw, the same everywhere
            return self.rng.random((1,))
        if len(shape) == 3:
            block = rows_at(self.rng.random((batch, self.seq, self.d_model))[b0:b1],
                            self.stream, axis=1)
        elif len(shape) == 4:
            h0, h1 = self.heads
            block = self.rng.random((batch, self.n_heads, self.seq, self.seq))[b0:b1, h0:h1]
        else:
            raise ValueError(f"a sharded model's dropout cannot draw shape {tuple(shape)}: "
                             "only the residual stream [B, S, D], dense attention's "
                             "probabilities [B, H, S, S] and the tiled op's seed (1,)")
        if tuple(block.shape) != tuple(shape):
            raise RuntimeError(f"sharded draws: block {tuple(block.shape)} != requested "
                               f"{tuple(shape)}")
        return block


# ---------------------------------------------------------------------------------------
# The parts


class ParallelParts(OneDevice):
    """The seams of one rank of a layout: tp (a Communicator, size 1 for none), sp,
    cp (the ring's Communicator, or None), balanced (the ring's mirrored chunks),
    loss_group (the Communicator over which the loss's token count is summed: the
    data-parallel and ring ranks of a batch; None: this rank's tokens alone), ep (the
    expert-parallel group of an MoE model, a block of consecutive ranks of loss_group;
    None: every expert on every rank). An MoE model's routing spans loss_group's tokens
    (expert_groups)."""

    name = "parallel"

    def __init__(self, config: DecoderConfig, tp, sp: bool = False, cp=None,
                 balanced: bool = True, loss_group=None, ep=None, ulysses: bool = False):
        self.config, self.tp, self.sp, self.cp = config, tp, bool(sp), cp
        self.ulysses = checks.boolean("ulysses", ulysses) and cp is not None
        self.ep_size, self.ep_rank = (1, 0) if ep is None else (ep.size, ep.rank)
        self.expert_groups = None
        if config.n_experts and loss_group is not None and loss_group.size > 1:
            self.expert_groups = ExpertGroups(loss_group,
                                              ep if ep is not None else loss_group.split(
                                                  loss_group.rank, name="ep1"))
        self.tp_size = tp.size
        self.balanced = checks.boolean("balanced", balanced)
        self.loss_group = loss_group
        self.ring = cp is not None
        check_tensor_parallel(config, tp.size, sequence_parallel=self.sp)
        self.vocab = L.vocab_partition(config.vocab_size, tp.size)[tp.rank]       # (v0, v1)
        H = config.n_heads
        self.heads = (tp.rank * H // tp.size, (tp.rank + 1) * H // tp.size)
        kv0, kv1 = kv_heads_of(config, tp.size, tp.rank)
        self.n_kv_local = kv1 - kv0
        # ranks that hold copies of one key/value head sum their gradients of it
        self.kv_shared = config.n_kv_heads < tp.size
        self.kv_group = tp.split(color=kv0, key=tp.rank, name="kv") if self.kv_shared else None
        self.summed = self.sp and tp.size > 1                  # replicated grads over tp
        self.grads_final_per_unit = not (self.summed or self.kv_shared)
        self._layouts = {}

    def local_shapes(self, shapes: dict) -> dict:
        return local_shapes(self.config, list(shapes), self.tp.size, self.tp.rank,
                            self.ep_size)

    def block_spec(self, spec):
        cfg, n = self.config, self.tp.size
        return replace(spec, n_heads=cfg.n_heads // n, n_kv_heads=self.n_kv_local,
                       d_ff=cfg.d_ff // n, d_head=cfg.head_dim,
                       attention="tiled" if self.ring and not self.ulysses
                       else spec.attention)

    # -- positions -----------------------------------------------------------------------
    def ring_layout(self, seq: int) -> ContextLayout:
        if seq not in self._layouts:
            self._layouts[seq] = ContextLayout(seq, self.cp.size,
                                               self.balanced and not self.ulysses)
        return self._layouts[seq]

    def attention_index(self, seq: int):
        if not self.ring:
            return slice(0, seq)
        self.layout = self.ring_layout(seq)            # the ring of this forward's sequences
        return tuple(slice(*self.layout.bounds[c])
                     for c in self.layout.chunks_of(self.cp.rank))   # S_r positions

    def stream_index(self, seq: int):
        at = self.attention_index(seq)
        if not self.summed:
            return at
        n = count_rows(at)
        if n % self.tp.size:
            what = ("sequence length" if isinstance(at, slice)
                    else "number of positions each ring rank holds")
            raise ValueError(f"with sequence parallelism the {what} ({n}) must be divisible "
                             f"by the tensor-parallel degree ({self.tp.size})")
        m = n // self.tp.size
        t = self.tp.rank
        return sub_rows(at, t * m, (t + 1) * m)

    def draws(self, rng, rows, seq: int):
        if rng is None or self.config.dropout == 0:
            return rng
        return LayoutDraws(rng, rows, seq, self.config.d_model, self.config.n_heads,
                           self.stream_index(seq), self.heads)

    def dropout_index(self, rng, q_shape, k_shape):
        """(whole, origin) of this rank's block of the tiled op's mask: its rows of the
        batch and its heads, all positions (the ring places its own pairs)."""
        if not isinstance(rng, LayoutDraws):
            return None
        b0, _, batch = rng.rows
        whole = (batch, self.config.n_heads, q_shape[2], k_shape[2])
        return whole, (b0, self.heads[0], 0, 0)

    def _mine(self, x):
        """x [B, S, ...] -> the ring's positions of it (the whole of it without a ring)."""
        if not self.ring:
            return x
        return rows_at(x, self.attention_index(x.shape[1]), axis=1)

    # -- embedding -----------------------------------------------------------------------
    def embed_forward(self, params, ids):
        return L.vocab_parallel_embedding_forward(self._mine(ids), params["wte"],
                                                  self.vocab[0], self.tp, self.sp)

    def embed_backward(self, params, dx, cache):
        nn.accumulate(params, "wte", L.vocab_parallel_embedding_backward(dx, cache))

    # -- column then row ---------------------------------------------------------------------
    def enter_forward(self, x):
        return L._enter(x, self.tp, self.sp)

    def enter_backward(self, dx, cache):
        return L._enter_backward(dx, cache, self.sp)

    def row_linear_forward(self, params, name, x):
        bias = params[name + ".b"] if name + ".b" in params else None
        return L.row_parallel_linear_forward(x, params[name + ".W"], bias, self.tp, self.sp)

    def row_linear_backward(self, params, name, dy, cache, overwrite_input=False):
        dx, dW, db = L.row_parallel_linear_backward(dy, cache)
        nn.accumulate(params, name + ".W", dW)
        if db is not None:
            nn.accumulate(params, name + ".b", db)
        return dx

    # -- attention on the ring ---------------------------------------------------------------
    def attention_forward(self, q, k, v, spec, rng=None, training=False):
        """q [B, H/N, S_r, D_h], k, v [B, H_kv/N, S_r, D_h] -> the ring's attention; with
        dropout, each pair of chunks draws its block of the whole attention's mask."""
        if self.ulysses:
            block = spec.attention_block_size if spec.attention == "tiled" else None
            return ulysses_attention_forward(q, k, v, self.cp, causal=spec.causal,
                                             attention=spec.attention, block_size=block,
                                             seq_len=self.layout.seq_len)
        dropout = {}
        if training and spec.dropout > 0 and isinstance(rng, LayoutDraws):
            b0, _, batch = rng.rows
            dropout = dict(dropout_p=spec.dropout, rng=rng, training=True,
                           dropout_origin=(batch, self.config.n_heads, b0, self.heads[0]))
        return ring_attention_forward(q, k, v, self.cp, self.layout, causal=spec.causal,
                                      block_size=spec.attention_block_size, **dropout)

    def attention_backward(self, da, cache, spec):
        if self.ulysses:
            return ulysses_attention_backward(da, cache)
        return ring_attention_backward(da, cache)

    def attention_keep_output(self, cache, out):
        """The ring's cache (q, k, v, out, lse, ...) with `out` in place of its output."""
        if not self.ring:
            return super().attention_keep_output(cache, out)
        if self.ulysses:               # its tiled op's output is of the heads layout
            return cache
        return cache[:3] + (out,) + cache[4:]

    # -- head and loss -------------------------------------------------------------------
    def head_forward(self, x, W, b):
        return L.column_parallel_linear_forward(x, W, b, self.tp, self.sp)

    def head_backward(self, dlogits, cache):
        return L.column_parallel_linear_backward(dlogits, cache)

    def loss_forward(self, logits, targets):
        return L.vocab_parallel_cross_entropy_forward(logits, self._mine(targets),
                                                      self.vocab[0], self.tp,
                                                      self.loss_group, IGNORE_INDEX)

    def loss_backward(self, dloss, cache, overwrite=False):
        return L.vocab_parallel_cross_entropy_backward(dloss, cache)

    def loss_count(self, cache) -> float:
        return float(cache[4])

    # -- the sums after a backward -----------------------------------------------------------
    def _reduced_views(self, params, names=None):
        """[(group, [gradient views])]: what is summed over a group after a backward."""
        names = params.names if names is None else names
        out = []
        if self.summed:
            views = [params.grad_of(n) for n in names if shard_rule(n) == "replicated"]
            out.append((self.tp, views))
        if self.kv_shared:
            q_width = (self.heads[1] - self.heads[0]) * self.config.head_dim
            views = [params.grad_of(n)[..., q_width:] for n in names
                     if shard_rule(n) == "qkv_cols"]
            out.append((self.kv_group, views))
        return out

    def take_reduced_grads(self, params):
        """Copies of what reduce_grads sums, then zeroed: the backward that follows adds
        only its own contribution to them (earlier micro-batches' are summed already)."""
        before = []
        for _, views in self._reduced_views(params):
            before.append([backend.namespace(v).asarray(v, copy=True) for v in views])
            for view in views:
                view[...] = 0
        return before

    def reduce_grads(self, params, before=None, names=None):
        """Sum over the sharing ranks the gradients each computed from its share (one
        all-reduce per group), and add back what they held before this backward."""
        for k, (group, views) in enumerate(self._reduced_views(params, names)):
            if not views:
                continue
            xp = backend.namespace(views[0])
            flat = group.all_reduce(xp.concat([xp.reshape(v, (-1,)) for v in views], axis=0))
            start = 0
            for j, view in enumerate(views):
                size = int(np.prod(view.shape))
                total = xp.reshape(flat[start:start + size], view.shape)
                view[...] = total if before is None else before[k][j] + total
                start += size
