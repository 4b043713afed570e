"""Ulysses sequence parallelism as a layout of the one decoder (Layout(cp=N, ulysses=True)):
each rank holds a contiguous chunk of every sequence, and attention runs by heads after
all-to-alls (tfcore.parallel.ulysses) instead of as a ring. Every case that
Layout.validate accepts trains 3 AdamW steps equal to one device in float64 (losses, every
gradient, the parameters after each update, relative 1e-12), and the bytes each rank sent
in a step, counted as they moved, equal plan()'s (volume.layout_traffic). The cases are
generated from the lists below and the validation; the count is observed."""
from __future__ import annotations

import dataclasses

import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import Layout, LayoutError, SimulatedGroup, plan
from tfcore.parallel.harness import train_layout

from mpi_tools import needs_mpi
from test_layout_matrix import _rel, one_device_references

STEPS, BATCH, SEQ = 3, 4, 8
TOL = 1e-12

LAYOUTS = {
    "ulysses cp2": Layout(cp=2, ulysses=True),
    "ulysses cp4": Layout(cp=4, ulysses=True),
    "tp2 x ulysses cp2": Layout(tp=2, cp=2, ulysses=True),
    "tp2 x ulysses cp2, sp": Layout(tp=2, cp=2, sp=True, ulysses=True),
    "dp2 x ulysses cp2, zero1": Layout(dp=2, cp=2, zero=1, ulysses=True),
    "dp2 x ulysses cp2, zero3": Layout(dp=2, cp=2, zero=3, ulysses=True),
    "pp2 x ulysses cp2": Layout(pp=2, cp=2, micro_batches=2, ulysses=True),
    "dp2 x ulysses cp2, K=2, clip": Layout(dp=2, cp=2, micro_batches=2, clip=0.05,
                                           ulysses=True),
}

BASE = dict(vocab_size=31, max_seq_len=16, d_model=16, n_layers=2, n_heads=4, d_ff=32,
            dtype="float64")
FEATURES = {
    "gpt": DecoderConfig(**BASE),
    "llama": DecoderConfig.llama(vocab_size=29, max_seq_len=16, d_model=16, n_layers=2,
                                 n_heads=4, d_ff=24, dtype="float64"),
    "tiled": DecoderConfig(**BASE, attention="tiled", attention_block_size=3),
    "gqa": DecoderConfig(**BASE, n_kv_heads=2),          # cp4: repeated to be sent
    "mqa": DecoderConfig(**BASE, n_kv_heads=1),
    "recompute full": DecoderConfig(**BASE, recompute="full"),
}

CASES = [(l, f) for l, layout in LAYOUTS.items() for f, config in FEATURES.items()
         if layout.refusal(config) is None]


def test_the_matrix_covers_every_layout_and_feature():
    assert len(CASES) == len(LAYOUTS) * len(FEATURES) >= 40


_reference = one_device_references(FEATURES, STEPS, BATCH, SEQ)


@pytest.mark.parametrize("lname,fname", CASES, ids=[f"{l} | {f}" for l, f in CASES])
def test_ulysses_trains_as_one_device_and_sends_its_formula(lname, fname):
    layout, config = LAYOUTS[lname], FEATURES[fname]
    ref = _reference(fname, layout.clip)
    group = SimulatedGroup(layout.world_size)
    results = group.run(train_layout, config, layout, STEPS, BATCH, SEQ)
    for out in results:
        assert _rel(out["losses"], ref["losses"]) < TOL
        assert _rel(out["params"], ref["params"]) < TOL
        if out.get("grads") is not None:
            assert _rel(out["grads"], ref["grads"]) < TOL
    one_step = SimulatedGroup(layout.world_size)
    one_step.run(train_layout, config, layout, 1, BATCH, SEQ, gather=False)
    assert [t.sent for t in one_step.traffic] == plan(config, layout, batch=BATCH,
                                                      seq=SEQ).sent


