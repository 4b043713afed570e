"""The training tasks: what tfcore.train's Trainer asks of the task it trains.

A task family is one small object (Task) and REGISTRY maps every task name to its family:

    family        tasks                 data                      model       evaluation
    text          shakespeare, text     characters [B, S]         DecoderLM   val loss
    digits        reverse, sort         digit strings [B, 2n]     DecoderLM   held-out
                                                                              exact match
    autoencoder   autoencoder           Gaussian rows [B, T, D]   Autoencoder held-out MSE

The Trainer never switches on a task's name: it asks the task for its batches
(Task.data), its model's config (Task.model_config), its model and optimizer
(Task.build), one update (Task.step) and an evaluation (Task.evaluate); TrainConfig asks
it which settings it reads, its own refusals, its sample length and whether it runs under
a layout. A new task is a subclass here and a line in REGISTRY.

The decoder tasks train through the Trainer's one decoder step (runner.build and
runner.train_step, on one device as on a layout's ranks); the autoencoder writes its
forward and backward out below (AutoencoderTask.step says why).
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

from . import backend, data


class ConfigError(ValueError):
    """A training setting that cannot work; `field` names it (the CLI prints its flag)."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field} {detail}")
        self.field, self.detail = field, detail


def step_seed(seed: int, step: int, stream: int) -> int:
    """An independent 63-bit seed for (run seed, step, stream): dropout needs no saved state
    (stream 1: a step's dropout; stream 2: the validation data)."""
    return int(np.random.SeedSequence([seed, stream, step]).generate_state(2, np.uint64)[0]
               >> np.uint64(1))


class TaskData(NamedTuple):
    """What a task's data gives the Trainer."""
    batches: object            # the training sampler: next() -> (x, y); state, check_state
    val_batches: object        # a validation sampler replayed from its state, or None
    tokenizer: object          # data.CharTokenizer of a text task, else None
    text_sha256: str | None    # of the file `text` (task 'text'): a resume checks it
    vocab_size: int | None     # the decoder's vocabulary (None: not a decoder task)


# the task that reads TrainConfig.text (a UTF-8 file; the command line's --text sets it)
FILE_TASK = "text"


class Task:
    """A task family. Class attributes say what TrainConfig checks; the methods are what
    the Trainer calls (`cfg` a validated TrainConfig, `trainer` the Trainer)."""

    family: str = ""
    settings: tuple = ()         # its own (task) settings, beside the decoder's fields
    decoder: bool = True         # its model is the DecoderLM: the decoder's fields, mixed
                                 # precision and plan() are for it
    parallel: bool = False       # runs under a layout's ranks (every layout field)
    one_device_layout: tuple = ()  # the layout fields it reads on its one device

    def check_source(self, cfg) -> None:
        """Refuse a `text` file given to a task that does not read one."""
        if cfg.text is not None:
            raise ConfigError("text", f"is only read by task {FILE_TASK!r}, not {cfg.task!r}")

    def check(self, cfg) -> None:
        """The task's own refusals (after the integers are checked)."""

    def sequence(self, cfg) -> int:
        """The length of one sample: the decoder's context, the tokens of a batch row."""
        raise NotImplementedError

    def layout_sequence(self, cfg) -> int | None:
        """The sequence a layout splits (Layout.validate's seq), None on one device."""
        return self.sequence(cfg) if self.parallel else None

    def tokens_per_step(self, cfg) -> int:
        return cfg.batch_size * self.sequence(cfg)

    def data(self, cfg) -> TaskData:
        raise NotImplementedError

    def model_config(self, cfg, task_data: TaskData):
        """The decoder's config: its vocabulary the data's, its context the sample's."""
        return cfg.decoder_config(task_data.vocab_size, self.sequence(cfg))

    def build(self, trainer, world) -> None:
        """The model and its optimizer: the one decoder as a runner.Run."""
        trainer._build_run(world)

    def step(self, trainer) -> float:
        """One update (the decoder's: runner.train_step); the batch's loss before it."""
        return trainer._decoder_step()

    def evaluate(self, trainer) -> dict:
        """{'val_loss', 'val_accuracy' (None where the task has none)}."""
        raise NotImplementedError


