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


# -- pipeline stages ---------------------------------------------------------------------

def _mpiexec():
    import shutil
    import sys
    from pathlib import Path

    pytest.importorskip("mpi4py")
    found = (shutil.which("mpiexec", path=str(Path(sys.executable).parent))
             or shutil.which("mpiexec"))
    if found is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    return found


def test_a_text_run_moves_between_dp_tp_and_pipeline_stages(text, tmp_path):
    """DP 2 x TP 2 for 2 steps, then PP 2 x DP 2 for 2 more, equals 4 one-device steps
    (losses, evaluations, clipped norms, dropout, the parameters); and a pipeline's
    checkpoint (PP 2 x TP 2, GPipe, 2 micro-batches) resumes on one device."""
    import dataclasses

    cfg = dataclasses.replace(_config(text, str(tmp_path / "one")), steps=4)
    one = T.Trainer(cfg).run()
    reference = one.history
    out = str(tmp_path / "layouts")
    history, path = _leg(dataclasses.replace(cfg, out_dir=out, dp=2, tp=2), 2)
    history, path = _leg(dataclasses.replace(cfg, out_dir=out, pp=2, dp=2), 4, path)
    assert len(history["loss"]) == 4 and history["eval_step"] == [2, 4]
    for key in ("loss", "val_loss", "grad_norm"):
        assert _rel(history[key], reference[key]) < 1e-12, key
    final = T.Trainer.from_checkpoint(path, dp=1, pp=None)                  # one device
    assert _rel(np.asarray(final.params.data), np.asarray(one.params.data)) < 1e-12

    out = str(tmp_path / "pipeline")
    _, path = _leg(dataclasses.replace(cfg, out_dir=out, pp=2, tp=2, schedule="gpipe",
                                       micro_batches=2), 2)
    rest = T.Trainer.from_checkpoint(path, pp=None, tp=1, schedule=None, micro_batches=1)
    rest.run()
    assert _rel(rest.history["loss"], reference["loss"]) < 1e-12
    assert _rel(np.asarray(rest.params.data), np.asarray(one.params.data)) < 1e-12


def test_the_pipeline_flags_are_checked_before_any_work(text, tmp_path, capsys):
    argv = ["--text", text, "--seq-len", "8", "--batch-size", "4", "--d-model", "16",
            "--n-layers", "2", "--steps", "2", "--warmup-steps", "0", "--no-progress"]
    bad = tmp_path / "bad"
    for extra, message in (
            (["--simulate", "3", "--pp", "2", "--dp", "2"],
             "--simulate 3 ranks, but the layout dp=2 x pp=2 x tp=1 needs 4"),
            (["--simulate", "2", "--pp", "3"], "--pp 3 must divide n_layers (2)"),
            (["--simulate", "2", "--pp", "0"], "--pp must be an integer >= 1, got 0"),
            (["--simulate", "2", "--pp", "2", "--virtual", "0"], "--virtual must be an "
                                                                  "integer >= 1, got 0"),
            (["--simulate", "2", "--pp", "2", "--schedule", "pipedream"],
             "--schedule: invalid choice: 'pipedream'"),
            (["--simulate", "2", "--virtual", "2"], "virtual stages without pipeline "
                                                    "parallelism (virtual=2, pp=None)"),
            (["--simulate", "2", "--schedule", "gpipe"], "pipeline schedule without "
                                                         "pipeline parallelism"),
            (["--simulate", "4", "--pp", "2", "--dp", "2", "--zero", "3"],
             "ZeRO-2/3 with pipeline parallelism (pp=2, zero=3): a stage keeps"),
            (["--simulate", "2", "--pp", "2", "--n-layers", "4", "--virtual", "2",
              "--schedule", "1f1b"], "virtual stages with a one-chunk schedule"),
            (["--simulate", "2", "--pp", "2", "--n-layers", "4", "--virtual", "2",
              "--micro-batches", "1"], "--micro-batches (1) must be a multiple of pp (2) "
                                       "for the interleaved schedule"),
            (["--simulate", "2", "--pp", "2", "--micro-batches", "3"],
             "--batch-size the global batch (4) must be divisible by dp x micro_batches"),
            (["--simulate", "4", "--pp", "2", "--tp", "2", "--n-heads", "3",
              "--d-model", "18"], "--tp n_heads (3) must be divisible by the "
                                  "tensor-parallel degree (2)")):
        try:
            code = T.main([*argv, "--out-dir", str(bad), *extra])
        except SystemExit as exit:                  # argparse's own (a choice, a type)
            code = exit.code
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.startswith("error: argument ") and err.count("\n") == 1, err
        assert message in err, err
        assert not bad.exists()                           # nothing was made or written
    assert T.main([*argv, "--out-dir", str(tmp_path / "ok"), "--simulate", "2", "--pp", "2",
                   "--micro-batches", "2", "--schedule", "gpipe"]) == 0
    captured = capsys.readouterr()
    assert "layout dp=1 x pp=2 x tp=1 (gpipe, 2 micro-batches)" in captured.err
    assert captured.out.count("checkpoint:") == 1


