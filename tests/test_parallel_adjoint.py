"""Each mapping's backward is the adjoint of its forward, proved on symbolic shards.

The mappings run unchanged on NumPy arrays of SymPy symbols, in a simulated group of N
ranks: x and the upstream y are symbols, and <forward(x), y> - <x, backward(y)> must
simplify to 0 exactly. The inner products are those of the logical values: a tensor
replicated on every rank is one tensor (counted once), per-rank values (partial sums, a
rank's own copy, shards) are counted on every rank.
"""
from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from tfcore.parallel import SimulatedGroup
from tfcore.parallel import mappings as M

N, B, S, D = 2, 1, 4, 2        # N ranks; S divisible by N for the sequence mappings


def symbols(prefix, n, shape):
    """n arrays (one per rank) of distinct symbols, dtype object."""
    size = int(np.prod(shape))
    return [np.array(sp.symbols(f"{prefix}{r}_0:{size}"), dtype=object).reshape(shape)
            for r in range(n)]


def dot(a, b):
    return sp.expand(sum(np.asarray(a, dtype=object).ravel() * np.asarray(b, dtype=object).ravel()))


def replicated(a, b):
    """One logical tensor held by every rank: counted once (the copies must agree)."""
    assert all(np.array_equal(np.asarray(x), np.asarray(a[0])) for x in a)
    assert all(np.array_equal(np.asarray(y), np.asarray(b[0])) for y in b)
    return dot(a[0], b[0])


def ranks_sum(a, b):
    """Values of each rank's own (partial sums, copies, shards): summed over ranks."""
    return sum(dot(x, y) for x, y in zip(a, b))


# name: (in shape, out shape, in kind, out kind): "rep" replicated, "rank" per rank
PAIRS = {
    "copy_to_tp_region": ((B, S, D), (B, S, D), "rep", "rank"),
    "reduce_from_tp_region": ((B, S, D), (B, S, D), "rank", "rep"),
    "gather_from_sequence_region": ((B, S // N, D), (B, S, D), "rank", "rank"),
    "reduce_scatter_to_sequence_region": ((B, S, D), (B, S // N, D), "rank", "rank"),
    "scatter_to_sequence_region": ((B, S, D), (B, S // N, D), "rep", "rank"),
    "gather_from_tp_region": ((B, S, D), (B, S, D * N), "rank", "rep"),
}


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("algorithm", ["ring", "naive"])
def test_backward_is_the_adjoint_of_forward(name, algorithm):
    in_shape, out_shape, in_kind, out_kind = PAIRS[name]
    xs = symbols("x", N, in_shape)
    ys = symbols("y", N, out_shape)
    if in_kind == "rep":
        xs = [xs[0]] * N
    if out_kind == "rep":
        ys = [ys[0]] * N
    forward = getattr(M, name + "_forward")
    backward = getattr(M, name + "_backward")

    def body(comm):
        out, cache = forward(xs[comm.rank], comm)
        return out, backward(ys[comm.rank], cache)

    results = SimulatedGroup(N, algorithm).run(body)
    fx = [r[0] for r in results]
    fty = [r[1] for r in results]
    inner_out = replicated if out_kind == "rep" else ranks_sum
    inner_in = replicated if in_kind == "rep" else ranks_sum
    assert sp.simplify(inner_out(fx, ys) - inner_in(xs, fty)) == 0


def test_a_wrong_backward_fails_the_same_check():
    """The identity as the backward of f (forgetting its all-reduce) gives a nonzero
    difference: the check can fail."""
    xs = symbols("x", 1, (3,)) * N
    ys = symbols("y", N, (3,))
    assert sp.simplify(ranks_sum(xs, ys) - dot(xs[0], ys[0])) != 0
