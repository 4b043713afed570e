"""Train a DecoderLM: ``python -m tfcore.train ...`` or ``train(TrainConfig(...))``.

One step (``Trainer.train_step``)::

    lr      = warmup_cosine(step, ...)                      the schedule
    x, y    = batches.next()                                [B, S] int64, seeded sampler
    params.zero_grad()                                      one write over the flat buffer
    loss    = model.forward(x, y, training=True, rng=...)   dropout keyed by (seed, step)
    model.backward()                                        every gradient into params.grad
    clip_grad_norm(params.grad, grad_clip)                  global norm
    AdamW step                                              a few ops over the flat buffers

A checkpoint (``Trainer.save``) is one ``.npz`` file: the flat parameters, the optimizer's
two moment buffers, and one JSON document (the configs, the step, the optimizer's scalars,
the sampler's generator state, the tokenizer, the history). It is written to a temporary
file in the same folder, flushed to disk, then renamed over the old one (``os.replace`` is
atomic), so a crash while saving leaves the previous checkpoint whole. Loading reads with
``allow_pickle=False``, checks everything (format, config, layout, shapes) before it
changes anything, and resuming continues bit for bit: the same parameters after N straight
steps as after N/2, save, load, N/2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from . import backend, data, optim
from .models.decoder import DecoderConfig, DecoderLM

FORMAT, VERSION = "tfcore-checkpoint", 1
TASKS = ("shakespeare", "reverse", "sort", "autoencoder")


@dataclass
class TrainConfig:
    """Everything that decides a training run. Fields below `out_dir` may change on resume;
    every other field must match the checkpoint's."""

    task: str = "shakespeare"     # 'shakespeare' (characters), a DigitTask ('reverse', 'sort'),
                                  # or 'autoencoder' (seed 002: reconstruct Gaussian sequences)
    n_digits: int = 6             # digit tasks: digits per sequence (x, y are [B, 2n])
    seq_len: int = 64             # text: the context length S; autoencoder: T
    standardize: bool = True      # autoencoder: rows of mean 0, variance 1 (else raw N(0, 1))
    val_fraction: float = 0.1     # text: the last tenth of the corpus is validation
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None       # None: 4 d_model
    position: str = "learned"
    norm: str = "layernorm"
    mlp: str = "gelu"
    dropout: float = 0.0
    dtype: str = "float32"
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
    seed: int = 0                 # model init, batches and dropout all derive from it
    out_dir: str | None = None    # where checkpoint.npz goes (None: no checkpoint)
    eval_interval: int = 50       # evaluate every this many steps (and at the end)
    eval_batches: int = 4         # validation batches per evaluation (the same ones each time)
    checkpoint_interval: int = 0  # save every this many steps (0: only at the end)
    progress: bool = True         # show a tqdm progress bar

    def validate(self) -> "TrainConfig":
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        for name in ("steps", "batch_size", "seq_len", "eval_interval", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must lie in [0, steps={self.steps}], got "
                             f"{self.warmup_steps}")
        if self.grad_clip < 0 or self.checkpoint_interval < 0:
            raise ValueError("grad_clip and checkpoint_interval must be >= 0")
        return self


