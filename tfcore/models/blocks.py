"""The Transformer block shared by the decoder LM and the post-norm autoencoder.

A block is two residual sublayers, attention then MLP, with the normalization placed

* pre-norm  (GPT-2, Llama):           x1 = x + f_attn(norm1(x));   y = x1 + f_mlp(norm2(x1))
* post-norm (the original Transformer): x1 = norm1(x + f_attn(x));  y = norm2(x1 + f_mlp(x1))

where each f ends in dropout of its output (the residual branch). With residual=False the
skips are dropped (x1 = f_attn(norm1(x)), or x1 = norm1(f_attn(x))): the experiment that
measures what the skip does for the gradient, not a model anyone trains. Forward functions return
(out, cache) like the op pairs; backward functions call the op pairs' backwards explicitly,
in the reverse order, add parameter gradients into the gradient views and return dx.

Shape letters: B batch, S sequence (S_k keys, more than S with a KV cache), D width, H heads,
D_h = D / H, H_kv key/value heads (grouped-query attention, chapter 16; H_kv = H without it),
F the MLP width.

Parameter names under the block's prefix ``h{i}``: ``ln1.g`` ``ln1.b``
``attn.qkv.W`` [D, D + 2 H_kv D_h] ``attn.qkv.b`` [D + 2 H_kv D_h] (q, then k, then v: [D, 3D]
and [3D] when H_kv = H) ``attn.proj.W`` [D, D] ``attn.proj.b`` [D] ``ln2.g`` ``ln2.b``
``mlp.fc.W`` [D, F] ``mlp.fc.b`` [F] (SwiGLU: also ``mlp.gate.W`` [D, F] ``mlp.gate.b`` [F])
``mlp.proj.W`` [F, D] ``mlp.proj.b`` [D]; ``.b`` only with biases, ``ln*.b`` only for LayerNorm.
A block whose spec has ``moe`` set has a mixture of experts in place of the MLP, with its
parameters under ``h{i}.moe`` (models/moe.py lists them); its output's dropout is the same draw.

Dropout (training, p > 0) draws from the one generator `rng` in the order the block runs:
the attention probabilities (one uniform [B, H, S, S_k] draw; the tiled op draws one seed
instead), the attention sublayer's output [B, S, D], then the MLP's output [B, S, D]; the
decoder's docstring states the whole model's order.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, NamedTuple

from .. import functional as F
from .. import nn, ops
from ..backend import namespace
from ..functional.activations import swiglu_backward, swiglu_forward
from ..functional.attention import merge_heads, qkv_split, split_heads
from ..functional.rope import rope_backward, rope_forward
from .moe import MoESpec, moe_param_shapes, moe_sublayer_backward, moe_sublayer_forward
from .parts import ONE_DEVICE

MLPS = ("gelu", "relu", "swiglu")


class AttentionSublayerCache(NamedTuple):
    """What the attention sublayer keeps: the parts' enter (f, or the sequence gather), the
    qkv projection's, the two rotations' (or None), the attention op's (A, or the tiled
    op's out and lse, or the ring's), the output projection's and dropout's caches."""

    enter: Any
    qkv: Any
    rope_q: Any
    rope_k: Any
    att: Any
    proj: Any
    drop: Any


class MLPCache(NamedTuple):
    """The MLP sublayer's: enter, fc, gate (SwiGLU, else None), the activation's, proj, drop."""

    enter: Any
    fc: Any
    gate: Any
    act: Any
    proj: Any
    drop: Any


class BlockCache(NamedTuple):
    """A block's: the two norms' and the two sublayers' caches (ffn: the MLP's or the MoE's)."""

    ln1: Any
    attn: Any
    ln2: Any
    ffn: Any
PLACEMENTS = ("pre", "post")
ATTENTIONS = ("dense", "tiled")


