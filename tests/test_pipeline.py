"""Pipeline parallelism in the simulation: every schedule equals one device (float64), the
bubble measured from the run's timeline equals (p - 1) / (v m) exactly, the caches alive at
once equal the closed form, the point-to-point bytes equal theirs, and a layout that does
not divide is refused, naming the sizes, before anything moves."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import SimulatedGroup, bubble_fraction, peak_stored_microbatches
from tfcore.parallel.pipeline import (
    SCHEDULES,
    check_pipeline_layout,
    make_schedule,
    measure_timeline,
    pipeline_bytes_sent,
)
from tfcore.parallel.harness import CONFIGS, train_pipeline, train_single

STEPS, BATCH, SEQ = 3, 8, 8


def _config(name="tiny", n_layers=4, **changes):
    return DecoderConfig(**{**CONFIGS[name]().to_dict(), "n_layers": n_layers, **changes})


def _run(config, pp, m, schedule, v=1, tp=1, dp=1, steps=STEPS, batch=BATCH, seq=SEQ):
    group = SimulatedGroup(dp * pp * tp)
    results = group.run(train_pipeline, config, steps, batch, seq, pp=pp, n_microbatches=m,
                        schedule=schedule, n_virtual=v, tp=tp, dp=dp)
    return results, group


def _rel(a, b):
    return np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b)))


@pytest.mark.parametrize("name,schedule,pp,m,v,tp,dp", [
    ("tiny", "gpipe", 2, 4, 1, 1, 1),
    ("tiny", "1f1b", 4, 4, 1, 1, 1),
    ("tiny", "interleaved", 2, 4, 2, 1, 1),
    ("tiny-llama", "gpipe", 4, 2, 1, 1, 1),
    ("tiny-llama", "1f1b", 2, 4, 1, 2, 1),
    ("tiny-llama", "interleaved", 2, 2, 2, 1, 2),
    ("tiny", "1f1b", 2, 2, 1, 2, 2),                 # the 3-D mesh: DP x PP x TP = 2 x 2 x 2
    ("tiny", "interleaved", 1, 2, 4, 1, 1),          # one stage: every message stays local
])
def test_schedules_equal_one_device(name, schedule, pp, m, v, tp, dp):
    config = _config(name)
    ref = train_single(config, STEPS, BATCH, SEQ)
    results, _ = _run(config, pp, m, schedule, v, tp, dp)
    for res in results:          # every rank gathers the same full buffers
        assert _rel(res["losses"], ref["losses"]) < 1e-12
        assert _rel(res["grads"], ref["grads"]) < 1e-12
        assert _rel(res["params"], ref["params"]) < 1e-12


@pytest.mark.parametrize("schedule,pp,m,v", [
    ("gpipe", 2, 3, 1), ("gpipe", 4, 4, 1), ("gpipe", 3, 6, 1),
    ("1f1b", 2, 5, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2), ("interleaved", 2, 2, 3),
    ("interleaved", 3, 6, 2),
])
def test_measured_bubble_and_memory_equal_the_formulas(schedule, pp, m, v):
    config = _config("tiny", n_layers=pp * v)
    results, group = _run(config, pp, m, schedule, v, steps=1, batch=2 * m, seq=4)
    timeline = measure_timeline([r["record"] for r in results], pp, v)
    # the executed order is the schedule, and every rank idles (p - 1) / (v m) of its work
    assert [[op[:3] for op in r["record"]] for r in results] == make_schedule(schedule, pp,
                                                                              m, v)
    assert timeline["bubble"] == [bubble_fraction(pp, m, v)] * pp
    assert all(isinstance(b, Fraction) for b in timeline["bubble"])
    # the span: (m + p - 1)(t_f + t_b) for one chunk per rank, (v m + p - 1) per chunk's
    # costs for the interleaved schedule
    assert timeline["span"] == (v * m + pp - 1) * 3
    for r, res in enumerate(results):
        assert res["peak_live"] == peak_stored_microbatches(schedule, pp, r, m, v)
        if v == 1:       # one chunk per rank: the bytes held are the count times one cache
            assert res["peak_bytes"] == res["peak_live"] * res["chunk_bytes"][0]
        assert res["sent"] == [pipeline_bytes_sent(pp, r, m, v, 2 * 4, config.d_model, 8)]
        assert group.traffic[r].sent >= res["sent"][0]


def test_gpipe_holds_every_microbatch_and_1f1b_does_not():
    p, m = 4, 8
    gpipe = [peak_stored_microbatches("gpipe", p, r, m) for r in range(p)]
    one_f = [peak_stored_microbatches("1f1b", p, r, m) for r in range(p)]
    assert gpipe == [8, 8, 8, 8] and one_f == [4, 3, 2, 1]


def test_a_record_that_waits_for_nothing_that_finishes_is_refused():
    records = [[("F", 0, 0, None), ("B", 0, 0, ("B", 0, 1))],
               [("B", 0, 0, ("F", 0, 1)), ("F", 0, 0, ("F", 0, 0))]]    # B before its F
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        measure_timeline(records, 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(world=6, pp=4), "world size 6 is not a multiple of pp=4 x tp=1 = 4"),
    (dict(world=8, pp=2, tp=2, dp=3), r"dp=3 x pp=2 x tp=2 needs 12 ranks, but the world has 8"),
    (dict(world=3, pp=3), r"n_layers \(4\) must be divisible by pp x n_virtual = 3 x 1"),
    (dict(world=2, pp=2, v=4), r"n_layers \(4\) must be divisible by pp x n_virtual = 2 x 4"),
    (dict(world=2, pp=2, m=3, batch=8), r"global batch \(8\) must be divisible by dp x "
                                        r"n_microbatches = 1 x 3"),
    (dict(world=2, pp=2, m=3, v=2, schedule="interleaved"),
     r"n_microbatches \(3\) divisible by n_stages \(2\)"),
    (dict(world=2, pp=2, v=2, schedule="1f1b"), r"virtual stages with a one-chunk schedule "
                                                r"\(pp=2, virtual=2, schedule='1f1b'\)"),
    (dict(world=2, pp=2, schedule="zigzag"), "schedule must be one of"),
    (dict(world=2, pp=2, m=0), "n_microbatches must be a positive integer, got 0"),
    (dict(world=4, pp=2, tp=2, heads=3), r"n_heads \(3\) must be divisible"),
])
def test_bad_layouts_are_refused_before_any_work(kwargs, match):
    kw = dict(world=2, pp=2, tp=1, dp=None, m=2, v=1, batch=8, schedule="1f1b", dropout=0.0,
              heads=4, attention="dense")
    kw.update(kwargs)
    changes = dict(dropout=kw["dropout"], attention=kw["attention"])
    if kw["heads"] != 4:
        changes.update(n_heads=kw["heads"], n_kv_heads=kw["heads"], d_model=12, d_ff=24)
    config = _config("tiny", **changes)
    with pytest.raises(ValueError, match=match):
        check_pipeline_layout(config, kw["world"], kw["pp"], kw["tp"], kw["dp"], kw["m"],
                              kw["v"], kw["batch"], kw["schedule"])
    group = SimulatedGroup(kw["world"])
    with pytest.raises(ValueError, match=match):
        group.run(train_pipeline, config, 1, kw["batch"], 4, pp=kw["pp"], tp=kw["tp"],
                  dp=kw["dp"], n_microbatches=kw["m"], n_virtual=kw["v"],
                  schedule=kw["schedule"])
    assert all(t.sent == 0 and not t.calls for t in group.traffic)      # nothing moved


@pytest.mark.parametrize("args,match", [
    ((0, 4), "n_stages must be a positive integer"),
    ((2, 4, 0), "n_virtual must be a positive integer"),
])
def test_formula_functions_check_their_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        bubble_fraction(*args)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        peak_stored_microbatches("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match="schedule must be one of"):
        peak_stored_microbatches("pipedream", 2, 0, 4)
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved"}


def test_a_gradient_of_the_wrong_shape_is_refused():
    from tfcore.parallel.pipeline import PipelineStage

    def body(comm):
        stage = PipelineStage(_config("tiny"), comm, 2, 0)
        ids = np.zeros((2, 4), dtype=np.int64)
        out, cache = stage.chunk_forward(0, ids)                       # X [2, 4, 16]
        with pytest.raises(ValueError, match=r"G must have shape \(2, 4, 16\)"):
            stage.chunk_backward(0, np.zeros((2, 4, 15)), cache)
        stage.chunk_backward(0, np.zeros(out.shape), cache)
        last = PipelineStage(_config("tiny"), comm, 2, 1)
        _, cache = last.chunk_forward(0, out, np.ones((2, 4), dtype=np.int64))
        with pytest.raises(ValueError, match="G must be None on the last virtual stage"):
            last.chunk_backward(0, out, cache)
        return True

    assert SimulatedGroup(1).run(body) == [True]


def test_the_3d_mesh_numbers_and_refuses():
    from tfcore.parallel import Mesh
    from tfcore.viz.parallel import mesh3d_coords

    ranks = mesh3d_coords(dp=2, pp=2, tp=2)
    assert [g["world"] for g in ranks] == [(g["d"] * 2 + g["s"]) * 2 + g["t"] for g in ranks]
    assert {g["pp_group"] for g in ranks} == {(0, 2), (1, 3), (4, 6), (5, 7)}
    with pytest.raises(ValueError, match="dp=3 x pp=2 x tp=2 needs 12 ranks, but the world "
                                         "has 8"):
        SimulatedGroup(8).run(lambda comm: Mesh(comm, tp=2, dp=3, pp=2))
    with pytest.raises(ValueError, match="not a multiple of tp=2 x pp=3 = 6"):
        SimulatedGroup(8).run(lambda comm: Mesh(comm, tp=2, pp=3))


def test_the_pictures_draw_from_a_measured_run():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tfcore.viz.parallel import draw_mesh3d, draw_timeline, mesh3d_coords

    results, _ = _run(_config("tiny"), 2, 4, "interleaved", 2, steps=1, batch=4, seq=4)
    timeline = measure_timeline([r["record"] for r in results], 2, 2)
    fig, (a, b) = plt.subplots(2, 1)
    draw_timeline(a, timeline, 4, "interleaved")
    draw_mesh3d(b, mesh3d_coords(dp=1, pp=2, tp=2))
    assert len(a.patches) == sum(len(row) for row in timeline["intervals"]) == 2 * 2 * 4 * 2
    plt.close(fig)


def test_train_pipeline_checks_its_sizes():
    with pytest.raises(ValueError, match="steps must be a positive integer, got 0"):
        SimulatedGroup(2).run(train_pipeline, _config(), 0, 8, 8, pp=2, n_microbatches=2)
    with pytest.raises(ValueError, match=r"seq \(99\) exceeds max_seq_len=16"):
        SimulatedGroup(2).run(train_pipeline, _config(), 1, 8, 99, pp=2, n_microbatches=2)
    with pytest.raises(ValueError, match="n_virtual must be 1 for the 'gpipe'"):
        peak_stored_microbatches("gpipe", 2, 0, 4, 2)
