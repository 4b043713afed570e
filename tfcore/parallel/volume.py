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

from .comm import chunk_bounds


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


def step_collectives(config, batch_local: int, seq: int, tp: int, dp: int, sp: bool,
                     zero: bool) -> list[tuple[str, str, int]]:
    """[(group, op, M)] of one training step of TensorParallelDecoder + AdamW (its Replicated
    or ZeRO1 strategy), as the model's structure says (forward, backward, optimizer), for
    tensor-parallel rank t = 0 (the replicated tensors and the vocab rows of rank t enter
    through P_t below)."""
    L = config.n_layers
    act = batch_local * seq * config.d_model                  # [B_loc, S, D]
    tok = batch_local * seq                                   # [B_loc, S]
    calls = []
    if sp:
        calls += [("tp", "reduce_scatter", act)] * (2 * L + 1)  # embedding, 2 exits per layer
        calls += [("tp", "all_gather", act)] * (2 * L + 1)      # 2 enters per layer, the head
    else:
        calls += [("tp", "all_reduce", act)] * (2 * L + 1)      # g: embedding, 2 per layer
    calls += [("tp", "all_reduce", tok)] * 3                    # cross-entropy: max, sum, pick
    if dp > 1:
        calls += [("dp", "all_reduce", 2)]                      # loss sum and token count
    if sp:
        calls += [("tp", "reduce_scatter", act)] * (2 * L + 1)  # adjoints of the gathers
        calls += [("tp", "all_gather", act)] * (2 * L + 1)      # adjoints of the scatters
        calls += [("tp", "all_reduce", replicated_elements(config))]
    else:
        calls += [("tp", "all_reduce", act)] * (2 * L + 1)      # f*: head, 2 per layer
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


def local_shape(name: str, shape, config, tp: int, t: int) -> tuple:
    """The shape of tensor `name` on tensor-parallel rank t (model.shard_tensor's rule,
    without allocating anything)."""
    from .parts import shard_rule

    shape = tuple(int(n) for n in shape)
    rule = shard_rule(name)
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
    import math

    from .fsdp import unit_names, unit_uses

    shapes, uses = config.param_shapes(), unit_uses(config)
    return [(u, sum(math.prod(local_shape(n, shapes[n], config, tp, t)) for n in names),
             uses[u]) for u, names in unit_names(config)]


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


def zero_collectives(config, tp: int, t: int, dp: int, zero: int) -> list[tuple[str, int]]:
    """[(op, M)] over the dp group of one step's gradient and parameter traffic at `zero`
    (0 = replicated DP), for tensor-parallel rank t: the table above."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if dp == 1:
        return []
    P = local_parameters(config, tp, t)
    if zero == 0:
        return [("all_reduce", P)]
    if zero == 1:
        return [("reduce_scatter", P), ("all_gather", P)]
    calls = []
    for _, M, uses in unit_elements(config, tp, t):
        if zero == 2:
            calls += [("reduce_scatter", M)] * uses + [("all_gather", M)]
        else:
            calls += [("all_gather", M), ("all_gather", M), ("reduce_scatter", M)] * uses
    return calls


def step_traffic(config, batch_local: int, seq: int, tp: int, dp: int, sp: bool, zero: int,
                 algorithm: str = "ring", itemsize: int = 8, cp: int | None = None,
                 balanced: bool = True) -> list[dict]:
    """Bytes each world rank sends in one training step (one micro-batch), by (group, op):
    [{(group, op): bytes}] per world rank w = (d * N_C + c) * tp + t (mesh.py; N_C = 1 and
    w = d * tp + t without a ring). ZeRO stages 0-3 over the data group (dp, or dp x cp,
    named "cp" when dp = 1); with a ring (cp) each rank's activations are its positions
    [B, S_c, D] and every layer adds the ring's forward and backward ("cp", "ring") of its
    key/value heads; recompute='full' runs each block's forward again in the backward (its
    collectives once more); key/value heads shared over tp (H_kv < N_T) sum their gradient
    columns over the sharing ranks ("kv", "all_reduce")."""
    from .context import ContextLayout, ring_attention_bytes
    from .parts import kv_heads_of

    C = cp or 1
    data_name = "dp" if cp is None else ("cp" if dp == 1 else "dp x cp")
    L, D_h = config.n_layers, config.head_dim
    ring = ContextLayout(seq, C, balanced) if cp is not None else None
    out = []
    for d in range(dp):
        for c in range(C):
            S_c = ring.local_len(c) if ring is not None else seq
            for t in range(tp):
                calls = step_collectives(config, batch_local, S_c, tp, dp * C, sp, zero)
                act = batch_local * S_c * config.d_model
                if config.recompute == "full":   # each block's forward again: its exits
                    calls += ([("tp", "all_gather", act), ("tp", "reduce_scatter", act)]
                              if sp else [("tp", "all_reduce", act)]) * (2 * L)
                calls += [("dp", op, M) for op, M in zero_collectives(config, tp, t, dp * C,
                                                                      zero)]
                k0, k1 = kv_heads_of(config, tp, t)
                sharing = tp // config.n_kv_heads if config.n_kv_heads < tp else 1
                if sharing > 1:
                    per_layer = 2 * D_h * (config.d_model + (1 if config.bias else 0))
                    calls += [("kv", "all_reduce", L * per_layer)]
                by_op: dict = {}
                for group, op, M in calls:
                    n, r = dict(tp=(tp, t), dp=(dp * C, d * C + c),
                                kv=(sharing, t % sharing))[group]
                    name = data_name if group == "dp" else group
                    sent = collective_bytes(op, algorithm, M, n, itemsize)["sent"][r]
                    by_op[(name, op)] = by_op.get((name, op), 0) + sent
                if ring is not None:
                    moved = ring_attention_bytes(ring, batch_local, k1 - k0, D_h,
                                                 itemsize=itemsize)
                    passes = moved["forward"][c] * (2 if config.recompute == "full" else 1)
                    by_op[("cp", "ring")] = L * (passes + moved["backward"][c])
                out.append(by_op)
    return out


def zero_memory(config, tp: int, t: int, dp: int, d: int, zero: int,
                itemsize: int = 8) -> dict:
    """Bytes of parameters, gradients and AdamW state that rank (d, t) holds at the peak of
    a step, and the transient part of them ('gathered': the whole units in use):

        zero 0   params P             grads P              optimizer 2 P
        zero 1   params P             grads P              optimizer 2 c_d  (chunk d of P)
        zero 2   params P             grads Z_d + M_max    optimizer 2 Z_d
        zero 3   params Z_d + M_max   grads Z_d + M_max    optimizer 2 Z_d
    P = P_t, Z_d the shard (shard_elements), M_max the largest phase (unit_phases): the
    units gathered at once, whose gradients the backward holds at the same moment."""
    P = local_parameters(config, tp, t)
    if zero in (0, 1):
        c = chunk_bounds(P, dp)[d]
        opt = 2 * P if zero == 0 else 2 * (c[1] - c[0])
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
