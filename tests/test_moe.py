"""The mixture of experts: the op pairs of tfcore.functional.moe against finite differences and
SymPy, the documented routing rules (ties, capacity, dropping), the balancing losses' values
and gradients, and the MoE decoder against an independent float64 reference.

The reference (`reference_loss` below) is written from the documented semantics (the
docstrings of tfcore/functional/moe.py, tfcore/models/moe.py and tfcore/models/decoder.py) as
plain loops over tokens, heads and experts on scalars. It imports nothing from tfcore but the
config; its gradients come from the chain rule applied to each scalar operation it makes
(`Scalar` records the local derivative of every operation and `backprop` sums them in reverse
topological order), so they depend on no derivation of tfcore's backward passes.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
import sympy as sp

from tfcore import functional as F
from tfcore import symbolic as sym
from tfcore.backend import asarray, to_numpy
from tfcore.functional import moe as M
from tfcore.gradcheck import assert_close, check_gradients, random_upstream
from tfcore.models import DecoderConfig, DecoderLM

from _model_checks import directional_errors, randomize


def _logits(rng, T, N, gap=0.7, noise=0.05):
    """[T, N] router logits whose entries in each row differ by about `gap`: no selection
    changes under a finite-difference step."""
    rows = [rng.permutation(N) * gap + noise * rng.standard_normal(N) for _ in range(T)]
    return np.array(rows)


# ---------------------------------------------------------------------------------------
# The router


def _router_loss(score, normalize, top_k, bias=None, probs_weight=None):
    """L = sum(G gates) (+ sum(H probs)) as a function of the logits, for check_gradients."""
    def forward(logits):
        routed, _ = M.router_forward(logits, top_k, score, normalize, bias)
        return routed.gates if probs_weight is None else routed.probs
    return forward


@pytest.mark.parametrize("score,normalize", [("softmax", False), ("softmax", True),
                                             ("sigmoid", True), ("sigmoid", False)])
def test_router_gates_gradient_matches_finite_differences(score, normalize, rng):
    T, N, K = 7, 5, 2
    z = _logits(rng, T, N)
    bias = 0.02 * rng.standard_normal(N) if score == "sigmoid" else None
    routed, cache = M.router_forward(z, K, score, normalize, bias)
    G = random_upstream((T, K), rng)
    dz = M.router_backward(G, cache)
    check_gradients(_router_loss(score, normalize, K, bias), {"logits": z}, {"logits": dz}, G,
                    tol=1e-8)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_probabilities_gradient_matches_finite_differences(score, rng):
    """The probabilities the balancing loss reads: softmax(z), or s / sum s for sigmoid."""
    T, N, K = 6, 4, 2
    z = _logits(rng, T, N)
    _, cache = M.router_forward(z, K, score)
    H = random_upstream((T, N), rng)
    dz = M.router_backward(np.zeros((T, K)), cache, dprobs=H)
    check_gradients(_router_loss(score, None, K, probs_weight=True), {"logits": z},
                    {"logits": dz}, H, tol=1e-8)


def test_gradients_flow_through_the_selected_gates_only(rng):
    """The selection is a constant mask: with sigmoid scores an unselected expert's logit
    gets exactly 0; softmax top-k renormalised is the softmax of the selected logits alone,
    so the unselected logits get 0 up to round-off; without renormalisation they get the
    softmax coupling p_i (0 - sum_k G_k g_k) and nothing from their own gate."""
    T, N, K = 8, 6, 2
    z = _logits(rng, T, N)
    G = random_upstream((T, K), rng)
    routed, cache = M.router_forward(z, K, "sigmoid")
    dz = M.router_backward(G, cache)
    off = np.ones((T, N), dtype=bool)
    np.put_along_axis(off, routed.experts, False, axis=1)
    assert np.all(dz[off] == 0.0) and np.all(dz[~off] != 0.0)
    routed, cache = M.router_forward(z, K, "softmax", normalize=True)
    dz = M.router_backward(G, cache)
    assert np.max(np.abs(dz[off])) < 1e-15 * np.max(np.abs(dz))
    routed, cache = M.router_forward(z, K, "softmax", normalize=False)
    dz = M.router_backward(G, cache)
    p = routed.probs
    coupling = -np.sum(G * routed.gates, axis=1, keepdims=True) * p
    assert_close("unselected dz", dz[off], coupling[off])


def test_renormalised_topk_jacobian_is_the_softmax_of_the_selected_logits(rng):
    """d g_k / d z_j = g_k (delta_{e_k j} - g_j') over the selected experts, 0 elsewhere:
    the Jacobian assembled from router_backward, one unit upstream at a time."""
    N, K = 5, 3
    z = _logits(rng, 1, N)
    routed, cache = M.router_forward(z, K, "softmax", normalize=True)
    e, g = routed.experts[0], routed.gates[0]
    jac = np.stack([M.router_backward(np.eye(K)[k][None, :], cache)[0] for k in range(K)])
    closed = np.zeros((K, N))
    for k in range(K):
        for j in range(K):
            closed[k, e[j]] = g[k] * ((k == j) - g[j])
    assert_close("jacobian", jac, closed)


def test_selection_bias_moves_the_selection_not_the_gates(rng):
    """DeepSeek-V3: the bias enters the top-k only. A bias that lifts the weakest expert puts
    it in every token's selection; its gate is its unbiased score over the selected unbiased
    scores, and nudging the bias (without changing the selection) moves nothing."""
    T, N, K = 5, 4, 2
    z = _logits(rng, T, N)
    weakest = np.argmin(z, axis=1)
    z[np.arange(T), weakest] = -3.0
    bias = np.zeros(N)
    bias_high = bias.copy()
    routed0, _ = M.router_forward(z, K, "sigmoid")
    for t in range(T):
        assert weakest[t] not in routed0.experts[t]
    z[:, 0] = -3.0                              # expert 0 the weakest of every token
    bias_high[0] = 2.0
    routed, cache = M.router_forward(z, K, "sigmoid", bias=bias_high)
    assert np.all(routed.experts[:, 0] == 0)
    s = 1 / (1 + np.exp(-z))
    chosen = np.take_along_axis(s, routed.experts, axis=1)
    assert_close("gates", routed.gates, chosen / chosen.sum(axis=1, keepdims=True))
    nudged, _ = M.router_forward(z, K, "sigmoid", bias=bias_high + 1e-3)
    np.testing.assert_array_equal(nudged.gates, routed.gates)
    np.testing.assert_array_equal(nudged.probs, routed.probs)


def test_tie_rule_lower_expert_index_wins():
    """Equal selection scores: the lower expert index takes the earlier slot."""
    z = np.array([[1.0, 3.0, 3.0, 0.5, 3.0],
                  [0.0, 0.0, 0.0, 0.0, 0.0],
                  [2.0, 1.0, 2.0, 1.0, 0.0]])
    routed, _ = M.router_forward(z, 3, "softmax")
    np.testing.assert_array_equal(routed.experts, [[1, 2, 4], [0, 1, 2], [0, 2, 1]])
    # with the sigmoid router the tie is in the biased score s + b
    z = np.zeros((1, 4))
    routed, _ = M.router_forward(z, 2, "sigmoid", bias=np.array([0.0, 0.1, 0.1, 0.1]))
    np.testing.assert_array_equal(routed.experts, [[1, 2]])


# ---------------------------------------------------------------------------------------
# Capacity, dispatch and combine


def test_capacity_is_ceil_of_factor_tokens_k_over_experts():
    assert M.capacity(10, 2, 4, 1.0) == 5
    assert M.capacity(10, 2, 4, 1.1) == 6           # 5.5 -> 6
    assert M.capacity(8, 1, 4, 0.5) == 1
    assert M.capacity(8, 1, 4, None) is None


def test_capacity_drops_exactly_the_documented_tokens():
    """Each expert keeps its first C tokens in token order; the rest are dropped."""
    experts = np.array([[0, 1], [0, 2], [1, 0], [0, 3], [2, 1], [0, 1]])   # T = 6, K = 2
    plan = M.moe_plan(experts, 4, capacity_factor=2 / 3)        # C = ceil(2/3 * 12 / 4) = 2
    assert plan.capacity == 2
    # expert 0 is chosen by tokens 0, 1, 2, 3, 5: keeps 0 and 1; expert 1 by 0, 2, 4, 5:
    # keeps 0 and 2; expert 2 by 1, 4: keeps both; expert 3 by 3: keeps it
    expected = np.array([[1, 1], [1, 1], [1, 0], [0, 1], [1, 0], [0, 0]], dtype=bool)
    np.testing.assert_array_equal(plan.kept, expected)
    np.testing.assert_array_equal(plan.load, [5, 4, 2, 1])
    np.testing.assert_array_equal(plan.kept_load, [2, 2, 2, 1])
    x = np.arange(6.0)[:, None] * np.ones((1, 3)) + 1.0         # token t's row is t + 1
    xe, _ = M.moe_dispatch_forward(x, plan)
    np.testing.assert_array_equal(xe[:, :, 0], [[1, 2], [1, 3], [2, 5], [4, 0]])
    gates = np.full((6, 2), 0.5)
    y, _ = M.moe_combine_forward(xe, gates, plan)
    np.testing.assert_array_equal(y[:, 0], [1.0, 2.0, 1.5, 2.0, 2.5, 0.0])  # token 5: all dropped


def test_dropless_routing_keeps_every_assignment(rng):
    experts = np.stack([rng.choice(5, 2, replace=False) for _ in range(9)])
    plan = M.moe_plan(experts, 5)
    assert plan.capacity == int(plan.load.max())
    assert plan.kept.all() and np.array_equal(plan.kept_load, plan.load)
    assert plan.load.sum() == 18


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_dispatch_and_combine_gradients_match_finite_differences(capacity_factor, rng):
    T, N, K, D = 7, 4, 2, 3
    experts = np.stack([rng.choice(N, K, replace=False) for _ in range(T)])
    plan = M.moe_plan(experts, N, capacity_factor)
    if capacity_factor is not None:
        assert not plan.kept.all()                       # the check covers dropped rows
    x = rng.standard_normal((T, D))
    xe, c_disp = M.moe_dispatch_forward(x, plan)
    G = random_upstream(xe.shape, rng)
    check_gradients(lambda x: M.moe_dispatch_forward(x, plan)[0], {"x": x},
                    {"x": M.moe_dispatch_backward(G, c_disp)}, G)
    ye = rng.standard_normal(xe.shape)
    gates = rng.uniform(0.1, 1.0, (T, K))
    y, c_comb = M.moe_combine_forward(ye, gates, plan)
    Gy = random_upstream(y.shape, rng)
    dye, dgates = M.moe_combine_backward(Gy, c_comb)
    combine = lambda ye, gates: M.moe_combine_forward(ye, gates, plan)[0]   # noqa: E731
    check_gradients(combine, {"ye": ye, "gates": gates}, {"ye": dye, "gates": dgates}, Gy)
    assert np.all(dgates[~plan.kept] == 0.0)


def test_dispatch_backward_is_its_adjoint(rng):
    """<dispatch(x), y> = <x, dispatch_backward(y)> (dispatch is linear), with drops."""
    experts = np.stack([rng.choice(6, 3, replace=False) for _ in range(10)])
    plan = M.moe_plan(experts, 6, 0.5)
    x = rng.standard_normal((10, 4))
    xe, cache = M.moe_dispatch_forward(x, plan)
    y = rng.standard_normal(xe.shape)
    lhs = float(np.sum(xe * y))
    rhs = float(np.sum(x * M.moe_dispatch_backward(y, cache)))
    assert abs(lhs - rhs) < 1e-13 * (abs(lhs) + 1)


@pytest.mark.parametrize("activation,bias", [("gelu", True), ("swiglu", False),
                                             ("relu", True), ("swiglu", True)])
def test_expert_mlp_gradients_match_finite_differences(activation, bias, rng):
    E, C, D, Fh = 3, 4, 5, 6
    inputs = {"xe": rng.standard_normal((E, C, D)), "W_fc": rng.standard_normal((E, D, Fh)),
              "W_proj": rng.standard_normal((E, Fh, D))}
    if bias:
        inputs.update(b_fc=rng.standard_normal((E, Fh)), b_proj=rng.standard_normal((E, D)))
    if activation == "swiglu":
        inputs["W_gate"] = rng.standard_normal((E, D, Fh))
        if bias:
            inputs["b_gate"] = rng.standard_normal((E, Fh))

    def forward(xe, W_fc, W_proj, b_fc=None, b_proj=None, W_gate=None, b_gate=None):
        return M.expert_mlp_forward(xe, W_fc, b_fc, W_proj, b_proj, activation, W_gate,
                                    b_gate)[0]

    ye, cache = forward(**inputs), M.expert_mlp_forward(
        inputs["xe"], inputs["W_fc"], inputs.get("b_fc"), inputs["W_proj"],
        inputs.get("b_proj"), activation, inputs.get("W_gate"), inputs.get("b_gate"))[1]
    G = random_upstream(ye.shape, rng)
    names = ("xe", "W_fc", "b_fc", "W_proj", "b_proj", "W_gate", "b_gate")
    grads = dict(zip(names, M.expert_mlp_backward(G, cache)))
    grads = {k: v for k, v in grads.items() if k in inputs}
    assert set(grads) == set(inputs)
    check_gradients(forward, inputs, grads, G, tol=1e-7)


def test_expert_mlp_is_each_expert_s_own_mlp(rng):
    """Expert e's rows go through expert e's weights only."""
    E, C, D, Fh = 3, 2, 4, 5
    xe, W1, W2 = (rng.standard_normal(s) for s in ((E, C, D), (E, D, Fh), (E, Fh, D)))
    ye, _ = M.expert_mlp_forward(xe, W1, None, W2, None, "relu")
    for e in range(E):
        assert_close(f"expert {e}", ye[e], np.maximum(xe[e] @ W1[e], 0) @ W2[e])


# ---------------------------------------------------------------------------------------
# Balancing


def test_balancing_loss_is_alpha_when_balanced_and_alpha_n_when_collapsed(rng):
    alpha, N, K, T = 0.3, 4, 2, 8
    probs = np.full((T, N), 1 / N)
    experts = np.array([[t % N, (t + 1) % N] for t in range(T)])     # every expert 4 times
    loss, _ = M.load_balancing_loss_forward(probs, experts, alpha)
    assert abs(float(loss) - alpha) < 1e-15
    # f_i sums to 1 under top-K (normalised by T K, not by T)
    f = to_numpy(M._fractions(experts, N, np.float64))
    assert abs(f.sum() - 1.0) < 1e-15 and np.allclose(f, 1 / N)
    # collapse: every token's probability on expert 0, top-1 routing to it
    probs = np.zeros((T, N))
    probs[:, 0] = 1.0
    loss, _ = M.load_balancing_loss_forward(probs, np.zeros((T, 1), dtype=np.int64), alpha)
    assert abs(float(loss) - alpha * N) < 1e-15
    # with f = P (the relaxed objective) the loss is alpha N sum P_i^2 >= alpha, equality at
    # uniform P only (Cauchy-Schwarz)
    for _ in range(20):
        P = rng.dirichlet(np.ones(N))
        assert alpha * N * np.sum(P * P) >= alpha * (1 - 1e-15)


def test_balancing_loss_gradient_treats_f_as_a_constant(rng):
    """dL/dP[t, i] = alpha N_E f_i / T, the same for every token, and the finite difference
    in the probabilities (experts held fixed) agrees."""
    T, N, K, alpha = 9, 5, 2, 0.7
    probs = rng.dirichlet(np.ones(N), size=T)
    experts = np.stack([rng.choice(N, K, replace=False) for _ in range(T)])
    loss, cache = M.load_balancing_loss_forward(probs, experts, alpha)
    dprobs = M.load_balancing_loss_backward(1.0, cache)
    f = np.bincount(experts.ravel(), minlength=N) / (T * K)
    assert_close("dprobs", dprobs, np.broadcast_to(alpha * N * f / T, (T, N)))
    assert abs(float(loss) - alpha * N * np.sum(f * probs.mean(axis=0))) < 1e-15
    check_gradients(lambda probs: M.load_balancing_loss_forward(probs, experts, alpha)[0],
                    {"probs": probs}, {"probs": 2.5 * dprobs}, np.array(2.5))


def test_sequence_balancing_loss_averages_the_per_sequence_loss(rng):
    B, S, N, K, alpha = 3, 5, 4, 2, 0.2
    probs = rng.dirichlet(np.ones(N), size=(B, S))
    experts = np.stack([[rng.choice(N, K, replace=False) for _ in range(S)] for _ in range(B)])
    loss, cache = M.sequence_balancing_loss_forward(probs, experts, alpha)
    per = [float(M.load_balancing_loss_forward(probs[b], experts[b], alpha)[0])
           for b in range(B)]
    assert abs(float(loss) - np.mean(per)) < 1e-15
    whole = float(M.load_balancing_loss_forward(probs.reshape(-1, N), experts.reshape(-1, K),
                                                alpha)[0])
    assert abs(whole - float(loss)) > 1e-6            # a different loss from the batch one
    dprobs = M.sequence_balancing_loss_backward(1.0, cache)
    check_gradients(lambda probs: M.sequence_balancing_loss_forward(probs, experts, alpha)[0],
                    {"probs": probs}, {"probs": dprobs}, np.array(1.0))


def test_z_loss_value_and_gradient(rng):
    z = 3.0 * rng.standard_normal((6, 5))
    loss, cache = M.router_z_loss_forward(z, 0.1)
    lse = np.log(np.sum(np.exp(z), axis=1))
    assert abs(float(loss) - 0.1 * np.mean(lse ** 2)) < 1e-14
    check_gradients(lambda logits: M.router_z_loss_forward(logits, 0.1)[0], {"logits": z},
                    {"logits": M.router_z_loss_backward(1.0, cache)}, np.array(1.0))


def test_expert_bias_update_is_the_sign_of_the_load_error():
    bias = np.array([0.0, 0.1, -0.2, 0.3])
    load = np.array([2, 6, 4, 4])                           # mean 4
    new = M.expert_bias_update(bias, load, 0.01)
    np.testing.assert_array_equal(new, bias + 0.01 * np.array([1.0, -1.0, 0.0, 0.0]))
    experts = np.array([[0, 1], [1, 2], [1, 3]])
    np.testing.assert_array_equal(M.expert_load(experts, 4), [1, 3, 1, 1])


def test_bias_updates_balance_a_skewed_sigmoid_router(rng):
    """The auxiliary-loss-free method at work: logits that favour experts 0 and 1 load them
    heavily; a few hundred sign updates of the bias bring every load near the mean."""
    T, N, K = 256, 8, 2
    z = rng.standard_normal((T, N)) + np.linspace(1.5, -1.5, N)
    bias = np.zeros(N)
    start = M.expert_load(M.router_forward(z, K, "sigmoid", bias=bias)[0].experts, N)
    for _ in range(300):
        load = M.expert_load(M.router_forward(z, K, "sigmoid", bias=bias)[0].experts, N)
        bias = M.expert_bias_update(bias, load, 0.01)
    mean = T * K / N
    assert start.max() > 2 * mean
    assert load.max() < 1.25 * mean and load.min() > 0.75 * mean


# ---------------------------------------------------------------------------------------
# SymPy proofs of the router's backward (a fixed selection: the gates are piecewise smooth
# and the selection is constant on each piece, so the proof holds for every selection)


def _router_closed_form(z, G, selected, score, normalize, planted=False):
    """router_backward's formula written on symbols (dlogits as a 1 x N row); planted=True
    forgets the renormalisation's coupling term -sum_j G_j g_j."""
    N, K = z.shape[1], len(selected)
    s = sym.softmax(z) if score == "softmax" else sym.sigmoid(z)
    g = sym.topk_gates(s, selected, normalize)
    if normalize:
        total = sum(s[e] for e in selected)
        dot = sum(G[k] * g[k] for k in range(K))
        da = [(G[k] - (0 if planted else dot)) / total for k in range(K)]
    else:
        da = [G[k] for k in range(K)]
    ds = sp.Matrix(1, N, lambda _, i: sum(da[k] for k in range(K) if selected[k] == i))
    if score == "softmax":
        inner = sum(ds[i] * s[i] for i in range(N))
        return sp.Matrix(1, N, lambda _, i: s[i] * (ds[i] - inner)), g
    return sp.Matrix(1, N, lambda _, i: ds[i] * s[i] * (1 - s[i])), g


@pytest.mark.parametrize("score,n_experts,selected", [("softmax", 4, [2, 0]),
                                                      ("softmax", 3, [1, 2]),
                                                      ("sigmoid", 3, [2, 0])])
def test_sympy_router_backward_equals_the_truth_and_tfcore(score, n_experts, selected):
    z = sym.vector("z", n_experts)
    G = sym.vector("G", len(selected))
    closed, gates = _router_closed_form(z, G, selected, score, normalize=True)
    truth = sym.vjp(gates, z, G)
    # a planted error: forgetting the renormalisation's coupling term -sum_j G_j g_j
    planted, _ = _router_closed_form(z, G, selected, score, normalize=True, planted=True)
    if score == "sigmoid":      # both sides are rational in u_i = exp(-z_i): compare those
        u = {sp.exp(-zi): sp.Symbol(f"u_{i}", positive=True) for i, zi in enumerate(z)}
        truth, closed_u, planted = (m.subs(u) for m in (truth, closed, planted))
        sym.assert_equal("dz", truth, closed_u)
    else:
        sym.assert_equal("dz", truth, closed)
    with pytest.raises(AssertionError, match="differs from the truth"):
        sym.assert_equal("dz", truth, planted)
    # tfcore equals the lambdified closed form where the selection is the proved one
    rng = np.random.default_rng(7)
    zv = rng.uniform(-1.0, 0.0, (1, n_experts))
    for rank, e in enumerate(selected):
        zv[0, e] = 3.0 - rank
    gv = rng.standard_normal((1, len(selected)))
    routed, cache = M.router_forward(zv, len(selected), score, normalize=True)
    np.testing.assert_array_equal(routed.experts[0], selected)
    expected = sym.lambdify([z, G], closed, cse=True)(zv, gv)
    assert_close("dz", M.router_backward(gv, cache), expected)


def test_sympy_balancing_loss_gradient_and_extremes():
    """L = alpha N sum_i f_i P_i with P_i the mean of probs over T tokens and f constants:
    dL/dprobs[t, i] = alpha N f_i / T; at f = P = 1/N, L = alpha; f = P = e_0 gives alpha N."""
    T, N = 3, 3
    alpha = sp.Symbol("alpha", positive=True)
    probs = sym.matrix("p", T, N)
    f = sym.vector("f", N)
    L = alpha * N * sum(f[i] * sum(probs[t, i] for t in range(T)) / T for i in range(N))
    truth = probs.applyfunc(lambda p: sp.diff(L, p))
    closed = sp.Matrix(T, N, lambda t, i: alpha * N * f[i] / T)
    sym.assert_equal("dprobs", truth, closed)
    uniform = {**{f[i]: sp.Rational(1, N) for i in range(N)},
               **{probs[t, i]: sp.Rational(1, N) for t in range(T) for i in range(N)}}
    assert sp.simplify(L.subs(uniform) - alpha) == 0
    collapsed = {**{f[i]: int(i == 0) for i in range(N)},
                 **{probs[t, i]: int(i == 0) for t in range(T) for i in range(N)}}
    assert sp.simplify(L.subs(collapsed) - alpha * N) == 0
    with pytest.raises(AssertionError):             # planted: normalising f by T, not T K
        sym.assert_equal("dprobs", truth, closed * 2)


def test_sympy_the_shares_of_a_batch_split_over_ranks_sum_to_its_loss():
    """A batch of T tokens in parts (data-parallel ranks): each part's share
    alpha N sum_i f_i (1/T) sum_{t in part} p_{t,i}, with the whole batch's f and T, sums to
    the whole batch's L, and its gradient is the whole loss's restricted to the part (the
    same alpha N f_i / T): proved, then tfcore's load=/n_tokens= shares against the whole in
    float64 and by finite differences; a share normalised by its own T is caught."""
    T, N, cut = 4, 3, 1
    alpha = sp.Symbol("alpha", positive=True)
    probs, f = sym.matrix("p", T, N), sym.vector("f", N)

    def share(rows, tokens):
        return alpha * N * sum(f[i] * sum(probs[t, i] for t in rows) / tokens
                               for i in range(N))

    whole = share(range(T), T)
    parts = [share(range(cut), T), share(range(cut, T), T)]
    assert sp.simplify(sum(parts) - whole) == 0
    for part in parts:
        for t in range(T):
            for i in range(N):
                assert sp.simplify(sp.diff(part, probs[t, i])
                                   - (sp.diff(whole, probs[t, i]) if (t < cut) == (part is
                                                                                 parts[0])
                                      else 0)) == 0
    assert sp.simplify(share(range(cut), cut) + parts[1] - whole) != 0      # planted

    rng = np.random.default_rng(31)
    n_e, k, tokens = 6, 2, 10
    p = rng.dirichlet(np.ones(n_e), size=tokens)
    chosen = np.argsort(-p, axis=1)[:, :k]
    load = np.bincount(chosen.reshape(-1), minlength=n_e)
    loss, _ = M.load_balancing_loss_forward(p, chosen, 0.3)
    pieces = [M.load_balancing_loss_forward(p[a:b], chosen[a:b], 0.3, load=load,
                                            n_tokens=tokens) for a, b in ((0, 4), (4, 10))]
    assert abs(sum(float(x) for x, _ in pieces) - float(loss)) < 1e-14 * abs(float(loss))
    d_whole = M.load_balancing_loss_backward(1.0, M.load_balancing_loss_forward(
        p, chosen, 0.3)[1])
    np.testing.assert_allclose(M.load_balancing_loss_backward(1.0, pieces[1][1]), d_whole[4:],
                               rtol=1e-14)
    u, h = rng.standard_normal((6, n_e)), 1e-6
    shifted = [float(M.load_balancing_loss_forward(p[4:] + s * h * u, chosen[4:], 0.3,
                                                   load=load, n_tokens=tokens)[0])
               for s in (1, -1)]
    numeric = (shifted[0] - shifted[1]) / (2 * h)
    assert abs(numeric - float(np.sum(d_whole[4:] * u))) < 1e-8
    z = rng.standard_normal((tokens, n_e))
    zl, _ = M.router_z_loss_forward(z, 0.2)
    z_parts = [float(M.router_z_loss_forward(z[a:b], 0.2, n_tokens=tokens)[0])
               for a, b in ((0, 3), (3, 10))]
    assert abs(sum(z_parts) - float(zl)) < 1e-14 * abs(float(zl))
    seq = p.reshape(2, 5, n_e)
    whole_seq, _ = M.sequence_balancing_loss_forward(seq, chosen.reshape(2, 5, k), 0.3)
    seq_parts = [float(M.sequence_balancing_loss_forward(seq[b:b + 1], chosen.reshape(2, 5, k)
                                                         [b:b + 1], 0.3, n_sequences=2)[0])
                 for b in (0, 1)]
    assert abs(sum(seq_parts) - float(whole_seq)) < 1e-14 * abs(float(whole_seq))


@pytest.mark.parametrize("call,message", [
    (lambda p, e: M.load_balancing_loss_forward(p, e, load=np.ones(5, np.int64)),
     "load must have shape"),
    (lambda p, e: M.load_balancing_loss_forward(p, e, n_tokens=2), "n_tokens must be"),
    (lambda p, e: M.router_z_loss_forward(p, n_tokens=1), "n_tokens must be"),
    (lambda p, e: M.sequence_balancing_loss_forward(p[None], e[None], n_sequences=0),
     "n_sequences must be"),
], ids=["load shape", "n_tokens below the part's", "z-loss n_tokens", "n_sequences 0"])
def test_a_share_with_whole_batch_counts_that_cannot_be_is_refused(call, message):
    p = np.full((4, 6), 1 / 6)
    e = np.tile(np.arange(2), (4, 1))
    with pytest.raises(ValueError, match=message):
        call(p, e)


# ---------------------------------------------------------------------------------------
# The independent reference of the MoE decoder


class Scalar:
    """A float that remembers how it was made: (parent, d self / d parent) pairs."""

    __slots__ = ("v", "g", "parents")

    def __init__(self, v, parents=()):
        self.v, self.g, self.parents = float(v), 0.0, parents

    def __add__(self, o):
        if isinstance(o, Scalar):
            return Scalar(self.v + o.v, ((self, 1.0), (o, 1.0)))
        return Scalar(self.v + o, ((self, 1.0),))

    __radd__ = __add__

    def __neg__(self):
        return Scalar(-self.v, ((self, -1.0),))

    def __sub__(self, o):
        return self + (-o)

    def __rsub__(self, o):
        return (-self) + o

    def __mul__(self, o):
        if isinstance(o, Scalar):
            return Scalar(self.v * o.v, ((self, o.v), (o, self.v)))
        return Scalar(self.v * o, ((self, o),))

    __rmul__ = __mul__

    def __truediv__(self, o):
        if isinstance(o, Scalar):
            return Scalar(self.v / o.v, ((self, 1.0 / o.v), (o, -self.v / o.v ** 2)))
        return Scalar(self.v / o, ((self, 1.0 / o),))

    def __rtruediv__(self, o):
        return Scalar(o / self.v, ((self, -o / self.v ** 2),))


def _exp(a):
    e = math.exp(a.v)
    return Scalar(e, ((a, e),))


def _log(a):
    return Scalar(math.log(a.v), ((a, 1.0 / a.v),))


def _sqrt(a):
    r = math.sqrt(a.v)
    return Scalar(r, ((a, 0.5 / r),))


def _tanh(a):
    t = math.tanh(a.v)
    return Scalar(t, ((a, 1.0 - t * t),))


def _sigmoid(a):
    s = 1.0 / (1.0 + math.exp(-a.v))
    return Scalar(s, ((a, s * (1.0 - s)),))


def _relu(a):
    return Scalar(max(a.v, 0.0), ((a, 1.0 if a.v > 0 else 0.0),))


def _total(xs):
    """sum(xs) as one node."""
    return Scalar(sum(x.v for x in xs), tuple((x, 1.0) for x in xs))


def _dot(xs, ws):
    """sum_i xs[i] ws[i] as one node (both lists of Scalars)."""
    return Scalar(sum(x.v * w.v for x, w in zip(xs, ws)),
                  tuple((x, w.v) for x, w in zip(xs, ws)) + tuple((w, x.v) for x, w in zip(xs, ws)))


def backprop(root):
    """Every Scalar's g = d root / d it: the chain rule over the recorded operations, in
    reverse topological order (a depth-first post-order, iteratively)."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((p, False) for p, _ in node.parents if id(p) not in seen)
    root.g = 1.0
    for node in reversed(order):
        for parent, local in node.parents:
            parent.g += local * node.g


def _vec_mat(x, W, b=None):
    """x [D_in] (Scalars) @ W [D_in, D_out] (object array) (+ b [D_out]) -> list [D_out]."""
    out = [_dot(x, list(W[:, j])) for j in range(W.shape[1])]
    return out if b is None else [o + bj for o, bj in zip(out, b)]


def _ref_norm(x, p, name, cfg):
    n = len(x)
    if cfg.norm == "layernorm":
        mean = _total(x) * (1.0 / n)
        c = [a - mean for a in x]
        var = _dot(c, c) * (1.0 / n)
        inv = 1.0 / _sqrt(var + cfg.eps)
        return [ci * inv * g + b for ci, g, b in zip(c, p[name + ".g"], p[name + ".b"])]
    inv = 1.0 / _sqrt(_dot(x, x) * (1.0 / n) + cfg.eps)
    return [xi * inv * g for xi, g in zip(x, p[name + ".g"])]


def _ref_act(u, cfg):
    if cfg.mlp == "relu":
        return [_relu(a) for a in u]
    c = math.sqrt(2 / math.pi)
    return [0.5 * a * (1.0 + _tanh(c * (a + 0.044715 * a * a * a))) for a in u]


def _ref_mlp(x, p, prefix, cfg, index=None):
    """act(x W_fc + b) W_proj + b, or with SwiGLU; index picks one expert's slice."""
    def w(name):
        key = f"{prefix}.{name}"
        if key not in p:
            return None
        return p[key] if index is None else p[key][index]

    up = _vec_mat(x, w("fc.W"), w("fc.b"))
    if cfg.mlp == "swiglu":
        gate = _vec_mat(x, w("gate.W"), w("gate.b"))
        hidden = [gi * _sigmoid(gi) * ui for gi, ui in zip(gate, up)]
    else:
        hidden = _ref_act(up, cfg)
    return _vec_mat(hidden, w("proj.W"), w("proj.b"))


def _ref_rotate(vec, position, cfg):
    out = list(vec)
    d_h = len(vec)
    for i in range(d_h // 2):
        angle = position * cfg.rope_base ** (-2 * i / d_h)
        c, s = math.cos(angle), math.sin(angle)
        out[2 * i] = vec[2 * i] * c - vec[2 * i + 1] * s
        out[2 * i + 1] = vec[2 * i] * s + vec[2 * i + 1] * c
    return out


def _ref_attention(xs, p, prefix, cfg):
    S, D, H = len(xs), cfg.d_model, cfg.n_heads
    d_h = D // H
    qkv = [_vec_mat(x, p[prefix + ".qkv.W"], p.get(prefix + ".qkv.b")) for x in xs]
    merged = [[None] * D for _ in range(S)]
    for h in range(H):
        cols = range(h * d_h, (h + 1) * d_h)
        q = [[row[c] for c in cols] for row in qkv]
        k = [[row[D + c] for c in cols] for row in qkv]
        v = [[row[2 * D + c] for c in cols] for row in qkv]
        if cfg.position == "rotary":
            q = [_ref_rotate(q[t], t, cfg) for t in range(S)]
            k = [_ref_rotate(k[t], t, cfg) for t in range(S)]
        for i in range(S):
            scores = [_dot(q[i], k[j]) * (1 / math.sqrt(d_h)) for j in range(i + 1)]
            top = max(s.v for s in scores)
            e = [_exp(s - top) for s in scores]
            total = _total(e)
            for c in range(d_h):
                merged[i][h * d_h + c] = _total([e[j] / total * v[j][c] for j in range(i + 1)])
    return [_vec_mat(m, p[prefix + ".proj.W"], p.get(prefix + ".proj.b")) for m in merged]


def _ref_moe(rows, p, prefix, cfg, B, S):
    """The documented mixture of experts over the T = B S rows (token t = b S + s).
    Returns (outputs [T] of [D], the auxiliary loss, the routed load)."""
    T, N, K, D = len(rows), cfg.n_experts, cfg.top_k, cfg.d_model
    logits = [_vec_mat(x, p[prefix + ".router.W"]) for x in rows]
    bias = p.get(prefix + ".select.b")
    chosen, gates, probs = [], [], []
    for z in logits:
        if cfg.router == "softmax":
            top = max(a.v for a in z)
            e = [_exp(a - top) for a in z]
            total = _total(e)
            s = [ei / total for ei in e]
            probs.append(s)
            normalize = bool(cfg.renormalize)
        else:
            s = [_sigmoid(a) for a in z]
            total = _total(s)
            probs.append([si / total for si in s])
            normalize = cfg.renormalize is None or cfg.renormalize
        select = [s[i].v + (bias[i].v if bias is not None else 0.0) for i in range(N)]
        order = sorted(range(N), key=lambda i: (-select[i], i))[:K]   # ties: lower index
        a = [s[i] for i in order]
        if normalize:
            total = _total(a)
            a = [ai / total for ai in a]
        chosen.append(order)
        gates.append(a)
    C = (max(sum(i in c for c in chosen) for i in range(N)) if cfg.capacity_factor is None
         else math.ceil(cfg.capacity_factor * T * K / N))
    taken = [0] * N
    outputs = []
    shared = f"{prefix}.shared"
    for t, x in enumerate(rows):
        y = [Scalar(0.0)] * D
        for k, i in enumerate(chosen[t]):
            if taken[i] >= C:                     # expert i is full: dropped
                continue
            taken[i] += 1
            out = _ref_mlp(x, p, prefix + ".experts", cfg, index=i)
            y = [yi + gates[t][k] * oi for yi, oi in zip(y, out)]
        if cfg.n_shared_experts:
            y = [yi + si for yi, si in zip(y, _ref_mlp(x, p, shared, cfg))]
        outputs.append(y)
    aux = Scalar(0.0)
    groups = [range(T)] if cfg.aux_loss == "batch" else [range(b * S, (b + 1) * S)
                                                         for b in range(B)]
    for group in groups:
        n = len(group)
        for i in range(N):
            f_i = sum(i in chosen[t] for t in group) / (n * K)
            P_i = _total([probs[t][i] for t in group]) * (1.0 / n)
            aux = aux + cfg.aux_loss_coef * N * f_i * P_i * (1.0 / len(groups))
    if cfg.z_loss_coef:
        for z in logits:
            top = max(a.v for a in z)
            lse = _log(_total([_exp(a - top) for a in z])) + top
            aux = aux + cfg.z_loss_coef * lse * lse * (1.0 / T)
    return outputs, aux, [sum(i in c for c in chosen) for i in range(N)]


def reference_loss(cfg, params, ids, targets):
    """The MoE decoder's loss (pre-norm or post-norm, learned or rotary positions, tied or
    untied head, no dropout) on Scalars: params {name: object array of Scalars}."""
    p = params
    B, S = ids.shape
    xs_all = []
    for b in range(B):
        xs = []
        for t in range(S):
            x = list(p["wte"][ids[b, t]])
            if cfg.position == "learned":
                x = [a + c for a, c in zip(x, p["wpe"][t])]
            xs.append(x)
        xs_all.append(xs)
    aux = Scalar(0.0)
    for layer in range(cfg.n_layers):
        pre = f"h{layer}"
        moe = cfg.n_experts > 0 and (layer + 1) % cfg.moe_every == 0
        post = cfg.norm_placement == "post"
        mids = []
        for xs in xs_all:
            if post:
                a = _ref_attention(xs, p, pre + ".attn", cfg)
                mids.append([_ref_norm([u + v for u, v in zip(x, at)], p, pre + ".ln1", cfg)
                             for x, at in zip(xs, a)])
            else:
                a = _ref_attention([_ref_norm(x, p, pre + ".ln1", cfg) for x in xs], p,
                                   pre + ".attn", cfg)
                mids.append([[u + v for u, v in zip(x, at)] for x, at in zip(xs, a)])
        flat = [x for xs in mids for x in xs]                         # token b S + s
        inputs = flat if post else [_ref_norm(x, p, pre + ".ln2", cfg) for x in flat]
        if moe:
            outs, layer_aux, _ = _ref_moe(inputs, p, pre + ".moe", cfg, B, S)
            aux = aux + layer_aux
        else:
            outs = [_ref_mlp(x, p, pre + ".mlp", cfg) for x in inputs]
        summed = [[u + v for u, v in zip(x, o)] for x, o in zip(flat, outs)]
        if post:
            summed = [_ref_norm(x, p, pre + ".ln2", cfg) for x in summed]
        xs_all = [summed[b * S:(b + 1) * S] for b in range(B)]
    nll = []
    for b in range(B):
        for t in range(S):
            x = xs_all[b][t]
            if cfg.norm_placement == "pre":
                x = _ref_norm(x, p, "lnf", cfg)
            W = p["wte"].T if cfg.tied_head else p["head.W"]
            logits = _vec_mat(x, W, p.get("head.b"))
            if targets[b, t] == -100:
                continue
            top = max(z.v for z in logits)
            lse = _log(_total([_exp(z - top) for z in logits])) + top
            nll.append(lse - logits[targets[b, t]])
    return _total(nll) * (1.0 / len(nll)) + aux


def _scalars(model):
    return {name: np.vectorize(Scalar, otypes=[object])(
        np.array(to_numpy(model.params[name]), dtype=np.float64)) for name in model.params.names}


SMALL = dict(vocab_size=11, max_seq_len=8, d_model=8, n_layers=2, n_heads=2, d_expert=6,
             n_experts=4, top_k=2)
MOE_CONFIGS = {
    "softmax-every-block-gelu-zloss": DecoderConfig(**SMALL, z_loss_coef=0.05,
                                                    aux_loss_coef=0.1),
    "softmax-renormalised-every-2nd-shared-capacity": DecoderConfig(
        **SMALL, renormalize=True, moe_every=2, n_shared_experts=1, capacity_factor=1.0),
    "switch-top1-capacity-untied-relu-post": DecoderConfig(
        **{**SMALL, "top_k": 1}, capacity_factor=1.25, tied_head=False, mlp="relu",
        norm_placement="post"),
    "sigmoid-every-block-swiglu-shared2-sequence": DecoderConfig.llama(
        11, 8, 8, 2, 2, d_ff=12, n_experts=4, top_k=2, router="sigmoid", n_shared_experts=2,
        d_expert=5, aux_loss="sequence", aux_loss_coef=0.2),
    "sigmoid-every-2nd-swiglu-capacity-zloss": DecoderConfig.llama(
        11, 8, 8, 2, 2, d_ff=12, n_experts=4, top_k=3, router="sigmoid", moe_every=2,
        capacity_factor=0.75, z_loss_coef=0.02),
    "sigmoid-unnormalised-gelu-shared": DecoderConfig(
        **SMALL, router="sigmoid", renormalize=False, n_shared_experts=1),
}


def _moe_model(cfg, seed=0):
    model = DecoderLM(cfg).init(seed)
    randomize(model.params, np.random.default_rng(seed + 1))
    return model


def _moe_data(cfg, B=2, S=5, seed=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (B, S))
    targets = rng.integers(0, cfg.vocab_size, (B, S))
    targets[1, 2] = -100
    return ids, targets


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_moe_decoder_loss_and_every_gradient_equal_the_reference(name):
    cfg = MOE_CONFIGS[name]
    model = _moe_model(cfg)
    ids, targets = _moe_data(cfg)
    _, loss = model.forward(asarray(ids, "int64"), asarray(targets, "int64"))
    model.backward()
    if cfg.capacity_factor is not None:           # the case really drops tokens
        assert any(int(np.sum(s["load"])) > int(np.sum(s["kept_load"]))
                   for s in model.moe_stats.values())
    params = _scalars(model)
    ref = reference_loss(cfg, params, ids, targets)
    assert abs(float(loss) - ref.v) < 1e-12 * abs(ref.v)
    backprop(ref)
    for n in model.params.names:
        expected = np.vectorize(lambda s: s.g, otypes=[float])(params[n])
        got = to_numpy(model.params.grad_of(n))
        if n.endswith(".select.b"):                   # the bias receives no gradient
            assert np.all(got == 0.0) and np.all(expected == 0.0)
            continue
        assert_close(f"d{n}", got, expected)


def test_the_reference_tells_the_routing_rules_apart():
    """Not blind: the reference with a changed rule (top_k, capacity, renormalisation, the
    balancing variant) gives another loss, far beyond the tolerance."""
    cfg = MOE_CONFIGS["softmax-renormalised-every-2nd-shared-capacity"]
    model = _moe_model(cfg)
    ids, targets = _moe_data(cfg)
    base = reference_loss(cfg, _scalars(model), ids, targets).v
    for wrong in (replace(cfg, renormalize=False), replace(cfg, capacity_factor=None),
                  replace(cfg, top_k=1), replace(cfg, aux_loss="sequence", aux_loss_coef=1.0)):
        assert abs(reference_loss(wrong, _scalars(model), ids, targets).v - base) > 1e-6


@pytest.mark.parametrize("name", ["softmax-renormalised-every-2nd-shared-capacity",
                                  "sigmoid-every-block-swiglu-shared2-sequence"])
def test_moe_decoder_loss_matches_finite_differences(name):
    cfg = MOE_CONFIGS[name]
    model = _moe_model(cfg)
    ids, targets = (asarray(a, "int64") for a in _moe_data(cfg))

    def loss_fn():
        return model.forward(ids, targets)[1]

    model.params.zero_grad()
    loss_fn()
    model.backward()
    names = [n for n in model.params.names if not n.endswith(".select.b")]
    errors = directional_errors(model.params, loss_fn, np.random.default_rng(4), names)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-6, (worst, errors[worst])


def test_auxiliary_losses_are_added_to_the_loss(rng):
    cfg = MOE_CONFIGS["softmax-every-block-gelu-zloss"]
    model = _moe_model(cfg)
    ids, targets = (asarray(a, "int64") for a in _moe_data(cfg))
    logits, loss = model.forward(ids, targets)
    ce, _ = F.cross_entropy_forward(logits, targets)
    aux = sum(float(s["aux_loss"]) for s in model.moe_stats.values())
    assert aux > 0 and abs(float(loss) - (float(ce) + aux)) < 1e-14
    plain = _moe_model(replace(cfg, aux_loss_coef=0.0, z_loss_coef=0.0))
    logits2, loss2 = plain.forward(ids, targets)
    np.testing.assert_array_equal(to_numpy(logits2), to_numpy(logits))
    assert float(loss2) == float(ce)


def test_recomputation_and_cached_generation_with_experts(rng):
    """recompute='full' gives the same gradients bit for bit; with dropless routing the
    KV-cached logits equal the uncached forward's."""
    cfg = MOE_CONFIGS["sigmoid-every-block-swiglu-shared2-sequence"]
    ids, targets = (asarray(a, "int64") for a in _moe_data(cfg))
    grads = []
    for recompute in ("none", "full"):
        model = _moe_model(replace(cfg, recompute=recompute))
        model.forward(ids, targets)
        model.backward()
        grads.append(to_numpy(model.params.grad).copy())
    np.testing.assert_array_equal(grads[0], grads[1])
    model = _moe_model(cfg)
    full = to_numpy(model.forward(ids)[0])
    cache = model.new_kv_cache(2)
    first = to_numpy(model.forward_with_cache(ids[:, :3], cache))
    rest = to_numpy(model.forward_with_cache(ids[:, 3:], cache))
    assert_close("cached logits", np.concatenate([first, rest], axis=1), full)


def test_update_expert_bias_moves_the_selection_bias_only():
    cfg = MOE_CONFIGS["sigmoid-every-block-swiglu-shared2-sequence"]
    model = _moe_model(cfg)
    ids, _ = _moe_data(cfg)
    before = to_numpy(model.params.data).copy()
    with pytest.raises(RuntimeError, match="needs a forward first"):
        model.update_expert_bias(0.01)
    model.forward(asarray(ids, "int64"))
    model.update_expert_bias(0.01)
    after = to_numpy(model.params.data)
    for n in model.params.names:
        start, stop = model.params.offsets[n]
        if n.endswith(".select.b"):
            load = model.moe_stats[int(re.match(r"h(\d+)\.", n).group(1))]
            step = 0.01 * np.sign(np.mean(load["load"]) - load["load"])
            assert_close(n, after[start:stop] - before[start:stop], step, tol=1e-12)
        else:
            np.testing.assert_array_equal(after[start:stop], before[start:stop])
    with pytest.raises(ValueError, match="needs router='sigmoid'"):
        _moe_model(MOE_CONFIGS["softmax-every-block-gelu-zloss"]).update_expert_bias(0.1)


def test_dense_configs_are_untouched_and_moe_layers_are_every_kth():
    dense = DecoderConfig(vocab_size=11, max_seq_len=8, d_model=8, n_layers=4, n_heads=2)
    assert dense.moe_layers == [] and dense.moe_spec() is None
    assert not any(".moe." in n for n in dense.param_shapes())
    cfg = replace(dense, n_experts=4, moe_every=2)
    assert cfg.moe_layers == [1, 3]
    names = cfg.param_shapes()
    assert "h1.moe.router.W" in names and "h0.mlp.fc.W" in names and "h1.mlp.fc.W" not in names
    assert names["h3.moe.experts.fc.W"] == (4, 8, 32)
    assert names["h3.moe.experts.proj.W"] == (4, 32, 8)
    assert "h1.moe.select.b" not in names
    assert replace(cfg, router="sigmoid").param_shapes()["h1.moe.select.b"] == (4,)


def test_float32_moe_model_stays_float32():
    cfg = replace(MOE_CONFIGS["softmax-renormalised-every-2nd-shared-capacity"], dtype="float32")
    model = _moe_model(cfg)
    ids, targets = (asarray(a, "int64") for a in _moe_data(cfg))
    logits, loss = model.forward(ids, targets)
    model.backward()
    assert to_numpy(logits).dtype == np.float32 and to_numpy(model.params.grad).dtype == np.float32
    assert np.all(np.isfinite(to_numpy(model.params.grad)))


def test_ops_run_on_the_strict_backend(rng):
    """The ops use only the array API: on array-api-strict they give NumPy's numbers."""
    xps = pytest.importorskip("array_api_strict")
    T, N, K, D = 6, 4, 2, 3
    z = _logits(rng, T, N)
    x = rng.standard_normal((T, D))
    W1, W2 = rng.standard_normal((N, D, 5)), rng.standard_normal((N, 5, D))

    def run(xp_asarray):
        bias = xp_asarray(0.01 * np.arange(N))
        routed, c_r = M.router_forward(xp_asarray(z), K, "sigmoid", bias=bias)
        plan = M.moe_plan(routed.experts, N, 0.75)
        xe, c_d = M.moe_dispatch_forward(xp_asarray(x), plan)
        ye, c_e = M.expert_mlp_forward(xe, xp_asarray(W1), None, xp_asarray(W2), None, "gelu")
        y, c_c = M.moe_combine_forward(ye, routed.gates, plan)
        loss, c_b = M.load_balancing_loss_forward(routed.probs, routed.experts, 0.1)
        dye, dg = M.moe_combine_backward(xp_asarray(np.ones((T, D))), c_c)
        dxe = M.expert_mlp_backward(dye, c_e)[0]
        dx = M.moe_dispatch_backward(dxe, c_d)
        dz = M.router_backward(dg, c_r, M.load_balancing_loss_backward(1.0, c_b))
        return [np.asarray(to_numpy(a)) for a in (y, loss, dx, dz)]

    for a, b in zip(run(np.asarray), run(xps.asarray)):
        assert_close("strict", b, a, tol=1e-14)


@pytest.mark.parametrize("name", ["softmax-renormalised-every-2nd-shared-capacity",
                                  "sigmoid-every-block-swiglu-shared2-sequence"])
def test_moe_decoder_on_each_backend(name, backend_name):
    """The MoE decoder's loss and gradients on every backend equal the NumPy ones."""
    from tfcore import backend

    cfg = MOE_CONFIGS[name]
    ids, targets = _moe_data(cfg)
    results = []
    for which in ("numpy", backend_name):
        backend.set_backend(which)
        model = _moe_model(cfg)
        _, loss = model.forward(asarray(ids, "int64"), asarray(targets, "int64"))
        model.backward()
        results.append((float(loss), np.array(to_numpy(model.params.grad))))
    (loss0, grad0), (loss1, grad1) = results
    assert abs(loss1 - loss0) < 1e-13 * abs(loss0)
    assert_close("grad", grad1, grad0, tol=1e-12)


# ---------------------------------------------------------------------------------------
# Bad input: a clear error before any work


@pytest.mark.parametrize("overrides,message", [
    (dict(n_experts=4, top_k=5), "top_k (5) must be at most n_experts (4)"),
    (dict(n_experts=4, top_k=0), "top_k must be an integer >= 1, got 0"),
    (dict(n_experts=-1), "n_experts must be an integer >= 0, got -1"),
    (dict(n_experts=4, capacity_factor=0.0), "capacity_factor must be positive, got 0.0"),
    (dict(n_experts=4, capacity_factor=-1.5), "capacity_factor must be positive, got -1.5"),
    (dict(n_experts=4, moe_every=0), "moe_every must be an integer >= 1, got 0"),
    (dict(n_experts=4, moe_every=3), "moe_every (3) must be at most n_layers (2)"),
    (dict(n_experts=4, router="relu"), "router must be one of ('softmax', 'sigmoid')"),
    (dict(n_shared_experts=1), "n_shared_experts = 1 needs routed experts"),
    (dict(n_experts=4, aux_loss_coef=-0.1), "aux_loss_coef must be >= 0, got -0.1"),
    (dict(n_experts=4, z_loss_coef=float("nan")), "z_loss_coef must be >= 0, got nan"),
    (dict(n_experts=4, aux_loss="global"), "aux_loss must be one of ('batch', 'sequence')"),
    (dict(n_experts=4, d_expert=0), "d_expert must be an integer >= 1, got 0"),
    (dict(n_experts=4, renormalize="yes"), "renormalize must be True, False or None"),
    (dict(n_experts=2.0), "n_experts must be an integer >= 0, got 2.0"),
])
def test_bad_moe_configs_are_refused_clearly(overrides, message):
    base = dict(vocab_size=11, max_seq_len=8, d_model=8, n_layers=2, n_heads=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        DecoderConfig(**base, **overrides).validate()


def test_bad_op_inputs_are_refused_clearly(rng):
    z = _logits(rng, 4, 3)
    message = "top_k must be at most the number of experts N_E = 3, got 4"
    with pytest.raises(ValueError, match=re.escape(message)):
        M.router_forward(z, 4)
    with pytest.raises(ValueError, match="top_k must be at least 1, got 0"):
        M.router_forward(z, 0)
    with pytest.raises(ValueError, match="score must be one of"):
        M.router_forward(z, 1, "relu")
    bad = z.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="logits must be finite"):
        M.router_forward(bad, 1)
    with pytest.raises(ValueError, match=re.escape("bias must have shape (3,)")):
        M.router_forward(z, 1, "sigmoid", bias=np.zeros(4))
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        M.moe_plan(np.zeros((4, 1), dtype=np.int64), 3, 0.0)
    with pytest.raises(ValueError, match=re.escape("experts must lie in [0, 3), found 3")):
        M.moe_plan(np.array([[0], [3]]), 3)
    with pytest.raises(ValueError, match="K distinct experts"):
        M.moe_plan(np.array([[0, 0], [1, 2]]), 3)
    with pytest.raises(TypeError, match="experts must be an integer array"):
        M.moe_plan(np.zeros((2, 1)), 3)
    plan = M.moe_plan(np.array([[0], [2]]), 3)
    with pytest.raises(ValueError, match=re.escape("x must have shape (2, 5)")):
        M.moe_dispatch_forward(np.zeros((3, 5)), plan)
    with pytest.raises(TypeError, match="plan must be a DispatchPlan"):
        M.moe_dispatch_forward(np.zeros((2, 5)), (1, 2))
    with pytest.raises(ValueError, match=re.escape("W_proj must have shape (2, 4, 3)")):
        M.expert_mlp_forward(np.zeros((2, 1, 3)), np.zeros((2, 3, 4)), None,
                             np.zeros((2, 3, 4)), None)
    with pytest.raises(ValueError, match="needs W_gate"):
        M.expert_mlp_forward(np.zeros((2, 1, 3)), np.zeros((2, 3, 4)), None,
                             np.zeros((2, 4, 3)), None, "swiglu")
    with pytest.raises(ValueError, match="coef must be >= 0"):
        M.load_balancing_loss_forward(np.full((2, 3), 1 / 3), np.array([[0], [1]]), -1.0)


def test_backwards_check_their_upstream_gradient(rng):
    z = _logits(rng, 4, 3)
    routed, cache = M.router_forward(z, 2)
    with pytest.raises(ValueError, match=re.escape("dgates must have shape (4, 2)")):
        M.router_backward(np.zeros((4, 3)), cache)
    with pytest.raises(TypeError, match="dgates must have dtype float64"):
        M.router_backward(np.zeros((4, 2), dtype=np.float32), cache)
    with pytest.raises(ValueError, match=re.escape("dprobs must have shape (4, 3)")):
        M.router_backward(np.zeros((4, 2)), cache, dprobs=np.zeros((4, 2)))
    plan = M.moe_plan(routed.experts, 3)
    xe, c_d = M.moe_dispatch_forward(rng.standard_normal((4, 2)), plan)
    with pytest.raises(ValueError, match="dxe must have shape"):
        M.moe_dispatch_backward(np.zeros((3, plan.capacity + 1, 2)), c_d)
    _, c_c = M.moe_combine_forward(xe, routed.gates, plan)
    with pytest.raises(ValueError, match=re.escape("dy must have shape (4, 2)")):
        M.moe_combine_backward(np.zeros((4, 3)), c_c)
    _, c_b = M.load_balancing_loss_forward(routed.probs, routed.experts)
    with pytest.raises(ValueError, match="dloss must be a scalar"):
        M.load_balancing_loss_backward(np.zeros(2), c_b)
