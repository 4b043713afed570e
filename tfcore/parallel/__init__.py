"""Tensor, sequence and data parallelism over one communicator interface (see comm.py)."""
from .comm import (  # noqa: F401
    CallRecord,
    Communicator,
    MPIComm,
    SimulatedComm,
    SimulatedGroup,
    Traffic,
    chunk_bounds,
    total_traffic,
)
