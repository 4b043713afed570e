"""Node-limited routing (DeepSeek-V3): the N_E experts in G groups of consecutive experts (a
node's, or an expert-parallel rank's), each token's K experts taken from its M best groups,
a group scored by the sum of its ceil(K / M) highest selection scores (ties: the lower group
index). Checked against a reference written from that rule, its gradient by finite
differences, and under expert parallelism with one group per rank: every token's rows go
to at most M ranks, counted in the dispatch's plan."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tfcore.functional import moe as M
from tfcore.models.decoder import DecoderLM
from tfcore.parallel import Layout, SimulatedGroup
from tfcore.parallel import experts as EP
from tfcore.parallel.harness import CONFIGS, train_layout, train_single


def reference_selection(select, top_k, n_groups, max_groups):
    """The rule, token by token in plain Python."""
    out = []
    per = len(select[0]) // n_groups
    take = math.ceil(top_k / max_groups)
    for row in select:
        scores = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:take])
                  for g in range(n_groups)]
        best = sorted(range(n_groups), key=lambda g: (-scores[g], g))[:max_groups]
        allowed = [e for e in range(len(row)) if e // per in best]
        out.append(sorted(allowed, key=lambda e: (-row[e], e))[:top_k])
    return np.array(out)


@pytest.mark.parametrize("score,groups,top_k", [
    ("sigmoid", (4, 2), 4), ("softmax", (4, 1), 2), ("sigmoid", (8, 3), 6),
    ("softmax", (2, 2), 3), ("sigmoid", (4, 4), 4)])
def test_the_selection_is_the_documented_rule(score, groups, top_k):
    rng = np.random.default_rng(7)
    z = rng.standard_normal((64, 8 if groups[0] <= 4 else 16))
    bias = 0.3 * rng.standard_normal(z.shape[1])
    routed, cache = M.router_forward(z, top_k, score, None, bias, groups)
    select = (np.exp(z) / np.exp(z).sum(1, keepdims=True) if score == "softmax"
              else 1 / (1 + np.exp(-z))) + bias
    np.testing.assert_array_equal(routed.experts, reference_selection(select.tolist(), top_k,
                                                                      *groups))
    per = z.shape[1] // groups[0]
    assert max(len(set((row // per).tolist())) for row in routed.experts) <= groups[1]


def test_every_group_allowed_is_the_unlimited_router():
    z = np.random.default_rng(8).standard_normal((40, 8))
    plain, _ = M.router_forward(z, 3, "sigmoid")
    limited, _ = M.router_forward(z, 3, "sigmoid", groups=(4, 4))
    np.testing.assert_array_equal(plain.experts, limited.experts)
    np.testing.assert_array_equal(plain.gates, limited.gates)


def test_the_limit_changes_some_choice():
    z = np.random.default_rng(9).standard_normal((40, 8))
    plain, _ = M.router_forward(z, 4, "sigmoid")
    limited, _ = M.router_forward(z, 4, "sigmoid", groups=(4, 2))
    assert not np.array_equal(plain.experts, limited.experts)


def test_the_gradient_is_the_selected_gates_gradient():
    rng = np.random.default_rng(10)
    z, dg = rng.standard_normal((16, 8)), rng.standard_normal((16, 4))
    routed, cache = M.router_forward(z, 4, "sigmoid", None, None, (4, 2))
    dz = M.router_backward(dg, cache)
    u = rng.standard_normal(z.shape)
    h = 1e-6
    up, _ = M.router_forward(z + h * u, 4, "sigmoid", None, None, (4, 2))
    down, _ = M.router_forward(z - h * u, 4, "sigmoid", None, None, (4, 2))
    assert np.array_equal(up.experts, routed.experts)       # no tie crossed
    numeric = float(np.sum(dg * (up.gates - down.gates)) / (2 * h))
    assert abs(numeric - float(np.sum(dz * u))) < 1e-7 * np.linalg.norm(dz)


def test_each_token_reaches_at_most_m_expert_parallel_ranks():
    rng = np.random.default_rng(11)
    n, n_experts, width, top_k, limit = 4, 8, 6, 4, 2
    xs = [rng.standard_normal((12, width)) for _ in range(n)]
    W_router = rng.standard_normal((width, n_experts))
    W = dict(W_fc=rng.standard_normal((n_experts, width, 5)),
             W_proj=rng.standard_normal((n_experts, 5, width)))

    def body(comm):
        mine = {k: v[2 * comm.rank:2 * comm.rank + 2] for k, v in W.items()}
        _, cache = EP.ep_moe_forward(xs[comm.rank], W_router, mine, comm, top_k,
                                     score="sigmoid", groups=(n, limit))
        plan = cache.plan
        ranks = np.asarray(cache.routed.experts) // plan.n_local           # [T, K]
        reached = max(len(set(row.tolist())) for row in ranks)
        sent_to = [int(c) for c in plan.send_counts]
        return reached, sent_to, ranks

    out = SimulatedGroup(n).run(body)
    for reached, sent_to, ranks in out:
        assert reached <= limit
        # what the dispatch sends each rank is the rows routed there, every token's in at
        # most `limit` of the ranks
        assert sent_to == [int(np.sum(ranks == j)) for j in range(n)]


def test_a_node_limited_decoder_trains_as_one_device_under_expert_parallelism():
    """Two groups of two experts, one per expert-parallel rank; top-2 from one group: every
    token's rows go to one rank."""
    config = dataclasses.replace(CONFIGS["tiny-moe"](), router="sigmoid", top_k=2,
                                 expert_groups=2, group_limit=1)
    assert config.moe_spec().groups == (2, 1)
    ref = train_single(config, 3, 8, 8)
    for out in SimulatedGroup(4).run(train_layout, config, Layout(dp=4, ep=2), 3, 8, 8):
        rel = np.max(np.abs(out["params"] - ref["params"])) / np.max(np.abs(ref["params"]))
        assert rel < 1e-12
    model = DecoderLM(config).init(0)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (4, 8))
    model.forward(ids, ids)
    groups = np.asarray(model._cache.blocks[0].block.ffn.experts) // 2     # [T, K] groups
    assert np.all(groups[:, 0] == groups[:, 1])


@pytest.mark.parametrize("groups,message", [
    ((3, 1), "must divide the number of experts"),
    ((4, 5), "must be at most the number of groups"),
    ((4, 1), "hold fewer than top_k"),
    ((4,), "must be \\(n_groups, max_groups\\)"),
])
def test_bad_groups_are_refused_clearly(groups, message):
    with pytest.raises(ValueError, match=message):
        M.router_forward(np.zeros((2, 8)), 3, "sigmoid", groups=groups)


def test_a_config_with_groups_but_no_limit_is_refused():
    with pytest.raises(ValueError, match="needs group_limit"):
        dataclasses.replace(CONFIGS["tiny-moe"](), expert_groups=2).validate()
