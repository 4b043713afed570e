"""`python -m tfcore.train` at any layout: the same Trainer on every rank of a layout (the
one decoder with its parts, runner.train_step), checkpoints that hold one device's state, so
a run saved under one layout resumes under another and goes on as the uninterrupted
one-device run (float64, 1e-12), evaluations included; the command line runs it on threads
(--simulate N) and refuses bad layouts in one line before any work."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import train as T
from tfcore.parallel import SimulatedGroup

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to "
        "suffer the slings and arrows of outrageous fortune, or to take arms against a sea "
        "of troubles, and by opposing end them. To die, to sleep; no more. ") * 4


@pytest.fixture()
def text(tmp_path):
    path = tmp_path / "play.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def _config(text, out_dir=None, dropout=0.1, **layout):
    return T.TrainConfig(task="text", text=text, seq_len=8, batch_size=4, d_model=16,
                         n_layers=2, n_heads=4, dtype="float64", steps=6, warmup_steps=2,
                         grad_clip=0.5, dropout=dropout, eval_interval=2, eval_batches=2,
                         out_dir=out_dir, progress=False, **layout)


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _leg(config, until, resume=None):
    """Train to step `until` under config's layout (from `resume`, or from the start), save,
    -> rank 0's (history, checkpoint path)."""
    ranks = config.layout().world_size

    def body(world):
        trainer = (T.Trainer(config, world) if resume is None
                   else T.Trainer.from_checkpoint(resume, world, **{
                       k: getattr(config, k) for k in (*T.FREE_FIELDS, "steps")}))
        trainer.run(until)
        path = trainer.save(f"{config.out_dir}/at-{until}.npz")
        return trainer.history, str(path)

    return SimulatedGroup(ranks).run(body)[0]


def test_a_text_run_moves_between_layouts_as_one_device(text, tmp_path):
    out = str(tmp_path)
    one = T.Trainer(_config(text, out)).run()
    reference = one.history
    history, path = _leg(_config(text, out, dp=2, tp=2), 2)
    history, path = _leg(_config(text, out, dp=2, zero=3), 4, path)
    history, path = _leg(_config(text, out, tp=2, dp=2, zero=1, sp=True), 6, path)
    assert len(history["loss"]) == 6
    assert _rel(history["loss"], reference["loss"]) < 1e-12
    assert _rel(history["val_loss"], reference["val_loss"]) < 1e-12
    assert _rel(history["grad_norm"], reference["grad_norm"]) < 1e-12
    final = T.Trainer.from_checkpoint(path, dp=1, tp=1, zero=0, sp=False)   # one device
    assert _rel(np.asarray(final.params.data), np.asarray(one.params.data)) < 1e-12


@pytest.mark.parametrize("layout", [dict(dp=2, micro_batches=2),
                                    dict(cp=2, tp=2, zero=1, sp=True)])
def test_a_one_device_checkpoint_resumes_under_a_layout(text, tmp_path, layout):
    out = str(tmp_path)
    dropout = 0.0 if "cp" in layout else 0.1      # (the ring draws no attention mask)
    reference = T.Trainer(_config(text, out, dropout)).run().history
    first = T.Trainer(_config(text, out, dropout))
    first.run(3)
    path = first.save(tmp_path / "one.npz")
    history, _ = _leg(_config(text, out, dropout, **layout), 6, path)
    assert _rel(history["loss"], reference["loss"]) < 1e-12
    assert _rel(history["val_loss"], reference["val_loss"]) < 1e-12


