"""The mixture-of-experts sublayer: the part a block uses in place of its MLP.

    x [B, S, D] -> rows [T, D] (T = B S, the whole micro-batch routed together)
     -> router logits z = rows W_router                              [T, N_E]
     -> top-k routing (softmax or sigmoid scores, selection bias)    gates [T, K], experts [T, K]
     -> dispatch plan (capacity C, or dropless) and dispatch          [N_E, C, D]
     -> the N_E experts, batched (GELU, ReLU or SwiGLU MLPs of width F_e)
     -> combine: y[t] = sum over kept slots of gate * expert output   [T, D]
     -> + the shared experts (always active: one MLP of width n_shared F_e, which is the sum
          of n_shared MLPs of width F_e with their output biases summed)
     -> dropout of the sum (the draw the MLP's output makes)          [B, S, D]

and, for the loss, alpha times the balancing loss (Switch over the T tokens, or DeepSeek's
sequence-wise variant over each of the B sequences) plus beta times the router z-loss.
tfcore.functional.moe states the routing rules (ties: the lower expert index wins; dropping:
each expert keeps its first C tokens in token order). The capacity C = ceil(c T K / N_E)
counts the tokens of one call, so cached generation (a few tokens per call) drops differently
from a forward over the whole sequence unless routing is dropless (capacity_factor None).

Parameters under the block's prefix ``h{i}.moe``: ``router.W`` [D, N_E] (no bias);
``select.b`` [N_E] (the sigmoid router's selection bias: it receives no gradient and moves
only by `expert_bias_update`); ``experts.fc.W`` [N_E, D, F_e] ``experts.fc.b`` [N_E, F_e]
(SwiGLU: also ``experts.gate.W`` ``experts.gate.b``) ``experts.proj.W`` [N_E, F_e, D]
``experts.proj.b`` [N_E, D]; with shared experts ``shared.fc.W`` [D, n_s F_e] ``shared.fc.b``
(``shared.gate.*``) ``shared.proj.W`` [n_s F_e, D] ``shared.proj.b`` [D]. The ``.b`` tensors
of the experts exist only with biases.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .. import functional as F
from .. import nn, ops
from ..backend import namespace
from ..functional import moe as M

BALANCES = ("batch", "sequence")


@dataclass(frozen=True)
class MoESpec:
    """What an MoE sublayer needs to know (DecoderConfig.block_spec builds it)."""

    n_experts: int
    top_k: int
    d_expert: int                    # F_e, each expert's hidden width
    router: str = "softmax"          # "softmax" | "sigmoid"
    normalize: bool | None = None    # renormalise the K gates (None: sigmoid yes, softmax no)
    n_shared: int = 0
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0       # alpha
    z_loss_coef: float = 0.0         # beta
    balance: str = "batch"           # "batch" (Switch) | "sequence" (DeepSeek)
    groups: tuple | None = None      # (G, M): each token's experts from its M best of G groups


def moe_param_shapes(prefix: str, spec, moe: MoESpec) -> dict[str, tuple[int, ...]]:
    """{name: shape} of one MoE sublayer's parameters, in buffer order; `spec` the block's."""
    D, E, Fe = spec.d_model, moe.n_experts, moe.d_expert
    shapes = {f"{prefix}.router.W": (D, E)}
    if moe.router == "sigmoid":
        shapes[f"{prefix}.select.b"] = (E,)

    def experts(name, d_in, d_out):
        shapes[f"{prefix}.experts.{name}.W"] = (E, d_in, d_out)
        if spec.bias:
            shapes[f"{prefix}.experts.{name}.b"] = (E, d_out)

    def shared(name, d_in, d_out):
        shapes[f"{prefix}.shared.{name}.W"] = (d_in, d_out)
        if spec.bias:
            shapes[f"{prefix}.shared.{name}.b"] = (d_out,)

    experts("fc", D, Fe)
    if spec.mlp == "swiglu":
        experts("gate", D, Fe)
    experts("proj", Fe, D)
    if moe.n_shared:
        width = moe.n_shared * Fe
        shared("fc", D, width)
        if spec.mlp == "swiglu":
            shared("gate", D, width)
        shared("proj", width, D)
    return shapes


class MoECache(NamedTuple):
    """What the MoE sublayer's backward needs, and what the model reads from its forward."""

    c_router_linear: tuple
    c_router: M.RouterCache
    c_dispatch: M.DispatchCache
    c_experts: M.ExpertCache
    c_combine: M.CombineCache
    c_shared: tuple | None
    c_balance: M.BalanceCache | None
    c_z: M.ZLossCache | None
    c_drop: tuple
    x_shape: tuple              # (B, S, D)
    aux_loss: object            # [] alpha * balancing loss + beta * z-loss (0 if both off)
    routing: dict               # load, kept_load [N_E] and capacity of the whole batch;
                                # load_by_rank [N_D, N_E] (host under a layout)
    experts: object             # [T, K] the selection
    groups: object              # the layout's expert seam, or None (one device)


