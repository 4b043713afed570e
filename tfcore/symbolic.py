"""SymPy helpers the chapters share: the proof recipe of the book, step by step.

1. `matrix` builds a small matrix of real symbols; an op is written entry by entry on it.
2. `vjp` differentiates L = sum(G * Y) with a symbolic upstream G: the true vector-Jacobian
   product, one `sympy.diff` per input entry.
3. `assert_equal` checks that a derived closed form minus that truth simplifies to zero.
4. `lambdify` turns the closed form into a NumPy function to compare with tfcore.

`softmax`, `sigmoid` and `topk_gates` build the router of a mixture of experts on symbols;
`show` typesets a result in a notebook.
"""
from __future__ import annotations

import numpy as np
import sympy as sp


def matrix(name: str, rows: int, cols: int, **assumptions) -> sp.Matrix:
    """A rows x cols Matrix of symbols name_{i,j} (real unless told otherwise)."""
    assumptions.setdefault("real", True)
    return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}_{{{i},{j}}}", **assumptions))


def vector(name: str, n: int, **assumptions) -> sp.Matrix:
    """A 1 x n row vector of symbols name_{j} (rows are the book's convention)."""
    assumptions.setdefault("real", True)
    return sp.Matrix(1, n, lambda _, j: sp.Symbol(f"{name}_{{{j}}}", **assumptions))


def upstream_like(Y: sp.Matrix, name: str = "G") -> sp.Matrix:
    """A symbolic upstream gradient G with Y's shape."""
    return matrix(name, *Y.shape)


def vjp(Y: sp.Matrix, X: sp.Matrix, G: sp.Matrix) -> sp.Matrix:
    """The vector-Jacobian product dL/dX of L = sum(G * Y), entry by entry with sympy.diff."""
    if G.shape != Y.shape:
        raise ValueError(f"upstream G must have Y's shape {Y.shape}, got {G.shape}")
    L = sum(g * y for g, y in zip(G, Y))
    return X.applyfunc(lambda x: sp.diff(L, x))


def is_zero(expr) -> bool:
    """True when expr simplifies to 0 (cheap expansion first, full simplify only if needed)."""
    expr = sp.expand(expr)
    if expr == 0:
        return True
    return sp.simplify(expr) == 0


def assert_equal(name: str, truth: sp.Matrix, closed: sp.Matrix) -> None:
    """Assert closed - truth simplifies to the zero matrix; the error names the first entry that does not."""
    truth, closed = sp.Matrix(truth), sp.Matrix(closed)
    if truth.shape != closed.shape:
        raise AssertionError(f"{name}: closed form has shape {closed.shape}, the truth {truth.shape}")
    for index in range(len(truth)):
        diff = closed[index] - truth[index]
        if not is_zero(diff):
            i, j = divmod(index, truth.shape[1])
            raise AssertionError(f"{name}: entry ({i}, {j}) differs from the truth by {sp.simplify(diff)}")


def lambdify(args: list[sp.Matrix], expr: sp.Matrix, cse: bool = False):
    """A NumPy function of arrays shaped like `args` that evaluates the matrix `expr` (float64).

    cse=True factors out common subexpressions first: several times faster to build for large
    expressions (a softmax written out entry by entry), and the same values up to rounding.
    """
    modules = ["scipy", "numpy"]  # scipy: erf on arrays
    fn = sp.lambdify([a.tolist() for a in args], expr, modules=modules, cse=cse)
    shape = expr.shape

    def evaluate(*arrays):
        for a, arr in zip(args, arrays):
            if np.shape(arr) != a.shape:
                raise ValueError(f"expected an array of shape {a.shape}, got {np.shape(arr)}")
        return np.asarray(fn(*[np.asarray(arr, dtype=np.float64) for arr in arrays]), dtype=np.float64).reshape(shape)

    return evaluate


def softmax(z: sp.Matrix) -> sp.Matrix:
    """softmax of a 1 x n row of expressions: exp(z_j) / sum_i exp(z_i), entry by entry."""
    e = z.applyfunc(sp.exp)
    return e / sum(e)


def sigmoid(z: sp.Matrix) -> sp.Matrix:
    """1 / (1 + exp(-z_j)), entry by entry."""
    return z.applyfunc(lambda v: 1 / (1 + sp.exp(-v)))


def topk_gates(scores: sp.Matrix, selected: list[int], normalize: bool) -> sp.Matrix:
    """The 1 x K gates of a router for a fixed selection (the experts `selected`, best first):
    scores[e_k], divided by their sum when `normalize` (the selection is a constant: the
    proof of the router's backward holds for each selection, which is piecewise constant)."""
    gates = sp.Matrix(1, len(selected), lambda _, k: scores[selected[k]])
    return gates / sum(gates) if normalize else gates


def show(lhs: str, expr) -> None:
    """Typeset "lhs = expr" (a SymPy expression or matrix) in a notebook's output."""
    from IPython.display import Math, display

    display(Math(lhs + " = " + sp.latex(expr)))
