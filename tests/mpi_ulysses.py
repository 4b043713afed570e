"""Run under `mpiexec -n 4 python tests/mpi_ulysses.py OUT.npz`: Ulysses attention on 4
processes, forward and backward, for multi-head, grouped-query (kv heads sent as stored and
repeated) and multi-query attention, dense and tiled; rank 0 saves every rank's output,
gradients and bytes sent and received for tests/test_ulysses.py to compare with one device
and with the simulation."""
from __future__ import annotations

import sys

import numpy as np

from tfcore.parallel import MPIComm
from tfcore.parallel.comm import abort_on_error
from tfcore.parallel.ulysses import ulysses_attention_backward, ulysses_attention_forward

WORLD = 4
BATCH, SEQ, D_H = 2, 12, 3
# name: (H, H_kv, attention, causal)
CASES = dict(mha_dense_causal=(8, 8, "dense", True),
             gqa_tiled_causal=(8, 4, "tiled", True),
             gqa_repeated_dense=(8, 2, "dense", False),
             mqa_tiled_causal=(4, 1, "tiled", True))


def inputs(name: str):
    """The whole q [B, H, S, D_h], k, v [B, H_kv, S, D_h] and upstream g [B, H, S, D_h]."""
    heads, kv_heads, _, _ = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name) + 17)
    q, g = (rng.standard_normal((BATCH, heads, SEQ, D_H)) for _ in range(2))
    k, v = (rng.standard_normal((BATCH, kv_heads, SEQ, D_H)) for _ in range(2))
    return q, k, v, g


def shard(x, rank: int, size: int):
    """Rank `rank`'s contiguous chunk of the positions (axis 2)."""
    m = x.shape[2] // size
    return np.ascontiguousarray(x[:, :, rank * m:(rank + 1) * m])


def run_case(comm, name: str) -> dict:
    """One forward and backward on this rank's chunk: {'out', 'dq', 'dk', 'dv', 'bytes'}
    (bytes: [sent, received] during the two calls)."""
    _, _, attention, causal = CASES[name]
    q, k, v, g = (shard(x, comm.rank, comm.size) for x in inputs(name))
    before = comm.traffic.sent, comm.traffic.received
    out, cache = ulysses_attention_forward(q, k, v, comm, causal, attention=attention,
                                           block_size=5 if attention == "tiled" else None)
    dq, dk, dv = ulysses_attention_backward(g, cache)
    moved = np.array([comm.traffic.sent - before[0], comm.traffic.received - before[1]])
    return dict(out=out, dq=dq, dk=dk, dv=dv, bytes=moved)


def run_all(comm) -> dict:
    return {f"{name}_{key}": value for name in CASES
            for key, value in run_case(comm, name).items()}


def main(argv) -> None:
    with abort_on_error():
        world = MPIComm(timeout=60)
        if world.size != WORLD:
            raise ValueError(f"run with mpiexec -n {WORLD}, got {world.size} processes")
        every = world.all_gather_object(run_all(world))
        if world.rank == 0:
            np.savez(argv[0], **{f"{k}_{r}": v for r, d in enumerate(every)
                                 for k, v in d.items()})
            print("ulysses runs: " + ", ".join(CASES))


if __name__ == "__main__":
    main(sys.argv[1:])
