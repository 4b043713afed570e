"""`python -m tfcore.train` with expert parallelism: a tiny mixture of experts (4 experts,
top-2, capacity 1 so tokens drop, both auxiliary losses, dropout, clipping) on the bundled
Shakespeare corpus, trained as DP 4 with EP 2 (threads, --simulate 4), saved, and resumed on
one device and as DP 2 with EP 2: each resumed run ends as the uninterrupted one-device run
(float64, 1e-12: losses, evaluations, clipped norms, parameters and both AdamW moments),
since a checkpoint holds one device's state. A bad expert-parallel setting is one line on
stderr and status 2, before any work."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from tfcore import train as T
from tfcore.parallel import SimulatedGroup

TOL = 1e-12
MOE = ["--n-experts", "4", "--top-k", "2", "--d-expert", "12", "--capacity-factor", "1.0",
       "--aux-loss-coef", "0.05", "--z-loss-coef", "0.01", "--dropout", "0.1"]
# --min-lr = --lr: a constant rate after the warm-up, so a run of 2 steps extends to 4
ARGV = ["--task", "shakespeare", "--seq-len", "8", "--batch-size", "8", "--d-model", "16",
        "--n-layers", "2", "--n-heads", "4", "--dtype", "float64", "--warmup-steps", "1",
        "--lr", "3e-3", "--min-lr", "3e-3", "--grad-clip", "0.5", "--eval-interval", "2",
        "--eval-batches", "2", "--no-progress", *MOE]


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _train(*argv) -> tuple[dict, dict]:
    """T.main(argv) -> the (meta, arrays) of the checkpoint it wrote in its --out-dir."""
    assert T.main(list(argv)) == 0
    out = argv[list(argv).index("--out-dir") + 1]
    return T.read_checkpoint(os.path.join(out, T.CHECKPOINT_NAME))


def _assert_one_device(ours, reference):
    (meta, arrays), (ref_meta, ref_arrays) = ours, reference
    assert meta["step"] == ref_meta["step"]
    history, ref = meta["history"], ref_meta["history"]
    assert history["eval_step"] == ref["eval_step"]
    for key in ("loss", "val_loss", "grad_norm"):
        assert len(history[key]) == len(ref[key]), key
        assert _rel(history[key], ref[key]) < TOL, key
    for key in ("params", "optimizer.m", "optimizer.v"):
        assert _rel(arrays[key], ref_arrays[key]) < TOL, key


def _resume(path, out_dir, **overrides) -> tuple[dict, dict]:
    """Trainer.from_checkpoint(path, **overrides) run to its end on its layout's ranks
    (threads), saved -> the (meta, arrays) of rank 0's checkpoint."""
    def body(world):
        trainer = T.Trainer.from_checkpoint(path, world, out_dir=str(out_dir), **overrides)
        trainer.run()
        return str(trainer.save(out_dir / T.CHECKPOINT_NAME))

    ranks = overrides.get("dp", 1) * overrides.get("tp", 1)
    return T.read_checkpoint(SimulatedGroup(ranks).run(body)[0])


def test_an_expert_parallel_checkpoint_resumes_on_one_device_and_at_dp2_ep2(tmp_path,
                                                                            capsys):
    """python -m tfcore.train ... --simulate 4 --dp 4 --ep 2 --steps 2, then the run
    extended to 4 steps from its checkpoint on one device and at DP 2 x EP 2 equals the 4
    uninterrupted steps of one device. (The resumes go through Trainer.from_checkpoint:
    the command line's --resume drops --steps, test_the_command_line_extends_... below.)"""
    reference = _train(*ARGV, "--steps", "4", "--out-dir", str(tmp_path / "one"))
    first = _train(*ARGV, "--steps", "2", "--out-dir", str(tmp_path / "ep"),
                   "--simulate", "4", "--dp", "4", "--ep", "2")
    assert first[0]["step"] == 2 and first[0]["config"]["ep"] == 2
    assert "layout dp=4 x tp=1 (ep=2)" in capsys.readouterr().err
    path = str(tmp_path / "ep" / T.CHECKPOINT_NAME)
    resumed = {
        "one device": _resume(path, tmp_path / "a", steps=4, dp=1, ep=1),
        "dp2, ep2": _resume(path, tmp_path / "b", steps=4, dp=2, ep=2),
    }
    for ours in resumed.values():
        _assert_one_device(ours, reference)
    assert resumed["one device"][0]["config"]["ep"] == 1
    assert resumed["dp2, ep2"][0]["config"]["dp"] == 2


