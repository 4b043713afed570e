"""A mixture-of-experts decoder under layouts: data, tensor and expert parallelism.

Every (layout x MoE model) case that Layout.validate accepts trains 3 AdamW steps equal to
one device in float64 (losses, every gradient of the last step, and the parameters after
each update, relative 1e-12). The routing of a layout is one device's: capacity and drops
follow the whole batch's token order (the loads are gathered over the data-parallel
ranks), and the auxiliary losses use the whole batch's statistics. The cases are generated
from the lists below and the validation; the count is observed. MPI_CASES run the same way on
four processes under one `mpiexec -n 4` (tests/mpi_layouts.py), skipped without mpiexec.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tfcore.models.decoder import DecoderConfig, DecoderLM
from tfcore.parallel import Layout, SimulatedGroup
from tfcore.parallel.harness import make_batches, train_layout, train_single
from tfcore.parallel.layout import LayoutError

from mpi_tools import needs_mpi
from test_layout_matrix import _rel, one_device_references

STEPS, BATCH, SEQ = 3, 8, 8
TOL = 1e-12
MPI_TIMEOUT = 300     # seconds for one mpiexec -n 4 (four processes on 2 cores)

LAYOUTS = {
    "dp2": Layout(dp=2),
    "ep2": Layout(dp=2, ep=2),
    "ep4": Layout(dp=4, ep=4),
    "dp4, ep2": Layout(dp=4, ep=2),
    "dp2 x tp2, ep2": Layout(dp=2, tp=2, ep=2),
    "tp2": Layout(tp=2),
    "ep2, clip": Layout(dp=2, ep=2, clip=0.05),
    "dp2 x tp2, ep2, clip": Layout(dp=2, tp=2, ep=2, clip=0.05),
    "dp2, zero1": Layout(dp=2, zero=1),
    "ep2, zero1": Layout(dp=2, ep=2, zero=1),
    "dp4, ep2, zero1, clip": Layout(dp=4, ep=2, zero=1, clip=0.05),
    "dp2, zero1, buckets": Layout(dp=2, zero=1, bucket_bytes=2048),
}

BASE = dict(vocab_size=31, max_seq_len=16, d_model=16, n_layers=2, n_heads=4, d_ff=32,
            dtype="float64", n_experts=4, top_k=2, d_expert=12)
FEATURES = {
    # Switch-style: softmax top-2, capacity 1 (tokens drop), balancing and z-losses
    "softmax, capacity, aux": DecoderConfig(**BASE, capacity_factor=1.0, aux_loss_coef=0.05,
                                            z_loss_coef=0.01),
    # DeepSeek-V3-style: sigmoid scores, normalised gates, sequence-wise balance, dropless
    "sigmoid, sequence-wise": DecoderConfig(**BASE, router="sigmoid", aux_loss="sequence",
                                            aux_loss_coef=0.05),
    # Llama blocks (SwiGLU experts), a shared expert, MoE in every second block
    "llama, shared, every 2nd": DecoderConfig.llama(
        vocab_size=29, max_seq_len=16, d_model=16, n_layers=2, n_heads=4, d_ff=24,
        dtype="float64", n_experts=4, top_k=1, d_expert=8, n_shared_experts=1, moe_every=2,
        capacity_factor=1.25),
    # (its name is not the dense matrix's "dropout": tests/mpi_layouts.py runs both's cases)
    "dropout, aux": DecoderConfig(**BASE, dropout=0.1, aux_loss_coef=0.05),
}

CASES = [(lname, fname) for lname, layout in LAYOUTS.items()
         for fname, config in FEATURES.items() if layout.refusal(config) is None]


def test_the_matrix_covers_every_layout_and_feature():
    assert len(CASES) >= 44, len(CASES)
    assert {l for l, _ in CASES} == set(LAYOUTS)
    assert {f for _, f in CASES} == set(FEATURES)


_reference = one_device_references(FEATURES, STEPS, BATCH, SEQ)


@pytest.mark.parametrize("lname,fname", CASES, ids=[f"{l} | {f}" for l, f in CASES])
def test_a_mixture_of_experts_trains_as_one_device(lname, fname):
    layout = LAYOUTS[lname]
    ref = _reference(fname, layout.clip)
    results = SimulatedGroup(layout.world_size).run(train_layout, FEATURES[fname], layout,
                                                    STEPS, BATCH, SEQ)
    for out in results:
        assert _rel(out["losses"], ref["losses"]) < TOL
        assert _rel(out["params"], ref["params"]) < TOL        # after 3 AdamW steps
        if out.get("grads") is not None:
            assert _rel(out["grads"], ref["grads"]) < TOL      # router, bias, experts: all


def test_the_cases_drop_tokens_and_balance():
    """Not vacuous: the capacity case drops assignments in the batch the test trains on,
    and its auxiliary losses are nonzero, so global order and statistics matter."""
    config = FEATURES["softmax, capacity, aux"]
    model = DecoderLM(config).init(0)
    ids, targets = make_batches(config, 1, BATCH, SEQ)
    model.forward(ids[0], targets[0])
    stats = model.moe_stats[0]
    assert int(np.sum(stats["kept_load"])) < int(np.sum(stats["load"]))
    assert float(stats["aux_loss"]) > 0


def _run_moe_layer(world, config, layout, ids, targets, local_routing):
    """One forward and backward of `layout`'s decoder; with local_routing each data-parallel
    rank routes its own rows apart (capacity and statistics of its tokens only), the rule
    a framework that ignores the other ranks follows."""
    from tfcore.parallel import runner
    from tfcore.parallel.harness import HYPER

    run = runner.build(world, config, layout, HYPER)
    run.model.load_full(DecoderLM(config).init(0).params)
    if local_routing:
        run.model.parts.expert_groups = None
    rows = BATCH // layout.dp
    d = run.mesh.dp_rank
    _, loss = run.model.forward(ids[d * rows:(d + 1) * rows],
                                targets[d * rows:(d + 1) * rows],
                                batch_rows=(d * rows, (d + 1) * rows, BATCH))
    return float(loss)


def test_routing_each_rank_apart_is_caught():
    """The planted error: capacity and balancing over each rank's own tokens instead of the
    batch's gives another loss than one device's, which the matrix's comparison catches."""
    config = FEATURES["softmax, capacity, aux"]
    ids, targets = (a[0] for a in make_batches(config, 1, BATCH, SEQ))
    _, one = DecoderLM(config).init(0).forward(ids, targets)
    layout = Layout(dp=2)          # every rank holds every expert: it can route alone
    right = SimulatedGroup(2).run(_run_moe_layer, config, layout, ids, targets, False)
    assert abs(right[0] - float(one)) < 1e-12 * abs(float(one))
    wrong = SimulatedGroup(2).run(_run_moe_layer, config, layout, ids, targets, True)
    assert abs(wrong[0] - float(one)) > 1e-6