# Fields that may differ between a checkpoint and the run that resumes it: they change
# where files go and how often we look, never the trajectory of the parameters.
FREE_FIELDS = ("out_dir", "eval_interval", "eval_batches", "checkpoint_interval", "progress")

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
    """A model, its optimizer, its data and the step count, with save / load.

    history: {'step', 'loss', 'lr', 'tokens_per_s'} per step and {'eval_step', 'val_loss',
    'val_accuracy'} per evaluation (accuracy: digit tasks' held-out exact match).
    """

    def __init__(self, config: TrainConfig):
        self.config = cfg = config.validate()
        if cfg.task == "shakespeare":
            text = data.load_corpus("shakespeare")
            self.tokenizer = data.CharTokenizer.from_text(text)
            train_ids, self.val_ids = data.train_val_split(self.tokenizer.encode(text),
                                                           cfg.val_fraction)
            self.batches = data.TextBatches(train_ids, cfg.batch_size, cfg.seq_len, cfg.seed)
            vocab, max_len = self.tokenizer.vocab_size, cfg.seq_len
        elif cfg.task == "autoencoder":
            self.tokenizer = None
            self.batches = data.GaussianSequences(cfg.batch_size, cfg.seq_len, cfg.d_model,
                                                  cfg.standardize, cfg.seed, cfg.dtype)
        else:
            self.tokenizer = None
            self.batches = data.DigitTask(cfg.n_digits, cfg.task, cfg.batch_size, cfg.seed)
            vocab, max_len = data.DigitTask.vocab_size, self.batches.seq_len
        if cfg.task == "autoencoder":
            from .models.autoencoder import Autoencoder, AutoencoderConfig

            self.model_config = AutoencoderConfig(
                d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=cfg.d_ff or 4 * cfg.d_model,
                n_layers=cfg.n_layers, max_seq_len=cfg.seq_len, dropout=cfg.dropout,
                dtype=cfg.dtype)
            self.model = Autoencoder(self.model_config).init(cfg.seed)
        else:
            self.model_config = DecoderConfig(
                vocab_size=vocab, max_seq_len=max_len, d_model=cfg.d_model,
                n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ff=cfg.d_ff, norm=cfg.norm,
                position=cfg.position, mlp=cfg.mlp, dropout=cfg.dropout, dtype=cfg.dtype)
            self.model = DecoderLM(self.model_config).init(cfg.seed)
        self.params = self.model.params
        betas = (cfg.beta1, cfg.beta2)
        # Without weight decay AdamW is Adam (seed 002's form), and is saved as such.
        self.optimizer = (optim.AdamW(self.params, lr=cfg.lr, betas=betas, eps=cfg.eps,
                                      weight_decay=cfg.weight_decay)
                          if cfg.weight_decay else
                          optim.Adam(self.params, lr=cfg.lr, betas=betas, eps=cfg.eps))
        self.step = 0
        self.history: dict[str, list] = {k: [] for k in (
            "step", "loss", "lr", "tokens_per_s", "eval_step", "val_loss", "val_accuracy")}

    # -- training ----------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        c = self.config
        return optim.warmup_cosine(step, c.lr, c.warmup_steps, c.steps, c.min_lr)

    def train_step(self) -> float:
        """One update; returns the batch's loss (before the update)."""
        cfg = self.config
        x, y = self.batches.next()                                        # [B, S] each
        self.params.zero_grad()
        rng = backend.default_rng(_step_seed(cfg.seed, self.step, 1)) if cfg.dropout else None
        _, loss = self.model.forward(x, y, training=True, rng=rng)
        self.model.backward()
        if cfg.grad_clip:
            optim.clip_grad_norm(self.params.grad, cfg.grad_clip)
        self.optimizer.lr = self.lr_at(self.step)
        self.optimizer.step()
        self.step += 1
        return float(loss)

    def evaluate(self) -> dict:
        """Mean loss over eval_batches fixed validation batches (digit tasks: 500 held-out
        sequences, with their exact-match accuracy)."""
        cfg = self.config
        if cfg.task == "shakespeare":
            batches = data.TextBatches(self.val_ids, cfg.batch_size, cfg.seq_len,
                                       seed=_step_seed(cfg.seed, 0, 2))
            losses = [float(self.model.forward(*batches.next())[1])
                      for _ in range(cfg.eval_batches)]
            self.model._cache = None
            return {"val_loss": sum(losses) / len(losses), "val_accuracy": None}
        if cfg.task == "autoencoder":     # MSE on sequences the model never saw
            x, _ = self.batches.heldout(seed=_step_seed(cfg.seed, 0, 2))
            loss = float(self.model.forward(x)[1])
            self.model._cache = None
            return {"val_loss": loss, "val_accuracy": None}
        x, y = self.batches.heldout(500, seed=_step_seed(cfg.seed, 0, 2))
        logits, loss = self.model.forward(x, y)
        self.model._cache = None
        return {"val_loss": float(loss), "val_accuracy": data.exact_match(logits, y)}

    def _record_eval(self) -> dict:
        result = self.evaluate()
        self.history["eval_step"].append(self.step)
        self.history["val_loss"].append(result["val_loss"])
        self.history["val_accuracy"].append(result["val_accuracy"])
        return result

    def run(self, until: int | None = None) -> "Trainer":
        """Train until step `until` (default config.steps), evaluating and checkpointing
        on the configured intervals; shows a tqdm bar with the loss and tokens/s."""
        cfg = self.config
        until = cfg.steps if until is None else min(until, cfg.steps)
        tokens = cfg.batch_size * (2 * cfg.n_digits if cfg.task in ("reverse", "sort")
                                   else cfg.seq_len)
        bar = None
        if cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=until, initial=self.step, desc="train", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        while self.step < until:
            start = time.perf_counter()
            loss = self.train_step()
            rate = tokens / max(time.perf_counter() - start, 1e-9)
            for key, value in (("step", self.step), ("loss", loss),
                               ("lr", self.optimizer.lr), ("tokens_per_s", rate)):
                self.history[key].append(value)
            post = {"loss": f"{loss:.4f}", "tok/s": f"{rate:,.0f}"}
            if self.step % cfg.eval_interval == 0 or self.step == cfg.steps:
                result = self._record_eval()
                post["val"] = f"{result['val_loss']:.4f}"
                if result["val_accuracy"] is not None:
                    post["acc"] = f"{result['val_accuracy']:.3f}"
            if cfg.out_dir and (self.step == cfg.steps or (
                    cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0)):
                self.save(Path(cfg.out_dir) / "checkpoint.npz")
            if bar is not None:
                bar.set_postfix(post, refresh=False)
                bar.update(1)
        if bar is not None:
            bar.close()
        return self

    # -- checkpoints ---------------------------------------------------------------------
    def _meta(self) -> dict:
        opt = self.optimizer.state_dict()
        return {
            "format": FORMAT, "version": VERSION,
            "config": asdict(self.config),
            "model_config": self.model_config.to_dict(),
            "layout": [[n, list(s)] for n, s in self.params.layout()],
            "step": self.step,
            "optimizer": {k: v for k, v in opt.items() if k not in ("m", "v")},
            "sampler_state": self.batches.state,
            "tokenizer": None if self.tokenizer is None else self.tokenizer.chars,
            "history": self.history,
        }

    def save(self, path) -> Path:
        """Write the checkpoint atomically (temporary file, fsync, os.replace); returns path."""
        path = Path(path)
        arrays = {
            "params": backend.to_numpy(self.params.data),
            "optimizer.m": backend.to_numpy(self.optimizer.m),
            "optimizer.v": backend.to_numpy(self.optimizer.v),
            "meta": np.frombuffer(json.dumps(self._meta()).encode(), dtype=np.uint8),
        }
        atomic_write(path, arrays)
        return path

    def load(self, path) -> "Trainer":
        """Restore a checkpoint into this trainer. Raises CheckpointError for a file that is
        not one, ConfigMismatch (naming the field) for another run's; in both cases this
        trainer is left exactly as it was."""
        meta, arrays = read_checkpoint(path)
        check_config(meta, self.config, path)
        layout = [(n, tuple(s)) for n, s in meta["layout"]]
        if layout != self.params.layout():
            raise ConfigMismatch(f"{path}: the parameter layout differs from this model's")
        n = self.params.size
        for key in ("params", "optimizer.m", "optimizer.v"):
            if arrays[key].shape != (n,) or arrays[key].dtype != np.dtype(self.config.dtype):
                raise CheckpointError(f"{path}: {key} has shape {arrays[key].shape} and dtype "
                                      f"{arrays[key].dtype}, expected ({n},) "
                                      f"{self.config.dtype}")
        opt_state = dict(meta["optimizer"], m=arrays["optimizer.m"], v=arrays["optimizer.v"])
        opt_state["betas"] = tuple(opt_state["betas"])
        # Everything is checked: from here on nothing can fail halfway.
        self.params.load_flat(arrays["params"])
        self.optimizer.load_state_dict(opt_state)
        self.batches.state = meta["sampler_state"]
        self.step = int(meta["step"])
        self.history = {k: list(v) for k, v in meta["history"].items()}
        return self

    @classmethod
    def from_checkpoint(cls, path, **overrides) -> "Trainer":
        """A trainer rebuilt from a checkpoint's own config (free fields may be overridden)."""
        meta, _ = read_checkpoint(path)
        bad = set(overrides) - set(FREE_FIELDS)
        if bad:
            raise ConfigMismatch(f"only {', '.join(FREE_FIELDS)} may change on resume, "
                                 f"not {', '.join(sorted(bad))}")
        config = TrainConfig(**dict(meta["config"], **overrides))
        return cls(config).load(path)


