"""`python -m tfcore.parallel` in process (--simulate): every bad argument, and every
combination of parallelisms the library does not train, ends with one line `error: ...`
naming it and status 2, before any training; every parallelism (TP, SP, DP, ZeRO-1/2/3,
the pipeline's three schedules, context parallelism) passes --check against one device;
--check fails (status 1) when the parallel run differs from one device."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore.parallel import __main__ as cli
from tfcore.parallel import harness

RUN = ["--simulate", "--tp", "2", "--steps", "2", "--quiet-times"]


def _assert_refused_in_one_line(args, message, capsys, monkeypatch):
    """Exit status 2, nothing on stdout, one line on stderr starting with the message, and
    no training started."""
    _forbid_training(monkeypatch)
    assert cli.main(["--simulate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: " + message)
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


@pytest.mark.parametrize("args,message", [
    (["--tp", "0"], "--tp must be a positive integer, got 0"),
    (["--tp", "-2"], "--tp must be a positive integer, got -2"),
    (["--dp", "0"], "--dp must be a positive integer, got 0"),
    (["--batch", "0"], "--batch must be a positive integer, got 0"),
    (["--steps", "-1"], "--steps must be a positive integer, got -1"),
    (["--seq", "0"], "--seq must be a positive integer, got 0"),
    (["--seq", "17"], "--seq 17 exceeds the context of --config tiny (16 positions)"),
    (["--seed", "-1"], "--seed must be a non-negative integer, got -1"),
    (["--check-tol", "nan"], "--check-tol must be a number >= 0, got nan"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
    (["--dp", "3", "--batch", "4"], "--batch 4 must be divisible by the data-parallel degree "
                                    "dp=3"),
    (["--algorithm", "native"], "--algorithm native --simulate: native collectives in a "
                                "simulation (algorithm='native', transport='simulated'): "
                                "native is MPI's own; simulate ring or naive"),
    (["--algorithm", "tree"], "argument --algorithm: invalid choice: 'tree'"),
    (["--tp", "1.5"], "argument --tp: invalid int value: '1.5'"),
    (["--config", "huge"], "argument --config: invalid choice: 'huge'"),
    (["--save", "/nonexistent-folder/x.npz"], "--save: the folder /nonexistent-folder does "
                                              "not exist or is not writable"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--tp", "3", "--batch", "3", "--dp", "1"], "--tp 3: n_heads (4) must be divisible by "
                                                 "the tensor-parallel degree (3)"),
    (["--zero", "4"], "argument --zero: invalid choice: 4 (choose from 0, 1, 2, 3)"),
    (["--dropout", "1"], "--dropout must be a probability in [0, 1), got 1.0"),
    (["--pp", "0"], "--pp must be a positive integer, got 0"),
    (["--layers", "0"], "--layers must be a positive integer, got 0"),
    (["--cp", "-1"], "--cp must be a positive integer, got -1"),
    (["--pp", "2", "--micro-batches", "0"],
     "--micro-batches must be a positive integer, got 0"),
    (["--pp", "2", "--schedule", "zigzag"], "argument --schedule: invalid choice: 'zigzag'"),
])
def test_bad_arguments_are_one_line_naming_the_argument(args, message, capsys, monkeypatch):
    _assert_refused_in_one_line(args, message, capsys, monkeypatch)


def _forbid_training(monkeypatch):
    def no_training(*a, **k):
        raise AssertionError("a bad argument must be refused before any training")

    for name in ("train_parallel", "train_sharded", "train_pipeline",
                 "train_context_parallel", "train_layout"):
        monkeypatch.setattr(harness, name, no_training)


@pytest.mark.parametrize("args,message", [
    (["--cp", "2", "--dropout", "0.1"], "--cp 2 --dropout 0.1 --config tiny: context "
                                        "parallelism with dropout on dense attention (cp=2, "
                                        "dropout=0.1, attention='dense')"),
    (["--pp", "2", "--zero", "2"], "--pp 2 --zero 2: ZeRO-2/3 with pipeline parallelism "
                                   "(pp=2, zero=2): a stage keeps its parameters and "
                                   "gradients for all its micro-batches; use ZeRO 0 or 1"),
    (["--pp", "2", "--zero", "3"], "--pp 2 --zero 3: ZeRO-2/3 with pipeline parallelism"),
    (["--schedule", "gpipe"], "--schedule gpipe: pipeline schedule without pipeline "
                              "parallelism (schedule='gpipe', pp=None): the schedule orders "
                              "a pipeline's micro-batches; give pp with it"),
    (["--virtual", "2"], "--virtual 2: virtual stages without pipeline parallelism"),
    (["--pp", "2", "--bucket-bytes", "64"], "--pp 2 --bucket-bytes 64: pipeline with "
                                            "gradient buckets"),
    (["--pp", "2", "--virtual", "2", "--schedule", "1f1b"],
     "--pp 2 --virtual 2 --schedule 1f1b: virtual stages with a one-chunk schedule"),
    (["--pp", "2", "--virtual", "2"],          # the interleaved schedule by default
     "--pp 2 --tp 1 --micro-batches 2: n_layers (2) must be divisible by pp x n_virtual"),
    (["--pp", "3"], "--pp 3 --tp 1 --micro-batches 3: n_layers (2) must be divisible by pp x "
                    "n_virtual = 3 x 1 = 3"),
    (["--pp", "2", "--micro-batches", "3"],
     "--pp 2 --tp 1 --micro-batches 3: the global batch (4) must be divisible by dp x "
     "n_microbatches"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual", "2"],
     "--pp 2 --tp 1 --micro-batches 2: n_layers (2) must be divisible by pp x n_virtual"),
    (["--cp", "4", "--seq", "6"], "--cp 4 --seq 6: seq_len (6) must be at least the number "
                                  "of chunks (8 = 2 x 4 ranks)"),
])
def test_unsupported_combinations_are_refused_in_one_line(args, message, capsys,
                                                          monkeypatch):
    _assert_refused_in_one_line(args, message, capsys, monkeypatch)


@pytest.mark.parametrize("args,layout", [
    (["--dp", "2", "--zero"], "world 2 = tp 1 x dp 2, sp=False, zero=1"),
    (["--tp", "2", "--dp", "2", "--zero", "2"], "world 4 = tp 2 x dp 2, sp=False, zero=2"),
    (["--dp", "4", "--zero", "3"], "world 4 = tp 1 x dp 4, sp=False, zero=3"),
    (["--pp", "2", "--dp", "2", "--schedule", "gpipe"],
     "world 4 = dp 2 x pp 2 x tp 1, gpipe m=2 v=1"),
    (["--pp", "2", "--tp", "2", "--micro-batches", "4"],
     "world 4 = dp 1 x pp 2 x tp 2, 1f1b m=4 v=1"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual", "2", "--layers", "4"],
     "world 2 = dp 1 x pp 2 x tp 1, interleaved m=2 v=2, 4 layers, ring, config tiny"),
    (["--pp", "2", "--virtual", "2", "--layers", "4"],
     "world 2 = dp 1 x pp 2 x tp 1, interleaved m=2 v=2, 4 layers, ring, config tiny"),
    (["--cp", "2"], "world 2 = cp 2 (ring attention, balanced chunks)"),
    (["--cp", "2", "--config", "tiny-llama"], "world 2 = cp 2"),
    (["--tp", "2", "--dp", "2", "--dropout", "0.1"],
     "world 4 = tp 2 x dp 2, sp=False, zero=0, dropout 0.1"),
    (["--dp", "2", "--micro-batches", "2", "--dropout", "0.1"],
     "world 2 = tp 1 x dp 2, sp=False, zero=0, dropout 0.1"),
    (["--tp", "2", "--sp", "--micro-batches", "2"], "world 2 = tp 2 x dp 1, sp=True, zero=0"),
    (["--cp", "2", "--tp", "2"], "world 4 = dp 1 x cp 2 x tp 2 (ring attention"),
    (["--cp", "2", "--dp", "2", "--zero", "3", "--clip", "1"],
     "world 4 = dp 2 x cp 2 x tp 1 (ring attention"),
    (["--pp", "2", "--tp", "2", "--sp"], "world 4 = dp 1 x pp 2 x tp 2, 1f1b m=2 v=1"),
    (["--pp", "2", "--cp", "2"], "world 4 = dp 1 x pp 2 x tp 1 x cp 2, 1f1b m=2 v=1"),
    (["--pp", "2", "--dp", "2", "--dropout", "0.1"],
     "world 4 = dp 2 x pp 2 x tp 1, 1f1b m=2 v=1, dropout 0.1"),
    (["--tp", "2", "--sp", "--dp", "2", "--zero", "3", "--micro-batches", "2"],
     "world 4 = tp 2 x dp 2, sp=True, zero=3"),
])
def test_every_parallelism_passes_check(args, layout, capsys):
    assert cli.main(["--simulate", *args, "--steps", "2", "--check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("simulated: " + layout)
    assert "one device: max relative difference" in out
    assert out.count("step ") == 2


def test_help_lists_every_option_and_the_bare_zero(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--simulate", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in ("--zero", "--pp", "--schedule", "--virtual", "--micro-batches", "--cp",
                   "--layers", "--dropout"):
        assert option in text
    assert "a bare --zero means 1" in text


def test_check_fails_on_a_planted_pipeline_difference(capsys, monkeypatch):
    """--check compares the pipeline's result too (not only train_parallel's)."""
    true_pipeline = harness.train_pipeline

    def moved(world, *args, **kwargs):
        out = true_pipeline(world, *args, **kwargs)
        out["params"] = out["params"] * (1 + 1e-9)
        return out

    monkeypatch.setattr(harness, "train_pipeline", moved)
    assert cli.main(["--simulate", "--pp", "2", "--steps", "1", "--check"]) == 1
    assert "parameters 1.0e-09" in capsys.readouterr().err


def test_save_refuses_a_folder(tmp_path, capsys):
    assert cli.main(["--simulate", "--save", str(tmp_path)]) == 2
    assert f"--save {tmp_path} is a folder" in capsys.readouterr().err


def test_check_passes_when_the_run_equals_one_device(capsys):
    assert cli.main([*RUN, "--check"]) == 0
    out = capsys.readouterr().out
    assert "one device: max relative difference" in out


def test_check_fails_on_a_planted_difference(capsys, monkeypatch):
    """One device's parameters moved by 1e-9 relative (the parallel run cannot tell):
    --check must exit 1 and say by how much."""
    true_single = harness.train_single

    def perturbed(*args, **kwargs):
        ref = true_single(*args, **kwargs)
        ref["params"] = ref["params"] * (1 + 1e-9)
        return ref

    monkeypatch.setattr(harness, "train_single", perturbed)
    assert cli.main([*RUN, "--check"]) == 1
    err = capsys.readouterr().err
    assert "error: --check: the parallel run differs from one device" in err
    assert "parameters 1.0e-09" in err
    assert cli.main([*RUN, "--check", "--check-tol", "1e-8"]) == 0


def test_check_fails_on_a_planted_loss_difference(capsys, monkeypatch):
    true_parallel = harness.train_parallel

    def one_rank_off(world, *args, **kwargs):
        out = true_parallel(world, *args, **kwargs)
        if world.rank == 0:
            out["losses"] = [loss + 1e-6 for loss in out["losses"]]
        return out

    monkeypatch.setattr(harness, "train_parallel", one_rank_off)
    assert cli.main([*RUN, "--check"]) == 1
    assert "error: --check" in capsys.readouterr().err


def test_a_failing_rank_is_reported_with_status_1(capsys, monkeypatch):
    true_parallel = harness.train_parallel

    def failing(world, *args, **kwargs):
        if world.rank == 1:
            raise RuntimeError("planted failure")
        return true_parallel(world, *args, **kwargs)

    monkeypatch.setattr(harness, "train_parallel", failing)
    assert cli.main(RUN) == 1
    assert capsys.readouterr().err.endswith("error: rank 1: planted failure\n")


def test_compare_measures_relative_differences():
    ref = dict(losses=[2.0, 4.0], params=np.array([1.0, -2.0]))
    out = dict(losses=[2.0, 4.4], params=np.array([1.0, -2.2]))
    d_loss, d_params = cli.compare(out, ref)
    assert abs(d_loss - 0.1) < 1e-15 and abs(d_params - 0.1) < 1e-15