def test_the_command_line_trains_a_layout_and_refuses_bad_ones(text, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--text", text, "--seq-len", "8", "--batch-size", "4", "--d-model", "16",
            "--n-layers", "2", "--steps", "2", "--warmup-steps", "0", "--dtype", "float64",
            "--no-progress",
            "--out-dir", str(out)]
    assert T.main([*argv, "--simulate", "4", "--dp", "2", "--tp", "2"]) == 0
    assert (out / "checkpoint.npz").exists() and (out / "log.jsonl").exists()
    assert "layout dp=2 x tp=2" in capsys.readouterr().err
    for extra, message in (
            (["--simulate", "3", "--dp", "2"], "error: argument --simulate 3 ranks, but the "
                                               "layout"),
            (["--simulate", "2", "--tp", "3"], "error: argument --simulate 2 ranks"),
            (["--simulate", "4", "--tp", "4", "--sp", "--dp", "1", "--seq-len", "6"],
             "error: argument"),
            (["--simulate", "2", "--cp", "2", "--dropout", "0.1"],
             "context parallelism with dropout"),
            (["--simulate", "1", "--task", "reverse", "--dp", "1", "--tp", "1",
              "--zero", "1"], None)):
        args = argv
        if "--task" in extra:                      # a digit task reads neither of these
            args = argv[4:]
            assert argv[:4] == ["--text", text, "--seq-len", "8"]
        code = T.main([*args, "--out-dir", str(tmp_path / "bad"), *extra])
        err = capsys.readouterr().err
        if message is None:
            assert code == 2 and "is for the text tasks" in err
            continue
        assert code == 2, err
        assert message in err and err.count("\n") == 1, err


def test_mpiexec_trains_a_layout_equal_to_one_device(text, tmp_path):
    """mpiexec -n 4 python -m tfcore.train --dp 2 --tp 2: four processes train, evaluate,
    log and checkpoint; the checkpoint's parameters are one device's (1e-12)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("mpi4py")
    mpiexec = (shutil.which("mpiexec", path=str(Path(sys.executable).parent))
               or shutil.which("mpiexec"))
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    out = tmp_path / "mpi"
    argv = ["--text", text, "--seq-len", "8", "--batch-size", "4", "--d-model", "16",
            "--n-layers", "2", "--steps", "3", "--warmup-steps", "1", "--dtype", "float64",
            "--eval-interval", "3", "--no-progress", "--seed", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    done = subprocess.run([mpiexec, "-n", "4", sys.executable, "-m", "tfcore.train", *argv,
                           "--out-dir", str(out), "--dp", "2", "--tp", "2"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("checkpoint:") == 1                  # rank 0 reports, once
    log = (out / "log.jsonl").read_text().splitlines()
    assert len([line for line in log if '"loss"' in line]) == 3
    assert T.main([*argv, "--out-dir", str(tmp_path / "one")]) == 0
    theirs = T.read_checkpoint(out / "checkpoint.npz")[1]["params"]
    ours = T.read_checkpoint(tmp_path / "one" / "checkpoint.npz")[1]["params"]
    assert _rel(theirs, ours) < 1e-12


def test_a_run_extends_its_steps_when_its_rate_is_constant(text, tmp_path):
    """Train 4 steps, resume to 8: with min_lr = lr (constant after the warm-up) the result
    is 8 uninterrupted steps, bit for bit on one device and to 1e-12 under a layout; under
    the cosine schedule the extension is refused, naming why."""
    import dataclasses

    constant = dataclasses.replace(_config(text, str(tmp_path)), steps=4, min_lr=3e-3)
    straight = T.Trainer(dataclasses.replace(constant, steps=8)).run()
    first = T.Trainer(constant).run()
    path = first.save(tmp_path / "four.npz")
    longer = T.Trainer.from_checkpoint(path, steps=8).run()
    assert longer.history["loss"] == straight.history["loss"]
    assert np.array_equal(np.asarray(longer.params.data), np.asarray(straight.params.data))
    history, _ = _leg(dataclasses.replace(constant, steps=8, dp=2, tp=2), 8, path)
    assert _rel(history["loss"], straight.history["loss"]) < 1e-12
    cosine = T.Trainer(_config(text, str(tmp_path / "cos")))
    cosine.run(2)
    cos_path = cosine.save(tmp_path / "cos.npz")
    with pytest.raises(T.ConfigMismatch, match="cosine schedule's rate at every step"):
        T.Trainer.from_checkpoint(cos_path, steps=12)
    with pytest.raises(T.ConfigMismatch, match="can only be extended, not shortened"):
        T.Trainer.from_checkpoint(path, steps=3)
