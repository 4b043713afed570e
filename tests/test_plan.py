"""The calculator (plan) with pipeline parallelism equals the simulated pipeline: bytes each
rank sends in a step (point-to-point and the dp / tied-embedding all-reduces), parameters it
holds, and the most chunk caches alive at once, for every schedule; the bubble is
pipeline.bubble_fraction's; bad input is refused before any work. (The dp x tp x ZeRO
layouts are compared with their runs in test_zero.py, the composed layouts in
test_layout_matrix.py.)"""
from __future__ import annotations

import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import SimulatedGroup, bubble_fraction
from tfcore.parallel.harness import CONFIGS, train_context_parallel, train_pipeline
from tfcore.parallel import plan

SEQ = 8


def _config(name, n_layers=4):
    return DecoderConfig(**{**CONFIGS[name]().to_dict(), "n_layers": n_layers})


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
    assert p.sent == [t.sent for t in group.traffic]
    assert p.peak_caches == [res["peak_live"] for res in results]
    for mem, res in zip(p.memory_per_rank, results):
        P = res["local_params"] * 8                       # float64
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (P, P, 2 * P)
        assert mem["activations"] == res["peak_bytes"]    # the caches the schedule held
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


def test_every_layout_that_trains_is_priced_and_the_activations_only_where_known():
    """Bytes, held state and activations for composed layouts (test_layout_matrix compares
    them with the runs); the activations are None (not a guess) under mixed precision
    (tfcore keeps float32 arrays where a GPU keeps bfloat16 ones)."""
    config = _config("tiny")
    for kwargs in (dict(pp=2, tp=2, microbatches=2), dict(pp=2, dp=2, zero=1),
                   dict(pp=2, cp=2, microbatches=2), dict(tp=2, microbatches=2),
                   dict(dp=2, mixed_precision="bf16")):
        p = plan(config, batch=8, seq=SEQ, **kwargs)
        assert p.sent is not None and p.traffic is not None and p.memory["params"] > 0
        unknown = "mixed_precision" in kwargs
        assert (p.memory["activations"] is None) == unknown, kwargs
    with pytest.raises(ValueError, match=r"ZeRO-2/3 with pipeline parallelism \(pp=2, "
                                         r"zero=2\)"):
        plan(config, pp=2, dp=2, zero=2, batch=8, seq=SEQ)     # refused: no run trains it
    accumulated = plan(config, microbatches=2, batch=8, seq=SEQ).memory["activations"]
    assert accumulated == plan(config, batch=4, seq=SEQ).memory["activations"]
    replicated = plan(config, pp=2, dp=2, batch=8, seq=SEQ).memory_per_rank
    zero1 = plan(config, pp=2, dp=2, zero=1, batch=8, seq=SEQ).memory_per_rank
    for r, z in zip(replicated, zero1):           # ZeRO-1 halves AdamW's m, v over dp = 2
        assert z["params"] == r["params"] and 2 * z["optimizer"] in (
            r["optimizer"], r["optimizer"] + 16, r["optimizer"] - 16)
    assert plan(config, pp=2, tp=2, microbatches=2, batch=8,
                seq=SEQ).peak_caches == [2, 2, 1, 1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(pp=2, schedule="pipedream"), "schedule must be one of"),
    (dict(schedule="zb-v"), "schedule must be one of"),
    (dict(pp=2, microbatches=3, virtual=2), "divisible by n_stages"),
    (dict(pp=2, schedule="gpipe", virtual=2), "virtual stages with a one-chunk schedule"),
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
        assert mem["activations"] > 0        # each rank's caches: test_layout_matrix.py


def test_context_parallel_refuses_and_declines():
    config = _config("tiny")
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        plan(config, cp=0, batch=2, seq=SEQ)
    with pytest.raises(ValueError, match="every chunk must hold a position"):
        plan(config, cp=8, batch=2, seq=SEQ)
    with pytest.raises(ValueError, match="balanced must be True or False"):
        plan(config, cp=2, balanced="yes", batch=2, seq=SEQ)
    for kwargs in (dict(dp=2), dict(tp=2), dict(zero=1), dict(microbatches=2)):
        p = plan(config, cp=2, batch=4, seq=SEQ, **kwargs)     # priced (the layout matrix
        assert p.sent is not None and p.memory["activations"] > 0      # checks them)


