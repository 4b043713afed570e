"""Seed 001's vanilla 2-layer ReLU network, in the book's row-major convention.

The seed writes a_1 = W_1 X^T + B_1 [d, n] for one example X [n, m]; row-major and batched:

    xs = standardize(x)                 x [B, n, m]  (seed eq. 1)
    a1 = xs W1 + b1                     W1 [m, d], b1 [n, d]: one bias per position and unit,
                                        as the seed's B_1 [d, n]                   [B, n, d]
    h1 = relu(a1)                                                                  [B, n, d]
    z  = flatten(h1) W2 + b2            W2 [n d, k], b2 [k]                        [B, k]
    loss = mean cross-entropy of softmax(z) against integer labels [B]
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .. import checks
from .. import functional as F
from .. import nn, ops
from ..backend import FLOAT_DTYPES, namespace
from .common import check_float_settings, check_labels, standardize


@dataclass
class MLPConfig:
    n_features: int       # m, the width of each input row
    seq_len: int          # n, the number of rows of an example
    d_hidden: int         # d
    n_classes: int        # k
    eps: float = 1e-5     # of the input standardization
    dtype: str = "float64"
    init_std: float = 0.02

    def __post_init__(self):
        self._check_floats()

    def _check_floats(self):
        check_float_settings(self, positive=("eps", "init_std"))

    def validate(self) -> "MLPConfig":
        for name in ("n_features", "seq_len", "d_hidden", "n_classes"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {self.dtype!r}")
        self._check_floats()
        return self

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        m, n, d, k = self.n_features, self.seq_len, self.d_hidden, self.n_classes
        return {"fc1.W": (m, d), "fc1.b": (n, d), "fc2.W": (n * d, k), "fc2.b": (k,)}

    def to_dict(self) -> dict:
        return asdict(self)


class MLPClassifier:
    """forward(x [B, n, m], labels [B] or None) -> (logits [B, k], loss); backward()."""

    def __init__(self, config: MLPConfig):
        self.config = config.validate()
        self.params = nn.Parameters(config.param_shapes(), config.dtype)
        self._cache = None

    def init(self, seed: int = 0) -> "MLPClassifier":
        """Weights N(0, init_std^2), biases zero, seeded."""
        nn.gpt2_init(self.params, seed, n_layers=1, std=self.config.init_std, residual_suffixes=())
        return self

    def num_parameters(self) -> int:
        return self.params.size

    def size_table(self, batch: int) -> dict:
        from .sizes import mlp_sizes

        return mlp_sizes(self.config, batch)

    def forward(self, x, labels=None):
        cfg, p = self.config, self.params
        checks.float_inputs(x=x)
        checks.shape("x", x, (None, cfg.seq_len, cfg.n_features))
        batch = x.shape[0]
        xp = namespace(x)
        xs = standardize(x, cfg.eps)                                       # [B, n, m]
        a1, c_fc1 = ops.linear_forward(xs, p["fc1.W"], trusted=True)      # [B, n, d]
        a1 += p["fc1.b"]                                                   # b1 [n, d]
        h1, c_relu = F.relu_forward(a1)                                    # [B, n, d]
        flat = xp.reshape(h1, (batch, cfg.seq_len * cfg.d_hidden))         # [B, n d] (a view)
        logits, c_fc2 = ops.linear_forward(flat, p["fc2.W"], p["fc2.b"],  # [B, k]
                                           trusted=True)
        loss = c_loss = None
        if labels is not None:
            check_labels(labels, batch, cfg.n_classes)
            loss, c_loss = ops.cross_entropy_forward(logits, labels)
        self._cache = (c_fc1, c_relu, c_fc2, c_loss, tuple(logits.shape), tuple(h1.shape))
        return logits, loss

    def backward(self, dlogits=None):
        """Adds every gradient into params.grad; dloss = 1, or dlogits [B, k] as the upstream."""
        if self._cache is None:
            raise RuntimeError(
                "backward() needs a forward() first (each forward allows one backward)")
        c_fc1, c_relu, c_fc2, c_loss, logits_shape, h1_shape = self._cache
        p = self.params
        if dlogits is None:
            if c_loss is None:
                raise RuntimeError("backward() without dlogits needs a forward with labels")
            dlogits = ops.cross_entropy_backward(1.0, c_loss, trusted=True)  # (s - y) / B
        else:
            checks.array("dlogits", dlogits)
            checks.shape("dlogits", dlogits, logits_shape)
        self._cache = None
        dflat = nn.linear_backward(p, "fc2", dlogits, c_fc2)              # [B, n d]
        dh1 = namespace(dflat).reshape(dflat, h1_shape)                    # [B, n, d]
        da1 = F.relu_backward(dh1, c_relu)                                 # [B, n, d]
        nn.accumulate(p, "fc1.b", namespace(da1).sum(da1, axis=0))         # [n, d]
        _, dW1, _ = ops.linear_backward(da1, c_fc1, trusted=True)   # dW1 [m, d]; dx unused
        nn.accumulate(p, "fc1.W", dW1)