def _shared_forward(params, prefix, rows, spec):
    """The shared experts: act(rows W_fc + b) W_proj + b (SwiGLU: with the gate). [T, D]."""
    up, c_fc = nn.linear_forward(params, prefix + ".fc", rows)           # [T, n_s F_e]
    c_gate = None
    if spec.mlp == "swiglu":
        gate, c_gate = nn.linear_forward(params, prefix + ".gate", rows)
        hidden, c_act = F.swiglu_forward(gate, up)
    elif spec.mlp == "gelu":
        hidden, c_act = ops.gelu_forward(up, spec.gelu_approximate, trusted=True)
    else:
        hidden, c_act = F.relu_forward(up)
    out, c_proj = nn.linear_forward(params, prefix + ".proj", hidden)    # [T, D]
    return out, (c_fc, c_gate, c_act, c_proj)


def _shared_backward(params, prefix, dout, cache, spec):
    c_fc, c_gate, c_act, c_proj = cache
    dhidden = nn.linear_backward(params, prefix + ".proj", dout, c_proj)
    if spec.mlp == "swiglu":
        dgate, dup = F.swiglu_backward(dhidden, c_act)
        dx = nn.linear_backward(params, prefix + ".gate", dgate, c_gate)
        return dx + nn.linear_backward(params, prefix + ".fc", dup, c_fc)
    dup = (ops.gelu_backward(dhidden, c_act, trusted=True) if spec.mlp == "gelu"
           else F.relu_backward(dhidden, c_act))
    return nn.linear_backward(params, prefix + ".fc", dup, c_fc)


def _param(params, name):
    return params[name] if name in params else None


def _dispatch(rows, routed, moe, groups):
    """-> (xe [N_E or E_l, C, D], c_dispatch, plan, routing): one device's dispatch, or the
    layout's (groups: the parts' expert seam, tfcore.parallel.experts.ExpertGroups)."""
    if groups is not None:
        plan, routing = groups.plan(routed.experts, moe)
        return (*groups.dispatch_forward(rows, plan), plan, routing)
    xp = namespace(rows)
    plan = M.moe_plan(routed.experts, moe.n_experts, moe.capacity_factor)
    xe, c_dispatch = M.moe_dispatch_forward(rows, plan)
    return xe, c_dispatch, plan, dict(load=plan.load, kept_load=plan.kept_load,
                                      capacity=plan.capacity, tokens=plan.n_tokens,
                                      load_by_rank=xp.expand_dims(plan.load, axis=0))


def _combine(ye, gates, plan, groups):
    if groups is None:
        return M.moe_combine_forward(ye, gates, plan)
    return groups.combine_forward(ye, gates, plan)


