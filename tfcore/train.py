"""Train a DecoderLM: ``python -m tfcore.train ...`` or ``train(TrainConfig(...))``.

    python -m tfcore.train --preset shakespeare-tiny       the bundled Shakespeare corpus
    python -m tfcore.train --text my.txt --steps 2000      your own UTF-8 text, by character
    python -m tfcore.plot runs/text-20260101-120000        its loss curves, to loss.png

One step (``Trainer.train_step``) of a decoder task is tfcore.parallel.runner.train_step,
on one device as on every rank of a layout (tests/test_train_step.py checks the one-device
step against the loop below written out by hand, bit for bit)::

    x, y    = batches.next()                                [B, S] int64, seeded sampler
    lr      = warmup_cosine(step, ...)                      the schedule, checked when set
    params.zero_grad()                                      one write over the flat buffer
    loss    = model.forward(x, y, training=True, rng=...)   dropout keyed by (seed, step);
    model.backward()                                        K micro-batches: weights c_k/T_c
    AdamW step: clip_grad_norm(grad, grad_clip), update     global norm (nan/inf: an error)

With --mixed-precision the forward and backward run under mixed_precision.autocast (fp16:
the loss scaled, the gradient unscaled, an overflowed step skipped and counted). The
autoencoder's step is its own (tfcore.tasks.AutoencoderTask.step: its inputs are not
tokens). Every DecoderConfig field is a TrainConfig field and a flag (MODEL_FIELDS).

What differs between the tasks (their data, model, step and evaluation, the settings
they read) is asked of the task's object, tfcore.tasks.REGISTRY[config.task]; this module
never switches on a task's name.

Before the first step the constructor checks every setting (ConfigError names it), reads
the data, builds every batcher and proves the output folder writable, so a run that starts
can save. A run with an output folder (the command line's default is
``runs/<preset or task>-<time>``) appends each step's loss, learning rate, gradient norm
and tokens/s, and each evaluation, to ``log.jsonl`` there, one JSON object per line.

A checkpoint (``Trainer.save``) is one ``.npz`` file: the flat parameters, the optimizer's
two moment buffers, and one JSON document (the configs, the step, the optimizer's scalars,
the sampler's generator state, the tokenizer, the history). It is written to a temporary
file in the same folder, flushed to disk, then renamed over the old one (``os.replace`` is
atomic), so a crash while saving leaves the previous checkpoint whole; the next save
removes the temporary file a killed one left. Non-finite parameters or moments are never
saved. Loading reads with ``allow_pickle=False``, refuses an entry whose header claims more
than it holds before allocating, checks everything (format, config, layout, shapes, the
optimizer state with the optimizer's own checks, sampler state, history, step, tokenizer)
before it changes anything, and resuming continues bit for bit: the same parameters after
N straight steps as after N/2, save, load, N/2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import math
import os
import re
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from . import backend, kernels, optim
from .backend import FLOAT_DTYPES
from .models.decoder import DecoderConfig, DecoderLM
from .tasks import FILE_TASK, REGISTRY, ConfigError, task_of
from .tasks import step_seed as _step_seed

FORMAT, VERSION = "tfcore-checkpoint", 1
TASKS = tuple(REGISTRY)      # the task names (tfcore.tasks.REGISTRY: their families)


# The model's settings: every DecoderConfig field but the two the data decides (the
# vocabulary, the context), made TrainConfig fields from dataclasses.fields(DecoderConfig)
# by _with_model_fields, so a field added to the decoder is a flag of the command line.
DATA_DECIDED = ("vocab_size", "max_seq_len")
RENAMED = {"eps": "norm_eps"}          # TrainConfig.eps is AdamW's
# the fields the autoencoder reads too, with the trainer's own defaults (d_ff None: 4 D)
SHARED_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": None, "dropout": 0.0,
                "dtype": "float32"}
# {TrainConfig name: DecoderConfig name}, in DecoderConfig's order
MODEL_FIELDS = {RENAMED.get(f.name, f.name): f.name for f in fields(DecoderConfig)
                if f.name not in DATA_DECIDED}
# the decoder tasks' own settings: None in TrainConfig means DecoderConfig's default
DECODER_SETTINGS = tuple(n for n in MODEL_FIELDS if n not in SHARED_MODEL)
DECODER_DEFAULTS = {n: f.default for f in fields(DecoderConfig)
                    for n in (RENAMED.get(f.name, f.name),) if n in DECODER_SETTINGS}


def task_settings(task) -> tuple:
    """The settings a task (tfcore.tasks.Task, or None: an unknown name) reads: its own,
    and the decoder's fields for a decoder task. One that a task ignores stays None:
    given, it is refused rather than written into a checkpoint that would then describe
    a model it is not."""
    if task is None:
        return ()
    return (*task.settings, *(DECODER_SETTINGS if task.decoder else ()))


OPTIONAL_SETTINGS = {"n_digits": 6, "seq_len": 64, "standardize": True, **DECODER_DEFAULTS}
PRECISIONS = {"bf16": "bfloat16", "fp16": "float16"}     # --mixed-precision's formats


def _model_presets() -> dict:
    """{name: settings}: the fields in which DecoderConfig.llama differs from the plain
    decoder of the same sizes (d_ff follows mlp: SwiGLU's width)."""
    sizes = dict(vocab_size=2, max_seq_len=2, d_model=8, n_layers=1, n_heads=2)
    plain, llama = DecoderConfig(**sizes), DecoderConfig.llama(**sizes)
    return {"llama": {n: getattr(llama, d) for n, d in MODEL_FIELDS.items()
                      if n != "d_ff" and getattr(llama, d) != getattr(plain, d)}}


def _with_model_fields(cls):
    """Add MODEL_FIELDS to the class's fields (before @dataclass reads them): the shared
    ones with SHARED_MODEL's defaults, the decoder's own as task settings (None: the
    decoder's default, filled in for the tasks that read them)."""
    for f in fields(DecoderConfig):
        name = RENAMED.get(f.name, f.name)
        if name not in MODEL_FIELDS:
            continue
        kind = str(f.type)
        if name in DECODER_SETTINGS and "None" not in kind:
            kind += " | None"
        cls.__annotations__[name] = kind
        setattr(cls, name, SHARED_MODEL.get(name))
    return cls


MODEL_PRESETS = _model_presets()


@dataclass
@_with_model_fields
class TrainConfig:
    """Everything that decides a training run. Fields below `out_dir` may change on resume;
    every other field must match the checkpoint's.

    Settings marked (task) are read by some tasks only: left None they take the task's
    default (n_digits 6, seq_len 64, standardize True, and DecoderConfig's defaults for
    the decoder's fields), and a task that does not read one refuses it.

    The model's fields follow the ones written here, one per DecoderConfig field
    (MODEL_FIELDS; the norm's eps is norm_eps): d_model 64, n_layers 2, n_heads 4, d_ff
    (None: 4 d_model), dropout 0 and dtype float32 for every task, the rest (norm, mlp,
    position, attention, n_kv_heads, recompute, tied_head, bias, the mixture of experts,
    ...) (task) settings of the decoder tasks. MODEL_PRESETS['llama'] holds Llama's.
    """

    task: str = "shakespeare"     # 'shakespeare' (characters), 'text' (characters of the
                                  # file `text`), a DigitTask ('reverse', 'sort'), or
                                  # 'autoencoder' (seed 002: reconstruct Gaussian sequences)
    text: str | None = None       # task 'text': a UTF-8 file to learn, character by character
    n_digits: int | None = None   # (task) digit tasks: digits per sequence (x, y [B, 2n])
    seq_len: int | None = None    # (task) text: the context length S; autoencoder: T
    standardize: bool | None = None  # (task) autoencoder: rows of mean 0, variance 1
    val_fraction: float = 0.1     # text: the last tenth of the corpus is validation
    steps: int = 200              # total updates (also the end of the cosine schedule)
    batch_size: int = 32
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    grad_clip: float = 1.0        # 0 turns clipping off
    mixed_precision: str | None = None  # decoder tasks: 'bf16' or 'fp16' products (float32
                                  # master weights and AdamW state; fp16: loss scaling)
    seed: int = 0                 # model init, batches and dropout all derive from it
    out_dir: str | None = None    # where checkpoint.npz and log.jsonl go (None: neither)
    eval_interval: int = 50       # evaluate every this many steps (and at the end)
    eval_batches: int = 4         # validation batches per evaluation (the same ones each time)
    checkpoint_interval: int = 0  # save every this many steps (0: only at the end)
    progress: bool = True         # show a tqdm progress bar and the evaluations
    # the layout (tfcore.parallel.Layout; the text tasks): ranks of data, tensor and context
    # parallelism, the ZeRO stage, sequence parallelism and micro-batches per step (with pp:
    # the pipeline's), pipeline stages, virtual stages (model chunks) per pipeline rank and
    # the pipeline's schedule (None: 1f1b, interleaved with virtual > 1). A run may resume
    # under another layout: a checkpoint holds one device's state. micro_batches (gradient
    # accumulation) is the digit tasks' too
    dp: int = 1
    tp: int = 1
    cp: int | None = None
    ep: int = 1                   # expert parallelism: an MoE model's experts over ep dp ranks
    ulysses: bool = False         # with cp: Ulysses attention (all-to-alls) instead of the ring
    zero: int = 0
    sp: bool = False
    micro_batches: int = 1
    pp: int | None = None
    virtual: int = 1
    schedule: str | None = None

    def __post_init__(self):
        reads = task_settings(REGISTRY.get(self.task) if isinstance(self.task, str) else None)
        for name, default in OPTIONAL_SETTINGS.items():
            if getattr(self, name) is None and name in reads:
                setattr(self, name, default)

    def validate(self) -> "TrainConfig":
        """Raise ConfigError naming the first setting that cannot work; return self."""
        from .models.blocks import MLPS
        from .models.decoder import POSITIONS

        if not isinstance(self.task, str) or self.task not in REGISTRY:
            raise ConfigError("task", f"must be one of {', '.join(REGISTRY)}, got "
                              f"{self.task!r}")
        task = task_of(self.task)
        for name in OPTIONAL_SETTINGS:
            if name not in task_settings(task) and getattr(self, name) is not None:
                reads = ", ".join(task.settings) + (" and the decoder's fields"
                                                    if task.decoder else "")
                raise ConfigError(name, f"is not read by task {self.task!r} (it sets "
                                  f"{reads}): leave it out")
        task.check_source(self)
        ints = {"d_model": 1, "n_layers": 1, "n_heads": 1, "steps": 1, "batch_size": 1,
                "eval_interval": 1, "eval_batches": 1, "warmup_steps": 0,
                "checkpoint_interval": 0, "seed": 0, "seq_len": 1, "d_ff": 1}
        for name, low in ints.items():
            value = getattr(self, name)
            if value is None and name in ("seq_len", "d_ff"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ConfigError(name, f"must be an integer, got {value!r}")
            if value < low:
                raise ConfigError(name, f"must be an integer >= {low}, got {value}")
        if self.seed >= 2**63:
            raise ConfigError("seed", f"must be below 2**63, got {self.seed}")
        task.check(self)
        if self.n_digits is not None and (isinstance(self.n_digits, bool) or not isinstance(
                self.n_digits, (int, np.integer)) or not 2 <= self.n_digits <= 18):
            raise ConfigError("n_digits", f"must be an integer in [2, 18], got {self.n_digits!r}")
        for name in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip",
                     "dropout", "val_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating,
                                                                 np.integer)):
                raise ConfigError(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(name, f"must be finite, got {value}")
        ranges = {"lr": (self.lr > 0, "must be > 0"),
                  "min_lr": (0 <= self.min_lr <= self.lr, f"must lie in [0, lr = {self.lr}]"),
                  "weight_decay": (self.weight_decay >= 0, "must be >= 0"),
                  "beta1": (0 <= self.beta1 < 1, "must lie in [0, 1)"),
                  "beta2": (0 <= self.beta2 < 1, "must lie in [0, 1)"),
                  "eps": (self.eps > 0, "must be > 0"),
                  "grad_clip": (self.grad_clip >= 0, "must be >= 0 (0 turns clipping off)"),
                  "dropout": (0 <= self.dropout < 1, "must lie in [0, 1)"),
                  "val_fraction": (0 < self.val_fraction < 1, "must lie in (0, 1)")}
        for name, (ok, rule) in ranges.items():
            if not ok:
                raise ConfigError(name, f"{rule}, got {getattr(self, name)}")
        if self.warmup_steps > self.steps:
            raise ConfigError("warmup_steps", f"({self.warmup_steps}) must not exceed steps "
                              f"({self.steps}): lower --warmup-steps or raise --steps")
        choices = {"dtype": FLOAT_DTYPES, "norm": ("layernorm", "rmsnorm"),
                   "mlp": MLPS, "position": POSITIONS}
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ConfigError(name, f"must be one of {', '.join(allowed)}, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError("n_heads", f"({self.n_heads}) must divide d_model "
                              f"({self.d_model}): each head takes d_model / n_heads columns")
        if self.position == "rotary" and (self.d_model // self.n_heads) % 2:
            raise ConfigError("n_heads", "must leave an even head width d_model / n_heads "
                              "for rotary positions")
        for name in ("standardize", "progress", "sp"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (bool, np.bool_)):
                raise ConfigError(name, f"must be True or False, got {value!r}")
        if self.out_dir is not None and not isinstance(self.out_dir, (str, os.PathLike)):
            raise ConfigError("out_dir", f"must be a path, got {self.out_dir!r}")
        model = self._checked_model(task)
        if self.mixed_precision is not None:
            if self.mixed_precision not in PRECISIONS:
                raise ConfigError("mixed_precision", f"must be one of "
                                  f"{', '.join(PRECISIONS)}, got {self.mixed_precision!r}")
            if not task.decoder:
                raise ConfigError("mixed_precision", f"is for the decoder tasks: task "
                                  f"{self.task!r} trains in its dtype")
            if self.dtype != "float32":
                raise ConfigError("mixed_precision", f"keeps float32 master weights and "
                                  f"AdamW state: give --dtype float32, not {self.dtype}")
        layout = self.layout()
        defaults = {f.name: f.default for f in fields(TrainConfig) if f.name in LAYOUT_FIELDS}
        given = [f for f in LAYOUT_FIELDS if getattr(self, f) != defaults[f]
                 and f not in task.one_device_layout]
        if given and not task.parallel:
            raise ConfigError(given[0], f"is for the text tasks: task {self.task!r} trains on "
                              "one device (leave the layout options out"
                              + "".join(f" but {flag(f)}" for f in task.one_device_layout)
                              + ")")
        try:       # the refusals and sizes that need the model's settings only (one
                   # device runs every model: the refusals are the ranks')
            layout.validate(model if layout.world_size > 1 else None, batch=self.batch_size,
                            seq=task.layout_sequence(self))
        except ValueError as err:
            raise layout_error(err, self) from None
        if self.mixed_precision == "fp16" and layout.world_size > 1:
            raise ConfigError("mixed_precision", "fp16 trains on one device only: its loss "
                              "scaler skips a step whose gradient overflowed, and every "
                              "rank would have to agree on it (a collective plan() does not "
                              "price); use bf16 under a layout")
        if layout.world_size == 1 and self.micro_batches > 1 and self.dropout > 0:
            raise ConfigError("micro_batches", f"({self.micro_batches}) on one device needs "
                              "--dropout 0: the one-device decoder draws each micro-batch's "
                              "dropout masks, not the whole batch's")
        if self.pp is not None and self.n_layers % (self.pp * self.virtual):
            times = ("" if self.virtual == 1 else
                     f" (times --virtual {self.virtual} = {self.pp * self.virtual})")
            raise ConfigError("pp", f"{self.pp}{times} must divide n_layers "
                              f"({self.n_layers}): every virtual stage holds the same number "
                              "of blocks")
        if layout.pp is not None and layout.pipeline_schedule == "interleaved" and (
                self.micro_batches % self.pp):
            raise ConfigError("micro_batches", f"({self.micro_batches}) must be a multiple "
                              f"of pp ({self.pp}) for the interleaved schedule: micro-batches "
                              "go through the chunks in groups of pp")
        return self

    def decoder_config(self, vocab_size: int, max_seq_len: int) -> DecoderConfig:
        """The DecoderConfig of this run's model (a decoder task), its vocabulary and
        context given by the data."""
        return DecoderConfig(vocab_size=vocab_size, max_seq_len=max_seq_len,
                             **{d: getattr(self, n) for n, d in MODEL_FIELDS.items()})

    def _checked_model(self, task) -> DecoderConfig | None:
        """The decoder's own checks of the model fields (DecoderConfig.validate), as a
        ConfigError naming the first field its message names; the DecoderConfig (its
        vocabulary a placeholder: the data decides it, its context the task's sample),
        or None for a task whose model is not the decoder (the autoencoder)."""
        if not task.decoder:
            return None
        try:
            return self.decoder_config(2, task.sequence(self)).validate()
        except (TypeError, ValueError) as err:
            text = str(err)
            named = [RENAMED.get(w, w) for w in re.findall(r"[a-z_]+", text)
                     if RENAMED.get(w, w) in MODEL_FIELDS]
            # the first field it names that was set (n_kv_heads, not n_heads at its default)
            defaults = {**SHARED_MODEL, **DECODER_DEFAULTS}
            field = next((n for n in named if getattr(self, n) != defaults[n]),
                         named[0] if named else "d_model")
            detail = text[len(MODEL_FIELDS[field]):].lstrip() if text.startswith(
                MODEL_FIELDS[field]) else text
            raise ConfigError(field, detail) from None

    def layout(self):
        """The run's tfcore.parallel.Layout (its fields' own checks, ConfigError naming it)."""
        from .parallel.layout import SCHEDULES, Layout

        for name in ("dp", "tp", "ep", "micro_batches", "virtual"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        for name in ("cp", "pp"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, np.integer)) or value < 1):
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ConfigError("zero", f"must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConfigError("schedule", f"must be one of {', '.join(SCHEDULES)}, got "
                              f"{self.schedule!r}")
        return Layout(dp=int(self.dp), tp=int(self.tp), cp=None if self.cp is None
                      else int(self.cp), ep=int(self.ep), ulysses=bool(self.ulysses),
                      zero=int(self.zero),
                      sp=bool(self.sp),
                      micro_batches=int(self.micro_batches),
                      pp=None if self.pp is None else int(self.pp),
                      virtual=int(self.virtual), schedule=self.schedule,
                      clip=self.grad_clip or None)


def parallel_field(config: TrainConfig) -> str:
    """The first layout degree above 1 (dp, tp, pp, cp): the flag a wrong number of ranks
    is reported on."""
    return next((f for f in ("dp", "tp", "pp", "cp", "ep") if (getattr(config, f) or 1) > 1),
                "dp")


def layout_error(err: ValueError, config: TrainConfig) -> ConfigError:
    """Layout.validate's refusal as a ConfigError naming the first of its fields that is a
    setting (its flag), with the refusal's own line: the combination and the reason."""
    rule = getattr(err, "rule", None)
    if rule is None:                 # a size (LayoutSizeError.field): the flag that sets it
        named = getattr(err, "field", None)
        field = {"batch": "batch_size", "seq": "seq_len", "world": None,
                 None: None}.get(named, named) or parallel_field(config)
        return ConfigError(field, str(err))
    field = next((f for f in rule.fields if f in LAYOUT_FIELDS + ("clip",)
                  + tuple(MODEL_FIELDS)), "dp")
    field = "grad_clip" if field == "clip" else field
    return ConfigError(field, f"{getattr(config, field)!r}: {err}")


# Fields that may differ between a checkpoint and the run that resumes it: they change
# where files go and how often we look, or the layout (whose runs equal one device's to
# rounding), never the trajectory of the parameters.
LAYOUT_FIELDS = ("dp", "tp", "cp", "ep", "ulysses", "zero", "sp", "micro_batches", "pp", "virtual",
                 "schedule")
FREE_FIELDS = ("out_dir", "eval_interval", "eval_batches", "checkpoint_interval", "progress",
               *LAYOUT_FIELDS)

PRESETS = {
    # The Training chapter's run: a few seconds on 2 cores.
    "shakespeare-tiny": dict(task="shakespeare", seq_len=32, d_model=48, n_layers=2,
                             n_heads=4, mlp="relu", steps=400, batch_size=16, lr=1e-2,
                             min_lr=1e-3, warmup_steps=10, dtype="float64",
                             eval_interval=100),
    # Seed 002's experiment: its post-norm encoder reconstructing a fixed set of 16 sequences
    # [16, 16, 64] with seed 002's Adam (lr 1e-3, constant), full batch: a step is an epoch.
    "seed002": dict(task="autoencoder", seq_len=16, batch_size=16, d_model=64, n_heads=4,
                    d_ff=256, n_layers=2, steps=500, lr=1e-3, min_lr=1e-3, warmup_steps=0,
                    beta2=0.999, weight_decay=0.0, grad_clip=0.0, dtype="float64",
                    eval_interval=50),
    # The larger run the README gives: 0.8 M parameters, about 0.5 s of one core per step.
    "shakespeare": dict(task="shakespeare", seq_len=64, d_model=128, n_layers=4,
                        n_heads=4, steps=2500, batch_size=32, lr=2e-3, min_lr=2e-4,
                        warmup_steps=100, dropout=0.1, dtype="float32", eval_interval=250,
                        eval_batches=8, checkpoint_interval=500),
    "reverse": dict(task="reverse", n_digits=6, d_model=64, n_layers=2, n_heads=4,
                    steps=400, batch_size=64, lr=3e-3, min_lr=3e-4, warmup_steps=20,
                    weight_decay=0.0, dtype="float32", eval_interval=100),
}


class CheckpointError(ValueError):
    """A file that is not a readable tfcore checkpoint (truncated, corrupted, wrong format)."""


class ConfigMismatch(ValueError):
    """A checkpoint made by a run with a different configuration."""


def _step_seed(seed: int, step: int, stream: int) -> int:
    """An independent 63-bit seed for (run seed, step, stream): dropout needs no saved state."""
    return int(np.random.SeedSequence([seed, stream, step]).generate_state(2, np.uint64)[0]
               >> np.uint64(1))


class Trainer:
    """A model, its optimizer, its data and the step count, with save / load. Its `task`
    (tfcore.tasks.REGISTRY[config.task]) gives the data, the model, the step and the
    evaluation; the loop, the log and the checkpoints are the same for every task.

    history: {'step', 'loss', 'lr', 'grad_norm', 'tokens_per_s'} per step and
    {'eval_step', 'val_loss', 'val_accuracy'} per evaluation (accuracy: digit tasks'
    held-out exact match). With an out_dir, every step and evaluation is also appended to
    out_dir/log.jsonl, one JSON object per line.

    The constructor checks everything a run needs before the first step: the settings, the
    data (the text, a validation part longer than the context), the model, and an output
    folder that exists and takes a file. So a run that starts can save.
    """

    HISTORY_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s",
                    "eval_step", "val_loss", "val_accuracy")

    def __init__(self, config: TrainConfig, world=None):
        """world: the communicator of a parallel layout's ranks (tfcore.parallel: a
        SimulatedGroup's or MPIComm), every rank building its Trainer with the same config;
        None on one device."""
        self.config = cfg = config.validate()
        self.layout = cfg.layout()
        self.task = task_of(cfg.task)
        if world is not None and not self.task.parallel:
            raise ConfigError("simulate", f"is for the text tasks: task {cfg.task!r} trains "
                              "on one device")
        self.world, self.run_state = world, None
        self.rank0 = world is None or world.rank == 0
        task_data = self.task.data(cfg)          # its batches, tokenizer and vocabulary
        self.batches, self.val_batches = task_data.batches, task_data.val_batches
        self.tokenizer, self.text_sha256 = task_data.tokenizer, task_data.text_sha256
        self._val_state = None if self.val_batches is None else self.val_batches.state
        self.model_config = self.task.model_config(cfg, task_data)
        self.task.build(self, world)             # model, params, optimizer; then _start

    def _hyper(self) -> dict:
        c = self.config
        return dict(lr=c.lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                    weight_decay=c.weight_decay)

    def _start(self):
        self.step = 0
        self.history: dict[str, list] = {k: [] for k in self.HISTORY_KEYS}
        # what this rank's steps measured: bytes sent in each step, seconds of each
        self.measured: dict[str, list] = {"sent": [], "seconds": []}
        self.last_saved: Path | None = None   # the checkpoint this trainer last wrote
        if self.config.out_dir is not None and self.rank0:
            prepare_out_dir(self.config.out_dir)

    def _build_run(self, world):
        """A decoder task's model (Task.build): the one decoder and its AdamW as a
        runner.Run (tfcore.parallel.runner.build):
        on this rank of the layout with its share of DecoderLM(model_config).init(seed),
        or (world None) on one device, DecoderLM(model_config).init(seed) itself."""
        from .parallel.layout import Layout
        from .parallel.runner import build

        cfg, layout = self.config, self.layout
        precision = PRECISIONS.get(cfg.mixed_precision)
        if world is None:
            if layout.world_size > 1:
                raise ConfigError(parallel_field(cfg), f"asks for {layout.world_size} ranks: "
                                  f"run under mpiexec -n {layout.world_size}, or with "
                                  f"--simulate {layout.world_size}")
            # one rank: what the layout asks of it is accumulation and clipping
            self.run_state = build(None, self.model_config,
                                   Layout(micro_batches=layout.micro_batches,
                                          clip=layout.clip), self._hyper(),
                                   precision=precision)
            self.model = self.run_state.model.init(cfg.seed)
            self.params = self.model.params
            self.optimizer = self.run_state.optimizer
            self._start()
            return
        try:
            layout.validate(self.model_config, world=world.size, batch=cfg.batch_size,
                            seq=cfg.seq_len)
        except ValueError as err:
            raise layout_error(err, cfg) from None
        if precision == "float16":
            raise ConfigError("mixed_precision", "fp16 trains on one device only (its loss "
                              "scaler's skip needs every rank to agree); use bf16")
        try:
            self.run_state = build(world, self.model_config, layout, self._hyper(),
                                   precision=precision)
        except ValueError as err:
            raise ConfigError("tp", str(err)) from None
        self.model = self.run_state.model
        self.model.load_full(DecoderLM(self.model_config).init(cfg.seed).params)
        self.optimizer = self.run_state.optimizer
        self.params = None          # a rank holds blocks of them: see checkpoint.gather_state
        self._start()

    # -- training ----------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        c = self.config
        return optim.warmup_cosine(step, c.lr, c.warmup_steps, c.steps, c.min_lr)

    def train_step(self) -> float:
        """One update of the task (Task.step); returns the batch's loss (before the
        update). A decoder task's is _decoder_step, the autoencoder's its own."""
        return self.task.step(self)

    def _decoder_step(self) -> float:
        """A decoder task's update: the batch, the scheduled learning rate, and
        tfcore.parallel.runner.train_step, on one device as on every rank of a layout
        (zeroed gradients, each micro-batch's forward and backward, the gradient summed
        over the data ranks, the optimizer's clip and step, which refuses a nan or inf
        gradient; with --mixed-precision under autocast, fp16's loss scaler skipping an
        overflowed step). Every rank takes the same batch and its rows of it; dropout's
        masks are one device's."""
        from .parallel.runner import train_step

        cfg = self.config
        # [B, S] each, on the host: the step moves each rank's micro-batches to the device
        x, y = (np.asarray(backend.to_numpy(a)) for a in self.batches.next())
        seed = _step_seed(cfg.seed, self.step, 1)
        dropout = (lambda: dict(training=True, rng=backend.default_rng(seed))) \
            if cfg.dropout else None
        self.optimizer.lr = self.lr_at(self.step)
        scaler = self.run_state.scaler
        skipped = None if scaler is None else scaler.skipped
        loss, _ = train_step(self.run_state, x, y, cfg.batch_size, dropout)
        if scaler is not None and scaler.skipped != skipped:
            self.last_grad_norm = None              # fp16 overflowed: the step was skipped
        else:
            self.last_grad_norm = self._grad_norm()
        self.step += 1
        return loss

    def _grad_norm(self):
        """The gradient's global norm before clipping, as the log shows it: the optimizer's
        with clipping; without, on one device, the norm of the gradient the step left in
        params.grad (the optimizer leaves it as it is when it does not clip); None on the
        ranks of a layout without clipping (its norm would cost a collective)."""
        if self.optimizer.clip is not None:
            return self.optimizer.last_norm
        return None if self.world is not None else optim.grad_norm(self.params.grad)

    def plan(self):
        """tfcore.parallel.plan of this run's model and layout on its batch [B, S] (its
        memory per rank, bytes per step per rank), or None for a task that is not the
        decoder's. A mixture of experts is priced for an even routing (its all-to-all
        bytes depend on where the router sends the tokens)."""
        from .parallel import plan
        from .parallel.layout import LayoutError

        if not self.task.decoder:
            return None
        try:
            return plan(self.model_config, self.layout, batch=self.config.batch_size,
                        seq=self.model_config.max_seq_len, dtype=self.config.dtype)
        except LayoutError:
            if self.world is not None:
                raise
            return None

    def held(self) -> dict:
        """Bytes of the parameters, gradients and AdamW state this rank holds (plan's
        memory): runner.held_bytes on a rank of a layout, the flat buffers on one device."""
        from .parallel.runner import Run, held_bytes

        run = self.run_state or Run(None, self.model, self.optimizer, None, self.layout)
        return held_bytes(run)

    def evaluate(self) -> dict:
        """Mean loss over eval_batches fixed validation batches (digit tasks: 500 held-out
        sequences, with their exact-match accuracy); under the step's autocast with
        --mixed-precision (the model it trains is the low-precision one)."""
        from .parallel.runner import precision_scope

        fp16 = self.config.mixed_precision == "fp16"      # an inf loss is reported as such
        with precision_scope(PRECISIONS.get(self.config.mixed_precision)), (
                backend.expected_overflow() if fp16 else contextlib.nullcontext()):
            return self.task.evaluate(self)

    @property
    def val_ids(self):
        """A text task's validation ids [N] int64: the stream its validation batches
        sample (the corpus's last val_fraction)."""
        if self.val_batches is None:
            raise AttributeError(f"task {self.config.task!r} has no validation ids: it "
                                 "evaluates on held-out samples of its own")
        return self.val_batches.ids

    def _record_eval(self) -> dict:
        result = self.evaluate()
        self.history["eval_step"].append(self.step)
        self.history["val_loss"].append(result["val_loss"])
        self.history["val_accuracy"].append(result["val_accuracy"])
        return result

    @property
    def log_path(self) -> Path | None:
        """out_dir/log.jsonl, or None without an out_dir (or on a rank other than 0)."""
        if self.config.out_dir is None or not self.rank0:
            return None
        return Path(self.config.out_dir) / LOG_NAME

    def _open_log(self):
        """The run log, opened for appending; lines of steps past this trainer's step (a
        run that went on after its last checkpoint, then resumed) are dropped first."""
        path = self.log_path
        if path is None:
            return None
        if path.exists():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if _log_step(line) is not None and _log_step(line) <= self.step]
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        return open(path, "a", encoding="utf-8")

    def run(self, until: int | None = None) -> "Trainer":
        """Train until step `until` (default config.steps), evaluating and checkpointing
        on the configured intervals; shows a tqdm bar with the loss and tokens/s and prints
        each evaluation above it (with progress), and appends every step to log.jsonl
        (with an out_dir)."""
        cfg = self.config
        until = cfg.steps if until is None else min(until, cfg.steps)
        if self.step >= until:
            return self
        tokens = self.task.tokens_per_step(cfg)
        bar = None
        if cfg.progress and self.rank0:
            from tqdm.auto import tqdm

            bar = tqdm(total=until, initial=self.step, desc="train", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        log = self._open_log()
        try:
            while self.step < until:
                start = time.perf_counter()
                before = 0 if self.world is None else self.world.traffic.sent
                loss = self.train_step()
                seconds = time.perf_counter() - start
                self.measured["sent"].append(
                    0 if self.world is None else self.world.traffic.sent - before)
                self.measured["seconds"].append(seconds)
                rate = tokens / max(seconds, 1e-9)
                record = {"step": self.step, "loss": loss, "lr": self.optimizer.lr,
                          "grad_norm": self.last_grad_norm, "tokens_per_s": rate}
                for key, value in record.items():
                    self.history[key].append(value)
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                post = {"loss": f"{loss:.4f}", "tok/s": f"{rate:,.0f}"}
                if self.step % cfg.eval_interval == 0 or self.step == cfg.steps:
                    result = self._record_eval()
                    if log is not None:
                        log.write(json.dumps({"step": self.step, **result}) + "\n")
                    line = (f"step {self.step}: train loss {loss:.4f}, "
                            f"val loss {result['val_loss']:.4f}")
                    if result["val_accuracy"] is not None:
                        line += f", held-out exact match {result['val_accuracy']:.3f}"
                    if bar is not None:
                        bar.write(line, file=sys.stderr)
                if log is not None:
                    log.flush()
                if cfg.out_dir and (self.step == cfg.steps or (
                        cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0)):
                    self.save(Path(cfg.out_dir) / CHECKPOINT_NAME)
                if bar is not None:
                    bar.set_postfix(post, refresh=False)
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            if log is not None:
                log.close()
        return self

    # -- checkpoints ---------------------------------------------------------------------
    def _one_device_layout(self) -> list:
        """[(name, shape)] of one device's flat buffer: what every checkpoint holds."""
        if self.world is None:
            return self.params.layout()
        return list(self.model_config.param_shapes().items())

    def _meta(self) -> dict:
        opt = self.optimizer.state_dict()
        return {
            "format": FORMAT, "version": VERSION,
            "config": asdict(self.config),
            "model_config": self.model_config.to_dict(),
            "layout": [[n, list(s)] for n, s in self._one_device_layout()],
            "step": self.step,
            "optimizer": {k: v for k, v in opt.items() if k not in ("m", "v")},
            "sampler_state": self.batches.state,
            "tokenizer": None if self.tokenizer is None else self.tokenizer.chars,
            "text_sha256": self.text_sha256,
            "history": self.history,
            "loss_scaler": self._scaler_state(),
        }

    def _scaler_state(self) -> dict | None:
        """fp16's LossScaler as JSON numbers (its scale, clean steps, steps and skips),
        None without one."""
        scaler = None if self.run_state is None else self.run_state.scaler
        if scaler is None:
            return None
        return {k: getattr(scaler, k) for k in SCALER_STATE}

    def save(self, path) -> Path:
        """Write the checkpoint atomically (temporary file, fsync, os.replace); returns path.

        Refuses (FloatingPointError, nothing written) parameters or moments holding nan or
        inf: a checkpoint that load() would refuse must not replace a good one.
        """
        path = Path(path)
        if self.world is not None:  # every rank: one device's state, rank 0 writes it
            from .parallel.checkpoint import gather_state

            state = gather_state(self.run_state)
            arrays = {"params": state["params"], "optimizer.m": state["m"],
                      "optimizer.v": state["v"]}
        else:
            arrays = {
                "params": backend.to_numpy(self.params.data),
                "optimizer.m": backend.to_numpy(self.optimizer.m),
                "optimizer.v": backend.to_numpy(self.optimizer.v),
            }
        for key, values in arrays.items():
            if not np.all(np.isfinite(values)):
                raise FloatingPointError(
                    f"refusing to save step {self.step} to {path}: {key} holds nan or inf "
                    "(the file there, if any, is left as it was)")
        arrays["meta"] = np.frombuffer(json.dumps(self._meta()).encode(), dtype=np.uint8)
        if self.rank0:
            atomic_write(path, arrays)
        if self.world is not None:          # no rank goes on before the file is whole
            self.world.barrier()
        self.last_saved = path
        return path

    def load(self, path) -> "Trainer":
        """Restore a checkpoint into this trainer. Raises CheckpointError for a file that is
        not one (or holds a malformed or inconsistent state), ConfigMismatch (naming the
        field) for another run's; in every case this trainer is left exactly as it was:
        everything is checked (the optimizer state by the optimizer's own checks) before
        anything is copied in."""
        meta, arrays = read_checkpoint(path)
        check_config(meta, self.config, path)
        try:
            layout = [(n, tuple(s)) for n, s in meta["layout"]]
        except (TypeError, ValueError, KeyError) as err:
            raise CheckpointError(f"{path}: malformed layout ({err})") from None
        if layout != [(n, tuple(s)) for n, s in self._one_device_layout()]:
            raise ConfigMismatch(f"{path}: the parameter layout differs from this model's")
        n = sum(int(np.prod(s)) for _, s in layout)
        for key in ("params", "optimizer.m", "optimizer.v"):
            if arrays[key].shape != (n,) or arrays[key].dtype != np.dtype(self.config.dtype):
                raise CheckpointError(f"{path}: {key} has shape {arrays[key].shape} and dtype "
                                      f"{arrays[key].dtype}, expected ({n},) "
                                      f"{self.config.dtype}")
        if not np.all(np.isfinite(arrays["params"])):
            raise CheckpointError(f"{path}: the parameters hold nan or inf")
        step = meta.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not (
                0 <= step <= self.config.steps):
            raise CheckpointError(f"{path}: step must be an integer in [0, steps = "
                                  f"{self.config.steps}], got {step!r}")
        if not isinstance(meta.get("optimizer"), dict):
            raise CheckpointError(f"{path}: malformed optimizer state")
        opt_state = dict(meta["optimizer"], m=arrays["optimizer.m"], v=arrays["optimizer.v"])
        if isinstance(opt_state.get("betas"), list):
            opt_state["betas"] = tuple(opt_state["betas"])
        # checked by the optimizer's own rules, against one device's buffers
        checker = self.optimizer
        if self.world is not None:
            from . import nn

            checker = type(self.optimizer)(
                nn.Parameters(self.model_config.param_shapes(), self.config.dtype),
                lr=self.optimizer.lr, betas=self.optimizer.betas, eps=self.optimizer.eps,
                **({"weight_decay": self.optimizer.weight_decay}
                   if "weight_decay" in type(self.optimizer)._hyper else {}))
        try:
            checker.check_state_dict(opt_state)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: {err}") from None
        scaler_state = _checked_scaler(meta.get("loss_scaler"), self._scaler_state(), path)
        skipped = 0 if scaler_state is None else scaler_state["skipped"]
        if opt_state["t"] + opt_state.get("skipped", 0) + skipped != step:
            raise CheckpointError(f"{path}: the optimizer has made {opt_state['t']} updates "
                                  + (f"and fp16 skipped {skipped} " if skipped else "")
                                  + f"but the checkpoint is at step {step}")
        try:
            self.batches.check_state(meta.get("sampler_state"))
        except (TypeError, ValueError, KeyError) as err:
            raise CheckpointError(f"{path}: malformed sampler state ({err})") from None
        history = _checked_history(meta.get("history"), step, path)
        chars = None if self.tokenizer is None else self.tokenizer.chars
        if meta.get("tokenizer") != chars:
            raise ConfigMismatch(f"{path}: its tokenizer differs from this run's data")
        if meta.get("text_sha256") != self.text_sha256:
            raise ConfigMismatch(f"{path}: the text file {self.config.text} has changed since "
                                 "this checkpoint was written")
        # Everything is checked: from here on nothing can fail halfway.
        if self.world is not None:
            from .parallel.checkpoint import load_state

            load_state(self.run_state, dict(params=arrays["params"], m=arrays["optimizer.m"],
                                            v=arrays["optimizer.v"], t=int(opt_state["t"]),
                                            skipped=int(opt_state.get("skipped", 0))))
            self.optimizer.lr = float(opt_state["lr"])
        else:
            self.params.load_flat(arrays["params"])
            self.optimizer.load_state_dict(opt_state)
        self.batches.state = meta["sampler_state"]
        if scaler_state is not None:
            for key, value in scaler_state.items():
                setattr(self.run_state.scaler, key, value)
        self.step = step
        self.history = history
        return self

    @classmethod
    def from_checkpoint(cls, path, world=None, **overrides) -> "Trainer":
        """A trainer rebuilt from a checkpoint's own config (free fields, the layout among
        them, may be overridden), on `world`'s ranks for a parallel layout."""
        meta, _ = read_checkpoint(path)
        bad = set(overrides) - set(FREE_FIELDS) - {"steps"}
        if bad:
            raise ConfigMismatch(f"only {', '.join(FREE_FIELDS)} and steps may change on "
                                 f"resume, not {', '.join(sorted(bad))}")
        try:
            config = TrainConfig(**dict(meta["config"], **overrides))
            check_config(meta, config, path)
        except TypeError as err:
            raise CheckpointError(f"{path}: malformed configuration ({err})") from None
        return cls(config, world).load(path)


CHECKPOINT_NAME, LOG_NAME = "checkpoint.npz", "log.jsonl"
SCALER_STATE = ("scale", "growth_tracker", "steps", "skipped")


def _checked_scaler(state, ours, path) -> dict | None:
    """A checkpoint's loss-scaler state, checked against this run's (both None without
    fp16; a positive finite scale, counts that are integers >= 0)."""
    if (state is None) != (ours is None):
        raise CheckpointError(f"{path}: {'no' if state is None else 'a'} loss scaler state, "
                              f"but this run {'has' if ours is not None else 'has no'} "
                              "loss scaler (fp16)")
    if state is None:
        return None
    if not isinstance(state, dict) or set(state) != set(SCALER_STATE):
        raise CheckpointError(f"{path}: the loss scaler state must hold "
                              f"{', '.join(SCALER_STATE)}")
    scale = state["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            0 < scale < math.inf):
        raise CheckpointError(f"{path}: the loss scale must be a positive finite number, "
                              f"got {scale!r}")
    for key in SCALER_STATE[1:]:
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{path}: the loss scaler's {key} must be an integer >= 0, "
                                  f"got {value!r}")
    return dict(state, scale=float(scale))


def _log_step(line: str):
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _checked_history(history, step: int, path) -> dict:
    """A copy of a checkpoint's history, checked: the known keys, lists of numbers (None for
    a missing accuracy or an older checkpoint's grad_norm), one entry per step."""
    if not isinstance(history, dict):
        raise CheckpointError(f"{path}: malformed history")
    history = {k: list(v) for k, v in history.items() if isinstance(v, list)}
    history.setdefault("grad_norm", [None] * len(history.get("step", [])))
    if set(history) != set(Trainer.HISTORY_KEYS):
        raise CheckpointError(f"{path}: history must hold {', '.join(Trainer.HISTORY_KEYS)}")
    per_step = [len(history[k]) for k in ("step", "loss", "lr", "grad_norm", "tokens_per_s")]
    per_eval = [len(history[k]) for k in ("eval_step", "val_loss", "val_accuracy")]
    if len(set(per_step)) != 1 or len(set(per_eval)) != 1 or per_step[0] > step:
        raise CheckpointError(f"{path}: history has lists of different lengths or more "
                              f"entries than steps ({step})")
    for key, values in history.items():
        if any(not (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))
               for v in values):
            raise CheckpointError(f"{path}: history {key} must hold numbers")
    return history