@dataclass(frozen=True)
class BlockSpec:
    """What a block needs to know (each model builds one from its config)."""

    d_model: int
    n_heads: int
    d_ff: int
    norm: str = "layernorm"          # "layernorm" | "rmsnorm"
    placement: str = "pre"           # "pre" | "post"
    mlp: str = "gelu"                # "gelu" | "relu" | "swiglu"
    bias: bool = True
    dropout: float = 0.0
    eps: float = 1e-5
    causal: bool = True
    gelu_approximate: str = "tanh"
    residual: bool = True            # False drops both skips (an experiment, not a model)
    attention: str = "dense"         # "dense" (chapter 6) | "tiled" (chapter 15)
    attention_block_size: int = 64   # the tile's side when attention == "tiled"
    n_kv_heads: int | None = None    # key/value heads (GQA, chapter 16); None: n_heads
    recompute_attention: bool = False  # drop A [B, H, S, S] and rebuild it (chapter 17)
    moe: MoESpec | None = None       # a mixture of experts in place of the MLP (models/moe.py)
    d_head: int | None = None        # a head's width D_h; None: d_model / n_heads (a tensor-
                                     # parallel rank runs n_heads / tp heads of D / H columns)

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads


def block_param_shapes(prefix: str, spec: BlockSpec) -> dict[str, tuple[int, ...]]:
    """{name: shape} of one block's parameters, in buffer order."""
    D, F_ = spec.d_model, spec.d_ff
    D_q = spec.n_heads * spec.head_dim                  # the query heads' width (D on one device)
    shapes: dict[str, tuple[int, ...]] = {}

    def norm(name):
        shapes[f"{prefix}.{name}.g"] = (D,)
        if spec.norm == "layernorm":
            shapes[f"{prefix}.{name}.b"] = (D,)

    def linear(name, d_in, d_out):
        shapes[f"{prefix}.{name}.W"] = (d_in, d_out)
        if spec.bias:
            shapes[f"{prefix}.{name}.b"] = (d_out,)

    norm("ln1")
    kv_width = spec.head_dim * (spec.n_kv_heads or spec.n_heads)        # n_kv_heads * D_h
    linear("attn.qkv", D, D_q + 2 * kv_width)
    linear("attn.proj", D_q, D)
    norm("ln2")
    if spec.moe is not None:
        shapes.update(moe_param_shapes(f"{prefix}.moe", spec, spec.moe))
        return shapes
    linear("mlp.fc", D, F_)
    if spec.mlp == "swiglu":
        linear("mlp.gate", D, F_)
    linear("mlp.proj", F_, D)
    return shapes


# ---------------------------------------------------------------------------------------
# The block's element-wise steps on its own arrays: the ops of tfcore.ops, called as trusted
# (the block made the arrays, so shapes and dtypes agree by construction): where a kernel
# takes them the argument checks are skipped, elsewhere the checked reference runs.


def _add(x, fx):
    """x + fx [...]: residual_forward's sum."""
    return ops.residual_forward(x, fx, trusted=True)[0]


def _split_grad(dy):
    """residual_backward(dy): the sum hands dy to the skip and to the branch alike."""
    return ops.residual_backward(dy, trusted=True)


def _dropout_forward(x, p, rng, training):
    """dropout_forward(x, p, rng, training): at p == 0 or in evaluation x itself."""
    return ops.dropout_forward(x, p, rng, training, trusted=True)


def _dropout_backward(dy, cache):
    """dropout_backward(dy, cache): dy itself when the forward drew no mask."""
    return ops.dropout_backward(dy, cache, trusted=True)


# ---------------------------------------------------------------------------------------
# Grouped-query attention: query head h reads key/value head h // (H / H_kv)


def repeat_kv_heads(x, groups: int):
    """[B, H_kv, S, D_h] -> [B, H_kv * groups, S, D_h]: kv head g serves query heads
    g * groups .. (g + 1) * groups - 1. A new array (the standard's repeat), whatever H_kv."""
    if groups == 1:
        return x
    return namespace(x).repeat(x, groups, axis=1)