def _aux_losses(z, routed, moe, shape, routing, groups):
    """alpha times the balancing loss plus beta times the z-loss -> (aux [], c_balance, c_z).
    Under a layout each rank computes its share with the whole batch's statistics (load,
    token and sequence counts) and the value is summed over the token group; the backward
    needs only the share's gradient, which the data-parallel sum of the router's gradient
    completes."""
    xp = namespace(z)
    batch, seq, _ = shape
    whole = {} if groups is None else dict(n_tokens=routing["tokens"])
    aux = xp.zeros((), dtype=z.dtype)
    c_balance = c_z = None
    if moe.aux_loss_coef:
        if moe.balance == "sequence":
            probs = xp.reshape(routed.probs, (batch, seq, moe.n_experts))
            chosen = xp.reshape(routed.experts, (batch, seq, moe.top_k))
            n_seq = {} if groups is None else dict(n_sequences=whole["n_tokens"] // seq)
            balance, c_balance = M.sequence_balancing_loss_forward(probs, chosen,
                                                                   moe.aux_loss_coef, **n_seq)
        else:
            load = {} if groups is None else dict(load=routing["load"])
            balance, c_balance = M.load_balancing_loss_forward(
                routed.probs, routed.experts, moe.aux_loss_coef, **load, **whole)
        aux = aux + balance
    if moe.z_loss_coef:
        zl, c_z = M.router_z_loss_forward(z, moe.z_loss_coef, **whole)
        aux = aux + zl
    if groups is not None and groups.tokens.size > 1 and (c_balance is not None
                                                          or c_z is not None):
        aux = groups.tokens.all_reduce(xp.reshape(aux, (1,)))[0]         # the whole batch's
    return aux, c_balance, c_z


def moe_sublayer_forward(params, prefix, x, spec, *, rng=None, training=False, groups=None):
    """x [B, S, D] -> out [B, S, D] (see the module docstring); the cache is an MoECache
    whose aux_loss the model adds to its loss. groups: None on one device; under a layout
    the parts' expert seam (tfcore.parallel.experts.ExpertGroups: its plan, dispatch and
    combine, its token group `tokens`), and params then hold this rank's E_l = N_E / ep
    experts."""
    moe = spec.moe
    xp = namespace(x)
    batch, seq, width = x.shape
    rows = xp.reshape(x, (batch * seq, width))                          # [T, D]
    z, c_lin = nn.linear_forward(params, prefix + ".router", rows)      # [T, N_E]
    routed, c_router = M.router_forward(z, moe.top_k, moe.router, moe.normalize,
                                        _param(params, prefix + ".select.b"), moe.groups)
    xe, c_dispatch, plan, routing = _dispatch(rows, routed, moe, groups)   # [N_E, C, D]
    e = prefix + ".experts"
    ye, c_experts = M.expert_mlp_forward(
        xe, params[e + ".fc.W"], _param(params, e + ".fc.b"), params[e + ".proj.W"],
        _param(params, e + ".proj.b"), spec.mlp, _param(params, e + ".gate.W"),
        _param(params, e + ".gate.b"), spec.gelu_approximate)          # [N_E, C, D]
    y, c_combine = _combine(ye, routed.gates, plan, groups)             # [T, D]
    c_shared = None
    if moe.n_shared:
        shared, c_shared = _shared_forward(params, prefix + ".shared", rows, spec)
        y = y + shared
    aux, c_balance, c_z = _aux_losses(z, routed, moe, x.shape, routing, groups)
    out = xp.reshape(y, (batch, seq, width))
    out, c_drop = ops.dropout_forward(out, spec.dropout, rng, training,  # [B, S, D]
                                      trusted=True)
    return out, MoECache(c_lin, c_router, c_dispatch, c_experts, c_combine, c_shared,
                         c_balance, c_z, c_drop, (batch, seq, width), aux, routing,
                         routed.experts, groups)


def moe_sublayer_backward(params, prefix, dout, cache: MoECache, spec):
    """dout [B, S, D] -> dx [B, S, D]; adds the gradients of the experts, the shared experts
    and the router (from the gates and from the auxiliary losses, which enter with weight 1:
    they are part of the model's loss). The selection bias gets none."""
    moe = spec.moe
    c = cache
    xp = namespace(dout)
    dout = ops.dropout_backward(dout, c.c_drop, trusted=True)
    batch, seq, width = c.x_shape
    dy = xp.reshape(dout, (batch * seq, width))                         # [T, D]
    dx = None
    if c.c_shared is not None:
        dx = _shared_backward(params, prefix + ".shared", dy, c.c_shared, spec)
    if c.groups is None:
        dye, dgates = M.moe_combine_backward(dy, c.c_combine)
    else:
        dye, dgates = c.groups.combine_backward(dy, c.c_combine)
    e = prefix + ".experts"
    dxe, dW_fc, db_fc, dW_proj, db_proj, dW_gate, db_gate = M.expert_mlp_backward(
        dye, c.c_experts)
    for name, grad in (("fc.W", dW_fc), ("fc.b", db_fc), ("proj.W", dW_proj),
                       ("proj.b", db_proj), ("gate.W", dW_gate), ("gate.b", db_gate)):
        if grad is not None:
            nn.accumulate(params, f"{e}.{name}", grad)
    drows = (M.moe_dispatch_backward(dxe, c.c_dispatch) if c.groups is None
             else c.groups.dispatch_backward(dxe, c.c_dispatch))         # [T, D]
    dx = drows if dx is None else dx + drows
    dprobs = None
    if c.c_balance is not None:
        dprobs = M.load_balancing_loss_backward(1.0, c.c_balance)
        if moe.balance == "sequence":
            dprobs = xp.reshape(dprobs, (batch * seq, moe.n_experts))
    dz = M.router_backward(dgates, c.c_router, dprobs)                  # [T, N_E]
    if c.c_z is not None:
        dz = dz + M.router_z_loss_backward(1.0, c.c_z)
    dx = dx + nn.linear_backward(params, prefix + ".router", dz, c.c_router_linear)
    return xp.reshape(dx, (batch, seq, width))
