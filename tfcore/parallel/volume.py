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
    heads and MLP columns, the replicated tensors whole)."""
    D, F, L, N = config.d_model, config.d_ff, config.n_layers, tp
    a, b = chunk_bounds(config.vocab_size, N)[t]
    V_t = b - a
    per_layer = 3 * D * D // N + D * D // N + D * F // N + F * D // N
    if config.mlp == "swiglu":
        per_layer += D * F // N
    if config.bias:
        per_layer += 3 * D // N + F // N * (2 if config.mlp == "swiglu" else 1)
    P = V_t * D + L * per_layer + replicated_elements(config)
    if not config.tied_head:
        P += D * V_t
    if config.head_bias:
        P += V_t
    return P


def step_collectives(config, batch_local: int, seq: int, tp: int, dp: int, sp: bool,
                     zero: bool) -> list[tuple[str, str, int]]:
    """[(group, op, M)] of one training step of TensorParallelDecoder + DataParallelAdamW,
    as the model's structure says (forward, backward, optimizer), for tensor-parallel rank
    t = 0 (the replicated tensors and the vocab rows of rank t enter through P_t below)."""
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
