"""Rank program for tests/test_real_runs_mpi.py (run under mpiexec, not collected by pytest).

    mpiexec -n 4 python tests/mpi_real_runs.py OUT.npz

Every rank runs, on MPIComm: bucketed overlapped training (ring, on the progress thread),
the same buckets blocking, overlapped with MPI_Iallreduce (native), and clipped training
on TP x DP with ZeRO-1; rank 0 saves what the test compares with the simulation and one
device, with the host name each rank was placed on (PMI_HOSTNAME, set by hydra).
"""
from __future__ import annotations

import os
import sys

import numpy as np

from tfcore.parallel.comm import MPIComm, abort_on_error
from tfcore.parallel.harness import CONFIGS, train_parallel

STEPS, BATCH, SEQ, BUCKET = 2, 8, 8, 2048
MAX_NORM = 0.1


def main(out_path):
    config = CONFIGS["tiny"]()
    results = {}
    for name, algorithm, kwargs in [
            ("overlap", "ring", dict(dp=4, bucket_bytes=BUCKET, micro_batches=2)),
            ("blocking", "ring", dict(dp=4, bucket_bytes=BUCKET, micro_batches=2,
                                      overlap=False)),
            ("native", "native", dict(dp=4, bucket_bytes=BUCKET, micro_batches=2)),
            ("clip", "ring", dict(tp=2, dp=2, zero=True, clip=MAX_NORM))]:
        world = MPIComm(algorithm=algorithm, timeout=60.0)
        out = train_parallel(world, config, STEPS, BATCH, SEQ, **kwargs)
        results[name] = out
        results[name + "_sent"] = world.all_gather_object(world.traffic.sent)
    hosts = MPIComm().all_gather_object(os.environ.get("PMI_HOSTNAME", "?"))
    if MPIComm().rank == 0:
        np.savez(out_path, hosts=np.array(hosts),
                 clip_norms=np.array(results["clip"]["norms"]),
                 **{f"{k}_params": results[k]["params"] for k in
                    ("overlap", "blocking", "native", "clip")},
                 **{f"{k}_losses": np.array(results[k]["losses"]) for k in
                    ("overlap", "blocking", "native", "clip")})


if __name__ == "__main__":
    with abort_on_error():
        main(sys.argv[1])