def test_the_command_line_extends_an_expert_parallel_run_on_resume(tmp_path, capsys):
    reference = _train(*ARGV, "--steps", "4", "--out-dir", str(tmp_path / "one"))
    _train(*ARGV, "--steps", "2", "--out-dir", str(tmp_path / "ep"), "--simulate", "4",
           "--dp", "4", "--ep", "2")
    path = str(tmp_path / "ep" / T.CHECKPOINT_NAME)
    for name, layout in (("a", ["--dp", "1", "--ep", "1"]),
                         ("b", ["--simulate", "2", "--dp", "2", "--ep", "2"])):
        ours = _train("--resume", path, "--steps", "4", *layout,
                      "--out-dir", str(tmp_path / name))
        _assert_one_device(ours, reference)


def test_a_cosine_run_saved_mid_way_at_dp4_ep2_resumes_as_one_device(tmp_path):
    """The Trainer's own save in the middle of a 4-step cosine schedule (which the command
    line cannot stop at): resumed on one device and at DP 2 x EP 2 (threads)."""
    config = T.TrainConfig(task="shakespeare", seq_len=8, batch_size=8, d_model=16,
                           n_layers=2, n_heads=4, dtype="float64", steps=4, warmup_steps=1,
                           grad_clip=0.5, eval_interval=2, eval_batches=2, progress=False,
                           n_experts=4, top_k=2, d_expert=12, capacity_factor=1.0,
                           aux_loss_coef=0.05, z_loss_coef=0.01, dropout=0.1)
    one = T.Trainer(config).run()
    stats = one.model.moe_stats[0]         # not vacuous: the last batch drops assignments
    assert int(np.sum(stats["kept_load"])) < int(np.sum(stats["load"]))

    def leg(layout, until, resume=None):
        cfg = dataclasses.replace(config, out_dir=str(tmp_path / f"at-{until}"), **layout)

        def body(world):
            trainer = (T.Trainer(cfg, world) if resume is None
                       else T.Trainer.from_checkpoint(resume, world, out_dir=cfg.out_dir,
                                                      **layout))
            trainer.run(until)
            return trainer.history, str(trainer.save(f"{cfg.out_dir}/ckpt.npz"))

        return SimulatedGroup(cfg.layout().world_size).run(body)[0]

    _, path = leg(dict(dp=4, ep=2), 2)
    history, _ = leg(dict(dp=2, ep=2), 4, path)
    rest = T.Trainer.from_checkpoint(path, dp=1, ep=1).run()
    for ours in (history, rest.history):
        for key in ("loss", "val_loss", "grad_norm"):
            assert len(ours[key]) == (2 if key == "val_loss" else 4), key
            assert _rel(ours[key], one.history[key]) < TOL, key
    assert _rel(np.asarray(rest.params.data), np.asarray(one.params.data)) < TOL


@pytest.mark.parametrize("extra,message", [
    (["--simulate", "2", "--dp", "2", "--ep", "3"],
     "argument --ep the expert-parallel degree ep = 3 must divide the data-parallel degree"),
    (["--dp", "2", "--ep", "3"],
     "argument --ep the expert-parallel degree ep = 3 must divide the data-parallel degree"),
    (["--simulate", "2", "--dp", "2", "--ep", "2", "--n-experts", "3"],
     "argument --n-experts the number of experts N_E = 3 must be divisible by the expert"),
    (["--simulate", "2", "--dp", "2", "--ep", "0"], "--ep must be an integer >= 1, got 0"),
], ids=["ep3 over dp2", "ep3 over dp2, no --simulate", "3 experts over ep2", "ep0"])
def test_a_bad_expert_layout_is_one_line_and_status_2(tmp_path, extra, message):
    """In a process of its own, as a user runs it: no traceback, nothing written."""
    bad = tmp_path / "bad"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "tfcore.train", *ARGV, "--steps", "2",
                           "--out-dir", str(bad), *extra], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: argument --"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert message in done.stderr, done.stderr
    assert done.stdout == "" and not bad.exists()
