"""Run under `mpiexec -n 4 python tests/mpi_experts.py OUT.npz`: all_to_allv with uneven
counts (the pairwise schedule and MPI's own Alltoallv) and the expert-parallel MoE layer at
ep = 4 and at ep = 2 (two groups of two ranks), forward and backward; rank 0 saves every
rank's results and bytes for tests/test_parallel_experts.py to compare with a NumPy
permutation, the simulation and one device.

`mpiexec -n 4 python tests/mpi_experts.py --mismatch` makes rank 1 expect one row too many:
every rank must refuse the call and the job end with status 1."""
from __future__ import annotations

import sys

import numpy as np

from tfcore.parallel import MPIComm
from tfcore.parallel import experts as EP
from tfcore.parallel.comm import abort_on_error

WORLD = 4
N_EXPERTS, TOP_K, WIDTH, HIDDEN = 8, 2, 6, 5


def counts() -> np.ndarray:
    """S[i][j] rows from rank i to rank j (zeros on and off the diagonal)."""
    S = np.random.default_rng(7).integers(0, 5, size=(WORLD, WORLD))
    S[0, 2] = S[3, 3] = 0
    return S


def rows(r: int) -> np.ndarray:
    return np.random.default_rng(100 + r).standard_normal((int(counts()[r].sum()), 3))


def layer_inputs():
    """Every rank's tokens and upstream gradient, the router and all experts' weights."""
    rng = np.random.default_rng(11)
    n_tokens = [5, 9, 0, 7]
    xs = [rng.standard_normal((t, WIDTH)) for t in n_tokens]
    dys = [rng.standard_normal((t, WIDTH)) for t in n_tokens]
    W_router = rng.standard_normal((WIDTH, N_EXPERTS))
    W = dict(W_fc=rng.standard_normal((N_EXPERTS, WIDTH, HIDDEN)) / np.sqrt(WIDTH),
             b_fc=0.1 * rng.standard_normal((N_EXPERTS, HIDDEN)),
             W_proj=rng.standard_normal((N_EXPERTS, HIDDEN, WIDTH)) / np.sqrt(HIDDEN),
             b_proj=0.1 * rng.standard_normal((N_EXPERTS, WIDTH)))
    return xs, dys, W_router, W


def layer(world, ep: int) -> dict:
    """The expert-parallel layer on world rank w's tokens, in its group of ep ranks:
    {'y', 'dx', 'dW_router', and each expert gradient of this rank's experts}."""
    xs, dys, W_router, W = layer_inputs()
    comm = EP.expert_parallel_group(world, ep)
    n_local = N_EXPERTS // ep
    mine = {k: v[comm.rank * n_local:(comm.rank + 1) * n_local] for k, v in W.items()}
    y, cache = EP.ep_moe_forward(xs[world.rank], W_router, mine, comm, TOP_K,
                                 capacity_factor=1.0)
    grads = EP.ep_moe_backward(dys[world.rank], cache)
    out = dict(y=y, dx=grads["x"], dW_router=grads["W_router"])
    out.update({f"d{k}": grads[k] for k in W})
    return out


def collectives(world) -> dict:
    S = counts()
    r = world.rank
    out = dict(a2av=world.all_to_allv(rows(r), S[r], S[:, r]))
    native = MPIComm(algorithm="native", timeout=60) if isinstance(world, MPIComm) else None
    if native is not None:
        out["a2av_native"] = native.all_to_allv(rows(r), S[r], S[:, r])
    return out


def main(argv) -> None:
    with abort_on_error():
        world = MPIComm(timeout=60)
        if argv[0] == "--mismatch":
            S = counts()
            recv = S[:, world.rank].copy()
            recv[0] += world.rank == 1
            world.all_to_allv(rows(world.rank), S[world.rank], recv)
            return
        saved = {}
        start = world.traffic.sent, world.traffic.received
        for key, value in collectives(world).items():
            saved[key] = value
        saved["a2av_bytes"] = np.array([world.traffic.sent - start[0],
                                        world.traffic.received - start[1]])
        for ep in (4, 2):
            before = world.traffic.sent, world.traffic.received
            for key, value in layer(world, ep).items():
                saved[f"ep{ep}_{key}"] = value
            saved[f"ep{ep}_bytes"] = np.array([world.traffic.sent - before[0],
                                               world.traffic.received - before[1]])
        every = world.all_gather_object(saved)
        if world.rank == 0:
            np.savez(argv[0], **{f"{k}_{r}": v for r, d in enumerate(every)
                                 for k, v in d.items()})
            print("expert-parallel runs: all_to_allv, ep 4, ep 2")


if __name__ == "__main__":
    main(sys.argv[1:])