# -- every field of the plan, for several layouts, against what the runs hold and send ------------
def _chunks(M, N):
    """Chunk sizes floor/ceil(M / N), the larger first (numpy.array_split's rule)."""
    return [M // N + (r < M % N) for r in range(N)]


def _ring_all_reduce_sent(M, N, r):
    """Bytes-free count: elements rank r sends in a ring all-reduce of M elements over N
    ranks: reduce-scatter (every chunk but the one it ends with, c_r) and all-gather (every
    chunk but the one it receives last, c_{r+1})."""
    c = _chunks(M, N)
    return 0 if N == 1 else 2 * M - c[r] - c[(r + 1) % N]


def _observe(kind, config, f, **kw):
    """One simulated step of the layout (float64): per world rank, (bytes held by kind,
    bytes sent by '<group> <op>', bytes sent, peak chunk caches or None), each byte count
    scaled to elements of f bytes; the bytes sent in the step only."""
    held, by_op, sent, peak = _observe_float64(kind, config, **kw)
    scale = lambda b: b * f // 8                                           # noqa: E731
    return ([{k: scale(b) for k, b in h.items()} for h in held],
            None if by_op is None else [{k: scale(b) for k, b in r.items()} for r in by_op],
            [scale(b) for b in sent], peak)


def _observe_float64(kind, config, **kw):
    f = 8
    from tfcore.parallel.harness import train_parallel, train_sharded

    batch, dp, tp = kw["batch"], kw.get("dp", 1), kw.get("tp", 1)
    zero = kw.get("zero", 0)
    if kind == "pp":
        pp, m = kw["pp"], kw["microbatches"]
        group = SimulatedGroup(dp * pp)
        out = group.run(train_pipeline, config, 1, batch, SEQ, pp=pp, n_microbatches=m,
                        schedule=kw.get("schedule", "1f1b"), dp=dp, gather=False)
        sent = [t.sent for t in group.traffic]
        held = [dict(params=o["local_params"] * f, grads=o["local_params"] * f,
                     optimizer=2 * o["local_params"] * f, gathered=0) for o in out]
        return held, None, sent, [o["peak_live"] for o in out]
    if kind == "cp":
        group = SimulatedGroup(kw["cp"])
        out = group.run(train_context_parallel, config, 1, batch, SEQ)
        P = out[0]["params"].size * f
        held = [dict(params=P, grads=P, optimizer=2 * P, gathered=0) for _ in out]
        return held, None, [t.sent for t in group.traffic], None
    if zero >= 2:
        out = SimulatedGroup(tp * dp).run(train_sharded, config, 1, batch, SEQ, tp=tp, dp=dp,
                                          stage=zero, gather=False)
        held = []
        for o in out:
            peak = o["ledger"].peak()
            # the transient part: what the peak holds beyond the shard (Z_d) of the kind
            # that is gathered (ZeRO-3: parameters; ZeRO-2: gradients)
            extra = peak["params" if zero == 3 else "grads"] - o["shard_size"] * f
            held.append(dict(params=peak["params"], grads=peak["grads"],
                             optimizer=peak["optimizer"], gathered=extra))
    else:
        out = SimulatedGroup(tp * dp).run(train_parallel, config, 1, batch, SEQ, tp=tp,
                                          dp=dp, zero=bool(zero), gather=False)
        held = [dict(o["held"], gathered=0) for o in out]
    by_op = []
    for o in out:
        counted = {}
        for c in o["step_calls"][0]:
            counted[f"{c.group} {c.op}"] = counted.get(f"{c.group} {c.op}", 0) + c.sent
        by_op.append(counted)
    return held, by_op, [sum(r.values()) for r in by_op], None


@pytest.mark.parametrize("kind,kw", [
    ("dp", dict(dp=1)),
    ("dp", dict(dp=2)),
    ("dp", dict(dp=3, zero=1, batch=6)),
    ("dp", dict(dp=2, tp=2, zero=1)),
    ("dp", dict(dp=2, zero=2)),
    ("dp", dict(dp=2, tp=2, zero=3)),
    ("dp", dict(dp=4, zero=3, dtype="float32")),
    ("pp", dict(pp=2, microbatches=2)),
    ("pp", dict(pp=2, dp=2, microbatches=4, schedule="gpipe", batch=8)),
    ("cp", dict(cp=2)),
])
def test_every_field_of_the_plan(kind, kw):
    """Each field of Plan: memory per rank (params, grads, optimizer, gathered as the runs
    hold them; activations; total = their sum, which a plan dropping a part fails), the
    fullest rank, the bytes per rank by collective and in all (as the run sends them), the
    busiest rank's traffic, the bubble (p - 1)/(v m) and the peak caches. The layouts run
    in float64; a float32 plan is the float64 one with 4-byte elements."""
    import dataclasses

    from tfcore.models.sizes import decoder_sizes

    config = _config("tiny", n_layers=2)
    kw = dict(dict(batch=4, seq=SEQ), **kw)
    dtype = kw.pop("dtype", "float64")
    f = {"float64": 8, "float32": 4}[dtype]
    p = plan(config, dtype=dtype, **kw)
    held, by_op, sent, peak = _observe(kind, config, f, **{k: v for k, v in kw.items()
                                                          if k != "seq"})
    assert {x.name for x in dataclasses.fields(p)} == {
        "layout", "memory", "memory_per_rank", "traffic", "traffic_per_rank", "sent",
        "bubble", "peak_caches", "time"}
    assert p.time is None                             # no cluster given
    # layout: what was asked, with the defaults filled in
    expect = dict(dp=1, tp=1, pp=1, cp=1, zero=0, microbatches=1, virtual=1, dtype=dtype)
    expect.update(kw)
    if kind == "pp":
        expect.setdefault("schedule", "1f1b")
    if kind == "cp":
        expect["balanced"] = True
    assert p.layout == expect
    # memory per rank
    for w, (m, h) in enumerate(zip(p.memory_per_rank, held)):
        assert set(m) == {"params", "grads", "optimizer", "gathered", "activations", "total"}
        assert {k: m[k] for k in h} == h, w
        one_device = len(p.memory_per_rank) == 1 and kind == "dp"
        activations = m["activations"]           # each rank's, measured: test_layout_matrix
        if one_device:                           # DecoderLM's caches
            assert activations == decoder_sizes(config.__class__(**{
                **config.to_dict(), "dtype": dtype}), kw["batch"], SEQ)["activation_bytes"]
        else:
            assert activations > 0
        assert m["total"] == m["params"] + m["grads"] + m["optimizer"] + (activations or 0)
        assert m["gathered"] <= min(m["params"], m["grads"])
    totals = [m["total"] for m in p.memory_per_rank]
    assert p.memory == p.memory_per_rank[totals.index(max(totals))]
    # bytes sent per rank, by collective and in all
    assert p.sent == sent
    assert [sum(r.values()) for r in p.traffic_per_rank] == p.sent
    if by_op is not None:
        for counted, priced in zip(by_op, p.traffic_per_rank):
            assert {k: b for k, b in priced.items() if b} == {
                k: b for k, b in counted.items() if b}
    if kind == "pp":                     # independently: activations forward, gradients back
        pp, m, dp = kw["pp"], kw["microbatches"], kw.get("dp", 1)
        tokens = kw["batch"] // (dp * m) * SEQ
        P_stage = [mem["params"] // f for mem in p.memory_per_rank[:pp]]
        for w, r in enumerate(p.traffic_per_rank):
            d, s = divmod(w, pp)
            assert r["pp send"] == m * tokens * config.d_model * f * ((s < pp - 1) + (s > 0))
            if dp > 1:           # and on the last stage the token count T_c and the loss
                last = 1 if s == pp - 1 else 0
                assert r["dp all_reduce"] == f * (_ring_all_reduce_sent(P_stage[s], dp, d)
                                                  + 2 * _ring_all_reduce_sent(last, dp, d))
            # the loss, broadcast in a chain from the last stage: pp-1 -> 0 -> ... -> pp-2
            assert r.get("pp broadcast", 0) == f * (s != pp - 2)
    busiest = p.sent.index(max(p.sent))
    assert p.traffic == {k: b for k, b in sorted(p.traffic_per_rank[busiest].items()) if b}
    # bubble and caches
    pp, m, v = kw.get("pp", 1), kw.get("microbatches", 1), kw.get("virtual", 1)
    assert p.bubble == (pp - 1) / (v * m)
    assert p.peak_caches == peak


def test_context_parallel_plans_grouped_query_attention():
    """The ring trains grouped-query attention (n_kv_heads < n_heads): plan(cp=2) prices it
    (the K, V blocks of the n_kv_heads heads, as the run sends them); the layouts of the
    tensor-parallel decoder still refuse it, with the tensor-parallel message."""
    config = DecoderConfig(**{**CONFIGS["tiny-llama"]().to_dict(), "n_kv_heads": 2})
    group = SimulatedGroup(2)
    results = group.run(train_context_parallel, config, 1, 2, SEQ)
    p = plan(config, cp=2, batch=2, seq=SEQ)
    assert p.sent == [t.sent for t in group.traffic]
    P = results[0]["params"].size * 8
    assert [m["total"] - m["activations"] for m in p.memory_per_rank] == [4 * P, 4 * P]
    full = plan(DecoderConfig(**{**config.to_dict(), "n_kv_heads": 4}), cp=2, batch=2,
                seq=SEQ)
    assert p.traffic["cp ring"] < full.traffic["cp ring"]      # fewer K, V heads move
    for kwargs in (dict(dp=2), dict(tp=2), dict(pp=2)):
        assert plan(config, batch=2, seq=SEQ, **kwargs).layout is not None   # trains


def test_the_calculator_is_tfcore_parallel_plan():
    """As the README writes it: tfcore.parallel.plan(config, dp=2, zero=3, ...) is the
    function, and no module of that name shadows it (the module is planning)."""
    import importlib

    import tfcore.parallel

    p = tfcore.parallel.plan(_config("tiny"), dp=2, zero=3, batch=4, seq=SEQ)
    assert p.layout["zero"] == 3 and p.memory["total"] > 0
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tfcore.parallel.plan")
    assert callable(tfcore.parallel.plan)
    assert tfcore.parallel.plan is importlib.import_module("tfcore.parallel.planning").plan


@pytest.mark.parametrize("dp", [1, 4])
def test_mixed_precision_state_is_16_bytes_a_parameter_sharded_by_the_zero_stage(dp):
    """bf16 weights and gradients, float32 master weights, m and v: over the dp ranks
    (the chunks add up to Psi = P elements, so the mean is exact) DP holds 16 Psi, ZeRO-1
    4 Psi + 12 Psi / N_D, ZeRO-2 2 Psi + 14 Psi / N_D and ZeRO-3 16 Psi / N_D, each plus the
    units it gathers at once (ZeRO-2: their gradients; ZeRO-3: weights and gradients)."""
    from tfcore.parallel.volume import local_parameters

    config = _config("tiny")
    Psi = local_parameters(config, 1, 0)
    expect = {0: 16 * Psi * dp, 1: 4 * Psi * dp + 12 * Psi, 2: 2 * Psi * dp + 14 * Psi,
              3: 16 * Psi}
    for zero in (0, 1, 2, 3) if dp > 1 else (0,):
        p = plan(config, dp=dp, zero=zero, batch=8, seq=SEQ, mixed_precision="bf16")
        held = [m["params"] + m["grads"] + m["optimizer"]
                - m["gathered"] * ((zero >= 2) + (zero == 3)) for m in p.memory_per_rank]
        assert sum(held) == expect[zero], zero
        assert all(m["activations"] is None for m in p.memory_per_rank)
        assert p.traffic == plan(config, dp=dp, zero=zero, batch=8, seq=SEQ,
                                 dtype="bfloat16").traffic       # 2-byte messages
    with pytest.raises(ValueError, match="mixed_precision must be None, 'bf16' or 'fp16'"):
        plan(config, batch=8, seq=SEQ, mixed_precision="fp8")


def test_the_step_time_adds_its_terms_and_names_the_largest():
    """compute = step FLOPs / N / flops; communication = the slowest rank's bytes /
    bandwidth + latency x rounds; bubble = compute x (p - 1) / (v m); no overlap."""
    from tfcore.models.sizes import step_flops
    from tfcore.parallel import Cluster, Layout

    config = _config("tiny")
    slow = Cluster(flops=1e9, bandwidth=1e6)
    p = plan(config, Layout(dp=2, pp=2, micro_batches=2), batch=8, seq=SEQ, cluster=slow)
    T = p.time
    assert T["compute"] == step_flops(config, 8, SEQ) / 4 / 1e9
    assert T["bubble"] == T["compute"] * p.bubble == T["compute"] * 1 / 2
    assert T["communication"] == max(p.sent) / 1e6
    assert T["total"] == T["compute"] + T["communication"] + T["bubble"]
    assert T["dominant"] == max(("compute", "communication", "bubble"), key=T.get)
    fast = plan(config, Layout(dp=2, pp=2, micro_batches=2), batch=8, seq=SEQ,
                cluster=Cluster(flops=1e9, bandwidth=2e6)).time
    assert fast["communication"] == T["communication"] / 2
    latent = plan(config, Layout(dp=2, pp=2, micro_batches=2), batch=8, seq=SEQ,
                  cluster=Cluster(flops=1e9, bandwidth=1e6, latency=1e-3)).time
    assert latent["communication"] > T["communication"]
    assert ("time dominated by", T["dominant"]) in p.rows()
    # tensor parallelism inside a machine of 2 ranks: its bytes at the machine's bandwidth
    two = plan(config, Layout(dp=2, tp=2), batch=8, seq=SEQ)
    inside = plan(config, Layout(dp=2, tp=2), batch=8, seq=SEQ, cluster=Cluster(
        flops=1e9, bandwidth=1e6, node_size=2, node_bandwidth=4e6)).time["communication"]
    assert inside == max(sum(b / (4e6 if key.startswith("tp ") else 1e6)
                             for key, b in r.items()) for r in two.traffic_per_rank)
    for bad in (dict(flops=0, bandwidth=1.0), dict(flops=1.0, bandwidth=float("inf")),
                dict(flops=1.0, bandwidth=1.0, latency=-1.0),
                dict(flops=1.0, bandwidth=1.0, node_size=0),
                dict(flops=1.0, bandwidth=1.0, node_bandwidth="fast")):
        with pytest.raises(ValueError, match="Cluster"):
            Cluster(**bad)
    with pytest.raises(ValueError, match="cluster must be a Cluster"):
        plan(config, batch=8, seq=SEQ, cluster=dict(flops=1.0))
