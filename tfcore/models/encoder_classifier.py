"""Seed 001's one-layer encoder classifier: a CLS token, Q/K/V/T projections, h = S V + T.

    xs    = standardize(x)                       x [B, n, m]                  (seed eq. 1)
    h1    = xs W_1 (+ b_1)                       proj.W [m, d1]               [B, n, d1]
    hpre2 = concat(cls, h1) over the sequence    cls [d1]                     [B, n+1, d1]
    Q, K, V = split(hpre2 W_qkv (+ b))           attn.qkv.W [d1, 3 d2]        [B, H, n+1, d2/H]
    T     = hpre2 W_T (+ b_T)                    attn.skip.W [d1, d2]         [B, n+1, d2]
    h2    = merge(softmax(Q K^T / sqrt(d2/H)) V) + T                          [B, n+1, d2]
    z     = h2[:, 0] W_2 (+ b_2)                 head.W [d2, k]               [B, k]
    loss  = mean cross-entropy of softmax(z) against integer labels [B]

The seed appends the CLS token after the n inputs and reads row n+1; here it is prepended and
row 0 is read. With no positions and no mask attention treats every row alike (permuting
the rows permutes the outputs), so the two give the same logits. One head (n_heads=1) is the
seed's model, whose scale is 1/sqrt(d2). Only the CLS row of h2 is kept for backward.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .. import checks
from .. import nn, ops
from ..backend import FLOAT_DTYPES, namespace
from ..functional.attention import merge_heads, qkv_split, split_heads
from .common import check_float_settings, check_labels, standardize


@dataclass
class EncoderClassifierConfig:
    n_features: int           # m
    seq_len: int              # n (the CLS token makes n + 1 rows)
    d_model: int              # d1, the width after the input projection
    n_classes: int            # k
    d_attn: int | None = None  # d2, the width of Q, K, V, T (None: d_model)
    n_heads: int = 1
    bias: bool = False        # the seed has none
    eps: float = 1e-5         # of the input standardization
    dtype: str = "float64"
    init_std: float = 0.02

    def __post_init__(self):
        if self.d_attn is None:
            self.d_attn = self.d_model
        self._check_floats()

    def _check_floats(self):
        check_float_settings(self, positive=("eps", "init_std"))

    def validate(self) -> "EncoderClassifierConfig":
        for name in ("n_features", "seq_len", "d_model", "n_classes", "d_attn", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_attn % self.n_heads:
            raise ValueError(f"d_attn ({self.d_attn}) must be divisible by n_heads "
                             f"({self.n_heads}): each head takes d_attn / n_heads columns")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {self.dtype!r}")
        self._check_floats()
        return self

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        m, d1, d2, k = self.n_features, self.d_model, self.d_attn, self.n_classes
        shapes: dict[str, tuple[int, ...]] = {}

        def linear(name, d_in, d_out):
            shapes[name + ".W"] = (d_in, d_out)
            if self.bias:
                shapes[name + ".b"] = (d_out,)

        linear("proj", m, d1)
        shapes["cls"] = (d1,)
        linear("attn.qkv", d1, 3 * d2)
        linear("attn.skip", d1, d2)
        linear("head", d2, k)
        return shapes

    def to_dict(self) -> dict:
        return asdict(self)


class EncoderClassifier:
    """forward(x [B, n, m], labels [B] or None) -> (logits [B, k], loss); backward()."""

    def __init__(self, config: EncoderClassifierConfig):
        self.config = config.validate()
        self.params = nn.Parameters(config.param_shapes(), config.dtype)
        self._cache = None

    def init(self, seed: int = 0) -> "EncoderClassifier":
        """Weights and the CLS token N(0, init_std^2), biases zero, seeded."""
        nn.gpt2_init(self.params, seed, n_layers=1, std=self.config.init_std, residual_suffixes=())
        return self

    def num_parameters(self) -> int:
        return self.params.size

    def size_table(self, batch: int) -> dict:
        from .sizes import encoder_classifier_sizes

        return encoder_classifier_sizes(self.config, batch)

    def forward(self, x, labels=None):
        cfg, p = self.config, self.params
        checks.float_inputs(x=x)
        checks.shape("x", x, (None, cfg.seq_len, cfg.n_features))
        batch = x.shape[0]
        xp = namespace(x)
        xs = standardize(x, cfg.eps)                                        # [B, n, m]
        h1, c_proj = nn.linear_forward(p, "proj", xs)                       # [B, n, d1]
        cls = xp.broadcast_to(xp.reshape(p["cls"], (1, 1, cfg.d_model)), (batch, 1, cfg.d_model))
        hpre2 = xp.concat([cls, h1], axis=1)                                # [B, n+1, d1]
        qkv, c_qkv = nn.linear_forward(p, "attn.qkv", hpre2)                # [B, n+1, 3 d2]
        q, k, v = qkv_split(qkv, cfg.n_heads)                               # [B, H, n+1, d2/H]
        skip, c_skip = nn.linear_forward(p, "attn.skip", hpre2)             # T [B, n+1, d2]
        a, c_att = ops.attention_forward(q, k, v)                           # S V [B, H, n+1, d2/H]
        h2_cls = merge_heads(a)[:, 0, :] + skip[:, 0, :]                    # h2 row 0 [B, d2]
        logits, c_head = nn.linear_forward(p, "head", h2_cls)               # [B, k]
        loss = c_loss = None
        if labels is not None:
            check_labels(labels, batch, cfg.n_classes)
            loss, c_loss = ops.cross_entropy_forward(logits, labels)
        self._cache = (c_proj, c_qkv, c_skip, c_att, c_head, c_loss, tuple(logits.shape),
                       tuple(skip.shape))
        return logits, loss

    def backward(self, dlogits=None):
        """Adds every gradient into params.grad; dloss = 1, or dlogits [B, k] as the upstream."""
        if self._cache is None:
            raise RuntimeError(
                "backward() needs a forward() first (each forward allows one backward)")
        c_proj, c_qkv, c_skip, c_att, c_head, c_loss, logits_shape, h2_shape = self._cache
        cfg, p = self.config, self.params
        if dlogits is None:
            if c_loss is None:
                raise RuntimeError("backward() without dlogits needs a forward with labels")
            dlogits = ops.cross_entropy_backward(1.0, c_loss, trusted=True)  # (s - y) / B
        else:
            checks.array("dlogits", dlogits)
            checks.shape("dlogits", dlogits, logits_shape)
        self._cache = None
        dh2_cls = nn.linear_backward(p, "head", dlogits, c_head)           # [B, d2]
        xp = namespace(dh2_cls)
        # only row 0 of h2 reaches the loss: the other rows' gradient is zero
        dh2 = xp.zeros(h2_shape, dtype=dh2_cls.dtype)                       # [B, n+1, d2]
        dh2[:, 0, :] = dh2_cls
        dhpre2 = nn.linear_backward(p, "attn.skip", dh2, c_skip)            # through T = hpre2 W_T
        dq, dk, dv = ops.attention_backward(split_heads(dh2, cfg.n_heads), c_att, trusted=True)
        dqkv = ops.qkv_merge_grads(dq, dk, dv, trusted=True)                # [B, n+1, 3 d2]
        dhpre2 = dhpre2 + nn.linear_backward(p, "attn.qkv", dqkv, c_qkv)   # [B, n+1, d1]
        nn.accumulate(p, "cls", xp.sum(dhpre2[:, 0, :], axis=0))            # the CLS row, summed
        dh1 = dhpre2[:, 1:, :]                                              # [B, n, d1]
        nn.linear_backward(p, "proj", dh1, c_proj)     # the inputs are data: their dx is unused
