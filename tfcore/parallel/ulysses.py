"""DeepSpeed-Ulysses: sequence-parallel attention by two all-to-alls around one device's op.

The ranks of a context-parallel group of N each hold a contiguous chunk of S / N positions
of every sequence (rank r: positions r S/N .. (r + 1) S/N - 1). Every op of a decoder but
attention works on each token alone; attention needs every position of a head. Ulysses
(Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models", arXiv 2309.14509) therefore trades the split:
an all-to-all turns "every head, my positions" into "my heads, every position", each rank
runs the one-device attention op (dense `attention_forward` or the tiled op of chapter 15)
on its H / N heads over the whole sequence, and a second all-to-all turns the output back.

    q  [B, H, S/N, D_h]  --all-to-all: split heads (axis 1), concat positions (axis 2)-->
    q' [B, H/N, S, D_h]      rank r: heads r H/N .. (r+1) H/N - 1, positions 0 .. S-1 in
                             order (the chunk from rank i lands at rows i S/N ..)
    k, v [B, K, S/N, D_h]  -->  k', v' [B, K/N, S, D_h]        (K kv heads sent, below)
    o' = attention(q', k', v', causal)   [B, H/N, S, D_v]      one device's op, no comm
    o' [B, H/N, S, D_v]  --all-to-all: split positions (axis 2), concat heads (axis 1)-->
    o  [B, H, S/N, D_v]

The backward runs the adjoints in reverse order. An all-to-all is a permutation of the rows
held over the ranks; its adjoint is its inverse, the all-to-all with the two axes swapped
(mappings.all_to_all_forward / _backward): dout goes to the heads layout, the one-device
backward gives dq', dk', dv', and three all-to-alls send them back to the positions layout.
Nothing of the attention is approximated: every rank computes the exact attention of its
heads, so the result equals one device's (tests/test_ulysses.py, float64, 1e-12).

Grouped-query attention (H_kv key/value heads, H_kv dividing H; query head h reads kv head
h // (H / H_kv)). Rank r must hold the kv heads its query heads r H/N .. read.
* N divides H_kv: the kv heads are sent as they are stored (K = H_kv). Rank r gets kv heads
  r H_kv/N .. (r+1) H_kv/N - 1, and its H/N query heads read exactly those: the groups of
  H / H_kv query heads never straddle a rank boundary, since H/N = (H_kv/N)(H/H_kv).
* N does not divide H_kv (MQA among them): the kv heads are repeated f times
  (repeat_kv_heads) before the all-to-all, K = f H_kv, f the smallest divisor of H / H_kv
  with N | f H_kv (f = H / H_kv, i.e. K = H, at most). Repeated head j is kv head j // f,
  and query head h reads repeated head h // (H / K), again within its rank. The backward
  sums the gradients of the f copies (sum_kv_groups). `ulysses_kv_heads` says which case
  holds: (kv heads sent per rank K / N, replicated).
Repeating to H (what a first reading suggests) would always work too; the smallest f sends
fewer bytes whenever f < H / H_kv (H = 8, H_kv = 2, N = 4: K = 4, not 8; MQA at H = 8,
N = 4: K = 4, not 8). Either way a rank's H/N query heads, H/K to a kv head, read all
K/N kv heads it holds. The degree is bounded by the heads: N must divide H.

Shape letters: B batch, H query heads, H_kv key/value heads, K the kv heads sent (above),
S the whole sequence, D_h the width of a head (D_v of a value head, usually D_h), N the
group size, b the bytes of an element.

Bytes. An all-to-all of a tensor of E elements per rank keeps 1/N of it and sends the rest,
E (N - 1)/N elements per rank, one block of E / N to each other rank (the pairwise
exchange of comm.all_to_all, counted as it moves). Per rank, per attention:
    forward   q, k, v, out:    b B (S/N) (H D_h + K D_h + K D_v + H D_v) (N - 1)/N
    backward  dout, dq, dk, dv: the same count (the same four tensors' sizes)
In total (over the N ranks) N times that. With K = H (MHA) and D_v = D_h, writing h = H D_h
for the hidden size, the forward sends 4 B S h (N - 1)/N^2 elements per rank and the
backward as many again (`ulysses_attention_bytes`).

Against the paper: DeepSpeed-Ulysses counts "an aggregate communication volume per link of
4Nh/P" (N the sequence length, h the hidden size, P the degree; q, k, v and the output of
one forward, MHA, B = 1), taking an all-to-all of a message of M elements over P GPUs to
cost M/P per link (per GPU's link to the switch). The exact count here is what a rank
sends: 4 S h (N - 1)/N^2 = (4Sh/N)(N - 1)/N elements, i.e. their 4Nh/P times (P - 1)/P
(half of it at P = 2, three quarters at P = 4), because a rank keeps its own block. Each
of the N - 1 directed links from a rank carries 4 S h / N^2 (one block of each tensor).
It falls as 1/N at a fixed S, which is the paper's central claim: the volume per link stays
constant when S and P grow together (Megatron-LM's sequence parallelism, whose all-gather
and reduce-scatter move O(S h) per rank whatever P, grows with S alone; a ring's, context.py,
2 (N - 1) B H_kv m D_h per forward with m = S/N, grows with N at a fixed m). The backward
doubles the forward's count; with GQA the k, v terms shrink by K / H. The paper also
claims that the attention inside is any one-device op (dense, FlashAttention, sparse; here
dense or tiled) and, in its runs, 2.5x the throughput of Megatron-LM's sequence parallelism
at 4x the sequence length (not measured here). Dropout is not supported here (the ring and
the one-device ops have it).
"""
from __future__ import annotations