class TextTask(Task):
    """Characters of the bundled Shakespeare corpus or of the file `text`: windows [B, S]
    of the first part, the validation loss on eval_batches fixed windows of the last."""

    family = "text"
    settings = ("seq_len",)
    parallel = True
    one_device_layout = ("micro_batches",)

    def check_source(self, cfg) -> None:
        if cfg.task != FILE_TASK:
            return super().check_source(cfg)
        if not isinstance(cfg.text, str) or not cfg.text:
            raise ConfigError("text", f"must name a UTF-8 file for task {FILE_TASK!r}")

    def sequence(self, cfg) -> int:
        return cfg.seq_len

    def data(self, cfg) -> TaskData:
        sha256 = None
        if cfg.task == FILE_TASK:
            try:
                text = data.read_text_file(cfg.text)
            except ValueError as err:
                raise ConfigError("text", str(err)) from None
            sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        else:
            text = data.load_corpus(cfg.task)
        tokenizer = data.CharTokenizer.from_text(text)
        train_ids, val_ids = data.train_val_split(tokenizer.encode(text), cfg.val_fraction)
        shortest = min(len(train_ids), len(val_ids))
        if shortest < cfg.seq_len + 2:
            part = "training" if len(train_ids) < len(val_ids) else "validation"
            raise ConfigError("seq_len", f"({cfg.seq_len}) is too long for this text: its "
                              f"{part} part holds {shortest} characters, and a window "
                              f"needs seq_len + 2 = {cfg.seq_len + 2}; lower --seq-len, "
                              "change --val-fraction, or give a longer text")
        return TaskData(
            batches=data.TextBatches(train_ids, cfg.batch_size, cfg.seq_len, cfg.seed),
            val_batches=data.TextBatches(val_ids, cfg.batch_size, cfg.seq_len,
                                         seed=step_seed(cfg.seed, 0, 2)),
            tokenizer=tokenizer, text_sha256=sha256, vocab_size=tokenizer.vocab_size)

    def evaluate(self, trainer) -> dict:
        """Mean loss over eval_batches validation batches, the same ones every time: on
        one device, on a layout's ranks (each its rows of the batch; the loss is the
        global mean), or through a pipeline's forward-only schedule."""
        cfg, val = trainer.config, trainer.val_batches
        val.state = trainer._val_state                  # the same batches every time
        if trainer.world is not None and trainer.layout.pp is not None:
            # each stage runs its blocks on every micro-batch, the last one's losses are
            # summed (no rank gathers the model)
            from .parallel.pipeline import pipeline_loss

            losses = [pipeline_loss(trainer.run_state,
                                    *(np.asarray(backend.to_numpy(a)) for a in val.next()),
                                    cfg.batch_size)
                      for _ in range(cfg.eval_batches)]
            return {"val_loss": sum(losses) / len(losses), "val_accuracy": None}
        model = trainer.model
        if trainer.world is not None:
            mesh, B = trainer.run_state.mesh, cfg.batch_size
            rows = B // mesh.dp_size
            b0 = mesh.dp_rank * rows
            losses = []
            for _ in range(cfg.eval_batches):           # this rank's rows; the mean is global
                x, y = (np.asarray(backend.to_numpy(a))[b0:b0 + rows] for a in val.next())
                losses.append(float(model.forward(backend.asarray(x), backend.asarray(y),
                                                  batch_rows=(b0, b0 + rows, B))[1]))
        else:
            losses = [float(model.forward(*val.next())[1]) for _ in range(cfg.eval_batches)]
        model._cache = None
        return {"val_loss": sum(losses) / len(losses), "val_accuracy": None}


class DigitsTask(Task):
    """data.DigitTask ('reverse', 'sort'): sequences [B, 2n] of n digits and their answer,
    scored on 500 held-out sequences by loss and exact match."""

    family = "digits"
    settings = ("n_digits",)
    one_device_layout = ("micro_batches",)

    def sequence(self, cfg) -> int:
        return 2 * cfg.n_digits

    def data(self, cfg) -> TaskData:
        return TaskData(batches=data.DigitTask(cfg.n_digits, cfg.task, cfg.batch_size,
                                               cfg.seed),
                        val_batches=None, tokenizer=None, text_sha256=None,
                        vocab_size=data.DigitTask.vocab_size)

    def evaluate(self, trainer) -> dict:
        x, y = trainer.batches.heldout(500, seed=step_seed(trainer.config.seed, 0, 2))
        logits, loss = trainer.model.forward(x, y)
        trainer.model._cache = None
        return {"val_loss": float(loss), "val_accuracy": data.exact_match(logits, y)}


