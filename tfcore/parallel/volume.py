"""Closed forms of what the collectives move, in bytes, and of what a rank holds.

Notation: M elements of b bytes each in the logical tensor, N ranks in the group, chunk
sizes c_0..c_{N-1} (chunk_bounds: ceil/floor(M/N)), r the rank's index in the group.
"per rank" counts what one rank sends (or receives); "total" is the sum over ranks of what
they send, which is also the sum over links (every byte sent is received once).

Ring (reduce-scatter then all-gather along r -> r+1):
    all_reduce      sent_r = (2M - c_r - c_{r+1}) b    received_r = (2M - c_{r-1} - c_r) b
                    = 2 (N-1)/N M b per rank when N divides M;   total 2 (N-1) M b
    reduce_scatter  sent_r = (M - c_r) b               total (N-1) M b
    all_gather      sent_r = (M - c_{r+1}) b           total (N-1) M b
    broadcast       sent_r = M b except the chain's last rank;   total (N-1) M b
Naive (through the root, rank 0):
    all_reduce      root sends (N-1) M b and receives (N-1) M b; the others M b each way;
                    total 2 (N-1) M b: seed 003's "2 (N_T - 1) [B, S, D]" is this total
                    (and the root's own traffic), not a per-rank figure
    reduce_scatter  total (N-1) M b + (M - c_0) b;  all_gather the same;  broadcast (N-1) M b
So the ring does not move fewer bytes in total than the naive all-reduce: it moves them
evenly, every rank 2 (N-1)/N M b, where the naive root carries 2 (N-1) M b alone.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..functional.moe import capacity
from .comm import chunk_bounds
from .experts import kept_loads


def collective_bytes(op: str, algorithm: str, M: int, N: int, itemsize: int = 8,
                     root: int = 0) -> dict:
    """{'sent': [per rank], 'received': [per rank], 'total': sum of sent} in bytes."""
    c = [b - a for a, b in chunk_bounds(M, N)]
    sent, recv = [0] * N, [0] * N
    if N > 1:
        if algorithm == "ring":
            for r in range(N):
                if op == "all_reduce":
                    sent[r] = 2 * M - c[r] - c[(r + 1) % N]
                    recv[r] = 2 * M - c[(r - 1) % N] - c[r]
                elif op == "reduce_scatter":
                    sent[r], recv[r] = M - c[r], M - c[(r - 1) % N]
                elif op == "all_gather":
                    sent[r], recv[r] = M - c[(r + 1) % N], M - c[r]
                elif op == "broadcast":
                    pos = (r - root) % N
                    sent[r] = M if pos < N - 1 else 0
                    recv[r] = M if pos > 0 else 0
        elif algorithm == "naive":
            for r in range(N):
                if op == "all_reduce":
                    sent[r] = recv[r] = (N - 1) * M if r == 0 else M
                elif op == "reduce_scatter":
                    sent[r] = M - c[0] if r == 0 else M
                    recv[r] = (N - 1) * M if r == 0 else c[r]
                elif op == "all_gather":
                    sent[r] = (N - 1) * M if r == 0 else c[r]
                    recv[r] = M - c[0] if r == 0 else M
                elif op == "broadcast":
                    sent[r] = (N - 1) * M if r == root else 0
                    recv[r] = 0 if r == root else M
        else:
            raise ValueError(f"algorithm must be 'ring' or 'naive', got {algorithm!r}")
    sent = [s * itemsize for s in sent]
    recv = [s * itemsize for s in recv]
    return dict(sent=sent, received=recv, total=sum(sent))


def replicated_elements(config) -> int:
    """R: elements of the tensors every tensor-parallel rank holds whole (norms, wpe, the
    row-parallel biases), whose gradients sequence parallelism sums once per step."""
    D, L = config.d_model, config.n_layers
    per_norm = 2 * D if config.norm == "layernorm" else D
    R = L * 2 * per_norm + (L * 2 * D if config.bias else 0)
    if config.norm_placement == "pre":
        R += per_norm
    if config.position == "learned":
        R += config.max_seq_len * D
    return R


def local_parameters(config, tp: int, t: int) -> int:
    """P_t: parameters held by tensor-parallel rank t (vocabulary rows V_t, 1/N_T of the
    heads and MLP columns, the replicated tensors whole). The fused q, k, v projection has
    D + 2 H_kv D_h columns; rank t holds D / N_T of the query columns and the columns of its
    key/value heads (H_kv / N_T of them, or the one it shares when H_kv < N_T)."""
    from .parts import kv_heads_of

    D, F, L, N = config.d_model, config.d_ff, config.n_layers, tp
    a, b = chunk_bounds(config.vocab_size, N)[t]
    V_t = b - a
    k0, k1 = kv_heads_of(config, N, t)          # H_kv / N heads, or the one head it shares
    qkv = D // N + 2 * (k1 - k0) * config.head_dim                 # this rank's q, k, v
    per_layer = D * qkv + D * D // N + D * F // N + F * D // N
    if config.mlp == "swiglu":
        per_layer += D * F // N
    if config.bias:
        per_layer += qkv + F // N * (2 if config.mlp == "swiglu" else 1)
    P = V_t * D + L * per_layer + replicated_elements(config)
    if not config.tied_head:
        P += D * V_t
    if config.head_bias:
        P += V_t
    return P


def span_collectives(config, rows: int, seq: int, sp: bool, n_layers: int, first: bool,
                     last: bool, moe_layers: int = 0) -> tuple[list, list]:
    """([(op, M)] forward, [(op, M)] backward): the tensor-parallel calls of one pass of a
    span of the decoder (pipeline chunk, or the whole model) over [rows, seq] tokens: the
    embedding when `first`, n_layers blocks (2 sub-layers each), the head and its
    cross-entropy when `last`. The backward runs each forward call's adjoint (an all-reduce
    for an all-reduce; sp: a reduce-scatter for an all-gather and back), and recompute='full'
    runs each block's forward exits again. moe_layers of the n_layers blocks have a mixture
    of experts in place of the MLP, which runs whole on every tensor-parallel rank: no
    enter and no exit."""
    act, tok = rows * seq * config.d_model, rows * seq          # [B, S, D], [B, S]
    sublayers = 2 * n_layers - moe_layers                       # the tensor-parallel ones
    enters, exits = int(first) + sublayers, sublayers + int(last)
    if sp:
        forward = [("reduce_scatter", act)] * enters + [("all_gather", act)] * exits
        backward = [("reduce_scatter", act)] * exits + [("all_gather", act)] * enters
        again = [("all_gather", act), ("reduce_scatter", act)] * sublayers
    else:
        forward = [("all_reduce", act)] * enters
        backward = [("all_reduce", act)] * exits
        again = [("all_reduce", act)] * sublayers
    if last:                                                    # cross-entropy: max, sum, pick
        forward += [("all_reduce", tok)] * 3
    if config.recompute == "full":
        backward += again
    return forward, backward


def step_collectives(config, batch_local: int, seq: int, tp: int, dp: int, sp: bool,
                     zero: bool) -> list[tuple[str, str, int]]:
    """[(group, op, M)] of one training step of TensorParallelDecoder + AdamW (its Replicated
    or ZeRO1 strategy), as the model's structure says (forward, backward, optimizer), for
    tensor-parallel rank t = 0 (the replicated tensors and the vocab rows of rank t enter
    through P_t below). Without recompute (span_collectives adds its calls)."""
    forward, backward = span_collectives(replace(config, recompute="none"), batch_local,
                                         seq, sp, config.n_layers, True, True)
    calls = [("tp", op, M) for op, M in forward]
    if dp > 1:
        calls += [("dp", "all_reduce", 2)]                      # loss sum and token count
    calls += [("tp", op, M) for op, M in backward]
    if sp:
        calls += [("tp", "all_reduce", replicated_elements(config))]
    return calls


def step_bytes(config, batch_local: int, seq: int, tp: int, dp: int, sp: bool, zero: bool,
               algorithm: str = "ring", itemsize: int = 8) -> dict:
    """Bytes of one training step: {'total': over all ranks, 'sent': [per world rank]}.
    World rank w = d * tp + t (mesh.py)."""
    world = tp * dp
    sent = [0] * world
    for t in range(tp):
        for d in range(dp):
            w = d * tp + t
            for group, op, M in step_collectives(config, batch_local, seq, tp, dp, sp, zero):
                n, r = (tp, t) if group == "tp" else (dp, d)
                sent[w] += collective_bytes(op, algorithm, M, n, itemsize)["sent"][r]
            P = local_parameters(config, tp, t)
            if dp > 1:
                ops = ["reduce_scatter", "all_gather"] if zero else ["all_reduce"]
                for op in ops:
                    sent[w] += collective_bytes(op, algorithm, P, dp, itemsize)["sent"][d]
    return dict(total=sum(sent), sent=sent)


# ---------------------------------------------------------------------------------------
# ZeRO-2 and ZeRO-3 (fsdp.py): per-unit sizes, the data-parallel collectives of a step, and
# what a rank holds. Psi = P_t b, the bytes of one tensor-parallel rank's parameters.
#
#   stage   data-parallel collectives of one step (ring, per unit u of M_u elements)
#   0       all_reduce(P_t)                                  2 (N_D-1)/N_D Psi per rank
#   1       reduce_scatter(P_t) + all_gather(P_t)            2 (N_D-1)/N_D Psi
#   2       uses_u x reduce_scatter(M_u) + all_gather(M_u)   2 (N_D-1)/N_D Psi (untied head)
#   3       uses_u x (2 all_gather(M_u) + reduce_scatter(M_u))   3 (N_D-1)/N_D Psi
#
# "(N_D-1)/N_D Psi" is exact for the mean over the dp ranks whatever the chunking (the
# chunks of a buffer add up to it); rank d's own count is M - c_d (reduce-scatter) and
# M - c_{d+1} (all-gather) per buffer, which is (N_D-1)/N_D M when N_D divides M. A tied head
# uses the embed unit twice (uses = 2), so its bytes count twice in the reduce-scatters
# (stage 2) or in all three (stage 3).


def local_shape(name: str, shape, config, tp: int, t: int, ep: int = 1) -> tuple:
    """The shape of tensor `name` on tensor-parallel rank t (model.shard_tensor's rule,
    without allocating anything); an MoE's experts: N_E / ep of them."""
    from .parts import shard_rule

    shape = tuple(int(n) for n in shape)
    rule = shard_rule(name)
    if rule == "experts":
        return (shape[0] // ep,) + shape[1:]
    a, b = chunk_bounds(config.vocab_size, tp)[t]
    if rule == "vocab_rows":
        return (b - a,) + shape[1:]
    if rule == "vocab_cols":
        return shape[:-1] + (b - a,)
    if rule == "qkv_cols":                       # its query heads and key/value heads
        from .parts import qkv_columns

        return shape[:-1] + (len(qkv_columns(config, tp, t)),)
    if rule == "cols":
        return shape[:-1] + (shape[-1] // tp,)
    if rule == "rows":
        return (shape[0] // tp,) + shape[1:]
    return shape


def unit_elements(config, tp: int = 1, t: int = 0) -> list[tuple[str, int, int]]:
    """[(unit, M_u, uses_u)] of fsdp's units on tensor-parallel rank t, in forward order."""
    import json
    import math

    from .fsdp import unit_names, unit_uses

    key = (json.dumps(config.to_dict(), sort_keys=True), tp, t)   # a plan asks per rank
    if key not in _UNITS:
        shapes, uses = config.param_shapes(), unit_uses(config)
        if len(_UNITS) > 64:
            _UNITS.clear()
        _UNITS[key] = [(u, sum(math.prod(local_shape(n, shapes[n], config, tp, t))
                               for n in names), uses[u]) for u, names in unit_names(config)]
    return list(_UNITS[key])


_UNITS: dict = {}          # unit_elements' answers: a pure function of the config, tp, t


def unit_phases(config, tp: int = 1, t: int = 0) -> list[int]:
    """Elements gathered at once in each phase of the forward (and again of the backward):
    the embedding, each block, the head (with the embed unit too when the head is tied)."""
    units = {u: M for u, M, _ in unit_elements(config, tp, t)}
    head = units.get("head", 0) + (units["embed"] if config.tied_head else 0)
    return [units["embed"]] + [units[f"h{i}"] for i in range(config.n_layers)] + (
        [head] if head else [])


def shard_elements(config, tp: int, t: int, dp: int, d: int) -> int:
    """Z_d: elements of dp rank d's shard under ZeRO-2/3 (its chunk of every unit)."""
    return sum(b - a for _, M, _ in unit_elements(config, tp, t)
               for a, b in [chunk_bounds(M, dp)[d]])


def zero_collectives(config, tp: int, t: int, dp: int, zero: int, micro_batches: int = 1,
                     P: int | None = None) -> list[tuple[str, int]]:
    """[(op, M)] over the dp group of one step's gradient and parameter traffic at `zero`
    (0 = replicated DP), for tensor-parallel rank t: the table above. Stages 0 and 1 sum the
    accumulated gradient once per step (P: the elements the rank holds, P_t by default; a
    pipeline stage's fewer); stages 2 and 3 scatter each micro-batch's gradient as its
    backward frees the unit (and stage 3 gathers the unit for each forward and backward),
    and stage 2 gathers the updated parameters once."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if dp == 1:
        return []
    P = local_parameters(config, tp, t) if P is None else P
    if zero == 0:
        return [("all_reduce", P)]
    if zero == 1:
        return [("reduce_scatter", P), ("all_gather", P)]
    calls = []
    for _, M, uses in unit_elements(config, tp, t):
        if zero == 2:
            calls += [("reduce_scatter", M)] * (uses * micro_batches) + [("all_gather", M)]
        else:
            calls += [("all_gather", M), ("all_gather", M),
                      ("reduce_scatter", M)] * (uses * micro_batches)
    return calls


def clip_collectives(zero: int, pp: int) -> list[tuple[str, str, int]]:
    """[(group, op, M)] of the global gradient norm's sums (grads.global_sum_of_squares:
    one element, all-reduced over each group of each grouping of the pieces): the tensor-
    parallel shards' sum over tp (and the stages, and the data group when ZeRO shards the
    gradient), and the replicated tensors' sum over the same groups but tp."""
    shared = (["data"] if zero else []) + (["pp"] if pp > 1 else [])
    return [(g, "all_reduce", 1) for g in ["tp"] + shared + shared]


def layout_traffic(config, *, batch: int, seq: int, dp: int = 1, tp: int = 1, pp: int = 1,
                   cp: int | None = None, zero: int = 0, sp: bool = False,
                   micro_batches: int = 1, virtual: int = 1, balanced: bool = True,
                   clip: bool = False, bucket_bytes: int | None = None,
                   algorithm: str = "ring", itemsize: int = 8,
                   rounds: list | None = None, ulysses: bool = False, ep: int = 1,
                   expert_loads=None) -> list[dict]:
    """Bytes each world rank sends in one training step of any layout without gradient
    buckets, by (group, op): [{(group, op): bytes}] per world rank
    w = ((d N_P + s) N_C + c) N_T + t (mesh.py). The step, as the one decoder runs it:

      per micro-batch (K of them: B / (N_D K) rows, S_c positions on ring rank c), per chunk
      of layers rank w holds (pipeline: chunks j N_P + s, j < v, of L / (N_P v) layers each;
      else one chunk of L), span_collectives' tensor-parallel calls, the ring's blocks of
      each layer, and after its backward the sums over tp of what each rank computed from
      its share (sp: the replicated gradients of the rank's tensors; key/value heads shared
      over tp: their columns), then:
        pipeline   point-to-point activations and their gradients (pipeline_bytes_sent;
                   [B_m, S_c / N_T, D] each under sp), the last stage's token count T_c
                   over dp (and each micro-batch's loss and count over the ring), a
                   tied wte's gradient between the first and last stage, and the step's
                   loss shared (pipeline.share_losses: summed over dp on the last stage,
                   broadcast from it down the pipeline)
        otherwise  the loss and token count over the data group (2 elements) per
                   micro-batch; with K > 1 the K counts (accumulation weights) over dp
      the gradient over the data group (dp x cp): zero_collectives of the rank's tensors
      (ZeRO-2/3 gather and scatter per micro-batch, ZeRO-0/1 once per step; with
      bucket_bytes an all-reduce of each bucket, grads.pack_buckets, in place of ZeRO-0's
      all-reduce or ZeRO-1's reduce-scatter), and with
      clipping the global norm's sums (one element per group, grads.global_sum_of_squares).
    The step's bookkeeping numbers (token counts, the accumulation weights' counts, the
    loss a pipeline shares, the norm's partial sums) travel as float64 whatever the model's
    dtype (SCALAR bytes each); the loss and count of the cross-entropy in the model's.
    rounds: a list to which each rank's rounds of messages are appended (collective_rounds
    per call, a pipeline message each, the ring's N_C - 1 per pass of a layer).
    With ulysses the cp group's attention is Ulysses's four all-to-alls forward and four
    backward per layer (ulysses.ulysses_attention_bytes, on contiguous chunks) in place of
    the ring's blocks. An MoE (config.n_experts) adds expert_layer_traffic per MoE layer,
    for expert_loads (one [dp, N_E] matrix per MoE layer) or an even routing, and with
    ep > 1 sums the experts' gradient over edp (dp / ep ranks) and the rest over dp.
    """
    from collections import Counter

    from .context import ContextLayout, ring_attention_bytes
    from .ulysses import ulysses_attention_bytes
    from .grads import pack_buckets
    from .parts import kv_heads_of, shard_rule
    from .pipeline import pipeline_bytes_sent, stage_layers, stage_param_names

    C, K, D, L = cp or 1, micro_batches, config.d_model, config.n_layers
    ring = ContextLayout(seq, C, balanced and not ulysses) if cp is not None else None
    data = dp * C                                          # the gradients' group
    data_name = "dp" if cp is None else ("cp" if dp == 1 else "dp x cp")
    micro = batch // dp // K                               # B_m rows
    moe_loads = []
    if config.n_experts and dp > 1:       # [N_D, N_E] per MoE layer: given, or even
        moe_loads = (list(expert_loads) if expert_loads is not None else
                     [even_expert_loads(config, dp, micro * seq)] * len(config.moe_layers))
        if len(moe_loads) != len(config.moe_layers):
            raise ValueError(f"expert_loads must hold one [dp, N_E] matrix per MoE layer "
                             f"({len(config.moe_layers)}), got {len(moe_loads)}")
    shapes = config.param_shapes()
    out = []
    for d in range(dp):
        for s in range(pp):
            chunks = [j * pp + s for j in range(virtual)] if pp > 1 else [0]
            names = (stage_param_names(config, pp, s, virtual) if pp > 1
                     else list(shapes))
            first, last = 0 in chunks, pp * virtual - 1 in chunks
            for c in range(C):
                S_c = ring.local_len(c) if ring is not None else seq
                for t in range(tp):
                    by_op: dict = {}
                    steps = 0                     # rounds of messages, for the latency

                    def add(group, op, M, n, r, root=0, times=1, size=itemsize):
                        nonlocal steps
                        sent = collective_bytes(op, algorithm, M, n, size, root)["sent"][r]
                        by_op[(group, op)] = by_op.get((group, op), 0) + times * sent
                        steps += times * collective_rounds(op, algorithm, n)

                    local = {n: math.prod(local_shape(n, shapes[n], config, tp, t, ep))
                             for n in names}
                    replicated = sum(M for n, M in local.items()
                                     if shard_rule(n) == "replicated")
                    k0, k1 = kv_heads_of(config, tp, t)
                    sharing = tp // config.n_kv_heads if config.n_kv_heads < tp else 1
                    kv_cols = 2 * (k1 - k0) * config.head_dim
                    kv = sum(math.prod(shapes[n][:-1]) * kv_cols for n in names
                             if shard_rule(n) == "qkv_cols") if sharing > 1 else 0
                    for chunk in chunks:
                        n_layers = (len(stage_layers(config, pp, virtual, chunk)) if pp > 1
                                    else L)
                        forward, backward = span_collectives(
                            config, micro, S_c, sp, n_layers, chunk == 0,
                            chunk == pp * virtual - 1, len(config.moe_layers))
                        for (op, M), times in Counter(forward + backward).items():
                            add("tp", op, M, tp, t, times=times * K)
                        if sp and tp > 1 and replicated:
                            add("tp", "all_reduce", replicated, tp, t, times=K)
                        if kv:
                            add("kv", "all_reduce", kv, sharing, t % sharing, times=K)
                        if ring is not None and n_layers and ulysses:
                            moved = ulysses_attention_bytes(
                                micro, seq, config.n_heads // tp, k1 - k0, config.head_dim,
                                C, itemsize=itemsize)
                            passes = 2 if config.recompute == "full" else 1
                            by_op[("cp", "all_to_all")] = by_op.get(("cp", "all_to_all"),
                                                                    0) + (
                                K * n_layers * (passes * moved["forward"][c]
                                                + moved["backward"][c]))
                            steps += K * n_layers * (passes + 1) * 4 * collective_rounds(
                                "all_to_all", algorithm, C)
                        elif ring is not None and n_layers:
                            moved = ring_attention_bytes(ring, micro, k1 - k0,
                                                         config.head_dim, itemsize=itemsize)
                            passes = 2 if config.recompute == "full" else 1
                            by_op[("cp", "ring")] = by_op.get(("cp", "ring"), 0) + (
                                K * n_layers * (passes * moved["forward"][c]
                                                + moved["backward"][c]))
                            steps += K * n_layers * (passes + 1) * (C - 1)
                    if pp > 1:
                        tokens = micro * S_c // (tp if sp else 1)
                        by_op[("pp", "send")] = pipeline_bytes_sent(
                            pp, s, K, virtual, tokens, D, itemsize)
                        steps += pipeline_bytes_sent(pp, s, K, virtual, 1, 1, 1)
                        if last and dp > 1:             # T_c, and the step's loss shared
                            add("dp", "all_reduce", 1, dp, d, times=2, size=SCALAR)
                        add("pp", "broadcast", 1, pp, s, root=pp - 1, size=SCALAR)
                        if last and C > 1:          # each micro-batch's loss over the ring
                            add("cp", "all_reduce", 2, C, c, times=K)
                        if config.tied_head and first != last:
                            add("embedding", "all_reduce", local["wte"], 2, int(last))
                    elif data > 1:
                        add(data_name, "all_reduce", 2, data, d * C + c, times=K)
                        if K > 1 and dp > 1:
                            add("dp", "all_reduce", K, dp, d, size=SCALAR)
                    if config.n_experts and dp > 1:      # each MoE layer's exchanges
                        for load in moe_loads:
                            for (group, op), (sent, n) in expert_layer_traffic(
                                    config, load, d, ep, K, itemsize, algorithm).items():
                                by_op[(group, op)] = by_op.get((group, op), 0) + sent
                                steps += n
                    experts = sum(M for n, M in local.items() if shard_rule(n) == "experts")
                    gradient = zero_collectives(config, tp, t, data, zero, K,
                                                sum(local.values()) - (
                                                    experts if ep > 1 else 0))
                    if ep > 1 and dp > ep:    # the experts' over the ranks holding them
                        for op, M in zero_collectives(config, tp, t, dp // ep, zero, K,
                                                      experts):
                            add("edp", op, M, dp // ep, d // ep)
                    if bucket_bytes is not None and data > 1:    # all-reduced in buckets
                        gradient = [("all_reduce", sum(local[n] for n in bucket))
                                    for bucket in pack_buckets(list(local.items()), itemsize,
                                                               bucket_bytes)
                                    ] + [call for call in gradient if call[0] == "all_gather"]
                    for (op, M), times in Counter(gradient).items():
                        add(data_name, op, M, data, d * C + c, times=times)
                    ranks = dict(tp=(tp, t), data=(data, d * C + c), pp=(pp, s))
                    for group, op, M in clip_collectives(zero, pp) if clip else []:
                        add(data_name if group == "data" else group, op, M, *ranks[group],
                            size=SCALAR)
                    if clip and ep > 1:          # the experts' squares, summed over ep
                        add("ep", "all_reduce", 1, ep, d % ep, size=SCALAR)
                        if zero == 1 and dp > ep:        # and over edp (their chunks)
                            add("edp", "all_reduce", 1, dp // ep, d // ep, size=SCALAR)
                    out.append(by_op)
                    if rounds is not None:
                        rounds.append(steps)
    return out


SCALAR = 8      # bytes of the float64 bookkeeping numbers a step exchanges


def collective_rounds(op: str, algorithm: str, n: int) -> int:
    """Rounds of messages one rank waits through in a collective over n ranks (each costs
    the link's latency alpha): the ring's all-reduce 2 (n - 1), its reduce-scatter and
    all-gather n - 1; the naive algorithm's one exchange per phase (2 and 1)."""
    if n == 1:
        return 0
    phases = 2 if op == "all_reduce" else 1
    return phases * (n - 1) if algorithm == "ring" else phases


def step_traffic(config, batch_local: int, seq: int, tp: int, dp: int, sp: bool, zero: int,
                 algorithm: str = "ring", itemsize: int = 8, cp: int | None = None,
                 balanced: bool = True) -> list[dict]:
    """layout_traffic of one step of batch_local rows per data-parallel rank, without a
    pipeline, accumulation or clipping."""
    return layout_traffic(config, batch=batch_local * dp, seq=seq, dp=dp, tp=tp, cp=cp,
                          zero=zero, sp=sp, balanced=balanced, algorithm=algorithm,
                          itemsize=itemsize)


def rank_activation_bytes(config, rows: int, seq: int, tp: int = 1, t: int = 0,
                          sp: bool = False, n_layers: int | None = None, first: bool = True,
                          last: bool = True, training: bool = True,
                          ring_chunks: int = 0) -> int:
    """Bytes the caches of one forward of a span of the parallel decoder keep on
    tensor-parallel rank t, for [rows, seq] tokens (N = rows seq): n_layers blocks
    (sizes.block_activation_bytes with this rank's heads and columns), and
      first  the vocab-parallel embedding's row index and mask (int64 [N], bool [N]), its
             dropout mask [N_r, D] (N_r = N / N_T under sp, else N)
      last   the final norm's xhat and 1/std [N_r, D], [N_r] (pre-norm), the head's input
             [N, D] (gathered under sp), the vocab-parallel cross-entropy's probabilities
             [N, V_t] and its target index, ownership mask and count mask (int64, bool,
             bool [N])
    in the config's dtype; training=False leaves out dropout's masks. On a ring
    (ring_chunks: how many chunks of the sequence the rank holds, seq its S_r positions)
    attention is the tiled op's, keeps no repeated key/value heads, and a rank of two or
    more chunks keeps the rotary tables of its positions (cos, sin [S_r, D_h / 2]: built
    by concatenation, where one chunk's are views of the model's)."""
    from ..models.sizes import BOOL_BYTES, INT64_BYTES, block_activation_bytes
    from .parts import kv_heads_of

    c, N = config, rows * seq
    f = {"float64": 8, "float32": 4}[c.dtype]
    n_rows = N // tp if sp else N
    dropout = training and c.dropout > 0
    k0, k1 = kv_heads_of(c, tp, t)
    L = c.n_layers if n_layers is None else n_layers
    rotary = c.position == "rotary"
    total = L * block_activation_bytes(
        rows, seq, c.d_model, c.n_heads, c.d_ff, c.mlp, rotary, dropout, c.dtype,
        "tiled" if ring_chunks else c.attention, c.n_kv_heads, c.recompute, tp=tp,
        kv_local=k1 - k0, sp=sp, repeats_kv=not ring_chunks)
    if rotary and ring_chunks > 1 and L:
        total += seq * c.head_dim * f
    if first:
        total += N * (INT64_BYTES + BOOL_BYTES) + (n_rows * c.d_model * BOOL_BYTES
                                                   if dropout else 0)
    if last:
        a, b = chunk_bounds(c.vocab_size, tp)[t]
        norm = (n_rows * c.d_model + n_rows) * f if c.norm_placement == "pre" else 0
        total += norm + N * c.d_model * f + N * (b - a) * f + N * (INT64_BYTES
                                                                     + 2 * BOOL_BYTES)
    return total


def zero_memory(config, tp: int, t: int, dp: int, d: int, zero: int,
                itemsize: int = 8, ep: int = 1) -> dict:
    """Bytes of parameters, gradients and AdamW state that rank (d, t) holds at the peak of
    a step, and the transient part of them ('gathered': the whole units in use):

        zero 0   params P             grads P              optimizer 2 P
        zero 1   params P             grads P              optimizer 2 c_d  (chunk d of P)
        zero 2   params P             grads Z_d + M_max    optimizer 2 Z_d
        zero 3   params Z_d + M_max   grads Z_d + M_max    optimizer 2 Z_d
    P = P_t, Z_d the shard (shard_elements), M_max the largest phase (unit_phases): the
    units gathered at once, whose gradients the backward holds at the same moment."""
    P = local_parameters(config, tp, t)
    E = 0                        # the rank's expert elements
    if config.n_experts:         # an MoE's tensors by name: the experts split over ep
        from .parts import shard_rule

        local = {n: math.prod(local_shape(n, s, config, tp, t, ep))
                 for n, s in config.param_shapes().items()}
        P = sum(local.values())
        E = sum(M for n, M in local.items() if shard_rule(n) == "experts")
    if zero in (0, 1):
        c = chunk_bounds(P, dp)[d]
        opt = 2 * P if zero == 0 else 2 * (c[1] - c[0])
        if zero == 1 and ep > 1 and E:   # the dense chunk over dp, the experts' over edp
            a, b = chunk_bounds(P - E, dp)[d]
            e0, e1 = chunk_bounds(E, dp // ep)[d // ep]
            opt = 2 * (b - a + e1 - e0)
        params, grads, gathered = P, P, 0
    elif zero in (2, 3):
        Z, M_max = shard_elements(config, tp, t, dp, d), max(unit_phases(config, tp, t))
        opt, grads, gathered = 2 * Z, Z + M_max, M_max
        params = P if zero == 2 else Z + M_max
    else:
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    out = dict(params=params, grads=grads, optimizer=opt, gathered=gathered)
    return {k: v * itemsize for k, v in out.items()}


# ---------------------------------------------------------------------------------------
# All-to-all (comm.all_to_all and all_to_allv run the pairwise exchange, the same schedule
# under 'ring' and 'naive': every block goes straight to its owner) and expert parallelism.
#
#   S[i][j]  rows rank i sends to rank j (the diagonal stays on its rank), R elements a row
#   per rank   sent_i = sum_{j != i} S[i][j] R b        received_j = sum_{i != j} S[i][j] R b
#   total      sum_{i != j} S[i][j] R b                 (the off-diagonal of S)
# The even all_to_all of M elements a rank (S[i][j] = M / N elements) sends (N-1)/N M b per
# rank and (N-1) M b in total: half what a ring all-reduce of the same tensor moves.
#
# Expert parallelism (parallel/experts.py), one MoE layer on N ranks with N_E experts,
# E_l = N_E / N on each rank, rank j holding experts j E_l .. (j+1) E_l - 1:
#   L[i][e]  assignments (token, slot) of rank i's tokens kept by expert e (dropless: all)
#   S[i][j] = sum over e of rank j of L[i][e]              dispatch rows, R = D
#   counts   all_gather of every rank's [N_E] int64 load   (N-1) N_E 8 per rank (ring)
#   dispatch all_to_allv(S)    combine all_to_allv(S^T)    (backward: the same two, swapped)
#   rows computed by rank j's experts: sum_i S[i][j]   (2 x 2 D F_e FLOPs each, forward,
#   for a GELU/ReLU expert; 3 matrices for SwiGLU)
# A skewed router makes one rank receive most of the rows: the busiest rank's received
# bytes and expert rows, not the mean, set the step's time.


def even_expert_loads(config, dp: int, tokens: int) -> list[list[int]]:
    """[N_D, N_E]: each data-parallel rank's `tokens` x K assignments spread as evenly as
    the counts allow over the N_E experts (the first (T K mod N_E) one more): the routing
    plan() assumes when it is not given one."""
    assignments = tokens * config.top_k
    base, extra = divmod(assignments, config.n_experts)
    return [[base + (e < extra) for e in range(config.n_experts)] for _ in range(dp)]


def kept_expert_loads(config, load) -> list[list[int]]:
    """[N_D, N_E] the assignments each expert keeps of load [N_D, N_E] (the data-parallel
    ranks' assignments, in rank order): all of them dropless, else the first C of the whole
    batch's in token order, C = ceil(c T K / N_E) (functional.moe.capacity; the rule of
    experts.kept_loads, which ep_plan applies)."""
    total = sum(int(c) for row in load for c in row)
    cap = capacity(total // config.top_k, config.top_k, config.n_experts,
                   config.capacity_factor)
    return kept_loads(load, cap).tolist()


def expert_layer_traffic(config, load, d: int, ep: int, micro_batches: int = 1,
                         itemsize: int = 8, algorithm: str = "ring") -> dict:
    """{(group, op): (bytes, rounds)} that data-parallel rank d sends for one MoE layer in a
    step of K micro-batches, the layer's routing load [N_D, N_E] (assignments per rank and
    expert): the loads' all_gather over dp (int64), dispatch and combine as all_to_allv over
    its block of ep ranks forward (twice with recompute='full') and their adjoints backward,
    and the auxiliary losses' all-reduced value (one element) when they are on."""
    dp, n_e = len(load), config.n_experts
    passes = micro_batches * (2 if config.recompute == "full" else 1)
    out = {}
    gather = collective_bytes("all_gather", algorithm, dp * n_e, dp, 8)["sent"][d]
    out[("dp", "all_gather")] = (passes * gather, passes * (dp - 1 if algorithm == "ring"
                                                             else 1))
    if ep > 1:
        g = d // ep * ep
        S = expert_send_counts(kept_expert_loads(config, load)[g:g + ep], ep)
        one = (all_to_all_bytes(S, config.d_model, itemsize)["sent"][d - g]
               + all_to_all_bytes([list(c) for c in zip(*S)], config.d_model,
                                  itemsize)["sent"][d - g])
        out[("ep", "all_to_allv")] = ((passes + micro_batches) * one,
                                      (passes + micro_batches) * 2 * (ep - 1))
    if config.aux_loss_coef or config.z_loss_coef:
        value = collective_bytes("all_reduce", algorithm, 1, dp, itemsize)["sent"][d]
        out[("dp", "all_reduce")] = (passes * value, passes * (2 * (dp - 1)
                                                               if algorithm == "ring" else 2))
    return out


def all_to_all_bytes(counts, row_elements: int = 1, itemsize: int = 8) -> dict:
    """Bytes of one all_to_all(v) with counts[i][j] rows from rank i to rank j, each of
    row_elements elements of itemsize bytes: {'sent': [per rank], 'received': [per rank],
    'total': sum over ranks of what they send (= what they receive)}."""
    S = [[int(c) for c in row] for row in counts]
    n = len(S)
    if any(len(row) != n for row in S) or any(c < 0 for row in S for c in row):
        raise ValueError(f"counts must be a square matrix of non-negative integers, got {S}")
    f = row_elements * itemsize
    sent = [sum(S[i][j] for j in range(n) if j != i) * f for i in range(n)]
    received = [sum(S[i][j] for i in range(n) if i != j) * f for j in range(n)]
    return dict(sent=sent, received=received, total=sum(sent))


def expert_send_counts(load, n_ranks: int) -> list[list[int]]:
    """S[i][j] = sum over the experts of rank j of load[i][e]: the dispatch's rows from rank
    i to rank j, for experts sharded contiguously (load [N, N_E], N_E divisible by N)."""
    L = [[int(c) for c in row] for row in load]
    n_experts = len(L[0])
    if len(L) != n_ranks or n_experts % n_ranks:
        raise ValueError(f"load must be [N, N_E] with N = {n_ranks} rows and N_E divisible "
                         f"by N, got {len(L)} x {n_experts}")
    local = n_experts // n_ranks
    return [[sum(L[i][j * local:(j + 1) * local]) for j in range(n_ranks)]
            for i in range(n_ranks)]


def expert_parallel_bytes(load, n_ranks: int, width: int, itemsize: int = 8,
                          algorithm: str = "ring") -> dict:
    """What one MoE layer's forward and backward move under expert parallelism.

    load [N, N_E] the kept assignments of each rank's tokens per expert; width D.
    Per rank (lists over the EP ranks) and in total (the sums), in bytes:
      counts    the all_gather of the loads (int64), forward only
      dispatch  all_to_allv(S) rows of D elements;  combine  all_to_allv(S^T)
      forward = counts + dispatch + combine;  backward = dispatch + combine (each adjoint is
      the other direction's all_to_allv);  step = forward + backward
    and rows[j] = sum_i S[i][j], the rows rank j's experts compute; busiest = the rank with
    the most rows (ties: the lowest rank), whose bytes are dispatch['received'][busiest].
    """
    S = expert_send_counts(load, n_ranks)
    n_experts = len(load[0])
    counts = collective_bytes("all_gather", algorithm, n_ranks * n_experts, n_ranks, 8)
    dispatch = all_to_all_bytes(S, width, itemsize)
    combine = all_to_all_bytes([list(col) for col in zip(*S)], width, itemsize)
    out = dict(S=S, counts=counts, dispatch=dispatch, combine=combine)
    for key in ("sent", "received"):
        fwd = [a + b + c for a, b, c in zip(counts[key], dispatch[key], combine[key])]
        bwd = [a + b for a, b in zip(dispatch[key], combine[key])]
        out.setdefault("forward", {})[key] = fwd
        out.setdefault("backward", {})[key] = bwd
        out.setdefault("step", {})[key] = [a + b for a, b in zip(fwd, bwd)]
    for part in ("forward", "backward", "step"):
        out[part]["total"] = sum(out[part]["sent"])
    out["rows"] = [sum(S[i][j] for i in range(n_ranks)) for j in range(n_ranks)]
    out["busiest"] = max(range(n_ranks), key=lambda j: (out["rows"][j], -j))
    return out
