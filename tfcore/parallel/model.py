"""The tensor- (and sequence-, and context-) parallel decoder: DecoderLM with parallel parts.

There is one decoder (tfcore/models). A rank of a parallel layout runs it with the parts of
parallel/parts.py plugged into its seams (column- and row-parallel linears with the f/g or
sequence-parallel boundaries, the vocab-parallel embedding, head and loss, ring attention)
and holds its blocks of the one-device parameters, by name (parts.shard_rule):

    model = TensorParallelDecoder(config, mesh.tp, mesh.dp, sequence_parallel=True)
    model.init(seed)            # exactly this rank's blocks of DecoderLM(config).init(seed)
    logits, loss = model.forward(ids, targets, batch_rows=(b0, b1, B)); model.backward()

Nothing here computes a forward or a backward: this module builds the model and moves
parameters between the sharded and the one-device layouts (load_full, gather_full).
"""
from __future__ import annotations

import hashlib
import json

from .. import backend, nn
from ..models.decoder import DecoderConfig, DecoderLM
from .layout import Layout
from .parts import (  # noqa: F401  (the sharding rules, here as before)
    ParallelParts,
    check_tensor_parallel,
    shard_rule,
    shard_tensor,
    unshard_tensor,
)


def check_layout(config: DecoderConfig, tp: int, seq_len: int | None = None,
                 sequence_parallel: bool = False) -> None:
    """Raise ValueError, before any work, for a model that cannot be split tp ways."""
    check_tensor_parallel(config, tp, seq_len, sequence_parallel)


def gather_tensors(config: DecoderConfig, tp, get, ep=None):
    """The one-device flat buffer [P] (config.param_shapes() order) from every tensor-parallel
    rank's blocks, get(name) -> this rank's block of tensor `name` (collective over tp, and
    over ep, the expert-parallel group, for the experts; every rank gets it)."""
    xp = backend.xp()
    out = []
    for name in config.param_shapes():
        local = get(name)
        rule = shard_rule(name)
        group = ep if rule == "experts" else tp
        if rule == "replicated" or group is None or group.size == 1 and rule == "experts":
            out.append(xp.reshape(local, (-1,)))
            continue
        sizes = group.all_gather_object(int(local.size))
        shapes = group.all_gather_object(tuple(local.shape))
        bounds, start = [], 0
        for s in sizes:
            bounds.append((start, start + s))
            start += s
        flat = group.all_gather_flat(xp.reshape(local, (-1,)), bounds)
        pieces = [xp.reshape(flat[a:b], shp) for (a, b), shp in zip(bounds, shapes)]
        out.append(xp.reshape(unshard_tensor(name, pieces, config), (-1,)))
    return xp.concat(out, axis=0)


def config_hash(config: DecoderConfig, **layout) -> str:
    text = json.dumps(dict(config=config.to_dict(), **layout), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class TensorParallelDecoder(DecoderLM):
    """Rank-local: the one decoder on a rank of tp (x dp x cp). forward(ids, targets,
    training, rng, batch_rows) -> (logits [B, S_a, V_r] of this rank's vocabulary columns
    and positions, loss: the mean over every counted token of the dp and cp ranks);
    backward(dloss=...).

    cp: the ring's communicator (context parallelism), balanced its mirrored chunks;
    loss_group: the group over which the loss's token count is summed (default: dp, or
    the dp x cp group when given as dp); layers: a pipeline stage's blocks; ep: an MoE
    model's expert-parallel group (consecutive ranks of dp), which shards its experts;
    ulysses: the cp group computes attention by heads after all-to-alls (Ulysses) instead
    of as a ring, on contiguous chunks of the sequence."""

    def __init__(self, config: DecoderConfig, tp, dp=None, sequence_parallel: bool = False,
                 cp=None, balanced: bool = True, layers=None, ep=None,
                 ulysses: bool = False):
        config.validate()
        # the layout's parts this rank knows of (the builder validated the whole layout)
        Layout(tp=tp.size, sp=sequence_parallel, cp=None if cp is None else cp.size,
               balanced=balanced, dp=1 if dp is None else dp.size,
               ep=1 if ep is None else ep.size, ulysses=ulysses).validate(config)
        check_tensor_parallel(config, tp.size, sequence_parallel=sequence_parallel)
        tp.check_same(config_hash(config, tp=tp.size, sp=sequence_parallel),
                      "the model configuration (or the parallel layout)")
        self.tp, self.dp, self.sp, self.cp, self.ep = tp, dp, sequence_parallel, cp, ep
        parts = ParallelParts(config, tp, sequence_parallel, cp, balanced, loss_group=dp,
                              ep=ep, ulysses=ulysses)
        super().__init__(config, parts, layers)
        self.vocab = parts.vocab
        self.replicated = [n for n in self.params.names if shard_rule(n) == "replicated"]

    def param_shapes(self):
        return self.parts.local_shapes(self.held_shapes())

    def held_shapes(self) -> dict:
        """{name: one-device shape} of the tensors this rank holds blocks of (all of them;
        a pipeline stage holds its own)."""
        return self.config.param_shapes()

    # -- parameters --------------------------------------------------------------------
    def init(self, seed: int = 0) -> "TensorParallelDecoder":
        """Exactly this rank's blocks of the one-device initialisation DecoderLM(config)
        .init(seed): every rank draws the whole model from the same seed and keeps its
        blocks, so no two ranks share a draw that one device would not share."""
        return self.load_full(DecoderLM(self.config).init(seed).params)

    def load_full(self, full_params: nn.Parameters) -> "TensorParallelDecoder":
        """Copy this rank's block of every tensor of a single-device model's Parameters."""
        for name in self.params.names:
            self.params[name][...] = shard_tensor(name, full_params[name], self.config,
                                                  self.tp.size, self.tp.rank,
                                                  self.parts.ep_size, self.parts.ep_rank)
        return self

    def gather_full(self, which: str = "data"):
        """The full flat buffer of the single-device layout (every rank gets it; collective
        over tp). which: 'data' or 'grad'."""
        get = self.params.__getitem__ if which == "data" else self.params.grad_of
        return gather_tensors(self.config, self.tp, get, self.ep)
