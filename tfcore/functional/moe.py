"""Mixture of experts: the router, the dispatch and combine, the batched experts and the
load-balancing terms, as forward/backward pairs.

Shape letters: T tokens (the rows of the micro-batch, B S flattened), D width, N_E routed
experts, K experts per token (top-k), C slots per expert (the capacity), F an expert's hidden
width, A the (token, slot) assignments that keep their place (at most T K).

The semantics, stated once (the tests' reference is written from this text):

* **Router.** From the logits z [T, N_E] (z = x W_router, made by the caller) the scores are
  softmax(z) (Switch, Mixtral) or sigmoid(z) (DeepSeek-V3). Each token selects the K experts
  with the largest *selection scores*: the scores, plus the selection bias b [N_E] when one is
  given (DeepSeek-V3's auxiliary-loss-free balancing: the bias enters the selection only).
  **Tie rule:** among equal selection scores the lower expert index wins; slot k = 0 holds
  the best expert, then k = 1, ... (a stable sort of the negated selection scores).
  The gate of slot k is the *unbiased* score a_k = score[e_k], divided by a_0 + ... + a_{K-1}
  when `normalize` is true (the default for sigmoid, as in DeepSeek-V3; off by default for
  softmax, as in Switch; Mixtral's softmax over the top k equals softmax with normalize=True).
  The selection is a constant of the backward: gradients reach z only through the K selected
  gates (and through the router probabilities when a balancing loss reads them).
  The router probabilities P [T, N_E] that the balancing losses read are softmax(z), or for
  sigmoid the scores normalised over all experts, s / sum_j s_j (DeepSeek-V3's s').
* **Capacity and dropping.** Expert i takes at most C assignments. With a capacity factor c,
  C = ceil(c T K / N_E); with None (dropless) C is the largest load, so nothing is dropped.
  **Drop rule:** each expert keeps its assignments in token order (token t before token
  t + 1; a token appears at most once per expert) and drops those past its first C. A dropped
  assignment contributes nothing to the output and gets no gradient; its token keeps its
  other slots (and the residual stream).
* **Dispatch and combine.** Dispatch gathers the kept rows of x into an expert-major buffer
  [N_E, C, D] (row position[a] of expert expert[a]; unused slots are zero); the experts map it
  to [N_E, C, D]; combine scatters each kept row back to its token, weighted by its gate:
  y[t] = sum over kept slots k of g[t, k] E_{e[t, k]}(x[t]).
* **Balancing.** f_i = (assignments routed to expert i) / (T K), counted before dropping, so
  that sum_i f_i = 1 and a balanced router gives f_i = 1/N_E; P_i = mean over tokens of P[t, i].
  Switch / GShard: L = alpha N_E sum_i f_i P_i (alpha at uniform load, alpha N_E when every
  token goes to one expert with probability 1); f carries no gradient. DeepSeek's
  sequence-wise variant computes the same within each sequence and averages over sequences.
  The router z-loss (ST-MoE) is beta mean_t (log sum_i exp z[t, i])^2. DeepSeek-V3's
  auxiliary-loss-free update is b_i <- b_i + gamma sign(mean load - load_i), no gradient.

Every op computes through the namespace of its inputs (NumPy, CuPy, array-api-strict); the
integer bookkeeping (positions in each expert's buffer) uses a cumulative sum of one-hot rows.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .. import backend, checks
from ..backend import matmul, namespace
from .activations import (
    GELU_APPROXIMATIONS,
    _sigmoid,
    gelu_backward,
    gelu_forward,
    relu_backward,
    relu_forward,
    swiglu_backward,
    swiglu_forward,
)

ROUTERS = ("softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("gelu", "relu", "swiglu")


def _one_hot(experts, n_experts: int, dtype):
    """experts [...] integers in [0, N_E) -> [..., N_E] of 0/1 in `dtype`."""
    xp = namespace(experts)
    return xp.astype(experts[..., None] == xp.arange(n_experts), dtype)


def _check_experts(name, experts, leading: tuple, n_experts: int):
    checks.integer_ids(name, experts, n_experts)
    checks.shape(name, experts, leading)


# --------------------------------------------------------------------------------------
# Router


class RouterCache(NamedTuple):
    score: str          # "softmax" | "sigmoid"
    scores: object      # [T, N_E]: softmax(z) or sigmoid(z)
    mask: object        # [T, K, N_E] one-hot of the selected experts (a constant)
    gates: object       # [T, K]
    total: object       # [T, 1]: the sum of the K selected scores (normalize), else None
    probs: object       # [T, N_E]: the router probabilities P (for sigmoid: s / sum s)
    ssum: object        # [T, 1]: sum over all experts of s (sigmoid), else None
    shape: tuple        # (T, K)
    dtype: object
    xp: object


class Routed(NamedTuple):
    gates: object       # [T, K] float
    experts: object     # [T, K] int64: slot k's expert, best first
    probs: object       # [T, N_E] float: the router probabilities the balancing losses read


def check_groups(groups, n_experts: int, top_k: int):
    """(G, M) of node-limited routing, checked: G divides N_E, 1 <= M <= G and the M groups
    hold at least K experts; None stays None."""
    if groups is None:
        return None
    if not isinstance(groups, tuple) or len(groups) != 2:
        raise ValueError(f"groups must be (n_groups, max_groups) or None, got {groups!r}")
    n_groups = checks.integer("n_groups", groups[0], least=1)
    max_groups = checks.integer("max_groups", groups[1], least=1)
    if n_experts % n_groups:
        raise ValueError(f"the number of expert groups ({n_groups}) must divide the number of "
                         f"experts N_E = {n_experts}")
    if max_groups > n_groups:
        raise ValueError(f"max_groups ({max_groups}) must be at most the number of groups "
                         f"({n_groups})")
    if max_groups * (n_experts // n_groups) < top_k:
        raise ValueError(f"max_groups = {max_groups} groups of {n_experts // n_groups} experts "
                         f"hold fewer than top_k = {top_k} experts")
    return n_groups, max_groups


def _limit_to_groups(select, top_k: int, groups):
    """The selection scores [T, N_E] with every expert outside each token's M best groups
    set to -inf: a group's score is the sum of its ceil(K / M) highest selection scores
    (DeepSeek-V3's node-limited routing; ties: the lower group index wins)."""
    xp = namespace(select)
    n_groups, max_groups = groups
    tokens, n_experts = select.shape
    per = n_experts // n_groups
    grouped = xp.reshape(select, (tokens, n_groups, per))               # [T, G, N_E / G]
    take = -(-top_k // max_groups)                                      # ceil(K / M)
    best = -xp.sort(-grouped, axis=-1)[..., :take]                      # [T, G, ceil(K/M)]
    order = xp.argsort(-xp.sum(best, axis=-1), axis=-1, stable=True)    # [T, G]
    kept = xp.sum(_one_hot(order[:, :max_groups], n_groups, xp.int64), axis=1) > 0   # [T, G]
    allowed = xp.reshape(xp.broadcast_to(kept[:, :, None], (tokens, n_groups, per)),
                         (tokens, n_experts))
    return xp.where(allowed, select, xp.full_like(select, -math.inf))


def router_forward(logits, top_k: int, score: str = "softmax", normalize: bool | None = None,
                   bias=None, groups=None):
    """Top-k routing of T tokens over N_E experts (the module docstring states the rules).

    logits [T, N_E]; top_k an integer in [1, N_E]; score 'softmax' | 'sigmoid'; normalize
    True / False / None (None: True for sigmoid, False for softmax); bias [N_E] or None, the
    selection bias (selection only, never the gates); groups (G, M) or None: node-limited
    routing, the N_E experts in G groups of consecutive experts (a node's, or an expert-
    parallel rank's) and each token's K experts taken from its M best groups only
    (_limit_to_groups: the selection is still a constant of the backward)
    ->  Routed(gates [T, K], experts [T, K] int64, probs [T, N_E]), cache.
    The logits (and the bias) must be finite: a nan would make the selection meaningless.
    """
    xp = checks.float_inputs(logits=logits, bias=bias)
    checks.ndim("logits", logits, 2)
    n_experts = checks.width("logits", logits, "N_E")
    score = checks.choice("score", score, ROUTERS)
    top_k = checks.integer("top_k", top_k, least=1)
    if top_k > n_experts:
        raise ValueError(f"top_k must be at most the number of experts N_E = {n_experts}, "
                         f"got {top_k}")
    if normalize is None:
        normalize = score == "sigmoid"
    normalize = checks.boolean("normalize", normalize)
    groups = check_groups(groups, n_experts, top_k)
    if bias is not None:
        checks.shape("bias", bias, (n_experts,))
        if not bool(xp.all(xp.isfinite(bias))):
            raise ValueError("bias must be finite (it shifts the selection scores)")
    if not bool(xp.all(xp.isfinite(logits))):
        raise ValueError("logits must be finite: a nan or inf router logit has no top-k")
    if score == "softmax":
        m = xp.max(logits, axis=-1, keepdims=True)                      # [T, 1]
        scores = xp.exp(logits - m)
        scores /= xp.sum(scores, axis=-1, keepdims=True)                # [T, N_E]
        probs, ssum = scores, None
    else:
        scores = _sigmoid(logits)                                       # [T, N_E]
        ssum = xp.sum(scores, axis=-1, keepdims=True)                   # [T, 1]
        probs = scores / ssum
    select = scores if bias is None else scores + bias                  # [T, N_E]
    if groups is not None:
        select = _limit_to_groups(select, top_k, groups)
    order = xp.argsort(-select, axis=-1, stable=True)                   # ties: lower index first
    experts = xp.astype(order[:, :top_k], xp.int64)                     # [T, K]
    mask = _one_hot(experts, n_experts, logits.dtype)                   # [T, K, N_E]
    gates = xp.sum(mask * scores[:, None, :], axis=-1)                  # a_k = score[e_k]
    total = None
    if normalize:
        total = xp.sum(gates, axis=-1, keepdims=True)                   # [T, 1]
        gates = gates / total
    cache = RouterCache(score, scores, mask, gates, total, probs, ssum,
                        tuple(gates.shape), gates.dtype, xp)
    return Routed(gates, experts, probs), cache


def router_backward(dgates, cache: RouterCache, dprobs=None):
    """The router's VJP: the selection (the experts) is a constant.

    dgates [T, K]; dprobs [T, N_E] or None (the balancing loss's gradient)  ->  dlogits [T, N_E]
    (the selection bias receives no gradient).
      normalize:  da_k = (dg_k - sum_j dg_j g_j) / sum_j a_j,   else da_k = dg_k
      dscore_i = sum_k da_k [e_k = i]  (+ dprobs for softmax; for sigmoid
                 + (dprobs_i - sum_j dprobs_j P_j) / sum_j s_j)
      softmax:  dz = p * (dscore - sum_j dscore_j p_j);   sigmoid:  dz = dscore * s (1 - s)
    """
    c = cache
    checks.upstream("dgates", dgates, c.shape, c.dtype, c.xp)
    if dprobs is not None:
        checks.upstream_like("dprobs", dprobs, c.probs)
    xp = c.xp
    da = dgates
    if c.total is not None:
        da = (dgates - xp.sum(dgates * c.gates, axis=-1, keepdims=True)) / c.total
    dscores = xp.sum(c.mask * da[:, :, None], axis=1)                   # [T, N_E]
    if c.score == "softmax":
        if dprobs is not None:
            dscores = dscores + dprobs
        return c.scores * (dscores - xp.sum(dscores * c.scores, axis=-1, keepdims=True))
    if dprobs is not None:
        dscores = dscores + (dprobs - xp.sum(dprobs * c.probs, axis=-1, keepdims=True)) / c.ssum
    return dscores * c.scores * (1.0 - c.scores)


# --------------------------------------------------------------------------------------
# Capacity, dispatch and combine


class DispatchPlan(NamedTuple):
    """Where each kept (token, slot) assignment goes; integer arrays, no gradient."""

    n_tokens: int       # T
    top_k: int          # K
    n_experts: int      # N_E
    capacity: int       # C, the slots of each expert
    token: object       # [A] the token of each kept assignment (in t K + k order)
    flat: object        # [A] its index t K + k into the [T, K] gates
    dest: object        # [A] its row e C + position in the [N_E C, D] buffer
    kept: object        # [T, K] bool: the assignment keeps its place
    load: object        # [N_E] int64: assignments routed to each expert, before dropping
    kept_load: object   # [N_E] int64: assignments each expert keeps (at most C)


def capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor) -> int | None:
    """C = ceil(capacity_factor T K / N_E), or None for dropless routing (capacity_factor None)."""
    n_tokens = checks.integer("n_tokens", n_tokens, least=0)
    top_k = checks.integer("top_k", top_k, least=1)
    n_experts = checks.integer("n_experts", n_experts, least=1)
    if capacity_factor is None:
        return None
    capacity_factor = checks.positive("capacity_factor", capacity_factor)
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def moe_plan(experts, n_experts: int, capacity_factor=None) -> DispatchPlan:
    """The dispatch plan of a routing: which assignments each expert keeps and in which slot.

    experts [T, K] integers in [0, N_E) (distinct within a row); capacity_factor a finite
    number > 0 or None (dropless). Expert i keeps its assignments in token order and drops
    those past its first C (see the module docstring).
    """
    n_experts = checks.integer("n_experts", n_experts, least=1)
    checks.array("experts", experts)
    checks.ndim("experts", experts, 2)
    _check_experts("experts", experts, (None, None), n_experts)
    xp = namespace(experts)
    n_tokens, top_k = experts.shape
    hot = _one_hot(xp.astype(experts, xp.int64), n_experts, xp.int64)   # [T, K, N_E]
    if top_k > 1 and n_tokens and bool(xp.any(xp.sum(hot, axis=1) > 1)):
        raise ValueError("experts must name K distinct experts in each row")
    rows = xp.reshape(hot, (n_tokens * top_k, n_experts))               # [T K, N_E]
    load = xp.sum(rows, axis=0)                                         # [N_E]
    cap = capacity(n_tokens, top_k, n_experts, capacity_factor)
    if cap is None:
        cap = int(xp.max(load)) if n_tokens else 0
    position = xp.sum(xp.cumulative_sum(rows, axis=0) * rows, axis=1) - 1   # [T K]
    kept_flat = position < cap                                          # [T K]
    flat = xp.astype(xp.nonzero(kept_flat)[0], xp.int64)                # [A]
    expert_flat = xp.reshape(xp.astype(experts, xp.int64), (-1,))
    dest = xp.take(expert_flat, flat) * cap + xp.take(position, flat)   # [A]
    kept_load = xp.sum(xp.astype(rows * xp.astype(kept_flat, xp.int64)[:, None], xp.int64),
                       axis=0)
    return DispatchPlan(n_tokens, top_k, n_experts, cap, flat // top_k, flat, dest,
                        xp.reshape(kept_flat, (n_tokens, top_k)), load, kept_load)


def _check_plan(plan):
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be a DispatchPlan from moe_plan, got {type(plan).__name__}")


class DispatchCache(NamedTuple):
    plan: DispatchPlan
    x_shape: tuple      # (T, D)
    shape: tuple        # (N_E, C, D)
    dtype: object
    xp: object


def moe_dispatch_forward(x, plan: DispatchPlan):
    """Gather the tokens to their experts.

    x [T, D]  ->  xe [N_E, C, D]: xe[e, c] = x[t] for the kept assignment of token t in slot c
    of expert e, zero in unused slots.
    """
    xp = checks.float_inputs(x=x)
    _check_plan(plan)
    checks.ndim("x", x, 2)
    width = checks.width("x", x, "D")
    checks.shape("x", x, (plan.n_tokens, width))
    checks.same_library(x=x, experts=plan.token)
    out = xp.zeros((plan.n_experts * plan.capacity, width), dtype=x.dtype)
    out = backend.scatter_add(out, plan.dest, xp.take(x, plan.token, axis=0))
    shape = (plan.n_experts, plan.capacity, width)
    return xp.reshape(out, shape), DispatchCache(plan, tuple(x.shape), shape, x.dtype, xp)


def moe_dispatch_backward(dxe, cache: DispatchCache):
    """dx[t] = sum of dxe over the slots that hold token t (a gather, then a scatter-add).

    dxe [N_E, C, D]  ->  dx [T, D]
    """
    c = cache
    checks.upstream("dxe", dxe, c.shape, c.dtype, c.xp)
    xp = c.xp
    rows = xp.take(xp.reshape(dxe, (-1, c.shape[2])), c.plan.dest, axis=0)   # [A, D]
    dx = xp.zeros(c.x_shape, dtype=dxe.dtype)
    return backend.scatter_add(dx, c.plan.token, rows)


class CombineCache(NamedTuple):
    plan: DispatchPlan
    rows: object        # [A, D]: the expert outputs of the kept assignments
    gate: object        # [A]: their gates
    ye_shape: tuple     # (N_E, C, D)
    gates_shape: tuple  # (T, K)
    shape: tuple        # (T, D)
    dtype: object
    xp: object


def moe_combine_forward(ye, gates, plan: DispatchPlan):
    """Scatter the experts' outputs back to their tokens, weighted by the gates.

    ye [N_E, C, D], gates [T, K]  ->  y [T, D], y[t] = sum over kept k of gates[t, k] ye[slot]
    (a token whose every assignment was dropped gets 0).
    """
    xp = checks.float_inputs(ye=ye, gates=gates)
    _check_plan(plan)
    checks.ndim("ye", ye, 3)
    width = checks.width("ye", ye, "D")
    checks.shape("ye", ye, (plan.n_experts, plan.capacity, width))
    checks.shape("gates", gates, (plan.n_tokens, plan.top_k))
    rows = xp.take(xp.reshape(ye, (-1, width)), plan.dest, axis=0)      # [A, D]
    gate = xp.take(xp.reshape(gates, (-1,)), plan.flat)                 # [A]
    y = xp.zeros((plan.n_tokens, width), dtype=ye.dtype)
    y = backend.scatter_add(y, plan.token, rows * gate[:, None])
    return y, CombineCache(plan, rows, gate, tuple(ye.shape), tuple(gates.shape),
                           tuple(y.shape), y.dtype, xp)


def moe_combine_backward(dy, cache: CombineCache):
    """dye[slot] = gate dy[t];  dgates[t, k] = <dy[t], ye[slot]> (0 where dropped).

    dy [T, D]  ->  dye [N_E, C, D], dgates [T, K]
    """
    c = cache
    checks.upstream("dy", dy, c.shape, c.dtype, c.xp)
    xp, plan = c.xp, c.plan
    dy_rows = xp.take(dy, plan.token, axis=0)                           # [A, D]
    dye = xp.zeros((c.ye_shape[0] * c.ye_shape[1], c.ye_shape[2]), dtype=dy.dtype)
    dye = backend.scatter_add(dye, plan.dest, dy_rows * c.gate[:, None])
    dgates = xp.zeros((c.gates_shape[0] * c.gates_shape[1],), dtype=dy.dtype)
    dgates = backend.scatter_add(dgates, plan.flat, xp.sum(dy_rows * c.rows, axis=1))
    return xp.reshape(dye, c.ye_shape), xp.reshape(dgates, c.gates_shape)


# --------------------------------------------------------------------------------------
# The experts, batched: one matmul per layer over the expert axis


class ExpertCache(NamedTuple):
    activation: str
    xe: object          # [N_E, C, D]
    W_fc: object        # [N_E, D, F]
    W_proj: object      # [N_E, F, D]
    W_gate: object      # [N_E, D, F] or None
    hidden: object      # [N_E, C, F]
    c_act: object       # the activation op's cache
    biases: tuple       # (has b_fc, has b_proj, has b_gate)
    shape: tuple        # (N_E, C, D)
    dtype: object
    xp: object


def _batched_linear(x, W, b):
    """x [N_E, C, D_in] @ W [N_E, D_in, D_out] (+ b [N_E, D_out]) -> [N_E, C, D_out]."""
    y = matmul(x, W, "moe")
    if b is not None:
        y = y + b[:, None, :]
    return y


def expert_mlp_forward(xe, W_fc, b_fc, W_proj, b_proj, activation: str = "gelu",
                       W_gate=None, b_gate=None, approximate: str = "tanh"):
    """N_E MLPs at once, experts a leading axis.

    gelu / relu:  ye = act(xe W_fc + b_fc) W_proj + b_proj
    swiglu:       ye = (silu(xe W_gate + b_gate) * (xe W_fc + b_fc)) W_proj + b_proj
    xe [N_E, C, D], W_fc [N_E, D, F], b_fc [N_E, F] or None, W_proj [N_E, F, D],
    b_proj [N_E, D] or None, W_gate [N_E, D, F] and b_gate [N_E, F] (swiglu only)
    ->  ye [N_E, C, D]. The activations are the existing ops (gelu's `approximate` as there).
    """
    xp = checks.float_inputs(xe=xe, W_fc=W_fc, b_fc=b_fc, W_proj=W_proj, b_proj=b_proj,
                             W_gate=W_gate, b_gate=b_gate)
    activation = checks.choice("activation", activation, EXPERT_ACTIVATIONS)
    approximate = checks.choice("approximate", approximate, GELU_APPROXIMATIONS)
    checks.ndim("xe", xe, 3)
    checks.ndim("W_fc", W_fc, 3)
    n_experts, width, hidden_width = W_fc.shape
    if min(n_experts, width, hidden_width) < 1:
        raise ValueError(f"W_fc must have shape (N_E, D, F) with every size >= 1, "
                         f"got {tuple(W_fc.shape)}")
    checks.shape("xe", xe, (n_experts, None, width))
    checks.shape("W_proj", W_proj, (n_experts, hidden_width, width))
    if b_fc is not None:
        checks.shape("b_fc", b_fc, (n_experts, hidden_width))
    if b_proj is not None:
        checks.shape("b_proj", b_proj, (n_experts, width))
    if activation == "swiglu":
        if W_gate is None:
            raise ValueError("activation 'swiglu' needs W_gate [N_E, D, F]")
        checks.shape("W_gate", W_gate, (n_experts, width, hidden_width))
        if b_gate is not None:
            checks.shape("b_gate", b_gate, (n_experts, hidden_width))
    elif W_gate is not None or b_gate is not None:
        raise ValueError(f"W_gate and b_gate belong to activation 'swiglu', not {activation!r}")
    up = _batched_linear(xe, W_fc, b_fc)                                # [N_E, C, F]
    if activation == "swiglu":
        gate = _batched_linear(xe, W_gate, b_gate)                      # [N_E, C, F]
        hidden, c_act = swiglu_forward(gate, up)
    elif activation == "gelu":
        hidden, c_act = gelu_forward(up, approximate)
    else:
        hidden, c_act = relu_forward(up)
    ye = _batched_linear(hidden, W_proj, b_proj)                        # [N_E, C, D]
    cache = ExpertCache(activation, xe, W_fc, W_proj, W_gate, hidden, c_act,
                        (b_fc is not None, b_proj is not None, b_gate is not None),
                        tuple(ye.shape), ye.dtype, xp)
    return ye, cache


def expert_mlp_backward(dye, cache: ExpertCache):
    """The batched MLP's VJP, expert by expert as one batched matmul each.

    dye [N_E, C, D]  ->  (dxe [N_E, C, D], dW_fc [N_E, D, F], db_fc [N_E, F] or None,
    dW_proj [N_E, F, D], db_proj [N_E, D] or None, dW_gate [N_E, D, F] or None,
    db_gate [N_E, F] or None), in the order of the forward's arguments.
    """
    c = cache
    checks.upstream("dye", dye, c.shape, c.dtype, c.xp)
    xp = c.xp
    has_fc, has_proj, has_gate = c.biases
    dW_proj = matmul(xp.matrix_transpose(c.hidden), dye, "moe")         # [N_E, F, D]
    db_proj = xp.sum(dye, axis=1) if has_proj else None                 # [N_E, D]
    dhidden = matmul(dye, xp.matrix_transpose(c.W_proj), "moe")         # [N_E, C, F]
    xe_t = xp.matrix_transpose(c.xe)                                    # [N_E, D, C]
    dW_gate = db_gate = None
    if c.activation == "swiglu":
        dgate, dup = swiglu_backward(dhidden, c.c_act)
        dW_gate = matmul(xe_t, dgate, "moe")
        db_gate = xp.sum(dgate, axis=1) if has_gate else None
        dxe = matmul(dgate, xp.matrix_transpose(c.W_gate), "moe")
    elif c.activation == "gelu":
        dup, dxe = gelu_backward(dhidden, c.c_act), None
    else:
        dup, dxe = relu_backward(dhidden, c.c_act), None
    dW_fc = matmul(xe_t, dup, "moe")                                    # [N_E, D, F]
    db_fc = xp.sum(dup, axis=1) if has_fc else None                     # [N_E, F]
    dx_fc = matmul(dup, xp.matrix_transpose(c.W_fc), "moe")             # [N_E, C, D]
    dxe = dx_fc if dxe is None else dxe + dx_fc
    return dxe, dW_fc, db_fc, dW_proj, db_proj, dW_gate, db_gate


# --------------------------------------------------------------------------------------
# Load balancing


def expert_load(experts, n_experts: int):
    """Assignments routed to each expert: experts [..., K] in [0, N_E) -> load [N_E] int64."""
    n_experts = checks.integer("n_experts", n_experts, least=1)
    checks.array("experts", experts)
    checks.integer_ids("experts", experts, n_experts)
    xp = namespace(experts)
    hot = _one_hot(xp.reshape(xp.astype(experts, xp.int64), (-1,)), n_experts, xp.int64)
    return xp.sum(hot, axis=0)


def _fractions(experts, n_experts, dtype):
    """f [..., N_E]: the share of the (token, slot) assignments of each expert, over the
    second-to-last axis of experts [..., T, K] (sum_i f_i = 1)."""
    xp = namespace(experts)
    tokens, top_k = experts.shape[-2], experts.shape[-1]
    hot = _one_hot(xp.astype(experts, xp.int64), n_experts, dtype)      # [..., T, K, N_E]
    return xp.sum(xp.sum(hot, axis=-2), axis=-2) / (tokens * top_k)


class BalanceCache(NamedTuple):
    f: object           # [..., N_E] (a constant)
    coef: float         # alpha N_E / (T (number of sequences))
    shape: tuple        # probs' shape
    dtype: object
    xp: object


def _balance_forward(name_probs, probs, experts, coef, ndim, load=None, n_tokens=None,
                     n_sequences=None):
    xp = checks.float_inputs(probs=probs)
    checks.ndim(name_probs, probs, ndim)
    n_experts = checks.width(name_probs, probs, "N_E")
    checks.array("experts", experts)
    checks.ndim("experts", experts, ndim)
    _check_experts("experts", experts, tuple(probs.shape[:-1]) + (None,), n_experts)
    top_k = checks.width("experts", experts, "K")
    checks.same_library(probs=probs, experts=experts)
    coef = checks.nonnegative("coef", coef)
    tokens = probs.shape[-2]
    sequences = probs.shape[0] if ndim == 3 else 1
    if n_tokens is not None:                      # a part of the batch: the whole one's T
        tokens = checks.integer("n_tokens", n_tokens, least=tokens)
    if n_sequences is not None:
        sequences = checks.integer("n_sequences", n_sequences, least=sequences)
    if tokens == 0 or sequences == 0:
        f = xp.zeros(tuple(probs.shape[:-2]) + (n_experts,), dtype=probs.dtype)
        return xp.zeros((), dtype=probs.dtype), BalanceCache(f, 0.0, tuple(probs.shape),
                                                              probs.dtype, xp)
    if load is None:
        f = _fractions(experts, n_experts, probs.dtype)                 # [..., N_E]
    else:                                         # the whole batch's assignments
        checks.shape("load", load, (n_experts,))
        f = xp.astype(xp.asarray(load), probs.dtype) / (tokens * top_k)     # [N_E]
    P = xp.sum(probs, axis=-2) / tokens           # [..., N_E] (this part's share)
    loss = coef * n_experts * xp.sum(f * P) / sequences
    scale = coef * n_experts / (tokens * sequences)
    return loss, BalanceCache(f, scale, tuple(probs.shape), probs.dtype, xp)


def load_balancing_loss_forward(probs, experts, coef: float = 1.0, *, load=None,
                                n_tokens: int | None = None):
    """Switch / GShard: L = coef N_E sum_i f_i P_i over all T tokens.

    probs [T, N_E] the router probabilities, experts [T, K] the selection, coef (alpha) >= 0
    ->  L [] (0-d). f_i = (assignments to i) / (T K) carries no gradient; balance gives
    f_i = P_i = 1/N_E and L = coef; collapse onto one expert with probability 1, L = coef N_E.

    A part of a batch spread over ranks passes the whole batch's load [N_E] (assignments
    to each expert) and token count n_tokens: it then returns its share, coef N_E sum_i f_i
    (1/T) sum_{t here} p_{t,i}, and the shares of the parts sum to the whole batch's L.
    """
    return _balance_forward("probs", probs, experts, coef, 2, load, n_tokens)


def sequence_balancing_loss_forward(probs, experts, coef: float = 1.0, *,
                                    n_sequences: int | None = None):
    """DeepSeek's sequence-wise variant: the Switch loss of each sequence, averaged.

    probs [B, S, N_E], experts [B, S, K]  ->  L = coef N_E (1/B) sum_b sum_i f_{b,i} P_{b,i}
    with f_{b,i} and P_{b,i} taken over the S tokens of sequence b. (DeepSeek-V3 writes
    f_i = N_E / (K S) count_i, which puts the factor N_E inside f: the same value.)
    Whole sequences of a batch spread over ranks: n_sequences the whole batch's B, and the
    shares of the parts sum to the whole batch's L.
    """
    return _balance_forward("probs", probs, experts, coef, 3, n_sequences=n_sequences)


def load_balancing_loss_backward(dloss, cache: BalanceCache):
    """dprobs[..., t, i] = dloss coef N_E f_i / (T B): f is a constant.

    dloss a number or 0-d array  ->  dprobs shaped like probs.
    """
    d = checks.scalar_upstream("dloss", dloss)
    c = cache
    xp = c.xp
    return xp.broadcast_to(xp.expand_dims(c.f * (d * c.coef), axis=-2), c.shape) * 1.0


sequence_balancing_loss_backward = load_balancing_loss_backward


class ZLossCache(NamedTuple):
    lse: object         # [T, 1]
    p: object           # [T, N_E] softmax(z)
    coef: float
    shape: tuple
    dtype: object
    xp: object
    divisor: int        # the mean's T (the whole batch's for a part of it)


def router_z_loss_forward(logits, coef: float = 1.0, *, n_tokens: int | None = None):
    """ST-MoE's z-loss: L = coef mean_t (log sum_i exp z[t, i])^2.

    logits [T, N_E]  ->  L [] (0 for T = 0); the cache keeps lse [T, 1] and softmax(z).
    A part of a batch spread over ranks passes the whole batch's token count n_tokens (the
    mean's divisor): the parts' shares then sum to the whole batch's L.
    """
    xp = checks.float_inputs(logits=logits)
    checks.ndim("logits", logits, 2)
    checks.width("logits", logits, "N_E")
    coef = checks.nonnegative("coef", coef)
    tokens = logits.shape[0]
    if n_tokens is not None:
        n_tokens = checks.integer("n_tokens", n_tokens, least=tokens)
    if tokens == 0 or n_tokens == 0:
        return xp.zeros((), dtype=logits.dtype), ZLossCache(
            None, None, coef, tuple(logits.shape), logits.dtype, xp, 0)
    divisor = tokens if n_tokens is None else n_tokens
    m = xp.max(logits, axis=-1, keepdims=True)
    e = xp.exp(logits - m)
    total = xp.sum(e, axis=-1, keepdims=True)
    lse = m + xp.log(total)                                             # [T, 1]
    loss = coef * xp.sum(lse * lse) / divisor
    return loss, ZLossCache(lse, e / total, coef, tuple(logits.shape), logits.dtype, xp,
                            divisor)


def router_z_loss_backward(dloss, cache: ZLossCache):
    """dz[t, i] = dloss coef 2 lse_t softmax(z_t)_i / T.   dloss scalar -> dlogits [T, N_E]."""
    d = checks.scalar_upstream("dloss", dloss)
    c = cache
    if c.lse is None:
        return c.xp.zeros(c.shape, dtype=c.dtype)
    return (2.0 * d * c.coef / c.divisor) * c.lse * c.p


def expert_bias_update(bias, load, rate: float):
    """DeepSeek-V3's auxiliary-loss-free step: b_i + rate sign(mean(load) - load_i).

    bias [N_E] float, load [N_E] (counts, e.g. DispatchPlan.load), rate (gamma) >= 0
    ->  a new bias [N_E]: an underloaded expert's bias rises, an overloaded one's falls,
    a balanced one's stays. No gradient is involved.
    """
    xp = checks.float_inputs(bias=bias)
    checks.ndim("bias", bias, 1)
    checks.array("load", load)
    checks.shape("load", load, tuple(bias.shape))
    checks.same_library(bias=bias, load=load)
    rate = checks.nonnegative("rate", rate)
    load = xp.astype(load, bias.dtype)
    return bias + rate * xp.sign(xp.mean(load) - load)
