"""Run under `mpiexec -n 4 python tests/mpi_pipeline.py OUT.npz`: the three schedules on 4
processes (GPipe on 4 stages; 1F1B on 2 stages x 2 tensor-parallel ranks; interleaved
1F1B, 2 chunks per rank, on 2 stages x 2 data-parallel replicas), each for a few AdamW
steps; rank 0 saves every run's losses, parameters and last gradients, and each rank's
point-to-point bytes, for tests/test_pipeline_mpi.py to compare with one device."""
from __future__ import annotations

import sys

import numpy as np

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import MPIComm
from tfcore.parallel.comm import abort_on_error
from tfcore.parallel.harness import CONFIGS, train_pipeline

STEPS, BATCH, SEQ = 3, 8, 8
LAYOUTS = {   # name: (config, train_pipeline's layout arguments)
    "gpipe": ("tiny", dict(pp=4, n_microbatches=4, schedule="gpipe")),
    "1f1b": ("tiny-llama", dict(pp=2, tp=2, n_microbatches=4, schedule="1f1b")),
    "interleaved": ("tiny", dict(pp=2, dp=2, n_microbatches=2, n_virtual=2,
                                 schedule="interleaved")),
}


def config_of(name: str) -> DecoderConfig:
    """The chapter's small models with 4 blocks, so that 4 stages or 2 x 2 chunks exist."""
    return DecoderConfig(**{**CONFIGS[name]().to_dict(), "n_layers": 4})


def main(out_path: str) -> None:
    with abort_on_error():
        world = MPIComm(timeout=60)
        saved = {}
        for run, (name, layout) in LAYOUTS.items():
            res = train_pipeline(world, config_of(name), STEPS, BATCH, SEQ, **layout)
            sent = np.array(world.all_gather_object(sum(res["sent"])))
            saved.update({f"{run}_losses": np.array(res["losses"]),
                          f"{run}_params": res["params"], f"{run}_grads": res["grads"],
                          f"{run}_sent": sent})
        if world.rank == 0:
            np.savez(out_path, **saved)
            print("pipeline runs:", ", ".join(LAYOUTS))


if __name__ == "__main__":
    main(sys.argv[1])
