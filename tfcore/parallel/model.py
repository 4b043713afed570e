"""A tensor- (and sequence-) parallel decoder, built from DecoderLM's parameters by name.

Rank r of the tensor-parallel group holds (N = tp.size, heads and MLP columns in blocks):

    wte [V_r, D]        vocabulary rows V_r (vocab_partition: uneven when N does not divide V)
    head.W [D, V_r], head.b [V_r]   the same vocabulary columns (untied head)
    attn.qkv.W [D, 3 D/N], .b      the q, k and v columns of heads r H/N .. (r+1) H/N
    attn.proj.W [D/N, D]           the matching rows (row-parallel); attn.proj.b replicated
    mlp.fc.W, mlp.gate.W [D, F/N]  columns (column-parallel), with their biases
    mlp.proj.W [F/N, D]            rows (row-parallel); mlp.proj.b replicated
    everything else (norms, wpe)   replicated

Each sub-block is enter -> column-parallel -> local work -> row-parallel -> exit, where
enter/exit are f/g (identity/all-reduce and its conjugate) or, with sequence parallelism,
all-gather/reduce-scatter along S; the residual stream, the norms and dropout then run on
[B, S/N, D] and the gradients of the replicated parameters, computed from a block of the
sequence on each rank, are summed over the group after backward (one all-reduce of this
backward's contribution only: what earlier micro-batches accumulated is summed already).
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from .. import backend, checks, nn
from .. import functional as F
from ..functional.activations import swiglu_backward, swiglu_forward
from ..functional.attention import (
    attention_backward,
    attention_forward,
    merge_heads,
    qkv_merge_grads,
    qkv_split,
    split_heads,
)
from ..functional.rope import rope_backward, rope_forward
from ..models.decoder import IGNORE_INDEX, DecoderConfig, position_tables
from . import layers as L
from .layout import Layout


def shard_rule(name: str) -> str:
    """How the tensor `name` is split over the tensor-parallel ranks."""
    if name == "wte":
        return "vocab_rows"
    if name == "head.W":
        return "vocab_cols"
    if name == "head.b":
        return "vocab_cols"
    if name.endswith("attn.qkv.W") or name.endswith("attn.qkv.b"):
        return "qkv_cols"
    if name.endswith(("mlp.fc.W", "mlp.fc.b", "mlp.gate.W", "mlp.gate.b")):
        return "cols"
    if name.endswith(("attn.proj.W", "mlp.proj.W")):
        return "rows"
    return "replicated"


def check_layout(config: DecoderConfig, tp: int, seq_len: int | None = None,
                 sequence_parallel: bool = False) -> None:
    """Raise ValueError, before any work, for a model that cannot be split tp ways (the
    sizes; which combinations train is Layout.validate's)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"the tensor-parallel degree must be a positive integer, got {tp!r}")
    if config.n_heads % tp:
        raise ValueError(f"n_heads ({config.n_heads}) must be divisible by the tensor-parallel "
                         f"degree ({tp}): each rank computes whole heads")
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


def _blocks(config, tp, rank):
    """Index ranges of rank `rank`: vocab rows, head columns (of D), MLP columns (of F)."""
    v0, v1 = L.vocab_partition(config.vocab_size, tp)[rank]
    d = config.d_model // tp
    f = config.d_ff // tp
    return (v0, v1), (rank * d, (rank + 1) * d), (rank * f, (rank + 1) * f)


def shard_tensor(name, full, config: DecoderConfig, tp: int, rank: int):
    """Rank `rank`'s block of the full tensor `name` (any array library, returns a copy)."""
    xp = backend.namespace(full)
    (v0, v1), (c0, c1), (f0, f1) = _blocks(config, tp, rank)
    rule = shard_rule(name)
    D = config.d_model
    if rule == "vocab_rows":
        out = full[v0:v1, ...]
    elif rule == "vocab_cols":
        out = full[..., v0:v1]
    elif rule == "qkv_cols":
        out = xp.concat([full[..., j * D + c0:j * D + c1] for j in range(3)], axis=-1)
    elif rule == "cols":
        out = full[..., f0:f1]
    elif rule == "rows":
        n = c1 - c0 if name.endswith("attn.proj.W") else f1 - f0
        start = c0 if name.endswith("attn.proj.W") else f0
        out = full[start:start + n, ...]
    else:
        out = full
    return xp.asarray(out, copy=True)


def unshard_tensor(name, pieces, config: DecoderConfig):
    """The full tensor from the list of every rank's block (the inverse of shard_tensor)."""
    xp = backend.namespace(pieces[0])
    rule = shard_rule(name)
    if rule == "replicated":
        return pieces[0]
    if rule in ("vocab_rows", "rows"):
        return xp.concat(pieces, axis=0)
    if rule in ("vocab_cols", "cols"):
        return xp.concat(pieces, axis=-1)
    third = pieces[0].shape[-1] // 3                                   # qkv: q | k | v blocks
    return xp.concat([p[..., j * third:(j + 1) * third] for j in range(3) for p in pieces],
                     axis=-1)


def config_hash(config: DecoderConfig, **layout) -> str:
    text = json.dumps(dict(config=config.to_dict(), **layout), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class TensorParallelDecoder:
    """Rank-local: the same code on every rank of `tp` (and of `dp`, which only scales the
    loss). forward(ids, targets) -> (local logits [B, S, V_r], loss); backward()."""

    def __init__(self, config: DecoderConfig, tp, dp=None, sequence_parallel: bool = False):
        self.config = config.validate()
        Layout(tp=tp.size, dp=1 if dp is None else dp.size,
               sp=sequence_parallel).validate(config)
        check_layout(config, tp.size, sequence_parallel=sequence_parallel)
        tp.check_same(config_hash(config, tp=tp.size, sp=sequence_parallel),
                      "the model configuration (or the parallel layout)")
        self.tp, self.dp, self.sp = tp, dp, sequence_parallel
        self.spec = config.block_spec()
        self.heads = config.n_heads // tp.size
        self.vocab = L.vocab_partition(config.vocab_size, tp.size)[tp.rank]   # (v0, v1)
        full = config.param_shapes()
        self.params = nn.Parameters({n: tuple(shard_tensor(n, np.empty(s), config, tp.size,
                                                           tp.rank).shape)
                                     for n, s in full.items()}, config.dtype)
        self.replicated = [n for n in self.params.names if shard_rule(n) == "replicated"]
        self._sinusoidal, self._rope = position_tables(config)
        self._cache = None

    # -- parameters --------------------------------------------------------------------
    def load_full(self, full_params: nn.Parameters) -> "TensorParallelDecoder":
        """Copy this rank's block of every tensor of a single-device model's Parameters."""
        for name in self.params.names:
            self.params[name][...] = shard_tensor(name, full_params[name], self.config,
                                                  self.tp.size, self.tp.rank)
        return self

    def shard_of(self, name, full):
        return shard_tensor(name, full, self.config, self.tp.size, self.tp.rank)

    def gather_full(self, which: str = "data"):
        """The full flat buffer of the single-device layout (every rank gets it; collective
        over tp). which: 'data' or 'grad'."""
        xp = backend.xp()
        get = self.params.__getitem__ if which == "data" else self.params.grad_of
        out = []
        for name, shape in self.config.param_shapes().items():
            local = get(name)
            if shard_rule(name) == "replicated":
                out.append(xp.reshape(local, (-1,)))
                continue
            sizes = self.tp.all_gather_object(int(local.size))
            shapes = self.tp.all_gather_object(tuple(local.shape))
            bounds, start = [], 0
            for s in sizes:
                bounds.append((start, start + s))
                start += s
            flat = self.tp.all_gather_flat(xp.reshape(local, (-1,)), bounds)
            pieces = [xp.reshape(flat[a:b], shp) for (a, b), shp in zip(bounds, shapes)]
            out.append(xp.reshape(unshard_tensor(name, pieces, self.config), (-1,)))
        return xp.concat(out, axis=0)

    # -- dropout draws that equal one device's -------------------------------------------
    def _draws(self, rng, kind, batch_rows, seq):
        if rng is None or self.config.dropout == 0:
            return rng
        b0, b1, B = batch_rows
        if kind == "probs":
            h0 = self.tp.rank * self.heads
            return L.ShardedDraws(rng, (B, self.config.n_heads, seq, seq),
                                  (slice(b0, b1), slice(h0, h0 + self.heads)))
        s0, s1 = self._seq_block(seq)
        return L.ShardedDraws(rng, (B, seq, self.config.d_model),
                              (slice(b0, b1), slice(s0, s1)))

    def _seq_block(self, seq):
        if not self.sp:
            return 0, seq
        n = seq // self.tp.size
        return self.tp.rank * n, (self.tp.rank + 1) * n

    # -- sub-blocks: enter -> column-parallel -> local -> row-parallel -> exit ------------
    def _attention_forward(self, prefix, h, ctx):
        """h [B, S_loc, D] -> out [B, S_loc, D] (S_loc = S/N with sequence parallelism)."""
        p, cfg = self.params, self.config
        hf, c_in = L._enter(h, self.tp, self.sp)                          # [B, S, D]
        qkv, c_qkv = nn.linear_forward(p, prefix + ".qkv", hf)           # [B, S, 3D/N]
        q, k, v = qkv_split(qkv, self.heads)                              # [B, H/N, S, D_h]
        c_rq = c_rk = None
        if ctx["rope"] is not None:
            q, c_rq = rope_forward(q, *ctx["rope"])
            k, c_rk = rope_forward(k, *ctx["rope"])
        a, c_att = attention_forward(q, k, v, causal=True, dropout_p=cfg.dropout,
                                     rng=ctx["draw"]("probs"), training=ctx["training"])
        merged = merge_heads(a)                                           # [B, S, D/N]
        bias = p[prefix + ".proj.b"] if prefix + ".proj.b" in p else None
        out, c_proj = L.row_parallel_linear_forward(merged, p[prefix + ".proj.W"], bias,
                                                    self.tp, self.sp)     # [B, S_loc, D]
        out, c_drop = F.dropout_forward(out, cfg.dropout, ctx["draw"]("stream"),
                                        ctx["training"])
        return out, (c_in, c_qkv, c_rq, c_rk, c_att, c_proj, c_drop)

    def _attention_backward(self, prefix, dout, cache):
        c_in, c_qkv, c_rq, c_rk, c_att, c_proj, c_drop = cache
        p = self.params
        dout = F.dropout_backward(dout, c_drop)
        dmerged, dW, db = L.row_parallel_linear_backward(dout, c_proj)   # [B, S, D/N]
        nn.accumulate(p, prefix + ".proj.W", dW)
        if db is not None:
            nn.accumulate(p, prefix + ".proj.b", db)
        dq, dk, dv = attention_backward(split_heads(dmerged, self.heads), c_att)
        if c_rq is not None:
            dq, dk = rope_backward(dq, c_rq), rope_backward(dk, c_rk)
        dhf = nn.linear_backward(p, prefix + ".qkv", qkv_merge_grads(dq, dk, dv), c_qkv)
        return L._enter_backward(dhf, c_in, self.sp)                      # [B, S_loc, D]

    def _mlp_forward(self, prefix, h, ctx):
        p, cfg = self.params, self.config
        hf, c_in = L._enter(h, self.tp, self.sp)                          # [B, S, D]
        up, c_fc = nn.linear_forward(p, prefix + ".fc", hf)              # [B, S, F/N]
        c_gate = None
        if cfg.mlp == "swiglu":
            gate, c_gate = nn.linear_forward(p, prefix + ".gate", hf)    # [B, S, F/N]
            hidden, c_act = swiglu_forward(gate, up)
        elif cfg.mlp == "gelu":
            hidden, c_act = F.gelu_forward(up, cfg.gelu_approximate)
        else:
            hidden, c_act = F.relu_forward(up)
        bias = p[prefix + ".proj.b"] if prefix + ".proj.b" in p else None
        out, c_proj = L.row_parallel_linear_forward(hidden, p[prefix + ".proj.W"], bias,
                                                    self.tp, self.sp)     # [B, S_loc, D]
        out, c_drop = F.dropout_forward(out, cfg.dropout, ctx["draw"]("stream"),
                                        ctx["training"])
        return out, (c_in, c_fc, c_gate, c_act, c_proj, c_drop)

    def _mlp_backward(self, prefix, dout, cache):
        c_in, c_fc, c_gate, c_act, c_proj, c_drop = cache
        p, cfg = self.params, self.config
        dout = F.dropout_backward(dout, c_drop)
        dhidden, dW, db = L.row_parallel_linear_backward(dout, c_proj)   # [B, S, F/N]
        nn.accumulate(p, prefix + ".proj.W", dW)
        if db is not None:
            nn.accumulate(p, prefix + ".proj.b", db)
        if cfg.mlp == "swiglu":
            dgate, dup = swiglu_backward(dhidden, c_act)
            dhf = nn.linear_backward(p, prefix + ".gate", dgate, c_gate)
            dhf = dhf + nn.linear_backward(p, prefix + ".fc", dup, c_fc)  # one reduction
        else:
            dup = (F.gelu_backward if cfg.mlp == "gelu" else F.relu_backward)(dhidden, c_act)
            dhf = nn.linear_backward(p, prefix + ".fc", dup, c_fc)
        return L._enter_backward(dhf, c_in, self.sp)

    def _block_forward(self, prefix, x, ctx):
        """As models/blocks.py, on [B, S_loc, D]: pre-norm or post-norm."""
        p, cfg = self.params, self.config
        norm = lambda name, t: nn.norm_forward(p, prefix + name, t, cfg.norm, cfg.eps)  # noqa
        if cfg.norm_placement == "pre":
            h, c_ln1 = norm(".ln1", x)
            a, c_attn = self._attention_forward(prefix + ".attn", h, ctx)
            x1 = x + a
            h, c_ln2 = norm(".ln2", x1)
            m, c_mlp = self._mlp_forward(prefix + ".mlp", h, ctx)
            return x1 + m, (c_ln1, c_attn, c_ln2, c_mlp)
        a, c_attn = self._attention_forward(prefix + ".attn", x, ctx)
        x1, c_ln1 = norm(".ln1", x + a)
        m, c_mlp = self._mlp_forward(prefix + ".mlp", x1, ctx)
        y, c_ln2 = norm(".ln2", x1 + m)
        return y, (c_ln1, c_attn, c_ln2, c_mlp)

    def _block_backward(self, prefix, dy, cache):
        c_ln1, c_attn, c_ln2, c_mlp = cache
        p, kind = self.params, self.config.norm
        if self.config.norm_placement == "pre":
            dh = self._mlp_backward(prefix + ".mlp", dy, c_mlp)
            dx1 = dy + nn.norm_backward(p, prefix + ".ln2", dh, c_ln2, kind)
            dh = self._attention_backward(prefix + ".attn", dx1, c_attn)
            return dx1 + nn.norm_backward(p, prefix + ".ln1", dh, c_ln1, kind)
        ds2 = nn.norm_backward(p, prefix + ".ln2", dy, c_ln2, kind)
        dx1 = ds2 + self._mlp_backward(prefix + ".mlp", ds2, c_mlp)
        ds1 = nn.norm_backward(p, prefix + ".ln1", dx1, c_ln1, kind)
        return ds1 + self._attention_backward(prefix + ".attn", ds1, c_attn)

    # -- what forward and backward share with the ZeRO-3 and pipeline subclasses -------------
    def _forward_context(self, ids, training, rng, batch_rows):
        """Check ids [B, S] and the dropout settings; the settings every sub-block reads:
        training, the dropout draws of this rank's rows, the rotary tables cut to S."""
        checks.ndim("ids", ids, 2)
        B, S = ids.shape
        if S > self.config.max_seq_len:
            raise ValueError(f"sequence of length {S} exceeds "
                             f"max_seq_len={self.config.max_seq_len}")
        if training and self.config.dropout > 0 and rng is None:
            raise ValueError("training with dropout > 0 needs rng (seeded alike on every rank)")
        rows = batch_rows or (0, B, B)
        return dict(training=training, draw=lambda kind: self._draws(rng, kind, rows, S),
                    rope=self.rope_for(S))

    def rope_for(self, S: int):
        """The rotary tables of positions 0..S-1 (cos, sin), or None without rotary."""
        if self._rope is None:
            return None
        return self._rope[0][:S, :], self._rope[1][:S, :]

    def _head_backward(self, dlogits, c_lnf, c_head):
        """dlogits [B, S, V_r] -> dx [B, S_loc, D]; the head's (or tied wte's) and the final
        norm's gradients added into params.grad."""
        cfg, p = self.config, self.params
        dx, dW, db = L.column_parallel_linear_backward(dlogits, c_head)  # dx [B, S_loc, D]
        nn.accumulate(p, "wte" if cfg.tied_head else "head.W", dW.T if cfg.tied_head else dW)
        if db is not None:
            nn.accumulate(p, "head.b", db)
        if c_lnf is not None:
            dx = nn.norm_backward(p, "lnf", dx, c_lnf, cfg.norm)
        return dx

    # -- the model ---------------------------------------------------------------------------
    def forward(self, ids, targets=None, training: bool = False, rng=None, batch_rows=None):
        """ids [B, S] (the same on every tensor-parallel rank) -> (logits [B, S, V_r] of this
        rank's vocabulary columns, loss: the mean over every counted token of the dp group).

        rng: one generator per rank, seeded alike on every rank (dropout draws the whole
        global tensor and keeps this rank's block); batch_rows = (start, stop, B_global),
        the rows of the global batch this rank holds (default: all of them).
        """
        cfg, p, tp = self.config, self.params, self.tp
        ctx = self._forward_context(ids, training, rng, batch_rows)
        S = ids.shape[1]
        check_layout(cfg, tp.size, S, self.sp)
        s0, s1 = self._seq_block(S)
        x, c_emb = L.vocab_parallel_embedding_forward(ids, p["wte"], self.vocab[0], tp,
                                                      self.sp)            # [B, S_loc, D]
        c_pos = None
        if cfg.position == "learned":
            x, c_pos = F.positional_forward(x, p["wpe"][s0:s1, :])
        elif cfg.position == "sinusoidal":
            x, _ = F.positional_forward(x, self._sinusoidal[s0:s1, :])
        x, c_drop = F.dropout_forward(x, cfg.dropout, ctx["draw"]("stream"), training)
        c_blocks = []
        for i in range(cfg.n_layers):
            x, c = self._block_forward(f"h{i}", x, ctx)
            c_blocks.append(c)
        c_lnf = None
        if cfg.norm_placement == "pre":
            x, c_lnf = nn.norm_forward(p, "lnf", x, cfg.norm, cfg.eps)
        W = p["wte"].T if cfg.tied_head else p["head.W"]                  # [D, V_r]
        bias = p["head.b"] if "head.b" in p else None
        logits, c_head = L.column_parallel_linear_forward(x, W, bias, tp, self.sp)
        loss, c_loss = None, None
        if targets is not None:
            loss, c_loss = L.vocab_parallel_cross_entropy_forward(
                logits, targets, self.vocab[0], tp, self.dp, IGNORE_INDEX)
        self._cache = (c_emb, c_pos, (s0, s1), c_drop, c_blocks, c_lnf, c_head, c_loss)
        return logits, loss

    def backward(self, dloss: float = 1.0, after_unit=None):
        """Add this rank's gradients into params.grad (every tensor's block, or the whole
        replicated tensor); with sequence parallelism the replicated tensors' gradients of
        this backward are summed over the tensor-parallel group at the end (one all-reduce)
        and added to what they held before (earlier micro-batches, summed already).

        dloss: the upstream gradient of the loss (a micro-batch's weight c_k / T_c when
        accumulating). after_unit(label): called when the gradients of a unit are final,
        'head' (head and final norm), 'h{L-1}' .. 'h0', then 'embed' (grads.GradientBuckets
        starts its all-reduces there); not with sequence parallelism, whose replicated
        gradients are only final after the closing all-reduce."""
        dloss = checks.scalar_upstream("dloss", dloss)
        if after_unit is not None and self.sp and self.tp.size > 1:
            raise ValueError("after_unit hooks need sequence_parallel=False: the replicated "
                             "gradients are summed over tp only after the whole backward")
        done = after_unit or (lambda label: None)
        if self._cache is None:
            raise RuntimeError("backward() needs a forward() with targets first")
        c_emb, c_pos, (s0, s1), c_drop, c_blocks, c_lnf, c_head, c_loss = self._cache
        if c_loss is None:
            raise RuntimeError("backward() needs a forward() with targets first")
        self._cache = None
        cfg, p = self.config, self.params
        summed = self.sp and self.tp.size > 1
        before = self._take_replicated_grads() if summed else None
        dlogits = L.vocab_parallel_cross_entropy_backward(dloss, c_loss)  # [B, S, V_r]
        dx = self._head_backward(dlogits, c_lnf, c_head)                  # [B, S_loc, D]
        done("head")
        for i in reversed(range(cfg.n_layers)):
            dx = self._block_backward(f"h{i}", dx, c_blocks[i])
            done(f"h{i}")
        dx = F.dropout_backward(dx, c_drop)
        if c_pos is not None:
            _, dP = F.positional_backward(dx, c_pos)                      # [S_loc, D]
            p.grad_of("wpe")[s0:s1, :] += dP
        nn.accumulate(p, "wte", L.vocab_parallel_embedding_backward(dx, c_emb))
        done("embed")
        if summed:
            self.sum_replicated_grads(before)

    def _take_replicated_grads(self):
        """The replicated tensors' gradients so far (a flat copy), then zeroed: the
        backward that follows adds only its own contribution to them."""
        xp = backend.namespace(self.params.grad)
        views = [xp.reshape(self.params.grad_of(n), (-1,)) for n in self.replicated]
        before = xp.concat(views, axis=0)                                   # a copy
        for name in self.replicated:
            self.params.grad_of(name)[...] = 0
        return before

    def sum_replicated_grads(self, before=None):
        """Sum the gradients of the replicated tensors over the tensor-parallel group: under
        sequence parallelism each rank computed them from its own block of the sequence.
        before: what they held before this backward (already summed), added back after."""
        xp = backend.namespace(self.params.grad)
        views = [xp.reshape(self.params.grad_of(n), (-1,)) for n in self.replicated]
        total = self.tp.all_reduce(xp.concat(views, axis=0))
        if before is not None:
            total = before + total
        start = 0
        for name, view in zip(self.replicated, views):
            self.params.grad_of(name)[...] = xp.reshape(total[start:start + view.shape[0]],
                                                        self.params.shapes[name])
            start += view.shape[0]
