"""`python -m tfcore.parallel` in process (--simulate): every bad argument ends with one line
`error: ...` naming it and status 2, before any training; --check fails (status 1) when the
parallel run differs from one device."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore.parallel import __main__ as cli
from tfcore.parallel import runner

RUN = ["--simulate", "--tp", "2", "--steps", "2", "--quiet-times"]


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
    (["--algorithm", "native"], "--algorithm native is MPI's own; simulate ring or naive"),
    (["--algorithm", "tree"], "argument --algorithm: invalid choice: 'tree'"),
    (["--tp", "1.5"], "argument --tp: invalid int value: '1.5'"),
    (["--config", "huge"], "argument --config: invalid choice: 'huge'"),
    (["--save", "/nonexistent-folder/x.npz"], "--save: the folder /nonexistent-folder does "
                                              "not exist or is not writable"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_are_one_line_naming_the_argument(args, message, capsys, monkeypatch):
    def no_training(*a, **k):
        raise AssertionError("a bad argument must be refused before any training")

    monkeypatch.setattr(runner, "train_parallel", no_training)
    assert cli.main(["--simulate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: " + message)
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


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
    true_single = runner.train_single

    def perturbed(*args, **kwargs):
        ref = true_single(*args, **kwargs)
        ref["params"] = ref["params"] * (1 + 1e-9)
        return ref

    monkeypatch.setattr(runner, "train_single", perturbed)
    assert cli.main([*RUN, "--check"]) == 1
    err = capsys.readouterr().err
    assert "error: --check: the parallel run differs from one device" in err
    assert "parameters 1.0e-09" in err
    assert cli.main([*RUN, "--check", "--check-tol", "1e-8"]) == 0


def test_check_fails_on_a_planted_loss_difference(capsys, monkeypatch):
    true_parallel = runner.train_parallel

    def one_rank_off(world, *args, **kwargs):
        out = true_parallel(world, *args, **kwargs)
        if world.rank == 0:
            out["losses"] = [loss + 1e-6 for loss in out["losses"]]
        return out

    monkeypatch.setattr(runner, "train_parallel", one_rank_off)
    assert cli.main([*RUN, "--check"]) == 1
    assert "error: --check" in capsys.readouterr().err


def test_a_failing_rank_is_reported_with_status_1(capsys, monkeypatch):
    true_parallel = runner.train_parallel

    def failing(world, *args, **kwargs):
        if world.rank == 1:
            raise RuntimeError("planted failure")
        return true_parallel(world, *args, **kwargs)

    monkeypatch.setattr(runner, "train_parallel", failing)
    assert cli.main(RUN) == 1
    assert capsys.readouterr().err.endswith("error: rank 1: planted failure\n")


def test_compare_measures_relative_differences():
    ref = dict(losses=[2.0, 4.0], params=np.array([1.0, -2.0]))
    out = dict(losses=[2.0, 4.4], params=np.array([1.0, -2.2]))
    d_loss, d_params = cli.compare(out, ref)
    assert abs(d_loss - 0.1) < 1e-15 and abs(d_params - 0.1) < 1e-15