def sum_kv_groups(dx, groups: int):
    """The backward of repeat_kv_heads: [B, H, S, D_h] -> [B, H / groups, S, D_h], the sum of
    the gradients of the query heads that share a key/value head."""
    if groups == 1:
        return dx
    xp = namespace(dx)
    batch, heads, seq, d_h = dx.shape
    return xp.sum(xp.reshape(dx, (batch, heads // groups, groups, seq, d_h)), axis=2)


def _split_gqa(qkv, spec):
    """qkv [B, S, D + 2 H_kv D_h] -> q [B, H, S, D_h], k, v [B, H_kv, S, D_h] (views)."""
    d_model = spec.n_heads * spec.head_dim                  # the query heads' width
    kv_width = spec.head_dim * spec.n_kv_heads
    q = split_heads(qkv[:, :, :d_model], spec.n_heads)
    k = split_heads(qkv[:, :, d_model:d_model + kv_width], spec.n_kv_heads)
    v = split_heads(qkv[:, :, d_model + kv_width:], spec.n_kv_heads)
    return q, k, v


# ---------------------------------------------------------------------------------------
# Recomputation (chapter 17): a forward run again in the backward must draw the same dropout
# masks, so it gets a copy of the generator as it was before the first run drew from it


def replayable(rng):
    """A copy of the generator `rng` in its current state (None stays None): handing the copy
    to a second run of the same forward replays the same draws, while `rng` itself goes on."""
    return None if rng is None else copy.deepcopy(rng)


def core_attention_forward(q, k, v, spec, rng=None, training=False, dropout_index=None):
    """q [B, H, S, D_h], k, v [B, H, S_k, D_h] -> (a [B, H, S, D_h], cache): the dense op
    (chapter 6) or the tiled one (chapter 15), as spec.attention says, through tfcore.ops.

    Without rotary positions or grouped heads, q, k and v are the [B, H, S, D_h] views of the
    qkv projection [B, S, 3D] (qkv_split): the tiled kernel reads them in place, with their
    row stride 3D, in the forward and again in the backward (no copy, and each thread's
    share of the batch is the rows it made in the projection)."""
    if spec.attention == "tiled":       # dropout_index: a rank's block of the whole mask
        return ops.tiled_attention_forward(q, k, v, causal=spec.causal,
                                           dropout_p=spec.dropout, rng=rng, training=training,
                                           block_size=spec.attention_block_size,
                                           dropout_index=dropout_index)
    return ops.attention_forward(q, k, v, causal=spec.causal, dropout_p=spec.dropout, rng=rng,
                                 training=training)


def core_attention_backward(da, cache, spec):
    """da [B, H, S, D_h] -> dq [B, H, S, D_h], dk, dv [B, H, S_k, D_h]: the backward of
    core_attention_forward (the cache is the model's own: a trusted call)."""
    backward = ops.tiled_attention_backward if spec.attention == "tiled" \
        else ops.attention_backward
    return backward(da, cache, trusted=True)


# ---------------------------------------------------------------------------------------
# Attention sublayer: qkv = x W_qkv + b; q, k, v = split; (rotary on q, k); a = attention;
# out = dropout(merge(a) W_proj + b)


def attention_sublayer_forward(params, prefix, x, spec, *, rope=None, rng=None, training=False,
                               kv=None, pos=0, parts=ONE_DEVICE):
    """x [B, S, D] -> out [B, S, D].

    rope: (cos, sin) tables [S, D_h/2] for the positions of x, or None.
    kv: (k_cache, v_cache) each [B, H_kv, S_max, D_h] to write this call's keys and values
    into at positions pos..pos+S-1 and attend over positions 0..pos+S-1 (generation); None
    otherwise. parts: the seams (parts.py); under tensor parallelism x enters the rank's
    heads (f, or an all-gather along S) and the projection leaves them (g, or a
    reduce-scatter), and H, H_kv are this rank's heads.
    """
    x, c_in = parts.enter_forward(x)                                    # [B, S, D]
    qkv, c_qkv = nn.linear_forward(params, prefix + ".qkv", x)          # [B, S, D + 2 H_kv D_h]
    del x
    groups = spec.n_heads // (spec.n_kv_heads or spec.n_heads)
    if groups == 1:
        q, k, v = qkv_split(qkv, spec.n_heads)                          # [B, H, S, D_h] each
    else:
        q, k, v = _split_gqa(qkv, spec)                                 # k, v [B, H_kv, S, D_h]
    c_rope_q = c_rope_k = None
    if rope is not None:
        q, c_rope_q = rope_forward(q, *rope)                            # [B, H, S, D_h]
        k, c_rope_k = rope_forward(k, *rope)                            # [B, H_kv, S, D_h]
    if kv is not None:
        k_cache, v_cache = kv                                           # [B, H_kv, S_max, D_h]
        end = pos + qkv.shape[1]
        k_cache[:, :, pos:end, :] = k
        v_cache[:, :, pos:end, :] = v
        k, v = k_cache[:, :, :end, :], v_cache[:, :, :end, :]           # [B, H_kv, S_k, D_h]
    replay = replayable(rng) if spec.recompute_attention else None
    if parts.ring:                  # the ring moves the H_kv heads and repeats them itself
        a, c_att = parts.attention_forward(q, k, v, spec, rng, training)  # [B, H, S, D_h]
    else:
        k, v = repeat_kv_heads(k, groups), repeat_kv_heads(v, groups)   # [B, H, S_k, D_h]
        index = parts.dropout_index(rng, q.shape, k.shape)   # None on one device
        a, c_att = core_attention_forward(q, k, v, spec, rng, training,
                                          index)                        # [B, H, S, D_h]
    if spec.recompute_attention:
        # keep what builds A again, not A: q, k, v (kept anyway) and the generator as it was
        c_att = ("recompute", q, k, v, replay, training, index)
    merged = merge_heads(a)                                             # [B, S, D]
    if spec.attention == "tiled" and not spec.recompute_attention:
        # the tiled backward (and the ring's, made of it) reads the output only through
        # rowsum(dout * out): keep it as the [B, H, S, D_h] view of the merged heads that the
        # projection keeps anyway (the fused kernel's output already is one), so that one
        # [B, S, D] array is kept, not two
        c_att = parts.attention_keep_output(c_att, split_heads(merged, spec.n_heads))
    out, c_proj = parts.row_linear_forward(params, prefix + ".proj", merged)   # [B, S, D]
    out, c_drop = _dropout_forward(out, spec.dropout, rng, training)    # [B, S, D]
    return out, AttentionSublayerCache(c_in, c_qkv, c_rope_q, c_rope_k, c_att, c_proj, c_drop)


def attention_sublayer_backward(params, prefix, dout, cache, spec, parts=ONE_DEVICE):
    """dout [B, S, D] -> dx [B, S, D]; adds d W_qkv [D, D + 2 H_kv D_h], d b_qkv, d W_proj,
    d b_proj."""
    c_in, c_qkv, c_rope_q, c_rope_k, c_att, c_proj, c_drop = cache
    del cache                       # as in the MLP: each part is freed when last used
    dout = _dropout_backward(dout, c_drop)                             # [B, S, D]
    dmerged = parts.row_linear_backward(params, prefix + ".proj", dout, c_proj)  # [B, S, D]
    del dout, c_proj                # the merged heads [B, S, D]
    da = split_heads(dmerged, spec.n_heads)                             # [B, H, S, D_h]
    if spec.recompute_attention:        # the same call on the same inputs and draws: same A
        _, q, k, v, replay, training, index = c_att
        _, c_att = core_attention_forward(q, k, v, spec, replay, training, index)
    if parts.ring:
        dq, dk, dv = parts.attention_backward(da, c_att, spec)  # dk, dv [B, H_kv, S, D_h]
    else:
        dq, dk, dv = core_attention_backward(da, c_att, spec)          # [B, H, S, D_h] each
    c_att = da = dmerged = None                 # q, k, v, out [B, H, S, D_h]: freed here
    groups = spec.n_heads // (spec.n_kv_heads or spec.n_heads)
    if not parts.ring:
        dk, dv = sum_kv_groups(dk, groups), sum_kv_groups(dv, groups)   # [B, H_kv, S, D_h]
    if c_rope_q is not None:
        dq = rope_backward(dq, c_rope_q)                                # the inverse rotation
        dk = rope_backward(dk, c_rope_k)
    if groups == 1:                                                     # H_kv = H
        # the kernels' dq, dk, dv are the three views of one buffer: merged without a copy
        dqkv = ops.qkv_merge_grads(dq, dk, dv, trusted=True)            # [B, S, 3D]
    else:                                                               # [B, S, D + 2 H_kv D_h]
        dqkv = namespace(dq).concat([merge_heads(dq), merge_heads(dk), merge_heads(dv)],
                                    axis=-1)
    dx = nn.linear_backward(params, prefix + ".qkv", dqkv, c_qkv)       # [B, S, D]
    return parts.enter_backward(dx, c_in)


# ---------------------------------------------------------------------------------------
# MLP sublayer: out = dropout(act(x W_fc + b_fc) W_proj + b_proj), or with SwiGLU
# out = dropout((silu(x W_gate + b_gate) * (x W_fc + b_fc)) W_proj + b_proj)


def mlp_sublayer_forward(params, prefix, x, spec, *, rng=None, training=False,
                         parts=ONE_DEVICE):
    """x [B, S, D] -> out [B, S, D] through a hidden layer [B, S, F] (F / tp columns of it
    under tensor parallelism, between the parts' enter and row-parallel exit)."""
    x, c_in = parts.enter_forward(x)                                    # [B, S, D]
    up, c_fc = nn.linear_forward(params, prefix + ".fc", x)             # [B, S, F]
    if spec.mlp == "swiglu":
        gate, c_gate = nn.linear_forward(params, prefix + ".gate", x)   # [B, S, F]
        hidden, c_act = swiglu_forward(gate, up)                        # silu(gate) * up [B, S, F]
    elif spec.mlp == "gelu":
        c_gate = None
        hidden, c_act = ops.gelu_forward(up, spec.gelu_approximate, trusted=True)  # [B, S, F]
    else:
        c_gate = None
        hidden, c_act = F.relu_forward(up)                              # [B, S, F]
    del x
    out, c_proj = parts.row_linear_forward(params, prefix + ".proj", hidden)   # [B, S, D]
    out, c_drop = _dropout_forward(out, spec.dropout, rng, training)
    return out, MLPCache(c_in, c_fc, c_gate, c_act, c_proj, c_drop)


def mlp_sublayer_backward(params, prefix, dout, cache, spec, parts=ONE_DEVICE):
    """dout [B, S, D] -> dx [B, S, D]; adds the gradients of fc, (gate,) proj."""
    c_in, c_fc, c_gate, c_act, c_proj, c_drop = cache
    del cache                       # the caller handed the cache over: each part is freed
    dout = _dropout_backward(dout, c_drop)                              # when last used
    # the projection's input, the hidden activation [B, S, F], is this cache's alone and
    # needed no more once dW is made: dhidden may be written over it
    dhidden = parts.row_linear_backward(params, prefix + ".proj", dout, c_proj,
                                        overwrite_input=True)           # [B, S, F]
    del dout, c_proj
    if spec.mlp == "swiglu":
        dgate, dup = swiglu_backward(dhidden, c_act)                    # [B, S, F] each
        del dhidden
        dx = nn.linear_backward(params, prefix + ".gate", dgate, c_gate)
        return parts.enter_backward(dx + nn.linear_backward(params, prefix + ".fc", dup, c_fc),
                                    c_in)
    if spec.mlp == "gelu":                                  # in place: a temporary
        dup = ops.gelu_backward(dhidden, c_act, out=dhidden, trusted=True)
    else:
        dup = F.relu_backward(dhidden, c_act)
    del dhidden                                 # [B, S, F]: not needed by the last product
    dx = nn.linear_backward(params, prefix + ".fc", dup, c_fc)          # [B, S, D]
    return parts.enter_backward(dx, c_in)


def _ffn_forward(params, prefix, x, spec, *, rng=None, training=False, parts=ONE_DEVICE):
    """The block's feed-forward sublayer: the MLP (prefix.mlp), or the mixture of experts
    (prefix.moe) when spec.moe is set. x [B, S, D] -> out [B, S, D]."""
    if spec.moe is not None:
        return moe_sublayer_forward(params, prefix + ".moe", x, spec, rng=rng,
                                    training=training, groups=parts.expert_groups)
    return mlp_sublayer_forward(params, prefix + ".mlp", x, spec, rng=rng, training=training,
                                parts=parts)


def _ffn_backward(params, prefix, dout, cache, spec, parts=ONE_DEVICE):
    if spec.moe is not None:
        return moe_sublayer_backward(params, prefix + ".moe", dout, cache, spec)
    return mlp_sublayer_backward(params, prefix + ".mlp", dout, cache, spec, parts)


# ---------------------------------------------------------------------------------------
# The block


def block_forward(params, prefix, x, spec, *, rope=None, rng=None, training=False, kv=None,
                  pos=0, parts=ONE_DEVICE):
    """x [B, S, D] -> y [B, S, D] (pre-norm or post-norm, see the module docstring).
    parts: the seams of a parallel layout (parts.py); x is then this rank's rows."""
    attn = dict(rope=rope, rng=rng, training=training, kv=kv, pos=pos, parts=parts)
    if spec.placement == "pre":
        h, c_ln1 = nn.norm_forward(params, prefix + ".ln1", x, spec.norm, spec.eps)
        a, c_attn = attention_sublayer_forward(params, prefix + ".attn", h, spec, **attn)
        x1 = _add(x, a) if spec.residual else a                 # x + attn(norm1(x))
        del x, a     # read by now: a freed here, and x too when the caller handed it over
        h, c_ln2 = nn.norm_forward(params, prefix + ".ln2", x1, spec.norm, spec.eps)
        m, c_mlp = _ffn_forward(params, prefix, h, spec, rng=rng, training=training,
                                parts=parts)
        y = _add(x1, m) if spec.residual else m                # x1 + mlp(norm2(x1))
    else:
        a, c_attn = attention_sublayer_forward(params, prefix + ".attn", x, spec, **attn)
        s1 = _add(x, a) if spec.residual else a                 # x + attn(x)
        del x, a     # read by now: a freed here, and x too when the caller handed it over
        x1, c_ln1 = nn.norm_forward(params, prefix + ".ln1", s1, spec.norm, spec.eps)
        m, c_mlp = _ffn_forward(params, prefix, x1, spec, rng=rng, training=training,
                                parts=parts)
        s2 = _add(x1, m) if spec.residual else m                # x1 + mlp(x1)
        y, c_ln2 = nn.norm_forward(params, prefix + ".ln2", s2, spec.norm, spec.eps)
    return y, BlockCache(c_ln1, c_attn, c_ln2, c_mlp)


def take(caches: list, index: int):
    """caches[index], leaving None in its place: handed on as an argument, the value is then
    held by the callee alone, which frees it as soon as it is done with it."""
    value, caches[index] = caches[index], None
    return value


def block_backward(params, prefix, dy, cache, spec, parts=ONE_DEVICE):
    """dy [B, S, D] -> dx [B, S, D]: the forward's op pairs in reverse order.

    The residual sum hands its gradient to both the skip and the branch unchanged, so each
    skip gradient is added to the branch's result (out of place: residual_backward returns
    one array for both). Each sublayer's cache is handed over with `take`, so that it is
    freed as soon as that sublayer's backward returns (the MLP's [B, S, F] tensors before
    the attention's backward runs); the caller hands `cache` over the same way.
    """
    if not spec.residual:
        return _block_backward_without_skips(params, prefix, dy, cache, spec, parts)
    caches = list(cache)                              # c_ln1, c_attn, c_ln2, c_mlp
    del cache
    if spec.placement == "pre":
        dx1, dm = _split_grad(dy)                                     # y = x1 + m
        dh = _ffn_backward(params, prefix, dm, take(caches, 3), spec, parts)
        dx1 = ops.add(dx1, nn.norm_backward(params, prefix + ".ln2", dh, take(caches, 2),
                                         spec.norm))
        del dh
        dx, da = _split_grad(dx1)                                     # x1 = x + a
        dh = attention_sublayer_backward(params, prefix + ".attn", da, take(caches, 1), spec,
                                         parts)
        return ops.add(dx, nn.norm_backward(params, prefix + ".ln1", dh, take(caches, 0),
                                         spec.norm))
    ds2 = nn.norm_backward(params, prefix + ".ln2", dy, take(caches, 2), spec.norm)  # norm2(s2)
    dx1, dm = _split_grad(ds2)                                        # s2 = x1 + m
    dx1 = ops.add(dx1, _ffn_backward(params, prefix, dm, take(caches, 3), spec, parts))
    ds1 = nn.norm_backward(params, prefix + ".ln1", dx1, take(caches, 0), spec.norm)  # norm1(s1)
    dx, da = _split_grad(ds1)                                         # s1 = x + a
    return ops.add(dx, attention_sublayer_backward(params, prefix + ".attn", da, take(caches, 1),
                                                spec, parts))


def _block_backward_without_skips(params, prefix, dy, cache, spec, parts=ONE_DEVICE):
    """The same chain with the two skips removed: nothing is added back."""
    c_ln1, c_attn, c_ln2, c_mlp = cache
    if spec.placement == "pre":
        dh = _ffn_backward(params, prefix, dy, c_mlp, spec, parts)
        dx1 = nn.norm_backward(params, prefix + ".ln2", dh, c_ln2, spec.norm)
        dh = attention_sublayer_backward(params, prefix + ".attn", dx1, c_attn, spec, parts)
        return nn.norm_backward(params, prefix + ".ln1", dh, c_ln1, spec.norm)
    dm = nn.norm_backward(params, prefix + ".ln2", dy, c_ln2, spec.norm)
    dx1 = _ffn_backward(params, prefix, dm, c_mlp, spec, parts)
    da = nn.norm_backward(params, prefix + ".ln1", dx1, c_ln1, spec.norm)
    return attention_sublayer_backward(params, prefix + ".attn", da, c_attn, spec, parts)
