"""plan() prices a mixture of experts under a layout: the parameters, gradients and AdamW
state each rank holds (its N_E / ep experts), and the bytes each rank sends in a step (the
loads' all-gather over dp, dispatch and combine as all-to-alls over its block of ep ranks and
their adjoints, the auxiliary losses' value, the experts' gradient over the ranks holding
them, the rest as for a dense decoder). The all-to-alls depend on the routing: given the
loads a step observed (moe_stats' load_by_rank), plan's bytes equal the counted ones rank by
rank; without them plan assumes an even routing."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tfcore import backend
from tfcore.models.decoder import DecoderLM
from tfcore.parallel import Cluster, Layout, SimulatedGroup, plan, runner
from tfcore.parallel.harness import CONFIGS, HYPER, make_batches
from tfcore.parallel.runner import held_bytes
from tfcore.parallel.volume import (even_expert_loads, expert_parallel_bytes,
                                   kept_expert_loads)

BATCH, SEQ = 8, 8
MOE = CONFIGS["tiny-moe"]()
CONFIGS_ = {
    "capacity, aux": MOE,
    "capacity, recompute": dataclasses.replace(MOE, recompute="full"),
    "dropless, no aux": dataclasses.replace(MOE, capacity_factor=None, aux_loss_coef=0.0,
                                            z_loss_coef=0.0),
    "every 2nd, sigmoid": dataclasses.replace(MOE, moe_every=2, router="sigmoid",
                                              aux_loss="sequence"),
}
LAYOUTS = {
    "dp2": Layout(dp=2), "ep2": Layout(dp=2, ep=2), "dp4, ep2": Layout(dp=4, ep=2),
    "ep4": Layout(dp=4, ep=4), "dp2 x tp2, ep2": Layout(dp=2, tp=2, ep=2),
    "ep2, clip": Layout(dp=2, ep=2, clip=0.1), "dp4, ep2, clip": Layout(dp=4, ep=2, clip=0.1),
    "dp2, zero1": Layout(dp=2, zero=1), "tp2": Layout(tp=2),
    "ep2, zero1": Layout(dp=2, ep=2, zero=1), "dp4, ep2, zero1": Layout(dp=4, ep=2, zero=1),
    "dp4, ep2, zero1, clip": Layout(dp=4, ep=2, zero=1, clip=0.1),
}
CASES = [(l, c) for l in LAYOUTS for c in CONFIGS_]


def _step(world, layout, config, zero_router=False):
    run = runner.build(world, config, layout, HYPER)
    full = DecoderLM(config).init(0).params
    if zero_router:                 # every token ties: the lowest experts take them all
        for name in full.names:
            if name.endswith(".router.W"):
                full[name][...] = 0
    run.model.load_full(full)
    ids, targets = make_batches(config, 1, BATCH, SEQ)
    before = world.traffic.sent
    runner.train_step(run, ids[0], targets[0], BATCH)
    loads = [np.asarray(backend.to_numpy(run.model.moe_stats[i]["load_by_rank"])).tolist()
             for i in sorted(run.model.moe_stats)]
    return world.traffic.sent - before, loads, held_bytes(run)


@pytest.mark.parametrize("lname,cname", CASES, ids=[f"{l} | {c}" for l, c in CASES])
def test_the_bytes_and_state_of_an_expert_layout_are_plans(lname, cname):
    layout, config = LAYOUTS[lname], CONFIGS_[cname]
    out = SimulatedGroup(layout.world_size).run(_step, layout, config)
    loads = out[0][1] if layout.dp > 1 else None
    priced = plan(config, layout, batch=BATCH, seq=SEQ, expert_loads=loads)
    assert [o[0] for o in out] == priced.sent
    for (_, _, held), memory in zip(out, priced.memory_per_rank):
        assert {k: memory[k] for k in held} == held
    assert priced.memory["activations"] is None          # not priced for experts


def test_a_collapsed_router_is_priced_from_its_loads_not_the_even_routing():
    layout = Layout(dp=2, ep=2)
    config = dataclasses.replace(MOE, capacity_factor=None)
    out = SimulatedGroup(2).run(_step, layout, config, True)
    loads = out[0][1]
    assert all(sum(row[2:]) == 0 for load in loads for row in load)   # experts 0, 1 only
    skewed = plan(config, layout, batch=BATCH, seq=SEQ, expert_loads=loads)
    even = plan(config, layout, batch=BATCH, seq=SEQ)
    assert [o[0] for o in out] == skewed.sent
    # what each rank sends is the same as under an even routing (rank 1 sends every row
    # out, rank 0 every row back), but rank 0's experts compute every row
    assert skewed.sent == even.sent
    tokens = BATCH // 2 * SEQ * config.top_k
    assert expert_parallel_bytes(loads[0], 2, config.d_model)["rows"] == [2 * tokens, 0]
    assert expert_parallel_bytes(even_expert_loads(config, 2, BATCH // 2 * SEQ), 2,
                                 config.d_model)["rows"] == [tokens, tokens]


def test_the_experts_each_rank_holds_shrink_with_ep():
    held = {ep: plan(MOE, Layout(dp=4, ep=ep), batch=BATCH, seq=SEQ).memory["params"]
            for ep in (1, 2, 4)}
    shapes = MOE.param_shapes()
    experts = sum(int(np.prod(s)) for n, s in shapes.items() if ".moe.experts." in n) * 8
    assert held[1] - held[2] == experts // 2 and held[1] - held[4] == 3 * experts // 4


def test_the_even_routing_and_the_capacity_rule():
    even = even_expert_loads(MOE, 2, 10)                  # 20 assignments over 4 experts
    assert even == [[5, 5, 5, 5]] * 2
    capped = dataclasses.replace(MOE, capacity_factor=0.5)  # C = ceil(0.5 20 2 / 4) = 5
    assert kept_expert_loads(capped, [[4, 0, 8, 8], [4, 0, 8, 8]]) == [[4, 0, 5, 5],
                                                                       [1, 0, 0, 0]]


def test_plan_refuses_what_it_cannot_price_for_experts():
    with pytest.raises(ValueError, match="one \\[dp, N_E\\] matrix per MoE layer"):
        plan(MOE, Layout(dp=2), batch=BATCH, seq=SEQ, expert_loads=[[[1, 1, 1, 1]] * 2])
    with pytest.raises(ValueError, match="step time prices dense decoders"):
        plan(MOE, Layout(dp=2), batch=BATCH, seq=SEQ,
             cluster=Cluster(flops=1e12, bandwidth=1e9, latency=1e-6))


@pytest.mark.parametrize("layout", [Layout(dp=2, ep=2), Layout(dp=4, ep=2, zero=1, clip=0.1)],
                         ids=["ep2", "dp4, ep2, zero1, clip"])
def test_expert_parallelism_on_the_array_api_strict_backend(layout):
    """The experts' gradient sums and ZeRO-1 chunks write through scatters that every array
    library takes: under array-api-strict the run equals NumPy's one device."""
    from tfcore.parallel.harness import train_layout, train_single

    ref = train_single(MOE, 3, BATCH, SEQ, clip=layout.clip)
    backend.set_backend("strict")
    try:
        out = SimulatedGroup(layout.world_size).run(train_layout, MOE, layout, 3, BATCH, SEQ)
    finally:
        backend.set_backend("numpy")
    for o in out:
        rel = np.max(np.abs(o["params"] - ref["params"])) / np.max(np.abs(ref["params"]))
        assert rel < 1e-12