class AutoencoderTask(Task):
    """Seed 002's experiment: a post-norm encoder reconstructing Gaussian sequences
    [B, T, D] (data.GaussianSequences), scored by the MSE on sequences it never saw."""

    family = "autoencoder"
    settings = ("seq_len", "standardize")
    decoder = False

    def check(self, cfg) -> None:
        if (isinstance(cfg.standardize, (bool, np.bool_)) and cfg.standardize
                and cfg.d_model < 2):
            raise ConfigError("d_model", f"must be at least 2 for task 'autoencoder' with "
                              f"standardize: a data row of {cfg.d_model} feature is constant "
                              "and standardizes to 0 / 0 (widen it, or give "
                              f"--no-standardize), got {cfg.d_model}")

    def sequence(self, cfg) -> int:
        return cfg.seq_len

    def data(self, cfg) -> TaskData:
        return TaskData(batches=data.GaussianSequences(cfg.batch_size, cfg.seq_len,
                                                       cfg.d_model, cfg.standardize,
                                                       cfg.seed, cfg.dtype),
                        val_batches=None, tokenizer=None, text_sha256=None, vocab_size=None)

    def model_config(self, cfg, task_data: TaskData):
        from .models.autoencoder import AutoencoderConfig

        return AutoencoderConfig(
            d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=cfg.d_ff or 4 * cfg.d_model,
            n_layers=cfg.n_layers, max_seq_len=cfg.seq_len, dropout=cfg.dropout,
            dtype=cfg.dtype)

    def build(self, trainer, world) -> None:
        """The Autoencoder and the decoder's AdamW over its flat buffers, the same clip.
        Without weight decay AdamW is Adam (seed 002's form), and is saved as such."""
        from . import optim
        from .models.autoencoder import Autoencoder
        from .parallel.optimizer import adamw

        trainer.model = Autoencoder(trainer.model_config).init(trainer.config.seed)
        trainer.params = trainer.model.params
        trainer.optimizer = adamw(trainer.params, optim.ShardView(), trainer._hyper(),
                                  clip=trainer.layout.clip)
        trainer._start()

    def step(self, trainer) -> float:
        """Not the decoder's step (runner.train_step): its inputs are float sequences
        [B, T, D] with no token counts to weight micro-batches by, no layout splits it,
        and its backward takes no loss weight; it shares the optimizer (the same AdamW
        with the same clip): zeroed gradients, forward, backward, the scheduled rate,
        the optimizer's clip and step."""
        cfg = trainer.config
        x, y = trainer.batches.next()                                     # [B, T, D] each
        trainer.params.zero_grad()
        rng = (backend.default_rng(step_seed(cfg.seed, trainer.step, 1)) if cfg.dropout
               else None)
        loss = trainer.model.forward(x, y, training=True, rng=rng)[1]
        trainer.model.backward()
        trainer.optimizer.lr = trainer.lr_at(trainer.step)
        trainer.optimizer.step()
        trainer.last_grad_norm = trainer._grad_norm()
        trainer.step += 1
        return float(loss)

    def evaluate(self, trainer) -> dict:
        x, _ = trainer.batches.heldout(seed=step_seed(trainer.config.seed, 0, 2))
        loss = float(trainer.model.forward(x)[1])
        trainer.model._cache = None
        return {"val_loss": loss, "val_accuracy": None}


# The one place a task's name decides anything: {task name: its family}.
_TEXT, _DIGITS = TextTask(), DigitsTask()
REGISTRY = {"shakespeare": _TEXT, FILE_TASK: _TEXT, "reverse": _DIGITS, "sort": _DIGITS,
            "autoencoder": AutoencoderTask()}
FAMILIES = {task.family: task for task in REGISTRY.values()}     # {family: its Task}


def task_of(name: str) -> Task:
    """The Task of a task name; ValueError naming the known ones."""
    if name not in REGISTRY:
        raise ValueError(f"unknown task {name!r}: expected one of {', '.join(REGISTRY)}")
    return REGISTRY[name]
