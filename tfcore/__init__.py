"""tfcore: a Transformer's forward and hand-written backward passes, proved in the companion book.

Modules:
    backend     which array library computes (NumPy, CuPy, or array-api-strict for testing)
    functional  stateless forward/backward pairs, one per op
    gradcheck   finite differences and relative-error helpers
    symbolic    SymPy helpers the chapters share
"""
from . import backend, checks, functional, gradcheck  # tfcore.symbolic (SymPy) is imported on demand

__all__ = ["backend", "checks", "functional", "gradcheck"]
__version__ = "0.1.0"
