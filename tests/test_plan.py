"""The calculator (plan) with pipeline parallelism equals the simulated pipeline: bytes each
rank sends in a step (point-to-point and the dp / tied-embedding all-reduces), parameters it
holds, and the most chunk caches alive at once, for every schedule; the bubble is
pipeline.bubble_fraction's; layouts it cannot price give None; bad input is refused before
any work. (The dp x tp x ZeRO layouts are compared with their runs in test_zero.py.)"""
from __future__ import annotations

import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import SimulatedGroup, bubble_fraction
from tfcore.parallel.context import train_context_parallel
from tfcore.parallel.pipeline import train_pipeline
from tfcore.parallel import plan
from tfcore.parallel.runner import CONFIGS

SEQ = 8


def _config(name, n_layers=4):
    return DecoderConfig(**{**CONFIGS[name]().to_dict(), "n_layers": n_layers})


def counted_step_bytes(group, results, pp, dp):
    """Bytes each world rank sent in a one-step run, without the losses the run shares for
    reporting once it is over (a pp broadcast, and on the last stage a dp all-reduce of the
    step losses: the last dp call): they are not part of a training step."""
    counted = []
    for w, res in enumerate(results):
        calls = group.traffic[w].calls
        reporting = [c for c in calls if c.op == "broadcast"]
        if res["coords"][1] == pp - 1 and dp > 1:
            reporting.append([c for c in calls if c.group == "dp"][-1])
        counted.append(group.traffic[w].sent - sum(c.sent for c in reporting))
    return counted


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("schedule,pp,m,v,dp", [
    ("gpipe", 4, 2, 1, 1),
    ("1f1b", 2, 4, 1, 2),
    ("1f1b", 2, 2, 1, 3),                        # dp = 3: chunks of unequal sizes
    ("interleaved", 2, 2, 2, 2),
])
def test_plan_equals_the_simulated_pipeline(name, schedule, pp, m, v, dp):
    config, batch = _config(name), 12 if dp == 3 else 8
    group = SimulatedGroup(dp * pp)
    results = group.run(train_pipeline, config, 1, batch, SEQ, pp=pp, n_microbatches=m,
                        schedule=schedule, n_virtual=v, dp=dp, gather=False)
    p = plan(config, dp=dp, pp=pp, microbatches=m, virtual=v, schedule=schedule,
             batch=batch, seq=SEQ)
    assert p.sent == counted_step_bytes(group, results, pp, dp)
    assert p.peak_caches == [res["peak_live"] for res in results]
    for mem, res in zip(p.memory_per_rank, results):
        P = res["local_params"] * 8                       # float64
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (P, P, 2 * P)
        assert mem["activations"] is None
    assert p.bubble == bubble_fraction(pp, m, v)
    assert p.layout["schedule"] == schedule


def test_gpipe_holds_more_caches_than_1f1b_and_interleaving_shrinks_the_bubble():
    config = _config("tiny", n_layers=8)
    kw = dict(dp=1, pp=4, microbatches=8, batch=8, seq=SEQ)
    gpipe = plan(config, schedule="gpipe", **kw)
    one_f = plan(config, schedule="1f1b", **kw)
    inter = plan(config, virtual=2, **kw)
    assert gpipe.peak_caches == [8] * 4 and one_f.peak_caches == [4, 3, 2, 1]
    assert gpipe.sent == one_f.sent                       # the same messages, reordered
    assert gpipe.bubble == one_f.bubble == 2 * inter.bubble == 3 / 8
    assert inter.layout["schedule"] == "interleaved"
    assert ("peak caches", "8 8 8 8") in gpipe.rows()


def test_layouts_not_priced_give_none_not_a_guess():
    config = _config("tiny")
    for kwargs in (dict(pp=2, tp=2), dict(pp=2, dp=2, zero=1), dict(microbatches=2)):
        p = plan(config, batch=8, seq=SEQ, **kwargs)
        assert p.memory is None and p.sent is None and p.traffic is None
    assert plan(config, pp=2, tp=2, microbatches=2, batch=8,
                seq=SEQ).peak_caches == [2, 2, 1, 1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(pp=2, schedule="pipedream"), "schedule must be one of"),
    (dict(schedule="zb-v"), "schedule must be one of"),
    (dict(pp=2, microbatches=3, virtual=2), "divisible by n_stages"),
    (dict(pp=2, schedule="gpipe", virtual=2), "n_virtual must be 1"),
    (dict(pp=2, microbatches=0), "microbatches must be a positive integer"),
    (dict(pp=8), "n_layers"),
])
def test_plan_refuses_bad_pipelines(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(_config("tiny"), **dict(dict(batch=12, seq=SEQ), **kwargs))


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("cp,balanced,seq", [(2, True, 12), (3, False, 12), (3, True, 13)])
def test_plan_equals_the_simulated_context_parallel_run(name, cp, balanced, seq):
    config = CONFIGS[name]()
    group = SimulatedGroup(cp)
    results = group.run(train_context_parallel, config, 1, 2, seq, balanced=balanced)
    p = plan(config, cp=cp, balanced=balanced, batch=2, seq=seq)
    assert p.sent == [t.sent for t in group.traffic]
    P = results[0]["params"].size * 8
    for mem in p.memory_per_rank:
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (P, P, 2 * P)
        assert mem["activations"] is None


def test_context_parallel_refuses_and_declines():
    config = _config("tiny")
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        plan(config, cp=0, batch=2, seq=SEQ)
    with pytest.raises(ValueError, match="every chunk must hold a position"):
        plan(config, cp=8, batch=2, seq=SEQ)
    with pytest.raises(ValueError, match="balanced must be True or False"):
        plan(config, cp=2, balanced="yes", batch=2, seq=SEQ)
    assert plan(config, cp=2, dp=2, batch=2, seq=SEQ).sent is None
