"""tfcore.data, tfcore.train and tfcore.sample: data, learning, checkpoints, the CLIs."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore import backend, data
from tfcore import train as train_mod
from tfcore.train import CheckpointError, ConfigMismatch, Trainer, TrainConfig

ROOT = Path(__file__).resolve().parents[1]

# A model small enough that a step takes a few milliseconds; dropout on, so that resuming
# must restore the dropout stream too.
TINY = TrainConfig(task="shakespeare", seq_len=16, d_model=16, n_layers=1, n_heads=2,
                   steps=8, batch_size=4, warmup_steps=2, dropout=0.1, dtype="float64",
                   eval_interval=4, eval_batches=1, progress=False)


def host(x):
    return np.array(backend.to_numpy(x))


def snapshot(trainer: Trainer) -> dict:
    return {"params": host(trainer.params.data), "m": host(trainer.optimizer.m),
            "v": host(trainer.optimizer.v), "t": trainer.optimizer.t, "step": trainer.step,
            "sampler": repr(trainer.batches.state)}


def same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
               for k in a)


# -- data ----------------------------------------------------------------------------------

def test_corpus_and_tokenizer_round_trip():
    text = data.load_corpus()
    assert len(text) == 375_815 and text.startswith("HAMLET")
    tok = data.CharTokenizer.from_text(text)
    assert tok.vocab_size == 74
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and tok.decode(ids) == text
    train_ids, val_ids = data.train_val_split(ids, 0.1)
    assert len(train_ids) + len(val_ids) == len(ids) and len(val_ids) == 37_581
    with pytest.raises(ValueError, match="character '@' is not in the tokenizer's vocabulary"):
        tok.encode("to be @")
    with pytest.raises(ValueError, match="unknown corpus 'dickens'"):
        data.load_corpus("dickens")


def test_text_batches_are_seeded_shifted_and_resumable(backend_name):
    ids = np.arange(1000)
    a = data.TextBatches(ids, batch_size=3, seq_len=5, seed=7)
    x, y = a.next()
    assert x.shape == (3, 5) and np.array_equal(host(y), host(x) + 1)  # y is x shifted by one
    state = a.state
    after = [host(a.next()[0]) for _ in range(3)]
    b = data.TextBatches(ids, batch_size=3, seq_len=5, seed=7)
    b.state = state
    assert all(np.array_equal(host(b.next()[0]), want) for want in after)


def test_digit_task_scores_only_the_answer_and_holds_out_a_tenth(backend_name):
    task = data.DigitTask(n_digits=5, kind="reverse", batch_size=200, seed=0)
    x, y = (host(t) for t in task.next())
    assert x.shape == y.shape == (200, 10)
    assert np.all(y[:, :5] == data.IGNORE_INDEX)
    assert np.all(x[:, 5] == task.SEP)
    assert np.array_equal(y[:, 5:], x[:, 4::-1])                       # reversed digits
    assert not task.is_heldout(x[:, :5]).any()
    hx, hy = (host(t) for t in task.heldout(300))
    assert task.is_heldout(hx[:, :5]).all()
    everything = np.array(np.meshgrid(*[np.arange(10)] * 5)).reshape(5, -1).T
    assert abs(task.is_heldout(everything).mean() - 0.1) < 0.005
    sort = data.DigitTask(n_digits=4, kind="sort", batch_size=50)
    sx, sy = (host(t) for t in sort.next())
    assert np.array_equal(sy[:, 4:], np.sort(sx[:, :4], axis=1))
    assert task.format(x[0]).count("=") == 1


def test_exact_match_needs_every_scored_position():
    y = np.array([[-100, 1, 2], [-100, 0, 0]])
    logits = np.zeros((2, 3, 3))
    logits[0, 1, 1] = logits[0, 2, 2] = 1.0                             # row 0 right
    logits[1, 1, 0] = logits[1, 2, 1] = 1.0                             # row 1 wrong at the end
    logits[:, 0, 2] = 5.0                                               # ignored position
    assert data.exact_match(logits, y) == 0.5


# -- learning --------------------------------------------------------------------------------

def test_reversal_is_learned_to_a_held_out_accuracy():
    # 120 steps of a 2-layer, 32-wide model: every held-out string reversed exactly in at
    # least 95% of 500 cases (the run reaches 100%; chance is 10^-5).
    cfg = TrainConfig(task="reverse", n_digits=5, d_model=32, n_layers=2, n_heads=4,
                      steps=120, batch_size=64, lr=1e-2, min_lr=1e-3, warmup_steps=10,
                      weight_decay=0.0, dtype="float32", eval_interval=120, seed=0,
                      progress=False)
    trainer = train_mod.train(cfg)
    assert trainer.history["val_accuracy"][-1] >= 0.95
    assert trainer.history["loss"][-1] < 0.1 * trainer.history["loss"][0]


def test_the_character_model_learns_something():
    cfg = dataclasses.replace(TINY, steps=40, dropout=0.0, lr=1e-2, eval_interval=40)
    trainer = train_mod.train(cfg)
    # ln 74 = 4.30 is the loss of a uniform guess; character statistics alone reach ~3.3.
    assert trainer.history["val_loss"][-1] < 3.4 < np.log(74)


# -- checkpoints ----------------------------------------------------------------------------

def test_resume_continues_bit_for_bit(tmp_path, backend_name):
    straight = train_mod.train(TINY)
    first = Trainer(TINY).run(until=4)
    first.save(tmp_path / "half.npz")
    resumed = Trainer.from_checkpoint(tmp_path / "half.npz").run()
    assert resumed.step == straight.step == 8
    assert same(snapshot(resumed), snapshot(straight))
    assert resumed.history["loss"] == straight.history["loss"]
    assert resumed.history["val_loss"] == straight.history["val_loss"]


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.npz"
    trainer = Trainer(TINY).run(until=2)
    trainer.save(path)
    saved_bytes, at_two = path.read_bytes(), snapshot(trainer)
    trainer.run(until=4)

    def dies_halfway(file, arrays):
        file.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(train_mod, "_write_npz", dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        trainer.save(path)
    assert path.read_bytes() == saved_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]  # no temp left
    assert same(snapshot(Trainer(TINY).load(path)), at_two)


def test_a_mismatched_config_is_refused_by_name_and_changes_nothing(tmp_path):
    path = Trainer(TINY).run(until=2).save(tmp_path / "c.npz")
    other = Trainer(dataclasses.replace(TINY, lr=0.01, weight_decay=0.0))
    before = snapshot(other)
    with pytest.raises(ConfigMismatch, match=r"lr \(checkpoint 0.003, this run 0.01\); "
                                             r"weight_decay \(checkpoint 0.1, this run 0.0\)"):
        other.load(path)
    assert same(snapshot(other), before)
    wider = Trainer(dataclasses.replace(TINY, d_model=32))
    with pytest.raises(ConfigMismatch, match=r"d_model \(checkpoint 16, this run 32\)"):
        wider.load(path)
    # Where files go and how often we look may change: the trajectory does not depend on them.
    free = Trainer(dataclasses.replace(TINY, eval_interval=3, out_dir=str(tmp_path)))
    assert free.load(path).step == 2
    with pytest.raises(ConfigMismatch, match="not lr"):
        Trainer.from_checkpoint(path, lr=0.5)


def test_a_corrupted_checkpoint_gives_a_clear_error(tmp_path):
    good = Trainer(TINY).run(until=1).save(tmp_path / "good.npz")
    trainer = Trainer(TINY)
    before = snapshot(trainer)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated.npz is truncated or corrupted"):
        trainer.load(truncated)
    wrong = tmp_path / "wrong.npz"
    wrong.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(CheckpointError, match=r"not a tfcore checkpoint: it starts with b'GGUF'"):
        trainer.load(wrong)
    plain = tmp_path / "plain.npz"
    np.savez(plain, params=np.zeros(3))
    with pytest.raises(CheckpointError, match="no 'meta' entry"):
        trainer.load(plain)
    flipped = bytearray(good.read_bytes())
    flipped[len(flipped) // 3] ^= 0xFF                                  # one bad byte in the data
    bad = tmp_path / "flipped.npz"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="corrupted"):
        trainer.load(bad)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        trainer.load(tmp_path / "missing.npz")
    assert same(snapshot(trainer), before)


def test_checkpoint_is_read_without_pickle(tmp_path, monkeypatch):
    path = Trainer(TINY).run(until=1).save(tmp_path / "c.npz")
    seen = {}
    real_load = np.load

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(train_mod.np, "load", spy)
    train_mod.read_checkpoint(path)
    assert seen.get("allow_pickle") is False


# -- command line ---------------------------------------------------------------------------

def run_module(*args, cwd=None):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=120)


def test_cli_train_then_sample(tmp_path):
    help_ = run_module("tfcore.train", "--help")
    assert help_.returncode == 0 and "--resume" in help_.stdout and "--preset" in help_.stdout
    out = tmp_path / "run"
    done = run_module("tfcore.train", "--task", "shakespeare", "--steps", "3",
                      "--warmup-steps", "1", "--d-model", "16", "--n-layers", "1",
                      "--n-heads", "2", "--seq-len", "16", "--batch-size", "4",
                      "--eval-interval", "3", "--eval-batches", "1", "--out-dir", str(out))
    assert done.returncode == 0, done.stderr
    assert "step 3: train loss" in done.stdout and (out / "checkpoint.npz").exists()
    assert "3/3" in done.stderr                                          # the tqdm bar
    text = run_module("tfcore.sample", "--checkpoint", str(out / "checkpoint.npz"),
                      "--prompt", "HAMLET.", "--tokens", "20", "--seed", "1")
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("HAMLET.") and len(text.stdout.rstrip("\n")) >= 7
    resumed = run_module("tfcore.train", "--resume", str(out / "checkpoint.npz"),
                         "--progress", "--eval-interval", "1")
    assert resumed.returncode == 0, resumed.stderr                       # already at step 3
    refused = run_module("tfcore.train", "--resume", str(out / "checkpoint.npz"),
                         "--d-model", "32")
    assert refused.returncode != 0 and "d_model" in refused.stderr
    bad = run_module("tfcore.sample", "--checkpoint", str(tmp_path / "none.npz"))
    assert bad.returncode == 2 and "no checkpoint at" in bad.stderr


def test_seed002_autoencoder_trains_and_resumes(tmp_path):
    # Seed 002's model and optimizer on a smaller set: Adam (no decay), full batch, float64.
    cfg = TrainConfig(**dict(train_mod.PRESETS["seed002"], batch_size=4, seq_len=8,
                             steps=12, eval_interval=12, progress=False))
    straight = train_mod.train(cfg)
    assert straight.optimizer.kind == "Adam"
    assert straight.history["loss"][-1] < 0.5 * straight.history["loss"][0]
    half = Trainer(cfg).run(until=6)
    half.save(tmp_path / "ae.npz")
    resumed = Trainer.from_checkpoint(tmp_path / "ae.npz").run()
    assert same(snapshot(resumed), snapshot(straight))


def test_gaussian_sequences_are_standardized_per_token():
    x = host(data.GaussianSequences(3, 5, 64, standardize=True, seed=1).x)
    assert np.allclose(x.mean(-1), 0, atol=1e-12) and np.allclose(x.var(-1), 1, atol=1e-12)
    raw = host(data.GaussianSequences(3, 5, 64, standardize=False, seed=1).x)
    assert not np.allclose(raw.var(-1), 1, atol=1e-2)


# -- the loop's order, and no silent poison ------------------------------------------------

def test_the_training_loop_is_schedule_clip_step_zero_as_written_by_hand():
    """Trainer.train_step against a loop written out here on the same model and batches:
    zero, forward, backward, clip, the scheduled lr, step. Setting the lr after the step,
    clipping after it, or not zeroing, each changes the parameters."""
    from tfcore import optim
    from tfcore.models.decoder import DecoderLM

    cfg = TrainConfig(task="shakespeare", seq_len=8, d_model=8, n_layers=1, n_heads=2,
                      steps=5, batch_size=3, lr=5e-2, min_lr=1e-2, warmup_steps=2,
                      weight_decay=0.1, grad_clip=0.05, dtype="float64", progress=False)
    trainer = Trainer(cfg)
    norms = []
    for _ in range(cfg.steps):
        trainer.train_step()
        norms.append(trainer.last_grad_norm)

    model = DecoderLM(trainer.model_config).init(cfg.seed)
    params = model.params
    opt = optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                      weight_decay=cfg.weight_decay)
    batches = data.TextBatches(trainer.batches.ids, cfg.batch_size, cfg.seq_len, cfg.seed)
    hand_norms = []
    for step in range(cfg.steps):
        x, y = batches.next()
        params.zero_grad()
        model.forward(x, y, training=True)
        model.backward()
        hand_norms.append(optim.clip_grad_norm(params.grad, cfg.grad_clip))
        opt.lr = optim.warmup_cosine(step, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr)
        opt.step()
    assert np.array_equal(host(trainer.params.data), host(params.data))
    assert norms == hand_norms and min(norms) > cfg.grad_clip          # clipping was active
    assert opt.lr == trainer.optimizer.lr != cfg.lr


def test_a_nan_gradient_stops_training_before_it_reaches_the_parameters(monkeypatch):
    cfg = dataclasses.replace(TINY, dropout=0.0, grad_clip=0.0)       # seed002's no-clip case
    trainer = Trainer(cfg)
    trainer.train_step()
    before = host(trainer.params.data)
    backward = trainer.model.backward

    def poisoned(*args, **kwargs):
        backward(*args, **kwargs)
        trainer.params.grad[0] = float("nan")
    monkeypatch.setattr(trainer.model, "backward", poisoned)
    with pytest.raises(FloatingPointError, match="nan or inf"):
        trainer.train_step()
    assert np.array_equal(host(trainer.params.data), before)


def test_sample_next_refuses_non_finite_logits():
    from tfcore.models.decoder import sample_next

    rng = np.random.default_rng(0)
    logits = np.array([[0.0, 1.0, np.nan]])
    for temperature in (0.0, 1.0):
        with pytest.raises(FloatingPointError, match="nan or inf"):
            sample_next(logits, temperature, None, None, rng)
    with pytest.raises(FloatingPointError, match="overflow"):
        sample_next(np.array([[0.0, 1e300]]), 1e-10, None, None, rng)
    masked = np.array([[-np.inf, 0.0, 1.0]])              # an impossible token is allowed
    assert sample_next(masked, 1.0, None, None, rng)[0] in (1, 2)


def test_token_streams_of_floats_are_refused_not_truncated():
    with pytest.raises(TypeError, match="integers"):
        data.TextBatches(np.arange(40) + 0.7, 2, 4)


def test_read_text_file_says_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc\xffdef")
    with pytest.raises(ValueError, match="byte 0xff at offset 3"):
        data.read_text_file(bad)
    good = tmp_path / "good.txt"
    good.write_text("h\u00e9llo \u4e16\u754c", encoding="utf-8")
    assert data.read_text_file(good) == "h\u00e9llo \u4e16\u754c"


@pytest.mark.parametrize("field, value", [("steps", 2.0), ("progress", "no"), ("seed", True),
                                          ("lr", "0.1"), ("norm", "batchnorm")])
def test_config_values_of_the_wrong_type_are_refused(field, value):
    with pytest.raises(train_mod.ConfigError) as err:
        dataclasses.replace(TINY, **{field: value}).validate()
    assert err.value.field == field


# -- the tasks -------------------------------------------------------------------------------

def test_the_task_registry_is_the_one_place_a_task_name_decides_anything():
    """Every task name has a Task (tasks.REGISTRY) and tfcore/train.py compares no task's
    or family's name: the Trainer and TrainConfig ask the task's object instead."""
    import ast

    from tfcore import tasks

    assert set(train_mod.TASKS) == set(tasks.REGISTRY)
    assert {name: task.family for name, task in tasks.REGISTRY.items()} == {
        "shakespeare": "text", "text": "text", "reverse": "digits", "sort": "digits",
        "autoencoder": "autoencoder"}
    assert set(tasks.FAMILIES) == {"text", "digits", "autoencoder"}
    # "text" is also a field's name (the file), so a bare "text" is not a task's name here
    names = (set(tasks.REGISTRY) | set(tasks.FAMILIES)) - {"text"}
    tree = ast.parse(Path(train_mod.__file__).read_text(encoding="utf-8"))

    def named(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    def family(node) -> bool:        # task_family(...), task.family, family
        return (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "task_family"
                or isinstance(node, ast.Attribute) and node.attr == "family"
                or isinstance(node, ast.Name) and node.id == "family")

    def task(node) -> bool:          # cfg.task, config["task"]
        return (isinstance(node, ast.Attribute) and node.attr == "task"
                or isinstance(node, ast.Subscript) and named(node.slice)
                and node.slice.value == "task")

    switches = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            if (any(named(s) and s.value in names or family(s) for s in sides)
                    or any(map(task, sides)) and any(map(named, sides))):
                switches.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert switches == [], switches
    assert not any(isinstance(node, ast.Name) and node.id == "task_family"
                   for node in ast.walk(tree))


def test_a_new_task_trains_saves_and_resumes_without_touching_the_trainer(tmp_path,
                                                                          monkeypatch):
    """A task registered in tasks.REGISTRY alone (the alphabet, by character) is checked,
    trained, evaluated, saved and resumed by the unchanged TrainConfig and Trainer."""
    from tfcore import tasks

    class AlphabetTask(tasks.TextTask):
        family = "alphabet"
        parallel = False

        def data(self, cfg):
            text = "abcdefghijklmnopqrstuvwxyz" * 20
            tok = data.CharTokenizer.from_text(text)
            ids = tok.encode(text)                                   # [520] int64
            return tasks.TaskData(
                batches=data.TextBatches(ids[:400], cfg.batch_size, cfg.seq_len, cfg.seed),
                val_batches=data.TextBatches(ids[400:], cfg.batch_size, cfg.seq_len, 1),
                tokenizer=tok, text_sha256=None, vocab_size=tok.vocab_size)

    alphabet = AlphabetTask()
    monkeypatch.setitem(tasks.REGISTRY, "alphabet", alphabet)
    monkeypatch.setitem(tasks.FAMILIES, "alphabet", alphabet)
    cfg = dataclasses.replace(TINY, task="alphabet", seq_len=None, steps=6, eval_interval=3,
                              out_dir=str(tmp_path / "run"))
    assert cfg.seq_len == 64 and cfg.norm == "layernorm"      # its settings' defaults
    with pytest.raises(train_mod.ConfigError) as err:          # its refusals: no layout
        dataclasses.replace(cfg, seq_len=8, dp=2).validate()
    assert err.value.field == "dp" and "task 'alphabet' trains on one device" in str(err.value)
    with pytest.raises(train_mod.ConfigError) as err:          # a setting it does not read
        dataclasses.replace(cfg, n_digits=4).validate()
    assert err.value.field == "n_digits"
    cfg = dataclasses.replace(cfg, seq_len=8)
    straight = Trainer(cfg).run()
    assert straight.model_config.vocab_size == 26 and straight.model_config.max_seq_len == 8
    losses = straight.history["val_loss"]
    assert straight.history["eval_step"] == [3, 6] and all(np.isfinite(losses))
    assert straight.history["loss"][-1] < straight.history["loss"][0]
    half = Trainer(dataclasses.replace(cfg, out_dir=str(tmp_path / "half"))).run(until=3)
    half.save(tmp_path / "half.npz")
    resumed = Trainer.from_checkpoint(tmp_path / "half.npz").run()
    assert same(snapshot(resumed), snapshot(straight))
    assert resumed.history["val_loss"] == losses
