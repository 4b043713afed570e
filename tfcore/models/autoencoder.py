"""Seed 002's post-norm Transformer encoder trained to reconstruct its input (MSE).

    h  = x (+ in: x W_in + b_in when d_input is set) + PE[:T]     x [B, T, d_input or D]
    N post-norm blocks, biases everywhere, ReLU MLP, no mask:
        z = LayerNorm(h + MultiHead(h));  h = LayerNorm(z + FFN(z))
    y  = h (+ out: h W_out + b_out when d_input is set)             [B, T, d_input or D]
    loss = mean((y - target)^2) over every element, target = x unless given

The seed reconstructs X [B, T, d_model] directly from the last block's output; `d_input`
adds the input and output projections for data of another width.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .. import checks
from .. import functional as F
from .. import nn
from ..backend import FLOAT_DTYPES
from .blocks import BlockSpec, block_backward, block_forward, block_param_shapes
from .common import check_float_settings


@dataclass
class AutoencoderConfig:
    d_model: int
    n_heads: int
    d_ff: int
    n_layers: int
    max_seq_len: int
    d_input: int | None = None    # None: the inputs are [B, T, d_model] (the seed's model)
    dropout: float = 0.0
    eps: float = 1e-5
    dtype: str = "float64"
    init_std: float = 0.02

    def __post_init__(self):
        self._check_floats()

    def _check_floats(self):
        check_float_settings(self, positive=("eps", "init_std"), probabilities=("dropout",))

    def validate(self) -> "AutoencoderConfig":
        for name in ("d_model", "n_heads", "d_ff", "n_layers", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_input is not None and (not isinstance(self.d_input, (int, np.integer))
                                         or isinstance(self.d_input, bool) or self.d_input < 1):
            raise ValueError(f"d_input must be a positive integer or None, got {self.d_input!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads}): each head takes d_model / n_heads columns")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {self.dtype!r}")
        self._check_floats()
        return self

    @property
    def width(self) -> int:
        """The width of the inputs and of the reconstruction."""
        return self.d_model if self.d_input is None else self.d_input

    def block_spec(self) -> BlockSpec:
        return BlockSpec(d_model=self.d_model, n_heads=self.n_heads, d_ff=self.d_ff,
                         norm="layernorm", placement="post", mlp="relu", bias=True,
                         dropout=self.dropout, eps=self.eps, causal=False)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        if self.d_input is not None:
            shapes.update({"in.W": (self.d_input, self.d_model), "in.b": (self.d_model,)})
        spec = self.block_spec()
        for i in range(self.n_layers):
            shapes.update(block_param_shapes(f"h{i}", spec))
        if self.d_input is not None:
            shapes.update({"out.W": (self.d_model, self.d_input), "out.b": (self.d_input,)})
        return shapes

    def to_dict(self) -> dict:
        return asdict(self)


class Autoencoder:
    """forward(x [B, T, W], target=None, training=False, rng=None) -> (y [B, T, W], loss);
    backward() adds every parameter gradient and returns dx, the gradient with respect to
    the input with the target held fixed."""

    def __init__(self, config: AutoencoderConfig):
        self.config = config.validate()
        self.params = nn.Parameters(config.param_shapes(), config.dtype)
        self.spec = config.block_spec()
        self._positions = F.sinusoidal_positions(config.max_seq_len, config.d_model,
                                                 config.dtype)              # [S_max, D]
        self._cache = None

    def init(self, seed: int = 0) -> "Autoencoder":
        nn.gpt2_init(self.params, seed, self.config.n_layers, self.config.init_std)
        return self

    def num_parameters(self) -> int:
        return self.params.size

    def size_table(self, batch: int, seq: int) -> dict:
        from .sizes import autoencoder_sizes

        return autoencoder_sizes(self.config, batch, seq)

    def forward(self, x, target=None, training: bool = False, rng=None):
        cfg, p = self.config, self.params
        checks.float_inputs(x=x, target=target)
        checks.shape("x", x, (None, None, cfg.width))
        if target is not None:
            checks.shape("target", target, tuple(x.shape))
        if x.shape[0] < 1 or x.shape[1] < 1:
            raise ValueError(f"x must hold at least one sequence of at least one position "
                             f"(x [B, T, {cfg.width}] with B, T >= 1: the loss is a mean over "
                             f"its entries), got shape {tuple(x.shape)}")
        if x.shape[1] > cfg.max_seq_len:
            raise ValueError(
                f"sequence of length {x.shape[1]} exceeds max_seq_len={cfg.max_seq_len}")
        if training and cfg.dropout > 0 and rng is None:
            raise ValueError("training with dropout > 0 needs rng=tfcore.backend.default_rng(seed)")
        c_in = None
        h = x
        if cfg.d_input is not None:
            h, c_in = nn.linear_forward(p, "in", x)                         # [B, T, D]
        h, c_pos = F.positional_forward(h, self._positions)                # + PE[:T]
        c_blocks = []
        for i in range(cfg.n_layers):
            h, c = block_forward(p, f"h{i}", h, self.spec, rng=rng, training=training)
            c_blocks.append(c)
        y, c_out = h, None
        if cfg.d_input is not None:
            y, c_out = nn.linear_forward(p, "out", h)                       # [B, T, d_input]
        loss, c_loss = F.mse_forward(y, x if target is None else target)
        self._cache = (c_in, c_pos, c_blocks, c_out, c_loss)
        return y, loss

    def backward(self):
        if self._cache is None:
            raise RuntimeError(
                "backward() needs a forward() first (each forward allows one backward)")
        c_in, c_pos, c_blocks, c_out, c_loss = self._cache
        self._cache = None
        p = self.params
        dy = F.mse_backward(1.0, c_loss)                                    # 2 (y - target) / numel
        dh = dy if c_out is None else nn.linear_backward(p, "out", dy, c_out)
        for i in reversed(range(self.config.n_layers)):
            dh = block_backward(p, f"h{i}", dh, c_blocks[i], self.spec)
        dh, _ = F.positional_backward(dh, c_pos)    # the sinusoidal table is fixed: no gradient
        if c_in is None:
            return dh
        return nn.linear_backward(p, "in", dh, c_in)