from typing import NamedTuple

from .. import checks, ops
from ..models.blocks import repeat_kv_heads, sum_kv_groups
from . import mappings
from .context import check_local_qkv

HEAD_AXIS, SEQ_AXIS = 1, 2          # q, k, v, out are [B, H, S, D_h]
ATTENTION = ("dense", "tiled")


class KVHeads(NamedTuple):
    """How the key/value heads travel: `per_rank` kv heads reach each rank (K / N), and
    `replicated` says whether they were repeated before the all-to-all (N does not
    divide H_kv)."""

    per_rank: int
    replicated: bool


class UlyssesCache(NamedTuple):
    """What ulysses_attention_backward needs: the one-device op's cache (of the heads
    layout), the four all-to-alls' caches (q, k, v in; out back), the attention kind,
    the repeat factor f of the kv heads before the exchange and the local one after it
    (H / K), and the output's shape, dtype and library (for dout's check)."""

    attention: str
    inner: tuple
    a2a_q: dict
    a2a_k: dict
    a2a_v: dict
    a2a_out: dict
    repeat: int
    local_groups: int
    out_like: object


def _kv_repeat(n_heads: int, n_kv_heads: int, n: int) -> int:
    """f: the smallest divisor of H / H_kv with N | f H_kv (1 when N divides H_kv)."""
    groups = n_heads // n_kv_heads
    return next(f for f in range(1, groups + 1)
                if groups % f == 0 and (f * n_kv_heads) % n == 0)


def _check_heads(n_heads: int, n_kv_heads: int, n: int) -> None:
    if n_heads % n:
        raise ValueError(f"Ulysses attention splits the heads over the group: the number of "
                         f"heads H = {n_heads} must be divisible by the group size N = {n}")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"the number of key/value heads H_kv = {n_kv_heads} must divide "
                         f"the number of query heads H = {n_heads} (grouped-query attention)")