def test_mpiexec_resumes_a_dp_tp_checkpoint_in_pipeline_stages(text, tmp_path):
    """2 steps at DP 2 x TP 2 (threads), then mpiexec -n 4 python -m tfcore.train --resume
    ... --pp 2 --dp 2 for 2 more: rank 0 logs once, and the 4 steps are one device's."""
    import dataclasses
    import os
    import subprocess
    import sys

    mpiexec = _mpiexec()
    cfg = dataclasses.replace(_config(text, str(tmp_path / "one")), steps=4)
    one = T.Trainer(cfg).run()
    out = tmp_path / "mpi"
    _, path = _leg(dataclasses.replace(cfg, out_dir=str(out), dp=2, tp=2), 2)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    done = subprocess.run([mpiexec, "-n", "4", sys.executable, "-m", "tfcore.train",
                           "--resume", path, "--pp", "2", "--dp", "2", "--tp", "1"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("checkpoint:") == 1                  # rank 0 reports, once
    log = [line for line in (out / "log.jsonl").read_text().splitlines() if '"loss"' in line]
    import json

    losses = [json.loads(line)["loss"] for line in log]
    assert len(losses) == 4
    assert _rel(losses, one.history["loss"]) < 1e-12
    meta, arrays = T.read_checkpoint(out / "checkpoint.npz")
    assert meta["step"] == 4 and meta["config"]["pp"] == 2
    assert _rel(arrays["params"], np.asarray(one.params.data)) < 1e-12


def test_a_rank_killed_while_saving_leaves_the_last_checkpoint_to_resume(text, tmp_path):
    """mpiexec -n 2 ... --pp 2 saves after every step; at the second save rank 0 (the
    writer) is killed with SIGKILL once its temporary file is whole and before the rename
    (the test-only pause T.PAUSE_IN_SAVE holds it there: a kill timed by the clock could
    land anywhere). The job dies; the checkpoint of step 1 is whole, loads, and the run
    resumed from it equals the uninterrupted one; its next save removes the dead one's
    temporary file. Every wait is bounded: the pause (60 s), the marker (120 s), the job."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    mpiexec = _mpiexec()
    out, marker = tmp_path / "run", tmp_path / "saving.json"
    argv = ["--text", text, "--seq-len", "8", "--batch-size", "4", "--d-model", "16",
            "--n-layers", "2", "--steps", "3", "--warmup-steps", "1", "--dtype", "float64",
            "--no-progress", "--checkpoint-interval", "1", "--dropout", "0.1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               **{T.PAUSE_IN_SAVE: str(marker)})
    job = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "tfcore.train", *argv,
                            "--out-dir", str(out), "--pp", "2"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True)          # its own group: killed whole
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert job.poll() is None, job.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no save reached the pause in 120 s"
            time.sleep(0.05)
        saving = json.loads(marker.read_text())
        os.kill(saving["pid"], signal.SIGKILL)                 # rank 0, inside the save
        job.communicate(timeout=60)
        assert job.returncode != 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert os.path.exists(saving["tmp"])            # the killed save's file, never renamed
    meta, _ = T.read_checkpoint(out / "checkpoint.npz")
    assert meta["step"] == 1
    assert T.main(["--resume", str(out / "checkpoint.npz"), "--simulate", "2"]) == 0
    assert not os.path.exists(saving["tmp"])
    straight = tmp_path / "straight"
    assert T.main([*argv, "--out-dir", str(straight)]) == 0
    ours = T.read_checkpoint(out / "checkpoint.npz")
    theirs = T.read_checkpoint(straight / "checkpoint.npz")
    assert ours[0]["step"] == 3
    assert _rel(ours[1]["params"], theirs[1]["params"]) < 1e-12
    assert _rel(ours[0]["history"]["loss"], theirs[0]["history"]["loss"]) < 1e-12


@pytest.mark.parametrize("layout", [
    [],
    ["--simulate", "4", "--dp", "2", "--tp", "2", "--sp"],
    ["--simulate", "4", "--pp", "2", "--dp", "2", "--micro-batches", "2", "--zero", "1"],
    ["--simulate", "4", "--zero", "3", "--dp", "4"],
    ["--simulate", "4", "--cp", "2", "--tp", "2"],
    ["--simulate", "4", "--pp", "2", "--cp", "2", "--micro-batches", "2"],
    ["--simulate", "2", "--dp", "2", "--micro-batches", "2", "--dtype", "float64"],
], ids=["one device", "dp2 x tp2 sp", "pp2 x dp2 zero1", "zero3 dp4", "cp2 x tp2",
        "pp2 x cp2", "dp2 K=2 float64"])
def test_the_command_line_prints_the_plan_and_measures_it(text, tmp_path, capsys, layout):
    """Before step 1 rank 0 prints plan()'s state held on the fullest rank and bytes sent
    by the busiest in a step; after the run, the same quantities as the ranks measured
    them (their flat buffers, or ZeRO-3's ledger; the bytes their steps sent): equal, in
    float32 (the model's messages 4 bytes a number, the step's bookkeeping 8) and float64,
    with the trainer's clipping."""
    argv = ["--text", text, "--seq-len", "8", "--batch-size", "4", "--d-model", "16",
            "--n-layers", "2", "--steps", "2", "--warmup-steps", "0",
            "--no-progress", "--out-dir", str(tmp_path / "run"), *layout]
    assert T.main(argv) == 0
    err = capsys.readouterr().err
    planned = [line[len("plan: "):] for line in err.splitlines() if line.startswith("plan: ")]
    measured = [line[len("measured: "):] for line in err.splitlines()
                if line.startswith("measured: ")]
    assert len(planned) == len(measured) == 1, err
    assert measured[0].startswith(planned[0] + "; "), (planned, measured)
    held = int(planned[0].split(" bytes")[0].replace(",", ""))
    assert held > 0