def _ops(world, config, layout):
    train_layout(world, config, layout, 1, BATCH, SEQ, gather=False)
    return sorted({(c.group.split("/")[0], c.op) for c in world.traffic.calls})


def test_ulysses_runs_all_to_alls_not_the_ring():
    config = FEATURES["gpt"]
    ulysses = SimulatedGroup(2).run(_ops, config, LAYOUTS["ulysses cp2"])[0]
    ring = SimulatedGroup(2).run(_ops, config, Layout(cp=2))[0]
    assert any(op == "all_to_all" for _, op in ulysses)
    assert not any(op == "all_to_all" for _, op in ring)
    assert plan(config, LAYOUTS["ulysses cp2"], batch=BATCH, seq=SEQ).traffic.get(
        "cp all_to_all", 0) > 0


@pytest.mark.parametrize("layout,config,message", [
    (Layout(ulysses=True), FEATURES["gpt"], "Ulysses without context parallelism"),
    (Layout(cp=2, ulysses=True), dataclasses.replace(FEATURES["gpt"], dropout=0.1),
     "Ulysses attention with dropout"),
])
def test_the_refused_combinations_name_themselves(layout, config, message):
    with pytest.raises(LayoutError, match=message):
        layout.validate(config)


@pytest.mark.parametrize("layout,seq,message", [
    (Layout(cp=4, tp=2, ulysses=True), 8, "n_heads / tp = 4 / 2 heads over cp = 4"),
    (Layout(cp=3, ulysses=True), 8, "heads over cp = 3"),
    (Layout(cp=2, ulysses=True), 7, "sequence length \\(7\\) must be divisible"),
])
def test_sizes_that_do_not_split_are_refused_before_any_work(layout, seq, message):
    with pytest.raises(ValueError, match=message):
        layout.validate(FEATURES["gpt"], seq=seq)


def test_the_command_line_trains_ulysses_equal_to_one_device(capsys):
    from tfcore.parallel import __main__ as cli

    assert cli.main(["--simulate", "--cp", "2", "--tp", "2", "--ulysses", "--check",
                     "--quiet-times"]) == 0
    text = capsys.readouterr().out
    assert "Ulysses attention" in text and "one device: max relative difference" in text


MPI_CASES = ["ulysses cp4 | gqa", "tp2 x ulysses cp2 | llama", "tp2 x ulysses cp2, sp | tiled",
             "dp2 x ulysses cp2, zero1 | mqa", "pp2 x ulysses cp2 | recompute full",
             "dp2 x ulysses cp2, K=2, clip | gpt"]


@needs_mpi
def test_ulysses_layouts_under_mpi_equal_one_device(tmp_path):
    """One `mpiexec -n 4` trains MPI_CASES on four processes (the all-to-alls over real
    messages), each equal to one device in float64 at 1e-12."""
    from mpi_layouts import check_under_mpi     # which imports this module: not at its top

    assert all(LAYOUTS[c.split(" | ")[0]].world_size == 4 for c in MPI_CASES)
    assert all(tuple(c.split(" | ")) in CASES for c in MPI_CASES)
    check_under_mpi(tmp_path, 4, MPI_CASES, timeout=300)


def test_the_ulysses_picture_is_the_all_to_all():
    """viz.parallel.ulysses_layout_data runs the all-to-all: rank r starts with positions
    r S/N .. of every head and ends with heads r H/N .. of every position, having sent the
    (N - 1)/N of its entries that belong elsewhere."""
    from tfcore.viz.parallel import ulysses_layout_data

    n, seq, heads = 4, 16, 8
    data = ulysses_layout_data(n, seq, heads)
    for r in range(n):
        assert (data["before"][:, r * seq // n:(r + 1) * seq // n] == r).all()
        assert (data["after"][r * heads // n:(r + 1) * heads // n, :] == r).all()
    assert data["moved"] == [heads * seq // n * (n - 1) // n] * n