def ulysses_kv_heads(n_heads: int, n_kv_heads: int, n: int) -> KVHeads:
    """(kv heads sent per rank, replicated) for H query heads, H_kv kv heads, N ranks.

    N | H_kv: (H_kv / N, False), the kv heads travel as stored. Otherwise the kv heads are
    repeated f times first, f the smallest divisor of H / H_kv with N | f H_kv, and each
    rank gets (f H_kv / N, True); f H_kv = H at most (MQA at N = H: one head per rank)."""
    n_heads = checks.integer("n_heads", n_heads, least=1)
    n_kv_heads = checks.integer("n_kv_heads", n_kv_heads, least=1)
    n = checks.integer("n", n, least=1)
    _check_heads(n_heads, n_kv_heads, n)
    f = _kv_repeat(n_heads, n_kv_heads, n)
    return KVHeads(f * n_kv_heads // n, f > 1)


def _check_inputs(q, k, v, comm, causal, attention, block_size, dropout_p, seq_len):
    """Every refusal, raised before any byte moves: the local checks, then (without seq_len
    and with the group's call check on) one uncounted exchange of the local shapes.
    -> (causal, attention, block_size) checked."""
    check_local_qkv(q, k, v)
    causal = checks.boolean("causal", causal)
    attention = checks.choice("attention", attention, ATTENTION)
    if checks.real("dropout_p", dropout_p) != 0.0:
        raise ValueError(f"Ulysses attention does not support dropout (dropout_p = "
                         f"{dropout_p}): use dropout_p = 0, or ring attention "
                         "(tfcore.parallel.context) or one device's op, which have it")
    if attention == "dense":
        if block_size is not None:
            raise ValueError(f"block_size ({block_size}) is a setting of attention='tiled'; "
                             "the dense op has no tiles")
    else:
        block_size = 64 if block_size is None else checks.integer("block_size", block_size,
                                                                  least=1)
    n = comm.size
    batch, heads, local, d_h = q.shape
    kv_heads = k.shape[1]
    _check_heads(heads, kv_heads, n)
    if seq_len is not None:
        seq_len = checks.integer("seq_len", seq_len, least=1)
        if seq_len % n:
            raise ValueError(f"Ulysses attention needs the sequence length S = {seq_len} "
                             f"divisible by the group size N = {n}: every rank holds S / N "
                             "positions")
        if local != seq_len // n:
            raise ValueError(f"q holds {local} positions, but S = {seq_len} over N = {n} "
                             f"ranks gives {seq_len // n} per rank")
    elif comm.check_calls and n > 1:
        _check_same_shapes(comm, (batch, heads, local, d_h, kv_heads, v.shape[3],
                                  checks.dtype_name(q)))
    return causal, attention, block_size


def _check_same_shapes(comm, mine) -> None:
    """Every rank holds the same [B, H, S/N, D_h] (and H_kv, D_v, dtype): S = N (S/N) with
    N | S. One exchange of small tuples, uncounted like the collectives' call headers."""
    every = comm.all_gather_object(mine)
    lengths = [e[2] for e in every]
    seq, n = sum(lengths), comm.size
    if seq % n:
        raise ValueError(f"Ulysses attention needs the sequence length S = {seq} divisible "
                         f"by the group size N = {n}, every rank holding S / N positions; "
                         f"the ranks hold {lengths}")
    if len(set(lengths)) > 1:
        raise ValueError(f"every rank must hold S / N = {seq // n} positions (S = {seq}, "
                         f"N = {n}); the ranks hold {lengths}")
    differing = [i for i, e in enumerate(every) if e != every[0]]
    if differing:
        names = "(B, H, S/N, D_h, H_kv, D_v, dtype)"
        raise ValueError(f"the ranks' q, k, v differ: {names} is {every[0]} on rank 0 and "
                         f"{every[differing[0]]} on rank {differing[0]}")


def ulysses_attention_forward(q, k, v, comm, causal: bool = True, *, attention: str = "dense",
                              block_size: int | None = None, dropout_p: float = 0.0,
                              seq_len: int | None = None):
    """Attention over the whole sequence from this rank's chunk, by heads (Ulysses).

    q [B, H, S/N, D_h], k [B, H_kv, S/N, D_h], v [B, H_kv, S/N, D_v]: this rank's
             positions r S/N .. (r + 1) S/N - 1 of every head; H_kv divides H, N divides H
    comm     the context-parallel group (any Communicator), N = comm.size
    causal   query at position i sees keys j <= i (global positions)
    attention  "dense" (ops.attention_forward) or "tiled" (ops.tiled_attention_forward
             with block_size, 64 when None; block_size is refused with "dense")
    dropout_p  only 0: Ulysses here has no dropout (a clear ValueError otherwise)
    seq_len  S, if the caller knows it: checked against N and S/N on this rank alone.
             Without it (and with comm.check_calls) the ranks compare their shapes in
             one uncounted exchange, so that N not dividing S is refused naming S and N
    ->  out [B, H, S/N, D_v], UlyssesCache

    Every refusal is raised before any byte moves. Four counted all-to-alls: q, k, v to
    the heads layout [B, H/N, S, .] and the output back (see the module docstring).
    """
    causal, attention, block_size = _check_inputs(q, k, v, comm, causal, attention,
                                                  block_size, dropout_p, seq_len)
    heads, kv_heads = q.shape[1], k.shape[1]
    f = _kv_repeat(heads, kv_heads, comm.size)
    local_groups = heads // (f * kv_heads)                           # H / K
    a2a = lambda x: mappings.all_to_all_forward(x, comm, HEAD_AXIS, SEQ_AXIS)  # noqa: E731
    q_h, a2a_q = a2a(q)                                              # [B, H/N, S, D_h]
    k_h, a2a_k = a2a(repeat_kv_heads(k, f))                          # [B, K/N, S, D_h]
    v_h, a2a_v = a2a(repeat_kv_heads(v, f))                          # [B, K/N, S, D_v]
    k_rep = repeat_kv_heads(k_h, local_groups)                       # [B, H/N, S, D_h]
    v_rep = repeat_kv_heads(v_h, local_groups)                       # [B, H/N, S, D_v]
    if attention == "dense":
        out_h, inner = ops.attention_forward(q_h, k_rep, v_rep, causal=causal)
    else:
        out_h, inner = ops.tiled_attention_forward(q_h, k_rep, v_rep, causal=causal,
                                                   block_size=block_size)
    out, a2a_out = mappings.all_to_all_forward(out_h, comm, SEQ_AXIS, HEAD_AXIS)
    return out, UlyssesCache(attention, inner, a2a_q, a2a_k, a2a_v, a2a_out, f, local_groups,
                             out)                                # out [B, H, S/N, D_v]


def ulysses_attention_backward(dout, cache: UlyssesCache):
    """The VJP of ulysses_attention_forward, its adjoints in reverse order:
    dout [B, H, S/N, D_v] -> dq [B, H, S/N, D_h], dk [B, H_kv, S/N, D_h],
    dv [B, H_kv, S/N, D_v] (this rank's positions).

    dout' = all-to-all(dout) to [B, H/N, S, D_v] (the output exchange's adjoint); the
    one-device backward; the local kv repeat summed back (sum_kv_groups); dq', dk', dv' sent
    home by the adjoints of the input exchanges; the f copies of a replicated kv head
    summed (sum_kv_groups)."""
    if not isinstance(cache, UlyssesCache):
        raise TypeError(f"cache must be the UlyssesCache of ulysses_attention_forward, got "
                        f"{type(cache).__name__}")
    checks.upstream_like("dout", dout, cache.out_like)
    dout_h = mappings.all_to_all_backward(dout, cache.a2a_out)       # [B, H/N, S, D_v]
    if cache.attention == "dense":
        dq_h, dk_rep, dv_rep = ops.attention_backward(dout_h, cache.inner, trusted=True)
    else:
        dq_h, dk_rep, dv_rep = ops.tiled_attention_backward(dout_h, cache.inner, trusted=True)
    dk_h = sum_kv_groups(dk_rep, cache.local_groups)                 # [B, K/N, S, D_h]
    dv_h = sum_kv_groups(dv_rep, cache.local_groups)                 # [B, K/N, S, D_v]
    dq = mappings.all_to_all_backward(dq_h, cache.a2a_q)             # [B, H, S/N, D_h]
    dk = mappings.all_to_all_backward(dk_h, cache.a2a_k)             # [B, K, S/N, D_h]
    dv = mappings.all_to_all_backward(dv_h, cache.a2a_v)             # [B, K, S/N, D_v]
    return dq, sum_kv_groups(dk, cache.repeat), sum_kv_groups(dv, cache.repeat)


def ulysses_attention_bytes(batch: int, seq: int, heads: int, kv_heads: int, d_h: int, n: int,
                            itemsize: int = 8, d_v: int | None = None) -> dict:
    """Bytes sent by one ulysses_attention_forward and one backward, per rank and in total:
    {'forward': [per rank], 'backward': [per rank], 'forward_total', 'backward_total',
    'total', 'kv_heads_sent' (K)}.

    An all-to-all of E elements per rank sends E (N - 1)/N of them per rank:
        forward_r  = b B (S/N) (H D_h + K D_h + K D_v + H D_v) (N - 1)/N     q, k, v, out
        backward_r = forward_r                                         dout, dq, dk, dv
        totals     = N x the per-rank counts
    K = N ulysses_kv_heads(H, H_kv, N).per_rank: H_kv, or the repeated f H_kv. With K = H
    and D_v = D_h the forward per rank is 4 b B S (H D_h)(N - 1)/N^2: DeepSpeed-Ulysses'
    4Nh/P times (P - 1)/P (module docstring). A group of one rank sends nothing."""
    batch = checks.integer("batch", batch, least=1)
    seq = checks.integer("seq", seq, least=1)
    d_h = checks.integer("d_h", d_h, least=1)
    d_v = d_h if d_v is None else checks.integer("d_v", d_v, least=1)
    itemsize = checks.integer("itemsize", itemsize, least=1)
    per_rank, _ = ulysses_kv_heads(heads, kv_heads, n)
    if seq % n:
        raise ValueError(f"Ulysses attention needs the sequence length S = {seq} divisible "
                         f"by the group size N = {n}")
    K = per_rank * n
    elements = batch * (seq // n) * (heads * d_h + K * d_h + K * d_v + heads * d_v)
    sent, rest = divmod(elements * (n - 1), n)          # each tensor's E is a multiple of N
    assert rest == 0, "H and K are multiples of N"
    forward = sent * itemsize
    return dict(forward=[forward] * n, backward=[forward] * n, forward_total=n * forward,
                backward_total=n * forward, total=2 * n * forward, kv_heads_sent=K)