def prepare_out_dir(out_dir) -> Path:
    """Create out_dir and prove that it takes a file (a temporary one, removed), before any
    step is trained; ConfigError naming out_dir otherwise."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError("out_dir", f"{str(path)!r} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError("out_dir", f"{str(path)!r} cannot hold the checkpoint: "
                          f"{err.strerror or err}") from None
    return path


def _write_npz(file, arrays: dict) -> None:
    np.savez(file, **arrays)


def atomic_write(path: Path, arrays: dict) -> None:
    """Write arrays as .npz to path so that a reader sees the old file or the new, whole.

    The bytes go to a temporary file in the same folder (same file system, so the rename is
    atomic), are flushed and fsync'ed, and the file is renamed over `path`; the folder is
    fsync'ed too, so the rename itself survives a power cut. On any error the temporary file
    is removed and `path` is untouched. Temporary files left by a save that was killed
    (.checkpoint.npz.*.tmp) are removed first.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        try:
            stale.unlink()
        except OSError:
            pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a checkpoint is not
        with os.fdopen(fd, "wb") as f:
            _write_npz(f, arrays)
            f.flush()
            os.fsync(f.fileno())
        _pause_for_test(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if hasattr(os, "O_DIRECTORY"):
        dir_fd = os.open(path.parent, os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


PAUSE_IN_SAVE = "TFCORE_TEST_PAUSE_IN_SAVE"


def _pause_for_test(path: Path, tmp: str) -> None:
    """A test's window into a save, off unless the environment variable PAUSE_IN_SAVE names
    a marker file: then a save that would replace an existing checkpoint, its temporary
    file whole, writes the marker (JSON: this process's id, the temporary file) and sleeps
    up to 60 s before the rename. tests/test_train_layouts.py kills the writing rank there
    with SIGKILL, a point no timing could hit reliably; the sleep is bounded so that a run
    nobody kills still finishes."""
    marker = os.environ.get(PAUSE_IN_SAVE)
    if not marker or not path.exists():
        return
    note = Path(marker)
    note.with_suffix(".part").write_text(json.dumps({"pid": os.getpid(), "tmp": tmp}))
    os.replace(note.with_suffix(".part"), note)          # the test reads it whole
    time.sleep(60)


def _check_entry_sizes(path: Path) -> None:
    """Refuse an .npz whose .npy headers claim more bytes than their entries hold (a forged
    shape of 10^12 values), reading the headers only: nothing large is allocated."""
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            with zf.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    raise ValueError(f"entry {info.filename}: unsupported .npy version "
                                     f"{version}")
                if dtype.hasobject:
                    raise ValueError(f"entry {info.filename} holds Python objects")
                claimed = math.prod(shape) * dtype.itemsize
                held = info.file_size - f.tell()
                if claimed > held:
                    raise ValueError(f"entry {info.filename} claims shape {shape} "
                                     f"({claimed:,} bytes) but holds {held:,} bytes")


def read_checkpoint(path) -> tuple[dict, dict]:
    """(meta, arrays) of a checkpoint file; CheckpointError says what is wrong with a bad one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a folder, not a checkpoint file (give the path "
                              f"of its {CHECKPOINT_NAME})") from None
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror or err}") from None
    if magic != b"PK\x03\x04":
        raise CheckpointError(f"{path} is not a tfcore checkpoint: it starts with {magic!r}, "
                              "not the .npz (zip) signature b'PK\\x03\\x04'")
    try:
        _check_entry_sizes(path)
        with np.load(path, allow_pickle=False) as z:
            if "meta" not in z.files:
                raise CheckpointError(f"{path} is an .npz file but not a tfcore checkpoint "
                                      "(no 'meta' entry)")
            meta = json.loads(z["meta"].tobytes().decode())
            arrays = {k: z[k] for k in z.files if k != "meta"}
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, MemoryError) as err:
        raise CheckpointError(f"{path} is truncated or corrupted and cannot be read "
                              f"({type(err).__name__}: {err})") from err
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: its meta entry is not a JSON object")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version "
                              f"{meta.get('version')!r}, expected {FORMAT!r} version {VERSION}")
    missing = {"params", "optimizer.m", "optimizer.v"} - set(arrays)
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(sorted(missing))}")
    if not isinstance(meta.get("config"), dict) or not isinstance(meta.get("model_config"),
                                                                 dict):
        raise CheckpointError(f"{path}: malformed config or model_config")
    meta["config"] = _upgraded_config(meta["config"])
    return meta, arrays


def _upgraded_config(config: dict) -> dict:
    """A checkpoint config in this version's fields: the settings its task does not read
    set to None (older checkpoints recorded their defaults there); the model fields older
    checkpoints did not record (their models had DecoderConfig's defaults there) with
    those defaults; no mixed precision where none was recorded."""
    config = dict(config)
    task = REGISTRY.get(config["task"]) if isinstance(config.get("task"), str) else None
    for name in OPTIONAL_SETTINGS:
        if task is not None and name not in task_settings(task):
            config[name] = None
        elif task is not None and name in DECODER_SETTINGS:
            config.setdefault(name, OPTIONAL_SETTINGS[name])
    config.setdefault("text", None)
    config.setdefault("mixed_precision", None)
    return config


def check_config(meta: dict, config: TrainConfig, path="checkpoint") -> None:
    """Raise ConfigMismatch naming every field (outside FREE_FIELDS) that differs.

    steps may grow when the rate is constant after the warm-up (min_lr = lr): the extended
    run then equals one trained that long from the start. Under the cosine schedule the
    rate of every step depends on the total, so a longer run would not be the same run."""
    theirs = meta["config"]
    diffs = [f"{f.name} (checkpoint {theirs.get(f.name)!r}, this run "
             f"{getattr(config, f.name)!r})"
             for f in fields(TrainConfig)
             if f.name not in FREE_FIELDS and f.name != "steps"
             and theirs.get(f.name) != getattr(config, f.name)]
    steps = theirs.get("steps")
    if steps != config.steps:
        if not (isinstance(steps, int) and config.steps > steps
                and config.min_lr == config.lr):
            why = ("a run can only be extended, not shortened" if isinstance(steps, int)
                   and config.steps < steps else
                   "the cosine schedule's rate at every step depends on the total, so the "
                   "longer run would not be this run continued (train with --min-lr equal "
                   "to --lr for a constant rate that extends)")
            diffs.append(f"steps (checkpoint {steps!r}, this run {config.steps!r}: {why})")
    if diffs:
        raise ConfigMismatch(f"{path} was made with another configuration: "
                             + "; ".join(diffs))


def train(config: TrainConfig, resume=None) -> Trainer:
    """Run a whole training: a fresh Trainer (or one resumed from the checkpoint `resume`,
    whose config must match), trained to config.steps. Returns the trainer."""
    trainer = Trainer(config)
    if resume is not None:
        trainer.load(resume)
    return trainer.run()


# -- command line ------------------------------------------------------------------------

class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, 'error: ...', with exit status 2."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def flag(field: str) -> str:
    """The command-line flag of a TrainConfig field: seq_len -> --seq-len."""
    return "--" + field.replace("_", "-")


def _choices() -> dict:
    """{field: its allowed values}: the trainer's own and the decoder's (its validate's)."""
    from .functional.activations import GELU_APPROXIMATIONS
    from .models.blocks import ATTENTIONS, MLPS, PLACEMENTS
    from .models.decoder import POSITIONS, RECOMPUTE, ROUTERS
    from .models.moe import BALANCES
    from .parallel.layout import SCHEDULES

    return {"task": TASKS, "dtype": FLOAT_DTYPES, "norm": ("layernorm", "rmsnorm"),
            "mlp": MLPS, "position": POSITIONS, "norm_placement": PLACEMENTS,
            "gelu_approximate": GELU_APPROXIMATIONS, "attention": ATTENTIONS,
            "recompute": RECOMPUTE, "router": ROUTERS, "aux_loss": BALANCES,
            "schedule": SCHEDULES, "mixed_precision": tuple(PRECISIONS)}


# what a flag does, where its name and default do not say it
HELP = {"mixed_precision": "the products in bfloat16 or float16 (float32 accumulation, "
                           "master weights and AdamW state; fp16 with loss scaling, one "
                           "device); needs --dtype float32",
        "norm_eps": "the norms' eps (DecoderConfig.eps; default 1e-05)",
        "d_ff": "the MLP's hidden width (default: 4 d_model; with --mlp swiglu Llama's "
                "2/3 of it, rounded up to a multiple of 256)",
        "pp": "pipeline stages: consecutive blocks on each rank (default: no pipeline)",
        "virtual": "model chunks per pipeline rank, for the interleaved schedule (default 1)",
        "schedule": "the pipeline's schedule (default 1f1b; interleaved with --virtual > 1)",
        "micro_batches": "micro-batches per step: the pipeline's, or gradient accumulation "
                         "(default 1)"}


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m tfcore.train",
        description="Train a decoder language model on the Shakespeare corpus, your own "
                    "text (--text FILE) or a digit task, with checkpoints that resume bit "
                    "for bit. Every run writes checkpoint.npz and log.jsonl into its "
                    "output folder (default runs/<preset or task>-<time>); "
                    "python -m tfcore.plot draws the log.")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="start from a named configuration (other flags override it)")
    parser.add_argument("--model-preset", choices=sorted(MODEL_PRESETS),
                        help="the decoder's settings of a named family (llama: "
                             + ", ".join(f"{k} {v}" for k, v in MODEL_PRESETS["llama"].items())
                             + "); other flags override them")
    parser.add_argument("--resume", metavar="CHECKPOINT",
                        help="continue from a checkpoint, with its own configuration")
    parser.add_argument("--backend", choices=backend.BACKENDS,
                        help="array library (default: TFCORE_BACKEND or numpy)")
    parser.add_argument("--simulate", type=int, metavar="N",
                        help="run a parallel layout's N ranks as threads of this process "
                             "(without it, a layout of more than one rank runs under "
                             "mpiexec -n N, one rank per process)")
    choices = _choices()
    for f in fields(TrainConfig):       # every field a flag, the model's among them
        kind = str(f.type).split(" |")[0]
        default = (f"{OPTIONAL_SETTINGS[f.name]!r} for the tasks that read it"
                   if f.name in OPTIONAL_SETTINGS else
                   "runs/<preset or task>-<time>" if f.name == "out_dir" else
                   "a UTF-8 file: sets --task text" if f.name == "text" else
                   repr(f.default))
        text = HELP.get(f.name, f"(default {default})")
        if kind == "bool":
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction,
                                default=None, help=text)
        elif f.name in choices:
            parser.add_argument(flag(f.name), choices=choices[f.name], default=None,
                                help=text)
        else:
            metavar = "FILE" if f.name == "text" else f.name.upper()
            parser.add_argument(flag(f.name), type={"int": int, "float": float,
                                                    "str": str}[kind],
                                default=None, metavar=metavar, help=text)
    return parser


def main(argv=None) -> int:
    """The command line; every bad argument ends in one line 'error: ...' and status 2."""
    try:
        return _main(argv)
    except ConfigError as err:
        print(f"error: argument {flag(err.field)} {err.detail}", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigMismatch) as err:
        print(f"error: argument --resume: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:
        print(f"error: training stopped: {err}", file=sys.stderr)
        return 1


def _default_out_dir(name: str) -> str:
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def _main(argv) -> int:
    args = _parser().parse_args(argv)
    kernels.keep_freed_memory()       # a step reuses last step's memory (no page faults)
    if args.backend:
        backend.set_backend(args.backend)
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
             if getattr(args, f.name) is not None}
    if args.simulate is not None and args.simulate < 1:
        raise ConfigError("simulate", f"must be a number of ranks >= 1, got {args.simulate}")
    if args.resume:
        for name in ("preset", "model_preset"):
            if getattr(args, name):
                raise ConfigError(name, "cannot be combined with --resume (a resumed run "
                                  "keeps its checkpoint's configuration)")
        meta, _ = read_checkpoint(args.resume)
        free = {k: v for k, v in given.items() if k in FREE_FIELDS or k == "steps"}
        if "out_dir" not in free and not meta["config"].get("out_dir"):
            free["out_dir"] = str(Path(args.resume).parent)
        config = TrainConfig(**dict(_upgraded_config(meta["config"]), **free))
        check_config(meta, dataclasses.replace(config, **given), args.resume)
    else:
        values = {**PRESETS.get(args.preset, {}), **MODEL_PRESETS.get(args.model_preset, {}),
                  **given}
        if "text" in given:
            if "task" in given and given["task"] != FILE_TASK:
                raise ConfigError("task", f"{given['task']!r} does not read --text (leave "
                                  f"--task out, or give --task {FILE_TASK})")
            values["task"] = FILE_TASK
        if "warmup_steps" not in given:
            warmup = values.get("warmup_steps", TrainConfig.warmup_steps)
            steps = values.get("steps", TrainConfig.steps)
            if isinstance(steps, int) and steps >= 1 and warmup > steps:
                values["warmup_steps"] = steps // 10
                print(f"note: the warm-up of {warmup} steps does not fit in --steps {steps}; "
                      f"using {steps // 10} (choose with --warmup-steps)", file=sys.stderr)
        if "out_dir" not in given:
            values["out_dir"] = _default_out_dir(args.preset or values.get("task", "run"))
        config = TrainConfig(**values)
    ranks = config.validate().layout().world_size

    def session(world):
        if args.resume:
            trainer = Trainer.from_checkpoint(args.resume, world, steps=config.steps,
                                              **{k: getattr(config, k) for k in FREE_FIELDS})
        else:
            trainer = Trainer(config, world)
        return _report(trainer, args.resume)

    if args.simulate is not None:
        if args.simulate != ranks:
            raise ConfigError("simulate", f"{args.simulate} ranks, but the layout "
                              f"{config.layout().shape()} needs {ranks}")
        from .parallel import SimulatedGroup

        outcomes = SimulatedGroup(ranks).run(_caught(session))
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
        return outcomes[0]
    if ranks == 1:
        return session(None)
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError("simulate", f"is needed for a layout of {ranks} ranks without "
                          "mpi4py (pip install mpi4py mpich, then mpiexec -n "
                          f"{ranks}): give --simulate {ranks}") from None
    if MPI.COMM_WORLD.Get_size() != ranks:
        started = MPI.COMM_WORLD.Get_size()
        raise ConfigError(parallel_field(config), f"the layout {config.layout().shape()} "
                          f"needs {ranks} ranks, "
                          f"but {started} {'was' if started == 1 else 'were'} started: run "
                          f"mpiexec -n {ranks}, or give --simulate {ranks}")
    from .parallel.comm import MPIComm, abort_on_error

    with abort_on_error():
        return session(MPIComm())


def _caught(session):
    """session, with a bad setting returned rather than raised (every rank finds the same
    one, before any collective), so the command line reports it once."""
    def body(world):
        try:
            return session(world)
        except (ConfigError, CheckpointError, ConfigMismatch) as err:
            return err
    return body


def _state(memory: dict) -> int:
    """Bytes of parameters, gradients and AdamW state in a memory dict (plan's or held)."""
    return memory["params"] + memory["grads"] + memory["optimizer"]


def _account(held: int, sent: int) -> str:
    """The line plan and measurement share, so that they compare digit for digit."""
    return (f"{held:,d} bytes of parameters, gradients and AdamW state on the fullest "
            f"rank, {sent:,d} bytes sent in a step by the busiest")


def _report(trainer: "Trainer", resume) -> int:
    """Train, with rank 0's account of it on stderr and stdout."""
    cfg = trainer.config
    if trainer.rank0:
        size = trainer.model_config.param_shapes() if hasattr(trainer.model_config,
                                                              "param_shapes") else None
        count = (sum(int(np.prod(s)) for s in size.values()) if size is not None
                 else trainer.model.num_parameters())
        layout = trainer.layout
        where = "" if trainer.world is None else f", layout {layout.shape()}"
        if trainer.world is not None and layout.pp is not None:
            where += (f" ({layout.pipeline_schedule}, {layout.micro_batches} micro-batches"
                      + (f", {layout.virtual} chunks per rank" if layout.virtual > 1 else "")
                      + ")")
        print(f"model: {count:,} parameters, task {cfg.task}, {cfg.steps} steps, backend "
              f"{backend.get_backend()}{where}, output {cfg.out_dir}", file=sys.stderr)
    planned = trainer.plan()
    if trainer.rank0 and planned is not None:
        even = (", for an even routing of the experts' tokens"
                if trainer.model_config.n_experts and trainer.layout.dp > 1 else "")
        print("plan: " + _account(max(_state(m) for m in planned.memory_per_rank),
                                  max(planned.sent)) + even, file=sys.stderr)
    if trainer.step >= cfg.steps:
        if trainer.rank0:
            print(f"nothing to train: {resume} is at step {trainer.step} of {cfg.steps}; "
                  "nothing was written", file=sys.stderr)
        return 0
    trainer.run()
    mine = (_state(trainer.held()), trainer.measured["sent"][-1],
            sum(trainer.measured["seconds"]) / len(trainer.measured["seconds"]))
    ranks = [mine] if trainer.world is None else trainer.world.all_gather_object(mine)
    if not trainer.rank0:
        return 0
    if planned is not None:
        print("measured: " + _account(max(r[0] for r in ranks), max(r[1] for r in ranks))
              + f"; {max(r[2] for r in ranks):.3g} s a step (the slowest rank's mean)",
              file=sys.stderr)
    if trainer.history["eval_step"]:
        acc = trainer.history["val_accuracy"][-1]
        print(f"step {trainer.step}: train loss {trainer.history['loss'][-1]:.4g}, "
              f"val loss {trainer.history['val_loss'][-1]:.4g}"
              + ("" if acc is None else f", held-out exact match {acc:.3f}"))
    if trainer.last_saved is not None:
        print(f"checkpoint: {trainer.last_saved}")
    if trainer.log_path is not None:
        print(f"log: {trainer.log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
