"""The command lines: every bad argument of tfcore.train, tfcore.sample and tfcore.plot ends
in one line 'error: argument --flag ...' with exit status 2 and writes nothing; training on
your own text, the default output folder, the log, the plot, streamed samples."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore import plot as plot_mod
from tfcore import sample as sample_mod
from tfcore import train as train_mod
from tfcore.train import Trainer, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
TINY_FLAGS = ["--d-model", "8", "--n-layers", "1", "--n-heads", "2", "--batch-size", "2",
              "--seq-len", "8", "--eval-batches", "1", "--no-progress", "--dtype", "float64"]
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind. " * 8


def run_main(main, argv, capsys):
    """(exit status, stdout, stderr) of main(argv) in this process."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A text file, a text checkpoint and an autoencoder checkpoint, made once."""
    root = tmp_path_factory.mktemp("cli")
    text = root / "poem.txt"
    text.write_text(TEXT, encoding="utf-8")
    text_cfg = TrainConfig(task="text", text=str(text), seq_len=8, d_model=8, n_layers=1,
                           n_heads=2, steps=2, batch_size=2, warmup_steps=0,
                           dtype="float64", eval_batches=1, progress=False)
    text_ckpt = Trainer(text_cfg).run().save(root / "text" / "checkpoint.npz")
    ae_cfg = TrainConfig(task="autoencoder", seq_len=4, d_model=8, n_layers=1, n_heads=2,
                         steps=1, batch_size=2, warmup_steps=0, dtype="float64",
                         progress=False)
    ae_ckpt = Trainer(ae_cfg).run().save(root / "ae" / "checkpoint.npz")
    latin1 = root / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait ".encode("latin-1") * 20)
    empty = root / "empty.txt"
    empty.write_bytes(b"")
    garbage = root / "garbage.npz"
    garbage.write_bytes(b"not a checkpoint at all")
    return dict(root=root, text=text, text_ckpt=text_ckpt, ae_ckpt=ae_ckpt, latin1=latin1,
                empty=empty, garbage=garbage)


# (arguments, the flag the one-line error must name); {name} is filled from `files`.
TRAIN_ERRORS = [
    (["--steps", "-1"], "--steps"), (["--steps", "0"], "--steps"),
    (["--steps", "x"], "--steps"), (["--batch-size", "0"], "--batch-size"),
    (["--lr", "nan"], "--lr"), (["--lr", "-1"], "--lr"), (["--lr", "inf"], "--lr"),
    (["--min-lr", "1"], "--min-lr"), (["--dtype", "float16"], "--dtype"),
    (["--grad-clip", "nan"], "--grad-clip"), (["--grad-clip", "-1"], "--grad-clip"),
    (["--seed", "-1"], "--seed"), (["--weight-decay", "inf"], "--weight-decay"),
    (["--beta1", "1"], "--beta1"), (["--beta2", "-0.1"], "--beta2"), (["--eps", "0"], "--eps"),
    (["--dropout", "1"], "--dropout"), (["--val-fraction", "0"], "--val-fraction"),
    (["--d-model", "0"], "--d-model"), (["--n-heads", "3"], "--n-heads"),
    (["--n-layers", "0"], "--n-layers"), (["--d-ff", "0"], "--d-ff"),
    (["--seq-len", "0"], "--seq-len"), (["--seq-len", "100000"], "--seq-len"),
    (["--eval-interval", "0"], "--eval-interval"), (["--eval-batches", "0"], "--eval-batches"),
    (["--checkpoint-interval", "-1"], "--checkpoint-interval"),
    (["--warmup-steps", "300"], "--warmup-steps"),
    (["--position", "rotary", "--d-model", "6", "--n-heads", "2"], "--n-heads"),
    (["--task", "reverse", "--seq-len", "10"], "--seq-len"),
    (["--task", "reverse", "--n-digits", "1"], "--n-digits"),
    (["--task", "autoencoder", "--norm", "rmsnorm"], "--norm"),
    (["--task", "autoencoder", "--mlp", "relu"], "--mlp"),
    (["--task", "autoencoder", "--position", "rotary"], "--position"),
    (["--task", "shakespeare", "--n-digits", "5"], "--n-digits"),
    (["--task", "shakespeare", "--standardize"], "--standardize"),
    (["--task", "text"], "--text"), (["--text", "{root}/missing.txt"], "--text"),
    (["--text", "{root}"], "--text"), (["--text", "{latin1}"], "--text"),
    (["--text", "{empty}"], "--text"), (["--text", "{text}", "--task", "reverse"], "--task"),
    (["--out-dir", "{text}"], "--out-dir"), (["--out-dir", "{text}/sub"], "--out-dir"),
    (["--resume", "{root}"], "--resume"), (["--resume", "{root}/missing.npz"], "--resume"),
    (["--resume", "{garbage}"], "--resume"), (["--resume", "{text_ckpt}", "--lr", "0.5"],
                                              "--resume"),
    (["--resume", "{text_ckpt}", "--preset", "reverse"], "--preset"),
    (["--backend", "bogus"], "--backend"), (["--preset", "bogus"], "--preset"),
]


