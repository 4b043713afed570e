"""The check every backward makes first: dout must look like the forward's output.

A backward pass that silently broadcasts a wrongly shaped upstream gradient returns wrong
numbers without an error, so each op records its output's shape and dtype in the cache, and
the backward compares dout with them (and with an array the cache already holds, for the
library) before computing anything. Recording the output array itself would keep it alive.
"""
from __future__ import annotations

from .. import checks
from ..backend import namespace


def check_upstream(name: str, dout, shape: tuple, dtype: str, like) -> None:
    """dout has the forward output's `shape` and `dtype`, in the library of the array `like`."""
    if not hasattr(dout, "shape") or not hasattr(dout, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(dout).__name__}")
    namespace(dout, like)  # one library, or a clear TypeError
    if tuple(dout.shape) != tuple(shape) or checks.dtype_name(dout) != dtype:
        raise ValueError(
            f"{name} must have the forward output's shape {tuple(shape)} and dtype {dtype}, "
            f"got shape {tuple(dout.shape)} and dtype {checks.dtype_name(dout)}"
        )
