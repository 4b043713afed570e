"""Expert parallelism: the experts of an MoE layer sharded over a group of ranks, the tokens
sent to them and back with all-to-alls, as forward/backward pairs.

N ranks (the expert-parallel group), N_E experts, E_l = N_E / N on each: rank j holds the
experts j E_l .. (j+1) E_l - 1 (contiguous; N_E must be divisible by N). Each rank routes
its own T_r tokens with the replicated router (tfcore.functional.moe.router_forward), then

    ep_plan      all_gather of every rank's load [N_E] -> L [N, N_E] (int64, counted): what
                 every rank sends to and receives from every other, and each row's slot
    dispatch     x [T_r, D] -> the rank's (token, slot) assignments sorted expert-major
                 (by expert, then token: for contiguous experts this is also rank-major by
                 destination) -> all_to_allv -> the arrivals, in (source rank, local expert,
                 token) order -> placed expert-major into xe [E_l, C, D]
    experts      the batched expert op on [E_l, C, D] with this rank's expert weights
    combine      ye [E_l, C, D] -> the arrivals' rows -> all_to_allv with the counts
                 transposed -> home at the rank of their token -> y[t] = sum_k g[t, k] ye[.]

and each backward runs the adjoints in reverse order; an all_to_allv's adjoint is the
all_to_allv with the transposed counts (mappings.all_to_allv_backward).

Semantics: those of one device (tfcore.functional.moe) on the tokens of all ranks
concatenated in rank order. The slots of expert e hold its assignments in that global token
order: rank i's k-th assignment to e takes slot P[i][e] + k, P[i][e] = sum_{i' < i} L[i'][e].
With a capacity C = ceil(c T K / N_E) (T = sum_i T_i, the one device's tokens) rank i keeps
its first max(0, min(L[i][e], C - P[i][e])) assignments to e, which is the one device's drop
rule (first C in token order); dropless (capacity_factor None) takes C = max_e sum_i L[i][e],
the one device's C, so that rank j's xe is rows j E_l .. (j+1) E_l - 1 of the one device's.

The router's weights are replicated and each rank's gradient of them covers its own tokens
only: `ep_moe_backward` all-reduces it over the group (reduce_router=True), the step whose
omission leaves the loss right and the router wrong. The experts' gradients are complete on
their rank (every token routed to them arrived there); under EP x DP they are summed over the
ranks holding the same experts, not over the expert-parallel group.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import backend, checks
from ..backend import matmul, namespace, to_numpy
from ..functional import moe as M
from . import mappings


def expert_parallel_group(comm, ep: int, name: str = "ep"):
    """The expert-parallel group of this rank: ep consecutive ranks of comm (ranks
    w // ep alike). ep must divide comm.size; every rank of comm must call this."""
    ep = checks.integer("ep", ep, least=1)
    if comm.size % ep:
        raise ValueError(f"the expert-parallel degree ep = {ep} must divide the number of "
                         f"ranks {comm.size}")
    if ep == comm.size:
        return comm
    return comm.split(comm.rank // ep, name=f"{name}{comm.rank // ep}")


def _check_degree(n_experts: int, comm) -> int:
    if n_experts % comm.size:
        raise ValueError(f"the number of experts N_E = {n_experts} must be divisible by the "
                         f"expert-parallel degree {comm.size} (each rank holds N_E / "
                         f"{comm.size} consecutive experts)")
    return n_experts // comm.size


class EPPlan(NamedTuple):
    """Where every assignment goes under expert parallelism (integers, no gradient)."""

    comm: object
    n_experts: int         # N_E
    n_local: int           # E_l = N_E / N
    top_k: int             # K
    n_tokens: int          # T_r, this rank's tokens
    capacity: int          # C, the slots of each expert (with a capacity factor the one
                           # device's; dropless: the busiest expert's load in this block)
    load: np.ndarray       # [N_tok, N_E] int64: assignments of token rank i's tokens to e
    kept: np.ndarray       # [N_tok, N_E] int64: those that keep their place (dropless: =
                           # load); N_tok = N unless a token group was given
    send_counts: tuple     # rows to each rank (dispatch)
    recv_counts: tuple     # rows from each rank
    send_flat: object      # [A_s] the assignments sent, as t K + k, expert-major
    send_token: object     # [A_s] their tokens
    unsort: object         # [A_s] the permutation putting them back in t K + k order
    dest: object           # [A_r] the row e_local C + slot of each arriving row


def kept_loads(load, capacity) -> np.ndarray:
    """[N, N_E] int64: the assignments each expert keeps of load [N, N_E] (each rank's
    assignments per expert, the ranks in token order): all of them when capacity is None
    (dropless), else the first `capacity` of the whole batch's, in token order."""
    load = np.asarray(load, dtype=np.int64)
    if capacity is None:
        return load
    before = np.cumsum(load, axis=0) - load                             # the earlier ranks'
    return np.clip(capacity - before, 0, load)


def ep_plan(experts, comm, n_experts: int, capacity_factor=None, tokens=None) -> EPPlan:
    """The expert-parallel dispatch plan of this rank's routing (collective: every rank of
    comm, and of tokens when given, calls it).

    experts [T_r, K] integers in [0, N_E), distinct within a row (the router's selection);
    capacity_factor a finite number > 0, or None (dropless). One all_gather of the loads
    [N_E] int64 (counted) tells every rank the whole count matrix.

    tokens: the group whose ranks hold the batch's tokens, in order (None: comm itself).
    Under EP x DP comm is a block of consecutive ranks of it (expert_parallel_group of the
    data-parallel group), the loads are gathered over tokens, and capacity and drops follow
    the whole batch's token order, as on one device; each block of comm then sends only to
    its own experts' replicas.
    """
    n_experts = checks.integer("n_experts", n_experts, least=1)
    n_local = _check_degree(n_experts, comm)
    tokens = comm if tokens is None else tokens
    if tokens.size % comm.size or (tokens.rank % comm.size) != comm.rank:
        raise ValueError(f"the expert-parallel group (size {comm.size}, rank {comm.rank}) "
                         f"must be a block of consecutive ranks of the token group (size "
                         f"{tokens.size}, rank {tokens.rank})")
    checks.array("experts", experts)
    checks.ndim("experts", experts, 2)
    checks.integer_ids("experts", experts, n_experts)
    if capacity_factor is not None:
        capacity_factor = checks.positive("capacity_factor", capacity_factor)
    xp = namespace(experts)
    chosen = np.asarray(to_numpy(experts), dtype=np.int64)              # [T_r, K] host
    n_tokens, top_k = chosen.shape
    if top_k < 1 or top_k > n_experts:
        raise ValueError(f"experts must have K columns with 1 <= K <= N_E = {n_experts}, "
                         f"got shape {tuple(chosen.shape)}")
    if n_tokens and np.any(np.diff(np.sort(chosen, axis=1), axis=1) == 0):
        raise ValueError("experts must name K distinct experts in each row")
    if tokens.check_calls and tokens.size > 1:  # bookkeeping, not counted (as call headers)
        tokens.check_same(str(top_k), "the number of experts per token K")
    flat_e = chosen.reshape(-1)                                         # [T_r K]
    mine = np.bincount(flat_e, minlength=n_experts).astype(np.int64)    # [N_E]
    load = (mine[None, :] if tokens.size == 1 else
            np.asarray(to_numpy(tokens.all_gather(xp.asarray(mine[None, :]), axis=0)),
                       dtype=np.int64))                                 # [N_tok, N_E]
    # the one device's C of the whole batch (None: dropless)
    cap = M.capacity(int(load.sum()) // top_k, top_k, n_experts, capacity_factor)
    kept = kept_loads(load, cap)                                        # [N_tok, N_E]
    g0 = tokens.rank - comm.rank                                        # this block's first
    block = kept[g0:g0 + comm.size]                                     # [N, N_E]
    if cap is None:                     # dropless: the block's busiest expert
        cap = int(block.sum(axis=0).max())
    slot0 = np.cumsum(block, axis=0) - block                            # [N, N_E]
    r = comm.rank
    order = np.argsort(flat_e, kind="stable")                           # expert, then token
    start = np.concatenate([[0], np.cumsum(mine)[:-1]])                 # [N_E]
    rank_in_expert = np.arange(order.size) - start[flat_e[order]]
    send_flat = order[rank_in_expert < block[r, flat_e[order]]]         # [A_s]
    owner = np.arange(n_experts) // n_local
    send_counts = tuple(int(block[r, owner == j].sum()) for j in range(comm.size))
    recv_counts = tuple(int(block[i, owner == r].sum()) for i in range(comm.size))
    dest = [e * cap + slot0[i, r * n_local + e] + np.arange(block[i, r * n_local + e])
            for i in range(comm.size) for e in range(n_local)]
    dest = np.concatenate(dest).astype(np.int64) if dest else np.zeros(0, np.int64)
    index = lambda a: xp.asarray(np.asarray(a, dtype=np.int64))          # noqa: E731
    return EPPlan(comm, n_experts, n_local, top_k, n_tokens, cap, load, kept, send_counts,
                  recv_counts, index(send_flat), index(send_flat // top_k),
                  index(np.argsort(send_flat, kind="stable")), index(dest))


def _check_plan(plan):
    if not isinstance(plan, EPPlan):
        raise TypeError(f"plan must be an EPPlan from ep_plan, got {type(plan).__name__}")


class EPDispatchCache(NamedTuple):
    plan: EPPlan
    c_a2a: dict
    x_shape: tuple         # (T_r, D)
    shape: tuple           # (E_l, C, D)
    dtype: object
    xp: object


def ep_dispatch_forward(x, plan: EPPlan):
    """This rank's tokens to the experts' ranks (collective).

    x [T_r, D] -> xe [E_l, C, D]: slot c of local expert e holds the row of the assignment
    in global slot c of expert r E_l + e (zero where unused), as on one device.
    """
    xp = checks.float_inputs(x=x)
    _check_plan(plan)
    checks.ndim("x", x, 2)
    width = checks.width("x", x, "D")
    checks.shape("x", x, (plan.n_tokens, width))
    checks.same_library(x=x, experts=plan.send_token)
    rows = xp.take(x, plan.send_token, axis=0)                          # [A_s, D]
    arrived, c_a2a = mappings.all_to_allv_forward(rows, plan.comm, plan.send_counts,
                                                  plan.recv_counts)     # [A_r, D]
    xe = xp.zeros((plan.n_local * plan.capacity, width), dtype=x.dtype)
    xe = backend.scatter_add(xe, plan.dest, arrived)
    shape = (plan.n_local, plan.capacity, width)
    return xp.reshape(xe, shape), EPDispatchCache(plan, c_a2a, tuple(x.shape), shape,
                                                  x.dtype, xp)


def ep_dispatch_backward(dxe, cache: EPDispatchCache):
    """The adjoint: every slot's gradient goes home and is added to its token's row.

    dxe [E_l, C, D] -> dx [T_r, D]
    """
    c = cache
    checks.upstream("dxe", dxe, c.shape, c.dtype, c.xp)
    xp, plan = c.xp, c.plan
    darrived = xp.take(xp.reshape(dxe, (-1, c.shape[2])), plan.dest, axis=0)   # [A_r, D]
    drows = mappings.all_to_allv_backward(darrived, c.c_a2a)             # [A_s, D]
    dx = xp.zeros(c.x_shape, dtype=dxe.dtype)
    return backend.scatter_add(dx, plan.send_token, drows)


class EPCombineCache(NamedTuple):
    plan: EPPlan
    c_a2a: dict
    home: object           # [A_s, D] the expert outputs of this rank's assignments
    gate: object           # [A_s] their gates
    ye_shape: tuple        # (E_l, C, D)
    gates_shape: tuple     # (T_r, K)
    shape: tuple           # (T_r, D)
    dtype: object
    xp: object


def ep_combine_forward(ye, gates, plan: EPPlan):
    """The experts' outputs back to their tokens' ranks, weighted by the gates (collective).

    ye [E_l, C, D], gates [T_r, K] -> y [T_r, D], y[t] = sum over kept k of gates[t, k]
    times the output of token t's slot k (added in k order, as on one device).
    """
    xp = checks.float_inputs(ye=ye, gates=gates)
    _check_plan(plan)
    checks.ndim("ye", ye, 3)
    width = checks.width("ye", ye, "D")
    checks.shape("ye", ye, (plan.n_local, plan.capacity, width))
    checks.shape("gates", gates, (plan.n_tokens, plan.top_k))
    out_rows = xp.take(xp.reshape(ye, (-1, width)), plan.dest, axis=0)   # [A_r, D]
    home, c_a2a = mappings.all_to_allv_forward(out_rows, plan.comm, plan.recv_counts,
                                               plan.send_counts)         # [A_s, D]
    gate = xp.take(xp.reshape(gates, (-1,)), plan.send_flat)            # [A_s]
    weighted = xp.take(home * gate[:, None], plan.unsort, axis=0)       # t K + k order
    y = xp.zeros((plan.n_tokens, width), dtype=ye.dtype)
    y = backend.scatter_add(y, xp.take(plan.send_token, plan.unsort), weighted)
    return y, EPCombineCache(plan, c_a2a, home, gate, tuple(ye.shape), tuple(gates.shape),
                             tuple(y.shape), y.dtype, xp)


def ep_combine_backward(dy, cache: EPCombineCache):
    """dgates[t, k] = <dy[t], output of slot k>; each slot's dy[t] gates[t, k] goes back to
    the expert's rank (the adjoint all_to_allv).

    dy [T_r, D] -> dye [E_l, C, D], dgates [T_r, K]
    """
    c = cache
    checks.upstream("dy", dy, c.shape, c.dtype, c.xp)
    xp, plan = c.xp, c.plan
    dy_rows = xp.take(dy, plan.send_token, axis=0)                      # [A_s, D]
    dgates = xp.zeros((c.gates_shape[0] * c.gates_shape[1],), dtype=dy.dtype)
    dgates = backend.scatter_add(dgates, plan.send_flat, xp.sum(dy_rows * c.home, axis=1))
    darrived = mappings.all_to_allv_backward(dy_rows * c.gate[:, None], c.c_a2a)   # [A_r, D]
    dye = xp.zeros((c.ye_shape[0] * c.ye_shape[1], c.ye_shape[2]), dtype=dy.dtype)
    dye = backend.scatter_add(dye, plan.dest, darrived)
    return xp.reshape(dye, c.ye_shape), xp.reshape(dgates, c.gates_shape)


# --------------------------------------------------------------------------------------
# The expert-parallel MoE layer: router, plan, dispatch, local experts, combine


EXPERT_NAMES = ("W_fc", "b_fc", "W_proj", "b_proj", "W_gate", "b_gate")


class EPMoECache(NamedTuple):
    x: object              # [T_r, D]
    W_router: object       # [D, N_E]
    c_router: object
    c_dispatch: EPDispatchCache
    c_experts: object
    c_combine: EPCombineCache
    routed: object         # Routed(gates, experts, probs) of this rank's tokens
    plan: EPPlan


def ep_moe_forward(x, W_router, experts: dict, comm, top_k: int, *, score: str = "softmax",
                   normalize=None, bias=None, capacity_factor=None, activation: str = "gelu",
                   approximate: str = "tanh", groups=None):
    """One MoE layer with its experts sharded over comm (collective).

    x [T_r, D] this rank's tokens; W_router [D, N_E] (the same on every rank); experts
    {'W_fc' [E_l, D, F], 'b_fc' [E_l, F] or None, 'W_proj' [E_l, F, D], 'b_proj' [E_l, D]
    or None, 'W_gate' [E_l, D, F] and 'b_gate' [E_l, F] (swiglu only)}: this rank's experts
    r E_l .. (r+1) E_l - 1; the routing settings as in tfcore.functional.moe.router_forward
    (groups (N, M): node-limited routing, each token's experts on at most M of the N ranks)
    -> y [T_r, D], cache. Every argument is checked before anything is sent.
    """
    checks.float_inputs(x=x, W_router=W_router, bias=bias)
    checks.ndim("x", x, 2)
    checks.ndim("W_router", W_router, 2)
    width = checks.width("x", x, "D")
    n_experts = W_router.shape[1]
    checks.shape("W_router", W_router, (width, n_experts))
    n_local = _check_degree(n_experts, comm)
    unknown = set(experts) - set(EXPERT_NAMES)
    if unknown or "W_fc" not in experts or "W_proj" not in experts:
        raise ValueError(f"experts must hold W_fc and W_proj (and optionally "
                         f"{', '.join(EXPERT_NAMES[1::2])}, W_gate), got {sorted(experts)}")
    activation = checks.choice("activation", activation, M.EXPERT_ACTIVATIONS)
    W_fc = experts["W_fc"]
    checks.float_inputs(x=x, **{f"experts['{k}']": v for k, v in experts.items()})
    checks.ndim("experts['W_fc']", W_fc, 3)
    if W_fc.shape[0] != n_local or W_fc.shape[1] != width:
        raise ValueError(f"experts['W_fc'] must have shape (N_E / N = {n_local}, D = {width}, "
                         f"F): this rank's experts, got {tuple(W_fc.shape)}")
    hidden = W_fc.shape[2]
    shapes = dict(b_fc=(n_local, hidden), W_proj=(n_local, hidden, width),
                  b_proj=(n_local, width), W_gate=(n_local, width, hidden),
                  b_gate=(n_local, hidden))
    for name, want in shapes.items():
        if experts.get(name) is not None:
            checks.shape(f"experts['{name}']", experts[name], want)
    if (activation == "swiglu") != (experts.get("W_gate") is not None):
        raise ValueError("experts['W_gate'] is needed by activation 'swiglu' and only by it, "
                         f"got activation {activation!r} and W_gate "
                         f"{'given' if experts.get('W_gate') is not None else 'absent'}")
    z = matmul(x, W_router, "moe")                                      # [T_r, N_E]
    routed, c_router = M.router_forward(z, top_k, score, normalize, bias, groups)
    plan = ep_plan(routed.experts, comm, n_experts, capacity_factor)
    xe, c_dispatch = ep_dispatch_forward(x, plan)                       # [E_l, C, D]
    ye, c_experts = M.expert_mlp_forward(
        xe, W_fc, experts.get("b_fc"), experts["W_proj"], experts.get("b_proj"), activation,
        experts.get("W_gate"), experts.get("b_gate"), approximate)      # [E_l, C, D]
    y, c_combine = ep_combine_forward(ye, routed.gates, plan)           # [T_r, D]
    return y, EPMoECache(x, W_router, c_router, c_dispatch, c_experts, c_combine, routed,
                         plan)


def ep_moe_backward(dy, cache: EPMoECache, reduce_router: bool = True) -> dict:
    """dy [T_r, D] -> {'x' [T_r, D], 'W_router' [D, N_E], 'W_fc', 'b_fc', 'W_proj', 'b_proj',
    'W_gate', 'b_gate' (this rank's experts; None where absent)} (collective).

    W_router's gradient is all-reduced over the group when reduce_router (the router is
    replicated and each rank saw only its own tokens); reduce_router=False leaves this
    rank's part, for a caller that reduces it over a larger group (EP x DP).
    """
    c = cache
    reduce_router = checks.boolean("reduce_router", reduce_router)
    xp = namespace(c.x)
    dye, dgates = ep_combine_backward(dy, c.c_combine)
    grads = M.expert_mlp_backward(dye, c.c_experts)
    out = dict(zip(("xe",) + EXPERT_NAMES, grads))
    dx = ep_dispatch_backward(out.pop("xe"), c.c_dispatch)             # [T_r, D]
    dz = M.router_backward(dgates, c.c_router)                          # [T_r, N_E]
    dW_router = matmul(xp.matrix_transpose(c.x), dz, "moe")             # [D, N_E]
    if reduce_router:
        dW_router = c.plan.comm.all_reduce(dW_router)
    out["x"] = dx + matmul(dz, xp.matrix_transpose(c.W_router), "moe")
    out["W_router"] = dW_router
    return out


# --------------------------------------------------------------------------------------
# The seam of the one decoder


class ExpertGroups:
    """The expert seam of a rank of a layout (ParallelParts.expert_groups), which the MoE
    sublayer (models/moe.py) routes through instead of one device's plan, dispatch and
    combine.

    tokens: the group whose ranks hold the batch's tokens in order (the data-parallel
    group): capacity, drops and the auxiliary losses' statistics span it, as they span one
    device's batch. ep: the expert-parallel group, a block of consecutive ranks of tokens,
    over which the experts are sharded and the tokens sent with all-to-alls (size 1: every
    rank holds every expert)."""

    dispatch_forward = staticmethod(ep_dispatch_forward)
    dispatch_backward = staticmethod(ep_dispatch_backward)
    combine_forward = staticmethod(ep_combine_forward)
    combine_backward = staticmethod(ep_combine_backward)

    def __init__(self, tokens, ep):
        self.tokens, self.ep = tokens, ep

    def plan(self, experts, moe) -> tuple:
        """-> (EPPlan, routing): the plan of this rank's selection experts [T_r, K] for an
        MoE sublayer's settings `moe` (models/moe.MoESpec), and the whole batch's routing
        statistics {load, kept_load [N_E], capacity (the one device's), tokens (the
        batch's T), load_by_rank [N_D, N_E] (host)}."""
        xp = namespace(experts)
        plan = ep_plan(experts, self.ep, moe.n_experts, moe.capacity_factor,
                       tokens=self.tokens)
        load, kept = plan.load.sum(axis=0), plan.kept.sum(axis=0)         # [N_E] host
        capacity = plan.capacity if moe.capacity_factor is not None else int(load.max())
        return plan, dict(load=xp.asarray(load), kept_load=xp.asarray(kept),
                          capacity=capacity, tokens=int(load.sum()) // moe.top_k,
                          load_by_rank=plan.load)
