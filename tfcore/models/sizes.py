"""How much memory a model takes, as formulas of its config: the single source of truth.

For a batch [B, S] (N = B S rows) each table gives

    parameters          the number of scalars in the flat parameter buffer
    parameter_bytes     parameters * itemsize
    gradient_bytes      the same again (one gradient buffer of the same layout)
    optimizer_bytes     AdamW's two moments m and v: 2 * parameters * itemsize
    activation_bytes    every array the forward's caches keep alive for backward (training,
                        with targets), counted once per buffer: a view (the heads of q, k, v
                        inside the fused qkv output) costs nothing extra
    kv_cache_bytes      (decoder) the generation cache: k and v [B, H_kv, S_max, D_h] per layer

`held_bytes` measures the last one from the caches themselves; the tests compare the two for
every variant. The activation formula follows what each op pair keeps (its docstring says):

    linear           its input x                          layernorm / rmsnorm   xhat, 1/std [N, 1]
    gelu             its input                            relu                  a bool mask
    swiglu           both inputs a, b                     dropout               a bool keep-mask
    attention        q, k, v and the probabilities A [B, H, S, S] (and dropout's keep-mask)
    rope             nothing of x (only the constant tables, not counted)
    cross-entropy    the probabilities [N, V], the safe labels [N] int64, the valid mask [N]
The user's ids and targets, the parameters and the constant position tables are not counted.
With recomputation (the decoder's `recompute`, chapter 17) a block keeps only its input
("full") or all but attention's probabilities and their mask ("selective");
`recompute_flops` gives the matmul FLOPs the backward then runs again.
"""
from __future__ import annotations

import math
from dataclasses import fields, is_dataclass, replace

import array_api_compat
import numpy as np

INT64_BYTES = 8
BOOL_BYTES = 1


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def _table(n_params: int, dtype: str, activation_bytes: int, **extra) -> dict:
    f = _itemsize(dtype)
    table = dict(
        parameters=n_params,
        parameter_bytes=n_params * f,
        gradient_bytes=n_params * f,
        optimizer_bytes=2 * n_params * f,
        activation_bytes=activation_bytes,
    )
    table.update(extra)
    table["total_training_bytes"] = (table["parameter_bytes"] + table["gradient_bytes"]
                                     + table["optimizer_bytes"] + activation_bytes)
    return table


def count_parameters(shapes: dict) -> int:
    return sum(math.prod(s) for s in shapes.values())


# ---------------------------------------------------------------------------------------
# The decoder LM (and the block shared with the autoencoder)


def block_param_count(d_model: int, d_ff: int, norm: str, mlp: str, bias: bool,
                      kv_width: int | None = None) -> int:
    """Parameters of one block: two norms, fused qkv, the output projection, the MLP.

    kv_width = n_kv_heads * D_h, the width of K and of V (grouped-query attention);
    None means d_model.
    """
    D, F_ = d_model, d_ff
    kv = D if kv_width is None else kv_width
    norms = 2 * (2 * D if norm == "layernorm" else D)
    attention = (D + 2 * kv) * D + D * D + (D + 2 * kv + D if bias else 0)
    matrices = 3 if mlp == "swiglu" else 2                  # (gate,) fc, proj
    mlp_params = matrices * D * F_ + ((matrices - 1) * F_ + D if bias else 0)
    return norms + attention + mlp_params