@pytest.mark.parametrize("argv, flag", TRAIN_ERRORS,
                         ids=[" ".join(a) for a, _ in TRAIN_ERRORS])
def test_every_bad_train_argument_is_one_line_naming_it(files, tmp_path, monkeypatch, capsys,
                                                        argv, flag):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(**files) for a in argv]
    status, out, err = run_main(train_mod.main, argv, capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and flag in lines[0], lines[0]
    assert out == "" and list(tmp_path.iterdir()) == []          # nothing written


SAMPLE_ERRORS = [
    (["--tokens", "-1"], "--tokens"), (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"), (["--top-k", "0"], "--top-k"),
    (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
    (["--seed", "-1"], "--seed"), (["--num-samples", "0"], "--num-samples"),
    (["--prompt", ""], "--prompt"), (["--prompt", "caf\u00e9"], "--prompt"),
    (["--tokens", "many"], "--tokens"),
    (["--prompt", "To", "--temperature", "1e-320"], "--temperature"),
]


@pytest.mark.parametrize("argv, flag", SAMPLE_ERRORS,
                         ids=[" ".join(a) for a, _ in SAMPLE_ERRORS])
def test_every_bad_sample_argument_is_one_line_naming_it(files, capsys, argv, flag):
    status, out, err = run_main(sample_mod.main, ["--checkpoint", str(files["text_ckpt"]),
                                                  *argv], capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert flag in lines[0] and out.strip() in ("", "To")    # an overflow stops at the prompt


@pytest.mark.parametrize("which", ["root", "garbage", "ae_ckpt", "missing"])
def test_a_bad_checkpoint_for_sample_names_checkpoint(files, capsys, which):
    path = files["root"] / "missing.npz" if which == "missing" else files[which]
    status, out, err = run_main(sample_mod.main, ["--checkpoint", str(path)], capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "--checkpoint" in lines[0], err
    if which == "ae_ckpt":
        assert "autoencoder" in lines[0] and "d_input" not in lines[0]


def test_errors_are_one_line_in_a_fresh_process(files, tmp_path):
    """Through python -m: the exit status, one stderr line, no traceback, nothing written."""
    for module, argv, flag in [
            ("tfcore.train", ["--grad-clip", "nan"], "--grad-clip"),
            ("tfcore.sample", ["--checkpoint", str(files["ae_ckpt"])], "--checkpoint")]:
        proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: ") and flag in lines[0]
        assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_own_text_default_folder_log_sample_and_plot(files, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status, out, err = run_main(train_mod.main, ["--text", str(files["text"]), "--steps", "6",
                                                 "--eval-interval", "3", *TINY_FLAGS], capsys)
    assert status == 0, err
    # --steps 6 is below the default warm-up of 20: a warm-up that fits is chosen, and said.
    assert "warm-up of 20 steps does not fit" in err and "--warmup-steps" in err
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("text-")
    assert f"checkpoint: {Path('runs') / run_dir.name / 'checkpoint.npz'}" in out
    records = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7)) and len(evals) == 2
    assert set(steps[0]) == {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
    meta, _ = train_mod.read_checkpoint(run_dir / "checkpoint.npz")
    assert meta["tokenizer"] == "".join(sorted(set(TEXT)))

    status, out, err = run_main(sample_mod.main, [
        "--checkpoint", str(run_dir / "checkpoint.npz"), "--prompt", "To be", "--tokens", "12",
        "--num-samples", "2", "--seed", "3"], capsys)
    assert status == 0, err
    first, second = out.rstrip("\n").split("\n" + sample_mod.SEPARATOR + "\n")
    assert first.startswith("To be") and len(first) == 5 + 12
    assert set(first) <= set(TEXT) and second != first
    assert first == sample_mod.sample(run_dir / "checkpoint.npz", "To be", 12, seed=3)

    status, out, err = run_main(plot_mod.main, [str(run_dir)], capsys)
    assert status == 0, err
    png = run_dir / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.strip() == str(png)


def test_resuming_a_finished_run_reports_no_checkpoint(files, tmp_path, capsys):
    before = files["text_ckpt"].read_bytes()
    status, out, err = run_main(train_mod.main, ["--resume", str(files["text_ckpt"])], capsys)
    assert status == 0 and "checkpoint:" not in out and "nothing to train" in err
    assert files["text_ckpt"].read_bytes() == before


def test_evaluations_stay_visible_with_the_progress_bar(files, tmp_path, capsys):
    cfg = TrainConfig(task="text", text=str(files["text"]), seq_len=8, d_model=8, n_layers=1,
                      n_heads=2, steps=4, batch_size=2, warmup_steps=0, dtype="float64",
                      eval_interval=2, eval_batches=1, progress=True)
    Trainer(cfg).run()
    err = capsys.readouterr().err
    assert "step 2: train loss" in err and "step 4: train loss" in err and "val loss" in err


def test_streamed_tokens_are_generates_tokens(files):
    model, tokenizer = sample_mod.load_model(files["text_ckpt"])
    ids = sample_mod.encode_prompt(tokenizer, "not to")
    for temperature, top_k in ((0.0, None), (0.9, 5)):
        streamed = list(sample_mod.stream(model, ids, 12, temperature, top_k, None, seed=4))
        whole = np.asarray(model.generate(ids[None], 12, temperature, top_k, None, seed=4))
        assert streamed == whole[0, len(ids):].tolist()
    with pytest.raises(ValueError, match="integer"):
        list(sample_mod.stream(model, ids.astype(float), 2))


def test_truthy_strings_in_a_model_config_are_refused(files, tmp_path):
    meta, arrays = train_mod.read_checkpoint(files["text_ckpt"])
    meta["model_config"]["tied_head"] = "no"
    path = tmp_path / "c.npz"
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    with pytest.raises(train_mod.CheckpointError, match="tied_head must be true or false"):
        sample_mod.load_model(path)


@pytest.mark.parametrize("argv, flag", [([], "RUN_DIR"), (["{root}"], "RUN_DIR"),
                                        (["{root}", "--smooth", "0"], "--smooth")])
def test_plot_errors_are_one_line(files, capsys, argv, flag):
    status, out, err = run_main(plot_mod.main, [a.format(**files) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert flag in lines[0] or "RUN_DIR" in lines[0]


def test_numba_cache_falls_back_when_nothing_is_writable(tmp_path):
    """A read-only install with an unwritable home: the kernels' cache moves to a temporary
    folder, with a warning that says how to choose."""
    script = (
        "import os, warnings\n"
        "real = os.access\n"
        "os.access = lambda p, mode, **k: False if mode & os.W_OK else real(p, mode, **k)\n"
        "from tfcore import kernels\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    kernels._writable_numba_cache()\n"
        "folder = os.environ['NUMBA_CACHE_DIR']\n"
        "assert os.path.isdir(folder) and real(folder, os.W_OK), folder\n"
        "(w,) = caught\n"
        "assert 'NUMBA_CACHE_DIR' in str(w.message) and 'TFCORE_KERNELS=0' in str(w.message)\n"
    )
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
