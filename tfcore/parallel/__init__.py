"""Tensor, sequence, data, pipeline and context parallelism and ZeRO over one communicator
interface.

    comm        Communicator: SimulatedGroup / SimulatedComm (threads, counted bytes), MPIComm
    mappings    f, g and the sequence-parallel gathers/scatters as forward/backward pairs
    layers      column/row-parallel linears, vocab-parallel embedding and cross-entropy
    model       TensorParallelDecoder, sharded by parameter name from a DecoderLM
    optimizer   the sharding strategies of optim's one AdamW: Replicated, ZeRO1, ZeRO23
    fsdp        ZeRO-2 and ZeRO-3 (FSDP): units gathered before use and freed, a memory ledger
    layout      Layout: the degrees and options of a run, and validate(config), the one
                list of the combinations that do not train (REFUSALS)
    mesh        Mesh: the DP x TP groups (DP x PP x TP with pipeline stages)
    pipeline    stages, micro-batches, schedules as data (GPipe, 1F1B, interleaved), bubble
    context     ring attention over the sequence, ContextParallelDecoder
    experts     expert parallelism: experts sharded over a group, dispatch and combine
                over all_to_allv as forward/backward pairs, the expert-parallel MoE layer
    volume      closed forms of bytes per collective and per step, parameters per rank
    runner      build (one rank of a layout: the one decoder, its AdamW) and train_step
    harness     the checks' small configs, random batches and comparison loops
                (train_single, train_layout, ...: the tests, the chapters, the CLI)
    planning    plan(config, dp=, tp=, ...), the calculator: memory per rank, bytes per
                step, bubble and (on a stated Cluster) the step time of a layout (also
                tfcore.parallel.plan)
"""
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
from .layout import REFUSALS, Layout, LayoutError  # noqa: F401
from .mesh import Mesh  # noqa: F401
from .model import TensorParallelDecoder  # noqa: F401
from .optimizer import Replicated, ZeRO1, ZeRO23  # noqa: F401
from .pipeline import bubble_fraction, peak_stored_microbatches  # noqa: F401
from .planning import Cluster, Plan, plan  # noqa: F401