def _held_experts(world, config, layout):
    from tfcore.parallel import runner
    from tfcore.parallel.harness import HYPER

    run = runner.build(world, config, layout, HYPER)
    shapes = run.model.params.shapes
    return {n: s for n, s in shapes.items() if ".moe.experts." in n}


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_each_rank_holds_its_share_of_the_experts(ep):
    config = FEATURES["softmax, capacity, aux"]
    full = {n: s for n, s in config.param_shapes().items() if ".moe.experts." in n}
    held = SimulatedGroup(4).run(_held_experts, config, Layout(dp=4, ep=ep))
    for shapes in held:
        assert set(shapes) == set(full)
        for name, shape in shapes.items():
            assert shape == (full[name][0] // ep,) + tuple(full[name][1:])


def _bias_step(world, config, layout, ids, targets):
    from tfcore.parallel import runner
    from tfcore.parallel.harness import HYPER

    run = runner.build(world, config, layout, HYPER)
    run.model.load_full(DecoderLM(config).init(0).params)
    rows = BATCH // layout.dp
    d = run.mesh.dp_rank
    run.model.forward(ids[d * rows:(d + 1) * rows], targets[d * rows:(d + 1) * rows],
                      batch_rows=(d * rows, (d + 1) * rows, BATCH))
    run.model.update_expert_bias(0.1)
    return np.array(run.model.gather_full("data"))


def test_the_auxiliary_loss_free_bias_update_uses_the_whole_batch_load():
    config = FEATURES["sigmoid, sequence-wise"]
    ids, targets = (a[0] for a in make_batches(config, 1, BATCH, SEQ))
    one = DecoderLM(config).init(0)
    one.forward(ids, targets)
    one.update_expert_bias(0.1)
    for params in SimulatedGroup(4).run(_bias_step, config, Layout(dp=4, ep=2), ids,
                                        targets):
        np.testing.assert_array_equal(params, np.array(one.params.data))


MOE = FEATURES["softmax, capacity, aux"]
REFUSED = [
    (Layout(dp=2, ep=2), dataclasses.replace(MOE, n_experts=0),
     "expert parallelism without experts"),
    (Layout(pp=2, micro_batches=2), MOE,
     "mixture of experts with pipeline parallelism"),
    (Layout(cp=2), MOE, "mixture of experts with context parallelism"),
    (Layout(tp=2, sp=True), MOE, "mixture of experts with sequence par"),
    (Layout(dp=2, zero=2), MOE, "mixture of experts with ZeRO-2/3"),
    (Layout(dp=2, ep=2, bucket_bytes=1024), MOE,
     "expert parallelism with gradient buckets"),
    (Layout(dp=2, micro_batches=2), MOE,
     "mixture of experts with accumulation over data-parallel ranks"),
]


@pytest.mark.parametrize("layout,config,message", REFUSED, ids=[m for _, _, m in REFUSED])
def test_the_refused_combinations_name_themselves(layout, config, message):
    with pytest.raises(LayoutError, match=message):
        layout.validate(config)


@pytest.mark.parametrize("layout,config,message", [
    (Layout(dp=2, ep=4), MOE, "ep = 4 must divide the data-parallel"),
    (Layout(dp=3, ep=3), MOE, "N_E = 4 must be divisible by the expert"),
])
def test_degrees_that_do_not_fit_are_refused_before_any_work(layout, config, message):
    with pytest.raises(ValueError, match=message):
        layout.validate(config)


def test_a_world_that_does_not_fit_the_expert_layout_is_refused():
    def body(world):
        from tfcore.parallel import runner
        from tfcore.parallel.harness import HYPER

        runner.build(world, MOE, Layout(dp=4, ep=2), HYPER)

    with pytest.raises(ValueError, match="needs 4 ranks, but the world has 2"):
        SimulatedGroup(2).run(body)


@pytest.mark.parametrize("argv,message", [
    (["--dp", "2", "--ep", "2", "--bucket-bytes", "1024"],
     "expert parallelism with gradient buckets"),
    (["--dp", "2", "--micro-batches", "2"],
     "mixture of experts with accumulation over data-parallel ranks"),
    (["--dp", "2", "--ep", "4"], "ep = 4 must divide the data-parallel degree dp = 2"),
])
def test_the_command_line_refuses_an_expert_layout_in_one_line(argv, message, capsys):
    from tfcore.parallel import __main__ as cli

    assert cli.main(["--simulate", "--config", "tiny-moe", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert message in captured.err


def test_the_command_line_trains_expert_parallel_equal_to_one_device(tmp_path, capsys):
    from tfcore.parallel import __main__ as cli

    out = tmp_path / "run.npz"
    assert cli.main(["--simulate", "--config", "tiny-moe", "--dp", "4", "--ep", "2",
                     "--batch", "8", "--check", "--save", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ep=2" in text and "one device: max relative difference" in text
    ref = train_single(FEATURES["softmax, capacity, aux"], 3, 8, 8)
    assert _rel(np.load(out)["losses"], ref["losses"]) < TOL


# -- real processes ------------------------------------------------------------------------

MPI_CASES = [
    "ep4 | llama, shared, every 2nd",
    "dp4, ep2 | dropout, aux",
    "dp2 x tp2, ep2 | softmax, capacity, aux",
    "dp2 x tp2, ep2 | sigmoid, sequence-wise",
    "dp2 x tp2, ep2, clip | softmax, capacity, aux",
    "dp4, ep2, zero1, clip | sigmoid, sequence-wise",
]


def test_the_mpi_runner_finds_the_cases_of_every_matrix():
    """tests/mpi_layouts.py merges the matrices' names: a layout or feature name in two of
    them is one layout or model, and every case of each resolves to its own matrix's model
    and sizes."""
    import mpi_layouts

    for matrix in mpi_layouts.MATRICES:
        for lname, fname in matrix.CASES:
            layout, config, steps, batch, seq = mpi_layouts.resolve(f"{lname} | {fname}")
            assert (layout, config) == (matrix.LAYOUTS[lname], matrix.FEATURES[fname])
            assert (steps, batch, seq) == (matrix.STEPS, matrix.BATCH, matrix.SEQ)
    dense = mpi_layouts.test_layout_matrix
    with pytest.raises(ValueError, match="collides"):
        mpi_layouts.merge(FEATURES, {"dropout, aux": dense.FEATURES["dropout"]},
                          equal_ok=True)
    with pytest.raises(ValueError, match="a case of no matrix"):
        mpi_layouts.resolve("ep2 | gpt")


@needs_mpi
def test_expert_layouts_under_mpi_equal_one_device(tmp_path):
    """One `mpiexec -n 4` trains MPI_CASES on four processes (MPIComm: the loads'
    all-gather and the dispatch and combine all-to-alls over real messages), each equal to
    one device (losses and parameters after 3 AdamW steps, relative 1e-12)."""
    from mpi_layouts import check_under_mpi     # which imports this module: not at its top

    assert all(LAYOUTS[c.split(" | ")[0]].world_size == 4 for c in MPI_CASES)
    assert all(tuple(c.split(" | ")) in CASES for c in MPI_CASES)
    check_under_mpi(tmp_path, 4, MPI_CASES, MPI_TIMEOUT)
