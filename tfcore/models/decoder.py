"""The decoder language model (GPT-2 and Llama style), forward to a loss and backward by hand.

    ids [B, S]
     -> x = wte[ids] (+ wpe[:S] or the sinusoidal table; rotary acts inside attention)
     -> dropout
     -> N blocks (pre-norm x + f(norm(x)) or post-norm norm(x + f(x)), see blocks.py)
     -> final norm lnf (pre-norm only: a post-norm block already ends in a norm)
     -> logits = x wte^T (tied head) or x head.W + head.b (untied)   [B, S, V]
     -> mean cross-entropy over the targets that are not -100

`backward()` runs the same ops' backwards in the reverse order and adds every parameter
gradient into ``params.grad`` (so gradients accumulate over micro-batches until
``params.zero_grad()``). With a tied head the embedding's gradient receives two
contributions: the scatter-add of the lookup and the head's x^T dlogits, transposed.

Generation (`generate`) samples greedily (temperature 0), with a temperature, top-k and
top-p, from a seeded host generator, and by default reuses keys and values through a
KV cache (`KVCache`); its logits equal the uncached forward's.

Mixture of experts (n_experts > 0): every `moe_every`-th block (h{moe_every - 1},
h{2 moe_every - 1}, ...) has a mixture of experts in place of its MLP (models/moe.py,
tfcore/functional/moe.py). The loss is then the cross-entropy plus, for each MoE block,
aux_loss_coef times its balancing loss and z_loss_coef times its router z-loss; the backward
differentiates that sum.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, NamedTuple

import numpy as np

from .. import backend, checks
from .. import functional as F
from .. import nn
from ..backend import FLOAT_DTYPES
from ..functional.moe import check_groups
from ..functional.rope import rope_tables
from .blocks import ATTENTIONS, MLPS, PLACEMENTS, BlockSpec, block_backward, block_forward, block_param_shapes
from .blocks import replayable
from .parts import ONE_DEVICE, Resident, add_rows_at, rows_at
from .moe import BALANCES, MoESpec
from .common import check_float_settings

POSITIONS = ("learned", "sinusoidal", "rotary")
ROUTERS = ("softmax", "sigmoid")
# what the forward keeps of each block for the backward (chapter 17): "none" recomputes
# nothing (every cache kept), "full" keeps only the block's input and runs the block's forward
# again in the backward, "selective" keeps all but attention's [B, H, S, S] tensors and
# rebuilds those
RECOMPUTE = ("none", "full", "selective")
IGNORE_INDEX = -100


def swiglu_width(d_model: int, multiple_of: int = 256) -> int:
    """Llama's hidden width for SwiGLU: 2/3 of 4 D (the same parameters as a 4 D MLP with two
    matrices), rounded up to a multiple of `multiple_of` (4096 -> 11008)."""
    hidden = int(2 * (4 * d_model) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class DecoderConfig:
    """Hyper-parameters of DecoderLM. d_ff=None means 4 * d_model (SwiGLU: swiglu_width).

    head_bias=None means: a bias on the head when it is untied and bias=True (a tied head
    with a bias, as seed 003 draws it, is head_bias=True). `gelu_approximate` is "tanh"
    (GPT-2) or "none" (exact erf).

    Mixture of experts: n_experts = 0 is a dense model (the MoE fields are then unused);
    n_experts > 0 routes each token to top_k of them in every moe_every-th block, with the
    router 'softmax' (Switch, Mixtral) or 'sigmoid' (DeepSeek-V3, with a selection bias that
    `DecoderLM.update_expert_bias` moves); renormalize the K gates or not (None: the router's
    custom, yes for sigmoid, no for softmax); n_shared_experts always-active experts;
    capacity_factor c (each expert takes ceil(c T K / N_E) of the T tokens of a forward) or
    None (dropless); aux_loss_coef alpha of the balancing loss, over the micro-batch
    (aux_loss='batch', Switch) or per sequence ('sequence', DeepSeek); z_loss_coef beta of the
    router z-loss; d_expert each expert's hidden width (None: d_ff).
    """

    vocab_size: int
    max_seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int | None = None
    norm: str = "layernorm"
    norm_placement: str = "pre"
    position: str = "learned"
    mlp: str = "gelu"
    tied_head: bool = True
    bias: bool = True
    dropout: float = 0.0
    eps: float = 1e-5
    dtype: str = "float64"
    head_bias: bool | None = None
    rope_base: float = 10000.0
    gelu_approximate: str = "tanh"
    init_std: float = 0.02
    attention: str = "dense"         # "tiled": the online-softmax op of chapter 15
    attention_block_size: int = 64
    n_kv_heads: int | None = None    # key/value heads (grouped-query attention); None: n_heads
    recompute: str = "none"          # "full" | "selective": activation recomputation
    n_experts: int = 0               # routed experts; 0: dense (no mixture of experts)
    top_k: int = 2                   # experts per token
    moe_every: int = 1               # blocks h{k-1}, h{2k-1}, ... are MoE
    router: str = "softmax"          # "softmax" | "sigmoid"
    renormalize: bool | None = None  # renormalise the K gates (None: sigmoid yes, softmax no)
    n_shared_experts: int = 0        # always-active experts, added
    capacity_factor: float | None = None   # None: dropless
    aux_loss_coef: float = 0.01      # alpha of the balancing loss
    z_loss_coef: float = 0.0         # beta of the router z-loss
    aux_loss: str = "batch"          # "batch" (Switch/GShard) | "sequence" (DeepSeek)
    d_expert: int | None = None      # an expert's hidden width; None: d_ff
    expert_groups: int = 1           # node-limited routing: the experts in this many groups
    group_limit: int | None = None   # ... and each token's experts from its best this many

    def __post_init__(self):
        if self.d_ff is None and isinstance(self.d_model, int):
            self.d_ff = swiglu_width(self.d_model) if self.mlp == "swiglu" else 4 * self.d_model
        if self.head_bias is None:
            self.head_bias = bool(self.bias and not self.tied_head)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self._check_floats()

    def _check_floats(self):
        check_float_settings(self, positive=("eps", "rope_base", "init_std"),
                             probabilities=("dropout",))
        for name in ("aux_loss_coef", "z_loss_coef"):
            checks.nonnegative(name, getattr(self, name))
        if self.capacity_factor is not None:
            checks.positive("capacity_factor", self.capacity_factor)

    @classmethod
    def llama(cls, vocab_size: int, max_seq_len: int, d_model: int, n_layers: int, n_heads: int,
              d_ff: int | None = None, multiple_of: int = 256, **overrides) -> "DecoderConfig":
        """Llama's choices: RMSNorm, rotary positions, SwiGLU, no biases, an untied head."""
        settings = dict(norm="rmsnorm", norm_placement="pre", position="rotary", mlp="swiglu",
                        tied_head=False, bias=False, head_bias=False, eps=1e-5)
        settings.update(overrides)
        if d_ff is None:
            d_ff = swiglu_width(d_model, multiple_of)
        return cls(vocab_size, max_seq_len, d_model, n_layers, n_heads, d_ff=d_ff, **settings)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> "DecoderConfig":
        """Raise ValueError naming the first inconsistent setting (TypeError for a float
        field that is not a number); return self when all is well. The float fields (eps,
        rope_base, init_std: finite and > 0; dropout in [0, 1)) are checked when the config
        is made as well."""
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "d_ff",
                     "attention_block_size", "n_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}): "
                "each head takes d_model / n_heads columns")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}): each key/value head serves n_heads / n_kv_heads "
                "query heads")
        for name in ("tied_head", "bias"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.head_bias, (bool, np.bool_)):
            raise ValueError(f"head_bias must be True, False or None, got {self.head_bias!r}")
        choices = dict(norm=("layernorm", "rmsnorm"), norm_placement=PLACEMENTS,
                       position=POSITIONS, mlp=MLPS, dtype=FLOAT_DTYPES,
                       gelu_approximate=F.GELU_APPROXIMATIONS, attention=ATTENTIONS)
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"recompute must be one of {RECOMPUTE} ('none' keeps every cache, 'full' "
                "keeps each block's input, 'selective' drops attention's [B, H, S, S] "
                f"tensors), got {self.recompute!r}")
        if self.recompute == "selective" and self.attention == "tiled":
            raise ValueError(
                "recompute='selective' drops attention's [B, H, S, S] probabilities, but "
                "attention='tiled' keeps none: its backward already rebuilds them tile by "
                "tile, so the combination would save nothing. Use recompute='none' with "
                "attention='tiled' (the same memory) or recompute='full'")
        if self.position == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"rotary positions rotate pairs of columns, so the head dimension d_model / "
                f"n_heads must be even, got {self.head_dim}")
        self._check_moe()
        self._check_floats()           # again: a field may have been set since
        return self

    def _check_moe(self):
        """The mixture-of-experts fields: ValueError naming the first that does not fit."""
        def count(name, least):
            value = getattr(self, name)
            if (not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_))
                    or value < least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
            return int(value)

        n_experts = count("n_experts", 0)
        count("top_k", 1)
        count("moe_every", 1)
        count("n_shared_experts", 0)
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if self.aux_loss not in BALANCES:
            raise ValueError(f"aux_loss must be one of {BALANCES}, got {self.aux_loss!r}")
        if self.renormalize is not None and not isinstance(self.renormalize, (bool, np.bool_)):
            raise ValueError(f"renormalize must be True, False or None, got {self.renormalize!r}")
        if self.d_expert is not None:
            count("d_expert", 1)
        if n_experts == 0:
            if self.n_shared_experts:
                raise ValueError(
                    f"n_shared_experts = {self.n_shared_experts} needs routed experts: set "
                    "n_experts >= 1 (n_experts = 0 is a dense model)")
            return
        if self.top_k > n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be at most n_experts ({n_experts}): "
                             "each token picks top_k distinct experts")
        count("expert_groups", 1)
        if self.group_limit is not None:
            count("group_limit", 1)
            check_groups((self.expert_groups, self.group_limit), n_experts, self.top_k)
        elif self.expert_groups != 1:
            raise ValueError(f"expert_groups = {self.expert_groups} needs group_limit (the "
                             "most groups a token's experts come from)")
        if self.moe_every > self.n_layers:
            raise ValueError(f"moe_every ({self.moe_every}) must be at most n_layers "
                             f"({self.n_layers}), or no block would be a mixture of experts")

    def is_moe_layer(self, i: int) -> bool:
        """Block h{i} has a mixture of experts in place of its MLP."""
        return self.n_experts > 0 and (i + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    def moe_spec(self) -> MoESpec | None:
        """The MoE sublayer's settings (None for a dense model)."""
        if not self.n_experts:
            return None
        return MoESpec(n_experts=self.n_experts, top_k=self.top_k,
                       d_expert=self.d_expert or self.d_ff, router=self.router,
                       normalize=self.renormalize, n_shared=self.n_shared_experts,
                       capacity_factor=self.capacity_factor,
                       aux_loss_coef=self.aux_loss_coef, z_loss_coef=self.z_loss_coef,
                       balance=self.aux_loss,
                       groups=(None if self.group_limit is None
                               else (self.expert_groups, self.group_limit)))

    def layer_spec(self, i: int) -> BlockSpec:
        """Block h{i}'s spec: block_spec(), with the MoE settings where h{i} is MoE."""
        spec = self.block_spec()
        return replace(spec, moe=self.moe_spec()) if self.is_moe_layer(i) else spec

    def block_spec(self) -> BlockSpec:
        return BlockSpec(d_model=self.d_model, n_heads=self.n_heads, d_ff=self.d_ff,
                         norm=self.norm, placement=self.norm_placement, mlp=self.mlp,
                         bias=self.bias, dropout=self.dropout, eps=self.eps, causal=True,
                         gelu_approximate=self.gelu_approximate, attention=self.attention,
                         attention_block_size=self.attention_block_size,
                         n_kv_heads=self.n_kv_heads,
                         recompute_attention=self.recompute == "selective")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of every parameter, in buffer order (no arrays are allocated)."""
        D, V = self.d_model, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"wte": (V, D)}
        if self.position == "learned":
            shapes["wpe"] = (self.max_seq_len, D)
        for i in range(self.n_layers):
            shapes.update(block_param_shapes(f"h{i}", self.layer_spec(i)))
        if self.norm_placement == "pre":
            shapes["lnf.g"] = (D,)
            if self.norm == "layernorm":
                shapes["lnf.b"] = (D,)
        if not self.tied_head:
            shapes["head.W"] = (D, V)
        if self.head_bias:
            shapes["head.b"] = (V,)
        return shapes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "DecoderConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown DecoderConfig field(s): {sorted(unknown)}")
        return cls(**values)


def position_tables(config: DecoderConfig):
    """(sinusoidal table [S_max, D] or None, rotary tables [S_max, D_h/2] or None): what the
    config's positions need, made once per model (the parallel decoders share it)."""
    S_max, dt = config.max_seq_len, config.dtype
    sinusoidal = (F.sinusoidal_positions(S_max, config.d_model, dt)
                  if config.position == "sinusoidal" else None)
    rope = (rope_tables(S_max, config.head_dim, config.rope_base, dt)
            if config.position == "rotary" else None)
    return sinusoidal, rope


class LayerCache(NamedTuple):
    """One block's caches in a span's: its index and what block_forward kept (a
    BlockCache), or ("recompute", x_in, replay, ctx) with recompute='full'."""

    layer: int
    block: Any


@dataclass
class SpanCache:
    """What forward_span keeps for backward_span: the embedding's caches (None when the span
    does not start there), [LayerCache] of its blocks, the head's and the loss's (None when
    it does not end there), and the output's shape (with its dtype and library when the
    span ends in the residual stream). backward_span takes each part out as it starts
    (leaving None, and None in the blocks' list as each block is done), so that whoever
    still holds the SpanCache holds nothing the backward has consumed: the head's and the
    loss's [B, S, D] and [B, S, V] arrays are freed before the blocks run."""

    embed: Any
    blocks: list
    head: Any
    loss: Any
    out: Any


class KVCache:
    """Keys and values of every layer for positions 0..length-1, for generation.

    k[i], v[i]: [B, H_kv, S_max, D_h] each (rotary already applied to the keys); `length` is the
    number of positions filled. Allocated once; each step writes one more position.
    """

    def __init__(self, config: DecoderConfig, batch: int):
        xp = backend.xp()
        shape = (batch, config.n_kv_heads, config.max_seq_len, config.head_dim)
        dt = getattr(xp, config.dtype)
        self.k = [xp.zeros(shape, dtype=dt) for _ in range(config.n_layers)]
        self.v = [xp.zeros(shape, dtype=dt) for _ in range(config.n_layers)]
        self.length = 0
        self.batch = batch
        self.capacity = config.max_seq_len


class DecoderLM:
    """A decoder-only language model: params in one flat buffer, hand-written backward.

    forward(ids, targets=None, training=False, rng=None) -> (logits [B, S, V], loss or None)
    backward(dlogits=None): adds every gradient into params.grad (dloss = 1 by default)

    With config.recompute="full" the forward keeps each block's input [B, S, D] (and a copy of
    the generator) instead of its caches, and the backward runs the block's forward again;
    with "selective" each attention rebuilds its probabilities. The gradients are the same,
    bit for bit (chapter 17).

    Dropout's draws, a contract that recomputation, the parallel decoders and any replay of
    a training step rely on: with training=True and dropout p > 0, each mask is
    ``rng.random(shape) >= p`` drawn from the one generator `rng`, in this order,

    1. the embedding's output (tokens plus positions) [B, S, D];
    2. then for each block h0, h1, ... in turn, pre-norm and post-norm alike:
       a. attention's probabilities [B, H, S, S] (with attention="tiled": one draw of shape
          (1,) that seeds the tiles' masks instead),
       b. the attention sublayer's output [B, S, D] (after its projection),
       c. the MLP sublayer's output [B, S, D];

    and nothing else (the final norm, the head and the loss draw nothing; evaluation or
    p = 0 draws nothing at all). recompute="full" / "selective" replay the block's or the
    attention's draws from a copy of the generator, so `rng` ends where it would without
    recomputation. Checked by
    tests/test_models_reference.py::test_dropout_draw_order_is_the_documented_one, which
    feeds masks drawn in this order to an independent forward and compares the logits and
    the generator's final state.
    """

    def __init__(self, config: DecoderConfig, parts=None, layers=None):
        """parts: the seams of a parallel layout (models/parts.py; None: one device).
        layers: the blocks this model runs (a pipeline stage's range; None: all of them)."""
        self.config = config.validate()
        self.parts = ONE_DEVICE if parts is None else parts
        self.layers = range(config.n_layers) if layers is None else layers
        self.params = nn.Parameters(self.param_shapes(), config.dtype)
        self.source = Resident(self)
        held = self.params.shapes
        self._head_units = ((["head"] if any(n in held for n in ("lnf.g", "head.W", "head.b"))
                             else []) + (["embed"] if config.tied_head else []))
        self.spec = self.parts.block_spec(config.block_spec())
        self._moe_block = (None, None)      # (the spec it was made from, the MoE block spec)
        self._sinusoidal, self._rope = position_tables(config)
        self._cache = None
        # after each forward of an MoE model: {layer: routing statistics} (see moe_stats)
        self.moe_stats: dict[int, dict] = {}

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of the parameters this model holds (every one, on one device)."""
        return self.config.param_shapes()

    # -- parameters --------------------------------------------------------------------
    def init(self, seed: int = 0) -> "DecoderLM":
        """GPT-2's initialisation (N(0, init_std^2), residual projections / sqrt(2 L)), seeded.

        The experts' and shared experts' output projections count as residual projections;
        the selection bias starts at 0."""
        nn.gpt2_init(self.params, seed, self.config.n_layers, self.config.init_std,
                     residual_suffixes=(".attn.proj.W", ".mlp.proj.W", ".experts.proj.W",
                                        ".shared.proj.W"))
        return self

    def layer_spec(self, i: int):
        """Block h{i}'s spec: self.spec, with the MoE settings where h{i} is an MoE block
        (made from the current self.spec, so an edit of self.spec reaches every block)."""
        if not self.config.is_moe_layer(i):
            return self.spec
        made_from, spec = self._moe_block
        if made_from is not self.spec:
            spec = replace(self.spec, moe=self.config.moe_spec())
            self._moe_block = (self.spec, spec)
        return spec

    def update_expert_bias(self, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: after a forward, move each sigmoid
        router's selection bias by rate * sign(mean load - load_i) (the loads of that
        forward), in place. No gradient is involved."""
        if self.config.router != "sigmoid" or not self.config.n_experts:
            raise ValueError("update_expert_bias needs router='sigmoid' and n_experts > 0: "
                             "only the sigmoid router has a selection bias")
        if not self.moe_stats:
            raise RuntimeError("update_expert_bias needs a forward first (it uses its loads)")
        for i, stats in self.moe_stats.items():
            bias = self.params[f"h{i}.moe.select.b"]
            bias[...] = F.moe.expert_bias_update(bias, stats["load"], rate)

    def num_parameters(self) -> int:
        return self.params.size

    def zero_grad(self) -> None:
        self.params.zero_grad()

    def dropout_draws(self, batch: int, seq: int, layers, embed: bool = True) -> list:
        """The shapes of the one-device dropout draws (the class docstring's order) of the
        embedding (when embed) and of the blocks `layers`, for a batch of `batch` rows and
        sequences of `seq`: a pipeline stage draws them from a copy of the step's generator
        and discards them, so that its own blocks draw one device's masks."""
        cfg = self.config
        if cfg.dropout == 0:
            return []
        stream = (batch, seq, cfg.d_model)                              # [B, S, D]
        probs = (1,) if cfg.attention == "tiled" else (batch, cfg.n_heads, seq, seq)
        shapes = [stream] if embed else []
        for _ in layers:
            shapes += [probs, stream, stream]
        return shapes

    def size_table(self, batch: int, seq: int) -> dict:
        from .sizes import decoder_sizes

        return decoder_sizes(self.config, batch, seq)

    # -- forward -----------------------------------------------------------------------
    def _check_ids(self, ids, pos=0):
        checks.array("ids", ids)        # a list: move it with tfcore.backend.asarray first
        checks.ndim("ids", ids, 2)
        seq = ids.shape[1]
        if seq < 1:
            raise ValueError("ids must hold at least one position, got shape (B, 0)")
        if pos + seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence of length {pos + seq} exceeds max_seq_len={self.config.max_seq_len}")

    def context(self, seq: int, training: bool = False, rng=None, batch_rows=None) -> dict:
        """What every unit of one forward reads: training, what dropout draws from (this
        rank's block of the whole batch's draws: batch_rows = (start, stop, B_global) are
        its rows), the positions of the residual stream's rows and the rotary tables of
        the positions attention covers, for a sequence of `seq` positions."""
        if training and self.config.dropout > 0 and rng is None:
            raise ValueError("training with dropout > 0 needs rng=tfcore.backend.default_rng(seed)"
                             " (seeded alike on every rank of a parallel run)")
        parts = self.parts
        rope = None
        if self._rope is not None:
            at = parts.attention_index(seq)
            rope = (rows_at(self._rope[0], at), rows_at(self._rope[1], at))  # [S_a, D_h/2]
        return dict(training=training, rng=parts.draws(rng, batch_rows, seq), seq=seq,
                    stream=parts.stream_index(seq), rope=rope)

    def embed_forward(self, params, ids, ctx):
        """ids [B, S] -> x [B, S_loc, D] = dropout(wte[ids] + positions), S_loc the rows
        of the residual stream this rank holds (S on one device), at positions ctx's
        "stream"."""
        x, c_emb = self.parts.embed_forward(params, ids)                   # [B, S_loc, D]
        at = ctx["stream"]
        c_pos = None
        if self.config.position == "learned":
            x, c_pos = F.positional_forward(x, rows_at(params["wpe"], at))   # [B, S_loc, D]
        elif self.config.position == "sinusoidal":
            x, _ = F.positional_forward(x, rows_at(self._sinusoidal, at))
        x, c_drop = F.dropout_forward(x, self.config.dropout, ctx["rng"], ctx["training"])
        return x, (c_emb, c_pos, at, c_drop)

    def embed_backward(self, params, dx, cache):
        c_emb, c_pos, at, c_drop = cache
        dx = F.dropout_backward(dx, c_drop)
        if c_pos is not None:
            dx, dP = F.positional_backward(dx, c_pos)                      # dP [S_loc, D]
            add_rows_at(params.grad_of("wpe"), at, dP)
        self.parts.embed_backward(params, dx, c_emb)                       # the lookup's share

    def head_forward(self, params, x):
        """x [B, S_loc, D] -> logits [B, S, V] (V_r columns under tensor parallelism): the
        final norm (pre-norm), then x wte^T (tied) or x head.W, plus head.b if any."""
        cfg = self.config
        c_lnf = None
        if cfg.norm_placement == "pre":
            x, c_lnf = nn.norm_forward(params, "lnf", x, cfg.norm, cfg.eps)
        W = params["wte"].T if cfg.tied_head else params["head.W"]          # [D, V]
        bias = params["head.b"] if "head.b" in params else None
        logits, c_head = self.parts.head_forward(x, W, bias)
        return logits, (c_lnf, c_head)

    def head_backward(self, params, dlogits, cache):
        """dlogits [B, S, V] -> dx [B, S_loc, D]; the head's (or the tied wte's) and the
        final norm's gradients added."""
        c_lnf, c_head = cache
        del cache
        cfg = self.config
        dx, dW, db = self.parts.head_backward(dlogits, c_head)           # dx [B, S, D], dW [D, V]
        del dlogits, c_head        # [B, S, V] and the head's input, freed here (the caller
        if cfg.tied_head:          # handed them over)
            nn.accumulate(params, "wte", dW.T)                             # the head's share of wte
        else:
            nn.accumulate(params, "head.W", dW)
        if db is not None:
            nn.accumulate(params, "head.b", db)
        del dW, db
        if c_lnf is not None:
            dx = nn.norm_backward(params, "lnf", dx, c_lnf, cfg.norm)
        return dx

    def head_units(self) -> list[str]:
        """The units the head reads: 'head' (lnf, head.W, head.b), and 'embed' when tied."""
        return self._head_units

    def forward_span(self, inputs, targets, ctx, layers, first: bool = True,
                     last: bool = True):
        """The skeleton, once: embedding (first) -> blocks `layers` -> final norm, head and
        loss (last). inputs: ids [B, S] when first, else the residual stream [B, S_loc, D].
        -> (out, cache): out is (logits, loss) when last (loss None without targets), else x.
        Each unit runs through the parameter source (a ZeRO-3 unit is gathered for it)."""
        cfg, run = self.config, self.source.forward
        if first:
            x, c_embed = run(["embed"], lambda p: self.embed_forward(p, inputs, ctx))
        else:
            x, c_embed = inputs, None
        c_blocks, aux = [], None
        full = cfg.recompute == "full"
        for i in layers:
            spec = self.layer_spec(i)
            # the block's input, handed over: block_forward alone holds it, and frees it once
            # its residual sum has read it (a full recompute keeps it as the block's cache)
            x_in, replay = (x, replayable(ctx["rng"])) if full else (None, None)
            box, x = [x], None
            x, c = run([f"h{i}"], lambda p: block_forward(
                p, f"h{i}", box.pop(), spec, rope=ctx["rope"], rng=ctx["rng"],
                training=ctx["training"], parts=self.parts))               # [B, S_loc, D]
            if spec.moe is not None:
                m = c.ffn                                                 # the MoECache
                aux = m.aux_loss if aux is None else aux + m.aux_loss
                self.moe_stats[i] = dict(load=m.routing["load"],
                                         kept_load=m.routing["kept_load"],
                                         capacity=m.routing["capacity"], aux_loss=m.aux_loss,
                                         load_by_rank=m.routing["load_by_rank"])
            if full:                         # the backward runs the block again from x_in
                c = ("recompute", x_in, replay, ctx)
            c_blocks.append(LayerCache(i, c))
        if not last:
            return x, SpanCache(c_embed, c_blocks, None, None,
                                (tuple(x.shape), x.dtype, backend.namespace(x)))
        # the residual stream handed over to the head, whose final norm is its last reader:
        # it is freed there, not held through the head's product and the loss
        box = [x]
        del x
        logits, c_head = run(self.head_units(), lambda p: self.head_forward(p, box.pop()))
        loss, c_loss = None, None
        if targets is not None:
            loss, c_loss = self.parts.loss_forward(logits, targets)
            if aux is not None:
                loss = loss + aux           # the balancing and z-losses of the MoE blocks
        return (logits, loss), SpanCache(c_embed, c_blocks, c_head, c_loss, tuple(logits.shape))

    def backward_span(self, cache, G=None, dloss=1.0, dlogits=None, after_unit=None):
        """The skeleton's backward: the loss (dloss, or dlogits given), head, blocks and
        embedding of a forward_span, in reverse, through the parameter source. G: the
        gradient of the span's output when it does not end in the loss. -> the gradient of
        the span's input (None when it starts at the embedding)."""
        c_embed, c_blocks, c_head, c_loss, like = (cache.embed, cache.blocks, cache.head,
                                                   cache.loss, cache.out)
        cache.embed = cache.head = cache.loss = None
        done = after_unit or (lambda label: None)
        run = self.source.backward
        if c_head is not None:
            if dlogits is None:
                if c_loss is None:
                    raise RuntimeError("backward() without dlogits needs a forward with targets")
                dlogits = self.parts.loss_backward(dloss, c_loss, overwrite=True)  # [B, S, V]
            else:
                checks.array("dlogits", dlogits)
                checks.shape("dlogits", dlogits, like)
            c_loss = None
            # both handed over, held by head_backward alone, which frees them before the
            # final norm's backward
            grad, box = [dlogits], [c_head]
            dlogits = c_head = None
            dx = run(self.head_units(),
                     lambda p, box: self.head_backward(p, grad.pop(), box.pop()), box,
                     head=True)
            done("head")
        else:
            checks.upstream("G", G, *like)
            dx = G
        for k in reversed(range(len(c_blocks))):
            i, box = c_blocks[k][0], [c_blocks[k][1]]   # the box is the caches' only holder
            c_blocks[k] = None
            spec = self.layer_spec(i)

            def block(p, box, i=i, spec=spec):
                if box[0][0] == "recompute":  # the same call, the same input, the same draws
                    _, x_in, replay, ctx = box.pop()
                    box.append(block_forward(p, f"h{i}", x_in, spec, rope=ctx["rope"],
                                             rng=replay, training=ctx["training"],
                                             parts=self.parts)[1])
                # handed over from the box, the block's backward holds this layer's caches
                # alone and frees each sublayer's as soon as it is done with it
                return block_backward(p, f"h{i}", dx, box.pop(), spec, self.parts)
            dx = run([f"h{i}"], block, box)                                # [B, S_loc, D]
            done(f"h{i}")
        if c_embed is None:
            return dx
        run(["embed"], lambda p, box: self.embed_backward(p, dx, box.pop()), [c_embed])
        done("embed")
        return None

    def forward(self, ids, targets=None, training: bool = False, rng=None, batch_rows=None):
        """ids [B, S] integers in [0, V) -> (logits [B, S, V], loss).

        targets [B, S] integers (or -100 to skip a position); loss is the mean cross-entropy
        over the counted positions as a 0-d array (plus the MoE blocks' auxiliary losses,
        moe_stats[i]["aux_loss"]), or None without targets. training=True
        turns dropout on, which needs `rng` (tfcore.backend.default_rng(seed)). The caches
        for backward() are kept until it runs.

        Under a parallel layout (parts) ids and targets are the whole sequences of this
        rank's rows of the batch, batch_rows = (start, stop, B_global) (default: every row),
        the logits are this rank's (its vocabulary columns, its positions) and the loss the
        mean over every counted token of the layout's data-parallel and ring ranks.
        """
        self._check_ids(ids)
        if targets is not None:
            checks.array("targets", targets)
            checks.shape("targets", targets, tuple(ids.shape))
        ctx = self.context(ids.shape[1], training, rng, batch_rows)
        self.moe_stats = {}
        out, self._cache = self.forward_span(ids, targets, ctx, self.layers)
        return out

    # -- backward ----------------------------------------------------------------------
    def backward(self, dlogits=None, *, dloss=1.0, after_unit=None):
        """Add every parameter's gradient into params.grad (+=), in the reverse order of forward.

        Without arguments: the gradient of the loss of the last forward (which needs
        targets), times dloss (a micro-batch's weight when accumulating). With dlogits
        [B, S, V]: the gradient of sum(dlogits * logits) instead (plus, for an MoE model, the
        auxiliary losses, which are part of every backward). The forward caches are released
        afterwards. after_unit(label): called when the gradients of a unit are final,
        'head', 'h{L-1}' .. 'h0', then 'embed' (grads.GradientBuckets starts its
        all-reduces there).
        """
        if self._cache is None:
            raise RuntimeError(
                "backward() needs a forward() first (each forward allows one backward)")
        dloss = checks.scalar_upstream("dloss", dloss)
        if after_unit is not None and not self.parts.grads_final_per_unit:
            raise ValueError("after_unit hooks need every gradient final when its unit's "
                             "backward ends; under sequence parallelism the replicated "
                             "gradients are summed over tp only after the whole backward")
        cache, self._cache = self._cache, None
        self.source.begin_backward()
        self.backward_span(cache, dloss=dloss, dlogits=dlogits, after_unit=after_unit)
        self.source.end_backward()

    # -- generation --------------------------------------------------------------------
    def new_kv_cache(self, batch: int) -> KVCache:
        return KVCache(self.config, batch)

    def forward_with_cache(self, ids, cache: KVCache):
        """Logits [B, T, V] of T new tokens ids [B, T] at positions cache.length.., attending to
        every cached position; their keys and values are appended to the cache (no dropout,
        nothing kept for backward)."""
        pos = cache.length
        self._check_ids(ids, pos)
        if ids.shape[0] != cache.batch:
            raise ValueError(
                f"ids has batch {ids.shape[0]} but the cache was made for {cache.batch}")
        if self.parts is not ONE_DEVICE:
            raise ValueError("generation runs on one device: load the parameters into a "
                             "DecoderLM(config) (gather_full gives them)")
        ctx = dict(training=False, rng=None, stream=slice(pos, pos + ids.shape[1]))
        x, _ = self.embed_forward(self.params, ids, ctx)                  # [B, T, D]
        rope = None
        if self._rope is not None:
            rope = tuple(t[pos:pos + ids.shape[1], :] for t in self._rope)  # [T, D_h/2]
        for i in range(self.config.n_layers):
            x, _ = block_forward(self.params, f"h{i}", x, self.layer_spec(i), rope=rope,
                                 kv=(cache.k[i], cache.v[i]), pos=pos)
        logits, _ = self.head_forward(self.params, x)
        cache.length = pos + ids.shape[1]
        return logits

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 use_cache: bool = True):
        """Continue prompt_ids [B, S0] (or [S0]) by max_new_tokens tokens -> ids [B, S0 + n].

        temperature 0 is greedy; otherwise tokens are drawn from softmax(logits / temperature)
        restricted to the top_k most likely and/or to the smallest set whose probability
        reaches top_p, with numpy.random.default_rng(seed) on the host (the same tokens on
        every backend). Beyond max_seq_len the context slides: the model sees the last
        max_seq_len tokens (with the cache, it is rebuilt for the new window).
        """
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        ids = np.asarray(backend.to_numpy(prompt_ids))
        if ids.dtype.kind not in "iu":      # a float id would be truncated without a word
            raise ValueError(f"prompt_ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64)
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.ndim != 2 or ids.shape[1] < 1:
            raise ValueError(f"prompt_ids must have shape (B, S0) with S0 >= 1, got {ids.shape}")
        checks.integer_ids("prompt_ids", ids, self.config.vocab_size)
        rng = np.random.default_rng(seed)
        S_max = self.config.max_seq_len
        cache = None
        pending = self._cache            # a forward's caches waiting for backward() survive
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self.forward(backend.asarray(ids[:, -S_max:]))
                self._cache = pending
            elif cache is None or cache.length >= S_max:
                cache = self.new_kv_cache(ids.shape[0])                    # (re)fill the window
                logits = self.forward_with_cache(backend.asarray(ids[:, -S_max:]), cache)
            else:
                logits = self.forward_with_cache(backend.asarray(ids[:, -1:]), cache)
            last = np.asarray(backend.to_numpy(logits[:, -1, :]), dtype=np.float64)   # [B, V]
            nxt = self.sample_next(last, temperature, top_k, top_p, rng)              # [B]
            ids = np.concatenate([ids, nxt[:, None]], axis=1)
        return backend.asarray(ids, dtype="int64")

    def sample_next(self, logits, temperature, top_k, top_p, rng):
        """sample_next(...) of this model's logits [B, V]; non-finite logits are blamed on
        the parameters that hold nan or inf, by name, when there are such."""
        try:
            return sample_next(logits, temperature, top_k, top_p, rng)
        except FloatingPointError as err:
            if np.all(np.isfinite(logits)):      # logits / temperature overflowed
                raise
            nn.blame_parameters(self.params, "the logits", err, kind=FloatingPointError)
            raise


def check_sampling(max_new_tokens, temperature, top_k, top_p):
    """The sampling settings of generate and tfcore.sample, each error naming its argument:
    temperature a finite real number >= 0 (a string is a TypeError), top_p a real number in
    (0, 1] or None."""
    if (isinstance(max_new_tokens, (bool, np.bool_))
            or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0):
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    temperature = checks.real("temperature", temperature)
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    checks.nonnegative("temperature", temperature)
    if top_k is not None and (isinstance(top_k, (bool, np.bool_))
                              or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0.0 < checks.real("top_p", top_p) <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1] or be None, got {top_p}")


def sample_next(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None,
                rng: np.random.Generator) -> np.ndarray:
    """One token per row of logits [B, V] (host float64) -> [B] int64.

    temperature 0: argmax. Otherwise p = softmax(logits / temperature), zeroed outside the
    top_k largest and outside the smallest prefix (by decreasing p) whose mass reaches
    top_p (the most likely token always stays), renormalised, sampled by inversion of one
    uniform draw per row.
    """
    if not np.all(np.isfinite(np.max(logits, axis=-1))):     # nan, +inf, or a row all -inf
        raise FloatingPointError("sample_next: the logits hold nan or inf (a non-finite "
                                 "parameter?); nothing can be sampled from them")
    if temperature == 0:
        return np.argmax(logits, axis=-1).astype(np.int64)
    with np.errstate(over="ignore"):
        z = logits / temperature
    if not np.all(np.isfinite(np.max(z, axis=-1))):
        raise FloatingPointError(f"sample_next: logits / temperature overflow at temperature "
                                 f"{temperature}; use a larger temperature, or 0 for greedy")
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[:, -top_k][:, None]                    # [B, 1]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")               # [B, V]
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p                  # mass of the better ones
        keep_sorted = before < top_p                                      # first always kept
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    cdf = np.cumsum(probs, axis=-1)                                       # [B, V]
    u = rng.random((probs.shape[0], 1)) * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=-1), probs.shape[-1] - 1).astype(np.int64)
