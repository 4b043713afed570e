"""Shape helpers shared by the op families."""
from __future__ import annotations

from ..backend import namespace


def _flat_rows(x, width: int):
    """[..., width] -> [N, width] (a view when x is contiguous)."""
    return namespace(x).reshape(x, (-1, width))


def _sum_over_leading(x):
    """[..., D] -> [D]: the sum over every axis but the last (a bias or gain gradient)."""
    return namespace(x).sum(_flat_rows(x, x.shape[-1]), axis=0)
