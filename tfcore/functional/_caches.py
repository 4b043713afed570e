"""The caches of the op pairs, as named tuples: a model reads ``cache.lse``, not ``cache[4]``.

Each is still a tuple with the fields in the order the forward has always returned them, so
indexing and unpacking keep working, and a backward takes a plain tuple of the same fields
as well (``xhat, rstd, gain = cache``). What a field holds is a reference, not a copy (see
the package docstring). A backward checks its upstream gradient against what the cache says
of the forward's output.
"""
from __future__ import annotations

from typing import Any, NamedTuple


class Spec(NamedTuple):
    """What an upstream gradient must be: the forward output's shape, dtype and array library.
    It is the whole cache of residual_forward."""

    shape: tuple
    dtype: Any
    xp: Any


class LinearCache(NamedTuple):
    """linear_forward: x [..., D_in], W [D_in, D_out], whether there was a bias."""

    x: Any
    W: Any
    has_bias: bool


class EmbeddingCache(NamedTuple):
    """embedding_forward: the ids flattened to int64 [N], x's shape [..., D], W's dtype and
    shape (V, D)."""

    ids: Any
    x_shape: tuple
    dtype: Any
    W_shape: tuple


class PositionalCache(NamedTuple):
    """positional_forward: y's shape (B, S, D), dtype and library, and P's shape (S_max, D)."""

    shape: tuple
    dtype: Any
    xp: Any
    P_shape: tuple


class ReluCache(NamedTuple):
    """relu_forward: the boolean mask x > 0 [...] and x's dtype."""

    positive: Any
    dtype: Any


class GeluCache(NamedTuple):
    """gelu_forward: x [...] itself and the form ("none" or "tanh")."""

    x: Any
    approximate: str


class SiluCache(NamedTuple):
    """silu_forward: x [...] and the output's Spec."""

    x: Any
    out_spec: Spec


class SwigluCache(NamedTuple):
    """swiglu_forward: a [..., F], b [..., F] and the output's Spec."""

    a: Any
    b: Any
    out_spec: Spec


class NormCache(NamedTuple):
    """layernorm_forward and rmsnorm_forward: the normalized xhat [..., D], the rows'
    reciprocal scale [..., 1] (LayerNorm's 1 / sqrt(var + eps), RMSNorm's
    1 / sqrt(mean(x^2) + eps)) and the gain [D]."""

    xhat: Any
    rstd: Any
    gain: Any


class DropoutCache(NamedTuple):
    """dropout_forward: the boolean keep-mask [...] (None at eval or p == 0), the scale
    1 / (1 - p), and x's Spec."""

    keep: Any
    scale: float
    x_spec: Spec


class CrossEntropyCache(NamedTuple):
    """cross_entropy_forward: softmax(logits) as rows [N, V], the labels [N] int64 (an
    ignored row's pointing at class 0), which rows count [N] bool, how many count, and the
    logits' shape [..., V]."""

    probs: Any
    labels: Any
    valid: Any
    n_valid: int
    shape: tuple


class AttentionCache(NamedTuple):
    """attention_forward: q [B, H, S_q, D_h], k [B, H, S_k, D_h], v [B, H, S_k, D_v], the
    probabilities A [B, H, S_q, S_k], dropout's cache of A, the scores' scale, and the
    output's Spec."""

    q: Any
    k: Any
    v: Any
    A: Any
    drop: Any
    scale: float
    out_spec: Spec


class TiledAttentionCache(NamedTuple):
    """tiled_attention_forward: q, k, v, the output out [B, H, S_q, D_v], the rows'
    log-sum-exp lse [B, H, S_q] and the settings dict (causal, scale, block_size, mask,
    key_padding, dropout_p, seed)."""

    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    settings: dict


class RopeCache(NamedTuple):
    """rope_forward: the S rows of cos and sin [S, D_h/2] used, and the output's Spec."""

    cos: Any
    sin: Any
    out_spec: Spec