def _write_npz(file, arrays: dict) -> None:
    np.savez(file, **arrays)


def atomic_write(path: Path, arrays: dict) -> None:
    """Write arrays as .npz to path so that a reader sees the old file or the new, whole.

    The bytes go to a temporary file in the same folder (same file system, so the rename is
    atomic), are flushed and fsync'ed, and the file is renamed over `path`; the folder is
    fsync'ed too, so the rename itself survives a power cut. On any error the temporary file
    is removed and `path` is untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a checkpoint is not
        with os.fdopen(fd, "wb") as f:
            _write_npz(f, arrays)
            f.flush()
            os.fsync(f.fileno())
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


def read_checkpoint(path) -> tuple[dict, dict]:
    """(meta, arrays) of a checkpoint file; CheckpointError says what is wrong with a bad one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    if magic != b"PK\x03\x04":
        raise CheckpointError(f"{path} is not a tfcore checkpoint: it starts with {magic!r}, "
                              "not the .npz (zip) signature b'PK\\x03\\x04'")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "meta" not in z.files:
                raise CheckpointError(f"{path} is an .npz file but not a tfcore checkpoint "
                                      "(no 'meta' entry)")
            meta = json.loads(z["meta"].tobytes().decode())
            arrays = {k: z[k] for k in z.files if k != "meta"}
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path} is truncated or corrupted and cannot be read "
                              f"({type(err).__name__}: {err})") from err
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version "
                              f"{meta.get('version')!r}, expected {FORMAT!r} version {VERSION}")
    missing = {"params", "optimizer.m", "optimizer.v"} - set(arrays)
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(sorted(missing))}")
    return meta, arrays


