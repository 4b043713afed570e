"""Nothing lost: a run checks its output folder and data before the first step, a checkpoint
is loaded whole or not at all, a bad state is never saved, a forged header is refused before
anything is allocated, and a killed save leaves no litter after the next one."""
from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tfcore import backend
from tfcore.train import (CheckpointError, ConfigError, ConfigMismatch, Trainer, TrainConfig,
                          read_checkpoint)

TINY = TrainConfig(task="shakespeare", seq_len=8, d_model=8, n_layers=1, n_heads=2, steps=4,
                   batch_size=2, warmup_steps=1, dtype="float64", eval_interval=2,
                   eval_batches=1, progress=False)


def host(x):
    return np.array(backend.to_numpy(x))


def state(trainer: Trainer) -> dict:
    return {"params": host(trainer.params.data), "m": host(trainer.optimizer.m),
            "v": host(trainer.optimizer.v), "t": trainer.optimizer.t, "step": trainer.step,
            "sampler": repr(trainer.batches.state), "history": repr(trainer.history),
            "lr": trainer.optimizer.lr}


def equal(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
               for k in a)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint at step 2 of TINY: (path, meta, arrays)."""
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.npz"
    Trainer(TINY).run(until=2).save(path)
    meta, arrays = read_checkpoint(path)
    return path, meta, arrays


def rewrite(path: Path, meta: dict, arrays: dict) -> Path:
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return path


def forged(tmp_path, saved, change):
    """A copy of the saved checkpoint with change(meta, arrays) applied."""
    _, meta, arrays = saved
    meta = json.loads(json.dumps(meta))
    arrays = {k: v.copy() for k, v in arrays.items()}
    change(meta, arrays)
    return rewrite(tmp_path / "forged.npz", meta, arrays)


def _set(path, value):
    def change(meta, arrays):
        *keys, last = path
        target = meta
        for k in keys:
            target = target[k]
        target[last] = value
    return change


def _array(name, fn):
    def change(meta, arrays):
        arrays[name] = fn(arrays[name])
    return change


BAD_STATES = {
    "another optimizer kind": _set(("optimizer", "kind"), "SGD"),
    "other betas": _set(("optimizer", "betas"), [0.5, 0.99]),
    "nan in m": _array("optimizer.m", lambda a: np.where(np.arange(a.size) == 3, np.nan, a)),
    "negative v": _array("optimizer.v", lambda a: -np.abs(a) - 1.0),
    "inf in v": _array("optimizer.v", lambda a: np.where(np.arange(a.size) == 0, np.inf, a)),
    "t = 0 at step 2": _set(("optimizer", "t"), 0),
    "t a float": _set(("optimizer", "t"), 2.5),
    "lr nan": _set(("optimizer", "lr"), float("nan")),
    "malformed sampler state": _set(("sampler_state",), {"bit_generator": "PCG64"}),
    "sampler state of another generator": _set(("sampler_state", "bit_generator"), "MT19937"),
    "history lists of different lengths": _set(("history", "loss"), [1.0]),
    "history of strings": _set(("history", "lr"), ["a", "b"]),
    "history without its keys": _set(("history",), {"step": [1, 2]}),
    "step past --steps": _set(("step",), 99),
    "step negative": _set(("step",), -1),
    "step a string": _set(("step",), "2"),
    "nan in the parameters": _array("params", lambda a: np.where(np.arange(a.size) == 5,
                                                                 np.nan, a)),
    "another tokenizer": _set(("tokenizer",), "abc"),
}


@pytest.mark.parametrize("fault", sorted(BAD_STATES))
def test_load_is_all_or_nothing(tmp_path, saved, fault):
    path = forged(tmp_path, saved, BAD_STATES[fault])
    trainer = Trainer(TINY).run(until=1)
    before = state(trainer)
    with pytest.raises((CheckpointError, ConfigMismatch)):
        trainer.load(path)
    assert equal(state(trainer), before)
    trainer.load(saved[0])                         # the good checkpoint still loads
    assert trainer.step == 2


def test_save_refuses_non_finite_state_and_keeps_the_good_checkpoint(tmp_path):
    trainer = Trainer(TINY).run(until=2)
    path = trainer.save(tmp_path / "checkpoint.npz")
    good = path.read_bytes()
    for buffer in (trainer.params.data, trainer.optimizer.v):
        keep = host(buffer)
        buffer[0] = float("nan")
        with pytest.raises(FloatingPointError, match="refusing to save"):
            trainer.save(path)
        buffer[...] = backend.asarray(keep)
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]
    assert Trainer(TINY).load(path).step == 2


def test_a_forged_header_is_refused_before_allocating(tmp_path, saved):
    path = tmp_path / "huge.npz"
    src = saved[0]
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            payload = zin.read(info)
            if info.filename == "params.npy":
                # The same header length, a shape of 10^12 values.
                header_end = payload.index(b"\n") + 1
                header = payload[:header_end].decode("latin1")
                start = header.index("'shape': (") + len("'shape': (")
                stop = header.index(")", start)
                new = header[:start] + "1000000000000," + header[stop:]
                new = new[:-1].rstrip(" ")
                new = new + " " * (header_end - 1 - len(new)) + "\n"
                assert len(new) == header_end
                payload = new.encode("latin1") + payload[header_end:]
            zout.writestr(info, payload)
    with pytest.raises(CheckpointError, match="claims shape"):
        read_checkpoint(path)


def test_a_killed_save_leaves_no_temporary_file_after_the_next(tmp_path):
    trainer = Trainer(TINY).run(until=1)
    litter = tmp_path / ".checkpoint.npz.abc123.tmp"
    litter.write_bytes(b"half a checkpoint")
    trainer.save(tmp_path / "checkpoint.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]


def test_a_folder_or_unreadable_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="is a folder"):
        read_checkpoint(tmp_path)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match="cannot read"):   # NotADirectoryError
        read_checkpoint(a_file / "checkpoint.npz")


def test_out_dir_is_checked_before_the_first_step(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="not a folder") as err:
        Trainer(TrainConfig(**{**TINY.__dict__, "out_dir": str(a_file)}))
    assert err.value.field == "out_dir"
    under_file = a_file / "sub"
    with pytest.raises(ConfigError, match="cannot hold") as err:
        Trainer(TrainConfig(**{**TINY.__dict__, "out_dir": str(under_file)}))
    assert err.value.field == "out_dir"


def test_a_validation_part_shorter_than_the_context_is_refused_up_front(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("abcdefghij" * 10, encoding="utf-8")         # 100 characters
    cfg = TrainConfig(task="text", text=str(text), seq_len=20, d_model=8, n_layers=1,
                      n_heads=2, steps=2, batch_size=2, warmup_steps=0, progress=False,
                      out_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="validation part holds 10") as err:
        Trainer(cfg)
    assert err.value.field == "seq_len"
    assert not (tmp_path / "run").exists()                          # nothing written


def test_resume_refuses_a_changed_text(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    cfg = TrainConfig(task="text", text=str(text), seq_len=8, d_model=8, n_layers=1,
                      n_heads=2, steps=2, batch_size=2, warmup_steps=0, progress=False)
    path = Trainer(cfg).run().save(tmp_path / "c.npz")
    changed = ("the quick brown fox jumps over the lazy dog. " * 20)[::-1]   # same characters
    text.write_text(changed, encoding="utf-8")
    with pytest.raises(ConfigMismatch, match="has changed"):
        Trainer.from_checkpoint(path)


def test_log_lines_past_the_checkpoint_are_dropped_on_resume(tmp_path):
    cfg = TrainConfig(**{**TINY.__dict__, "out_dir": str(tmp_path), "checkpoint_interval": 2})
    trainer = Trainer(cfg).run(until=2)
    trainer.run(until=3)                      # a step after the checkpoint, then a "crash"
    resumed = Trainer.from_checkpoint(tmp_path / "checkpoint.npz").run()
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == [1, 2, 3, 4] and resumed.step == 4
    assert all(math.isfinite(r["grad_norm"]) for r in records if "loss" in r)


# A checkpoint whose stored characters cannot be the tokenizer its model was trained with
# (the same number of them, so only the tokenizer's own check can catch it).
BAD_TOKENIZERS = {
    "a duplicated character": lambda chars: chars[0] + chars[:-1],
    "a list of characters": list,
    "a number": lambda chars: 42,
    "characters out of order": lambda chars: chars[::-1],
    "an empty string": lambda chars: "",
}


@pytest.mark.parametrize("fault", sorted(BAD_TOKENIZERS))
def test_sample_refuses_a_malformed_tokenizer(tmp_path, saved, capsys, fault):
    """The library call raises CheckpointError (a ValueError) naming the tokenizer; the command
    line prints one line naming --checkpoint, exit status 2, and nothing else."""
    from tfcore import sample

    path = forged(tmp_path, saved, lambda meta, arrays: meta.update(
        tokenizer=BAD_TOKENIZERS[fault](meta["tokenizer"])))
    with pytest.raises(CheckpointError, match="tokenizer"):
        sample.load_model(path)
    with pytest.raises(ValueError, match="tokenizer"):
        sample.sample(path, "t", 2)
    status = sample.main(["--checkpoint", str(path), "--prompt", "t", "--tokens", "2"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: argument --checkpoint: {path}: ") and "tokenizer" in err