def block_activation_bytes(batch, seq, d_model, n_heads, d_ff, mlp, rotary, dropout, dtype,
                           attention="dense", n_kv_heads=None, recompute="none", tp=1,
                           kv_local=None, sp=False, repeats_kv=True):
    """Bytes one block's caches keep after a training forward (see the module docstring).

    recompute (chapter 17): "full" keeps only the block's input [N, D]; "selective" keeps
    everything but attention's probabilities [B, H, S, S] and their keep-mask (so, with
    attention="tiled", which keeps neither, it would equal "none").

    attention="tiled" keeps the log-sum-exp [B, H, S] in place of the probabilities
    [B, H, S, S] and their keep-mask (chapter 15); its output [B, H, S, D_h] is kept as a
    view of the merged heads [N, D], which the projection keeps anyway.
    n_kv_heads < n_heads (chapter 16): attention keeps the repeated k and v, [N, D] each.

    floats: xhat of both norms and their 1/std, the attention input, the fused qkv output
    [N, 3D], rotated q and k (rotary: new arrays, v stays a view of qkv), the probabilities
    [B, H, S, S], the merged heads [N, D], the MLP input and its hidden layer(s):
    GELU keeps its input and output (2 N F), ReLU its output (N F, and a bool mask),
    SwiGLU both inputs and the output (3 N F).

    A tensor-parallel rank (tp = N_T > 1, chapter 12) keeps the same caches for its
    h = H / N_T query heads, its kv_local key/value heads (H_kv / N_T, or the one it shares
    when H_kv < N_T) and its F / N_T hidden columns; the sublayers' inputs (gathered under
    sequence parallelism) are whole [N, D]; the norms, the residual dropout masks and the
    block's input under full recomputation are [N / N_T, D] with sp (chapter 12's sequence
    parallelism), whole without. repeats_kv=False: attention keeps no repeated key/value
    heads (the ring repeats each arriving block for its products and drops it).
    """
    # one device (tp = 1) divides nothing, so the sizes may be SymPy symbols (chapter 17)
    split = (lambda n: n) if tp == 1 else (lambda n: n // tp)
    N, D = batch * seq, d_model
    rows = split(N) if sp else N                          # the norms' tokens
    h, F_ = split(n_heads), split(d_ff)                   # this rank's heads, columns
    g = (n_kv_heads or n_heads) if kv_local is None else kv_local
    g = split(g) if kv_local is None else g               # its key/value heads
    width = split(D)                                      # h D_h, its heads' width
    kv_width = width if g == h else g * (D // n_heads)    # g D_h
    if recompute == "full":
        return rows * D * _itemsize(dtype)
    scores = batch * h * seq * seq
    hidden = {"gelu": 2, "relu": 1, "swiglu": 3}[mlp] * N * F_
    if attention == "tiled":          # the output is a view of the merged heads: lse only
        scores_kept, scores_masks = batch * h * seq, 0
    elif recompute == "selective":
        scores_kept, scores_masks = 0, 0
    else:
        scores_kept, scores_masks = scores, scores
    if g == h or not repeats_kv:   # the fused q, k, v output; rotary: new q and k (v a view)
        qkv = N * (width + 2 * kv_width) + (N * (width + kv_width) if rotary else 0)
    elif rotary:     # grouped: q a rotated copy, k and v repeated copies (the fused output
        qkv = 3 * N * width                        # and the rotated k are not kept alive)
    else:            # q a view of the fused output; the repeated k and v
        qkv = N * (width + 2 * kv_width) + 2 * N * width
    norms = 2 * rows * D + 2 * rows                       # xhat and 1/std of both norms
    floats = norms + 2 * N * D + qkv + scores_kept + N * width + hidden
    bools = (scores_masks + 2 * rows * D if dropout else 0) + (
        N * F_ if mlp == "relu" else 0)
    return floats * _itemsize(dtype) + bools * BOOL_BYTES


def _refuse_moe(config, what: str) -> None:
    """The formulas here are those of dense blocks: a mixture of experts is not priced."""
    if getattr(config, "n_experts", 0):
        raise ValueError(f"{what} prices dense blocks only; this config has n_experts = "
                         f"{config.n_experts} (count its parameters with "
                         "count_parameters(config.param_shapes()))")


def decoder_sizes(config, batch: int, seq: int, training: bool = True,
                  targets: bool = True) -> dict:
    """The size table of DecoderLM(config) for ids [batch, seq] (see the module docstring).

    training=False leaves out dropout's masks; targets=False the cross-entropy's cache.
    """
    c = config
    _refuse_moe(c, "decoder_sizes")
    D, V, N = c.d_model, c.vocab_size, batch * seq
    f = _itemsize(c.dtype)
    n_params = V * D + (c.max_seq_len * D if c.position == "learned" else 0)
    kv_width = D // c.n_heads * getattr(c, "n_kv_heads", c.n_heads)      # H_kv D_h
    n_params += c.n_layers * block_param_count(D, c.d_ff, c.norm, c.mlp, c.bias, kv_width)
    if c.norm_placement == "pre":
        n_params += 2 * D if c.norm == "layernorm" else D
    n_params += (0 if c.tied_head else D * V) + (V if c.head_bias else 0)
    dropout = training and c.dropout > 0
    per_block = block_activation_bytes(batch, seq, D, c.n_heads, c.d_ff, c.mlp,
                                       c.position == "rotary", dropout, c.dtype,
                                       getattr(c, "attention", "dense"),
                                       getattr(c, "n_kv_heads", None),
                                       getattr(c, "recompute", "none"))
    # the head's input (pre-norm: also lnf's xhat and 1/std); the embedding's dropout mask
    final = (2 * N * D + N if c.norm_placement == "pre" else N * D) * f
    final += N * D * BOOL_BYTES if dropout else 0
    loss = (N * V * f + N * INT64_BYTES + N * BOOL_BYTES) if targets else 0
    activations = c.n_layers * per_block + final + loss
    kv = 2 * c.n_layers * batch * c.max_seq_len * kv_width * f
    return _table(n_params, c.dtype, activations, activation_bytes_per_layer=per_block,
                  logits_bytes=N * V * f, kv_cache_bytes=kv)


def step_flops(config, batch: int, seq: int) -> int:
    """The matmul FLOPs of one training step (forward and backward) of `config` on [B, S]:

        6 T (L (D (D + 2 H_kv D_h) + D^2 + m D F) + D V) + c L A + recompute_flops

    T = B S; the fused qkv, the output projection and the m = 2 (3 with SwiGLU) MLP
    matrices of each block and the head, 2 T FLOPs per weight forward and 4 T backward;
    A = 4 B S^2 D, attention's two products forward; c = 3: twice A backward (dV, dP, dQ,
    dK), and c = 7/2 tiled, whose backward recomputes the scores Q K^T first. (The tiled
    op skips the tiles above the causal diagonal; like the FLOP counters of the field, and
    tfcore's own, this counts the dense-equivalent work.) The GPT-style decoder's 6 T (L (4 D^2 + 2 D F) + D V) + 12 L B S^2 D
    is the case H_kv = H, m = 2, dense (chapter 11 counts it product by product)."""
    _refuse_moe(config, "step_flops")
    c, T, D = config, batch * seq, config.d_model
    tiled = getattr(c, "attention", "dense") == "tiled"
    attention = 4 * batch * seq * seq * D
    kv_width = D // c.n_heads * getattr(c, "n_kv_heads", c.n_heads)
    matrices = 3 if c.mlp == "swiglu" else 2
    per_layer = D * (D + 2 * kv_width) + D * D + matrices * D * c.d_ff
    dense = 6 * T * (c.n_layers * per_layer + D * c.vocab_size)
    products = (7 if tiled else 6) * c.n_layers * attention // 2
    again = recompute_flops(replace(config, attention="dense"), batch, seq)   # counted alike
    return dense + products + again


def recompute_flops(config, batch: int, seq: int) -> int:
    """The matmul FLOPs that activation recomputation adds to a training step (chapter 17).

    "full" runs every block's forward again: per block 2 T (D (D + 2 H_kv D_h) + D^2 + m D F)
    for the fused qkv, the output projection and the m = 2 (3 with SwiGLU) MLP matrices, plus
    attention's two products (QK^T and AV): 4 B S^2 D dense, or 4 B H D_h summed over the
    tiles the tiled op computes (causal tiles above the diagonal skipped). "selective" runs
    attention again: the two products alone. The head is never recomputed. T = B S.
    """
    _refuse_moe(config, "recompute_flops")
    from ..functional.tiled_attention import attention_tiles

    c, T, D = config, batch * seq, config.d_model
    mode = getattr(c, "recompute", "none")
    if mode == "none":
        return 0
    if getattr(c, "attention", "dense") == "tiled":
        tiles = attention_tiles(seq, seq, c.attention_block_size, causal=True)
        attention = sum(4 * batch * D * (i1 - i0) * (j1 - j0) for i0, i1, j0, j1, _ in tiles)
    else:
        attention = 4 * batch * seq * seq * D                  # H heads of 2 S^2 D_h, twice
    if mode == "selective":
        return c.n_layers * attention
    kv_width = D // c.n_heads * getattr(c, "n_kv_heads", c.n_heads)
    matrices = 3 if c.mlp == "swiglu" else 2
    dense = 2 * T * (D * (D + 2 * kv_width) + D * D + matrices * D * c.d_ff)
    return c.n_layers * (dense + attention)


# ---------------------------------------------------------------------------------------
# Measuring what the caches hold


def _root(array):
    """The array that owns the memory `array` views (array-api-strict wraps a NumPy array)."""
    a = getattr(array, "_array", array)
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def held_bytes(cache, exclude=()) -> int:
    """Bytes of the distinct buffers reachable from `cache` (nested tuples, lists, dicts,
    dataclasses), each buffer counted once however many views of it are held; buffers owned
    by the arrays in `exclude` (parameters, the user's inputs, constant tables) are not
    counted."""
    excluded = {id(_root(a)) for a in exclude if a is not None}
    roots: dict[int, object] = {}

    def visit(obj):
        if isinstance(obj, (tuple, list)):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
        elif is_dataclass(obj) and not isinstance(obj, type):
            for field in fields(obj):
                visit(getattr(obj, field.name))
        elif array_api_compat.is_array_api_obj(obj):    # NumPy, CuPy, array-api-strict
            root = _root(obj)
            if id(root) not in excluded:
                roots[id(root)] = root

    visit(cache)
    return int(sum(r.nbytes for r in roots.values()))


# ---------------------------------------------------------------------------------------
# Seed 001's encoder classifier and MLP, seed 002's autoencoder


def encoder_classifier_sizes(config, batch: int, labels: bool = True) -> dict:
    """EncoderClassifier(config) on x [batch, n, m].

    activations: the standardized input [B, n, m], hpre2 [B, n+1, d1] (the input of both the
    qkv and the skip projection), the fused qkv output [B, n+1, 3 d2] (q, k, v are views),
    the probabilities [B, H, n+1, n+1], the CLS row of h2 [B, d2]; the loss's cache.
    """
    c = config
    B, n, m, d1, d2, k = batch, c.seq_len, c.n_features, c.d_model, c.d_attn, c.n_classes
    n_params = count_parameters(c.param_shapes())
    floats = B * n * m + B * (n + 1) * d1 + 3 * B * (n + 1) * d2
    floats += B * c.n_heads * (n + 1) ** 2 + B * d2
    activations = floats * _itemsize(c.dtype)
    if labels:
        activations += B * k * _itemsize(c.dtype) + B * INT64_BYTES + B * BOOL_BYTES
    return _table(n_params, c.dtype, activations)


def mlp_sizes(config, batch: int, labels: bool = True) -> dict:
    """MLPClassifier(config) on x [batch, n, m].

    activations: the standardized input [B, n, m], relu's output [B, n, d] (flattened, a view)
    and its bool mask; the loss's cache.
    """
    c = config
    B, n, m, d, k = batch, c.seq_len, c.n_features, c.d_hidden, c.n_classes
    n_params = count_parameters(c.param_shapes())
    activations = (B * n * m + B * n * d) * _itemsize(c.dtype) + B * n * d * BOOL_BYTES
    if labels:
        activations += B * k * _itemsize(c.dtype) + B * INT64_BYTES + B * BOOL_BYTES
    return _table(n_params, c.dtype, activations)


def autoencoder_sizes(config, batch: int, seq: int, training: bool = True) -> dict:
    """Autoencoder(config) on x [batch, seq, width].

    activations: the blocks (post-norm, ReLU, no rotary), the last block's output when an
    output projection reads it, and the MSE's difference y - target [B, T, width].
    """
    c = config
    N, D = batch * seq, c.d_model
    f = _itemsize(c.dtype)
    n_params = count_parameters(c.param_shapes())
    per_block = block_activation_bytes(batch, seq, D, c.n_heads, c.d_ff, "relu", False,
                                       training and c.dropout > 0, c.dtype)
    final = (N * D if c.d_input is not None else 0) + N * c.width
    activations = c.n_layers * per_block + final * f
    return _table(n_params, c.dtype, activations, activation_bytes_per_layer=per_block)