def check_config(meta: dict, config: TrainConfig, path="checkpoint") -> None:
    """Raise ConfigMismatch naming every field (outside FREE_FIELDS) that differs."""
    theirs = meta["config"]
    diffs = [f"{f.name} (checkpoint {theirs.get(f.name)!r}, this run "
             f"{getattr(config, f.name)!r})"
             for f in fields(TrainConfig)
             if f.name not in FREE_FIELDS and theirs.get(f.name) != getattr(config, f.name)]
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

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tfcore.train",
        description="Train a decoder language model on the Shakespeare corpus or a digit "
                    "task, with checkpoints that resume bit for bit.")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="start from a named configuration (other flags override it)")
    parser.add_argument("--resume", metavar="CHECKPOINT",
                        help="continue from a checkpoint, with its own configuration")
    parser.add_argument("--backend", choices=backend.BACKENDS,
                        help="array library (default: TFCORE_BACKEND or numpy)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"int": int, "float": float, "str": str, "int | None": int,
                    "str | None": str}[str(f.type)]
            parser.add_argument(flag, type=kind, default=None, metavar=f.name.upper(),
                                help=f"(default {f.default!r})")
    return parser


def main(argv=None) -> int:
    try:
        return _main(argv)
    except (CheckpointError, ConfigMismatch) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _main(argv) -> int:
    args = _parser().parse_args(argv)
    if args.backend:
        backend.set_backend(args.backend)
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
             if getattr(args, f.name) is not None}
    if args.resume:
        trainer = Trainer.from_checkpoint(
            args.resume, **{k: v for k, v in given.items() if k in FREE_FIELDS})
        check_config(read_checkpoint(args.resume)[0],
                     dataclasses.replace(trainer.config, **given), args.resume)
    else:
        values = dict(PRESETS.get(args.preset, {}), **given)
        trainer = Trainer(TrainConfig(**values))
    cfg = trainer.config
    print(f"model: {trainer.model.num_parameters():,} parameters, task {cfg.task}, "
          f"{cfg.steps} steps, backend {backend.get_backend()}", file=sys.stderr)
    trainer.run()
    if trainer.history["eval_step"]:
        acc = trainer.history["val_accuracy"][-1]
        print(f"step {trainer.step}: train loss {trainer.history['loss'][-1]:.4g}, "
              f"val loss {trainer.history['val_loss'][-1]:.4g}"
              + ("" if acc is None else f", held-out exact match {acc:.3f}"))
    if cfg.out_dir:
        print(f"checkpoint: {Path(cfg.out_dir) / 'checkpoint.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
