"""tfcore: a Transformer's forward and hand-written backward passes, proved in the companion book.

Modules:
    backend     which array library computes (NumPy, CuPy, or array-api-strict for testing)
    checks      argument validation with clear errors, shared by every op
    functional  stateless forward/backward pairs, one module per family of ops (the reference)
    ops         the one dispatch seat: each accelerated op runs a registered kernel where it
                takes the arguments, the functional op otherwise
    kernels     fused Numba kernels for the CPU, registered with ops; TFCORE_KERNELS=0 selects
                the reference path
    nn          Parameters: one flat buffer of values and one of gradients, views by name
    models      blocks, the decoder LM, note 001's encoder classifier and MLP, note 002's
                autoencoder, size tables
    optim       SGD, Adam, AdamW over the flat buffers, clipping, schedules
    data        the character corpus, the digit tasks, batch samplers
    train       the training loop and atomic checkpoints (python -m tfcore.train)
    sample      continue a prompt from a checkpoint (python -m tfcore.sample)
    plot        loss curves of a run's log.jsonl (python -m tfcore.plot; the figure is viz's)
    exercises   checks a reader's own backward against tfcore's ("write this backward yourself")
    bench       a training step timed against the matmul peak and PyTorch (python -m tfcore.bench)
    parallel    communicators, tensor/sequence/data parallelism, ZeRO-1
                (python -m tfcore.parallel)
    viz         figures drawn from runs: the parallel layouts' diagrams, pipeline
                timelines, loss curves (matplotlib imported by the drawing functions only)
    gradcheck   finite differences and relative-error helpers
    mixed_precision  bfloat16/float16 matmuls with float32 accumulation, loss scaling
    symbolic    SymPy helpers the chapters share
Only backend, checks, functional, ops, kernels (which registers its kernels with ops) and
gradcheck are imported with the package; the others are imported on demand
(`from tfcore.models import DecoderLM`).
"""
from . import backend, checks, functional, gradcheck  # tfcore.symbolic (SymPy) is imported on demand
from . import ops, kernels  # noqa: E402  (kernels after ops: importing it registers the kernels)

__all__ = ["backend", "checks", "functional", "gradcheck", "kernels", "ops"]
__version__ = "0.1.0"
