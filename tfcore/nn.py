"""Parameters in one flat buffer, gradients in another of the same layout (as llm.c keeps them).

Every tensor of a model is a view into ``Parameters.data`` and its gradient the matching view
into ``Parameters.grad``:

* zeroing every gradient is one call (``zero_grad``);
* an optimizer step is a few vectorized operations over the two flat arrays (and any slice of
  them, so sharded optimizers reuse the same code);
* a tied weight is one view used twice: both uses add their gradient into the same view;
* a checkpoint is one array plus the layout (``state_dict`` / ``load_state_dict``).

The views stay valid for the life of the object: nothing ever rebinds ``data`` or ``grad``;
loading copies into them in place.

Layers never store gradients anywhere else: an op's backward *returns* its parameter gradients
and the model adds them into ``grad_of(name)`` with ``+=``.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

from . import backend, checks, ops
from .backend import FLOAT_DTYPES


class Parameters:
    """Named tensors that are views into one flat float buffer, with gradients alike.

    shapes: an ordered mapping {name: shape}; the order is the layout of the flat buffer.
    dtype:  'float32' or 'float64'. The buffers are created on the selected backend.

    data [P], grad [P] with P = sum of the tensors' sizes; p[name] and p.grad_of(name) are
    views of shape shapes[name]; offsets[name] = (start, stop) into the flat buffers.
    """

    def __init__(self, shapes: Mapping[str, Iterable[int]], dtype: str = "float64"):
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        if not shapes:
            raise ValueError("Parameters needs at least one named tensor")
        self.dtype = dtype
        self.names: list[str] = list(shapes)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name in self.names:
            shape = tuple(int(n) for n in shapes[name])
            if any(n < 1 for n in shape):
                raise ValueError(f"parameter {name!r} must have positive sizes, got shape {shape}")
            self.shapes[name] = shape
            self.offsets[name] = (start, start + math.prod(shape))
            start += math.prod(shape)
        self.size = start
        xp = backend.xp()
        self.data = xp.zeros((self.size,), dtype=getattr(xp, dtype))   # [P]
        self.grad = xp.zeros((self.size,), dtype=getattr(xp, dtype))   # [P]
        self._values = {n: self._view(self.data, n) for n in self.names}
        self._grads = {n: self._view(self.grad, n) for n in self.names}

    def _view(self, flat, name):
        start, stop = self.offsets[name]
        return backend.namespace(flat).reshape(flat[start:stop], self.shapes[name])

    # -- access --------------------------------------------------------------------------
    def __getitem__(self, name: str):
        """The value of tensor `name`: a view of .data (writes go into the flat buffer)."""
        try:
            return self._values[name]
        except KeyError:
            raise KeyError(f"no parameter named {name!r}; known: {', '.join(self.names)}") from None

    def grad_of(self, name: str):
        """The gradient of tensor `name`: a view of .grad; layers add into it with +=."""
        try:
            return self._grads[name]
        except KeyError:
            raise KeyError(f"no parameter named {name!r}; known: {', '.join(self.names)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def items(self):
        return ((n, self._values[n]) for n in self.names)

    def numel(self) -> int:
        """The number of scalars held (the length of .data)."""
        return self.size

    @property
    def nbytes(self) -> int:
        """Bytes of the value buffer (the gradient buffer holds as many again)."""
        return self.size * np.dtype(self.dtype).itemsize

    # -- whole-buffer operations ---------------------------------------------------------
    def zero_grad(self) -> None:
        """Set every gradient to zero: one write over the flat gradient buffer."""
        self.grad[...] = 0.0

    def decay_mask(self, decayed: Iterable[str] | None = None):
        """[P] array of 0/1: 1 where AdamW's decoupled weight decay applies.

        By default the weight matrices (names ending in '.W'); not biases, norm gains,
        embeddings ('wte'), positions ('wpe') or tokens such as 'cls'. `decayed` names the
        tensors explicitly instead.
        """
        chosen = set(self.names if decayed is None else decayed)
        unknown = chosen - set(self.names)
        if unknown:
            raise KeyError(f"decay_mask: unknown parameter(s) {sorted(unknown)}")
        mask = np.zeros(self.size, dtype=self.dtype)
        for name in self.names:
            if name in chosen and (decayed is not None or name.endswith(".W")):
                start, stop = self.offsets[name]
                mask[start:stop] = 1.0
        return backend.asarray(mask)

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """[(name, shape), ...] in buffer order: what a checkpoint must match."""
        return [(n, self.shapes[n]) for n in self.names]

    def load_flat(self, flat) -> None:
        """Copy a flat array of length P (any backend, or NumPy) into .data, in place."""
        host = backend.to_numpy(flat)
        if host.ndim != 1 or host.shape[0] != self.size:
            raise ValueError(
                f"load_flat expects a 1-D array of {self.size} values, got shape {host.shape}")
        if not np.all(np.isfinite(host)):
            raise ValueError("load_flat: the array holds non-finite values (nan or inf)")
        self.data[...] = backend.asarray(host, dtype=self.dtype)

    def state_dict(self) -> dict:
        """A host (NumPy) copy of the values with the layout and dtype: one array to save."""
        return {
            "layout": self.layout(),
            "dtype": self.dtype,
            "data": np.array(backend.to_numpy(self.data), copy=True),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Load a state_dict, refusing (before changing anything) one of another layout."""
        theirs = [(str(n), tuple(int(d) for d in s)) for n, s in state["layout"]]
        if theirs != self.layout():
            mine = dict(self.layout())
            other = dict(theirs)
            diffs = [
                f"{n}: {other.get(n, 'missing')} vs {mine.get(n, 'missing')}"
                for n in list(dict.fromkeys(list(mine) + list(other)))
                if other.get(n) != mine.get(n)
            ]
            if not diffs:
                diffs = ["same tensors in a different order"]
            raise ValueError("state_dict layout does not match these parameters (theirs vs ours): "
                             + "; ".join(diffs[:5]) + (" ..." if len(diffs) > 5 else ""))
        self.load_flat(state["data"])

    def __repr__(self) -> str:
        return f"Parameters({len(self.names)} tensors, {self.size} values, {self.dtype})"


def gpt2_init(params: Parameters, seed: int, n_layers: int, std: float = 0.02,
              residual_suffixes: tuple[str, ...] = (".attn.proj.W", ".mlp.proj.W")) -> None:
    """Initialise like GPT-2, reproducibly: the same seed gives the same values on every backend.

    Names ending in '.g' (norm gains) are ones, in '.b' (biases) zeros; every other tensor is
    drawn from N(0, std^2), and the projections that write into the residual stream
    (`residual_suffixes`) from N(0, (std / sqrt(2 n_layers))^2), so that the sum of 2 n_layers
    residual branches keeps the variance of the stream of order one at initialisation.
    The draws are made on the host in buffer order, then copied once.
    """
    std = checks.positive("std", std)
    rng = np.random.default_rng(seed)
    flat = np.zeros(params.size, dtype=np.float64)
    residual_std = std / math.sqrt(2 * max(n_layers, 1))
    for name in params.names:
        start, stop = params.offsets[name]
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "g":
            flat[start:stop] = 1.0
        elif leaf == "b":
            flat[start:stop] = 0.0
        else:
            scale = residual_std if name.endswith(residual_suffixes) else std
            flat[start:stop] = scale * rng.standard_normal(stop - start)
    limit = np.finfo(params.dtype).max
    if not np.all(np.abs(flat) <= limit):        # a huge std overflows the dtype
        raise ValueError(f"std (init_std) = {std} draws values beyond {params.dtype}'s "
                         f"range (max {limit:.3g}): choose a smaller init_std")
    params.load_flat(flat)


# -- small layer helpers: an op pair applied to the parameters named `<name>.W`, `<name>.b` ... --
# Each returns (out, cache) like the op it wraps; each backward adds the parameter gradients
# into the gradient views with += (so a tensor used twice collects both contributions) and
# returns the gradient of the input.


def accumulate(params: Parameters, name: str, grad) -> None:
    """params.grad_of(name) += grad (in place: the flat gradient buffer is updated)."""
    view = params.grad_of(name)
    view += grad


# The helpers below run inside a model, on arrays the model made itself (shapes, dtypes and
# library agree by construction). They call the ops of tfcore.ops as trusted calls: where a
# kernel takes the arrays, the argument checks are skipped (a few microseconds each, hundreds
# of times a step); anything else goes through the checked op. The results are the same arrays.

def linear_forward(params: Parameters, name: str, x):
    """y = x @ W + b with W = params[name.W] [D_in, D_out] and b = params[name.b] if present.

    x [..., D_in]  ->  y [..., D_out] (one GEMM over the flattened leading axes)
    """
    W = params._values[name + ".W"]
    bias = params._values.get(name + ".b")
    return ops.linear_forward(x, W, bias, trusted=True)


def linear_backward(params: Parameters, name: str, dy, cache, overwrite_input: bool = False):
    """Adds dW (and db) into the gradient views; returns dx [..., D_in].

    overwrite_input=True: the caller needs the cached input no more, and the fused kernel may
    write dx over it (one input-sized array fewer at the backward's peak)."""
    grads = params._grads
    gb = grads[name + ".b"] if cache[2] else None                    # cache: (x, W, has_bias)
    return ops.linear_backward_into(dy, cache, grads[name + ".W"], gb, overwrite_input,
                                    trusted=True)


NORMS = ("layernorm", "rmsnorm")


def nonfinite_parameters(params) -> list[str]:
    """The names of the tensors of `params` that hold nan or inf, in buffer order.

    One isfinite over the flat buffer of a Parameters (a parameter source without one, such
    as a gather-on-use shard, is looked at tensor by tensor). Meant for error paths: it
    tells a non-finite parameter from a non-finite activation."""
    if isinstance(params, Parameters):
        xp = backend.namespace(params.data)
        finite = xp.isfinite(params.data)                               # [P]
        if bool(xp.all(finite)):
            return []
        bad = ~np.asarray(backend.to_numpy(finite))
        return [n for n in params.names
                if bad[params.offsets[n][0]:params.offsets[n][1]].any()]
    found = []
    for n, value in params._values.items():
        xp = backend.namespace(value)
        if not bool(xp.all(xp.isfinite(value))):
            found.append(n)
    return found


def blame_parameters(params, where: str, err: Exception | None = None, kind=ValueError):
    """Raise `kind` naming the non-finite parameters, if any, as the cause of a non-finite
    `where` (an error path: the parameters are looked at only after something failed)."""
    bad = nonfinite_parameters(params)
    if bad:
        listed = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        who = f"parameters {listed} hold" if len(bad) > 1 else f"parameter {listed} holds"
        raise kind(f"{who} nan or inf, which makes {where} non-finite: re-initialise the "
                   "model or load finite parameters") from err


def norm_forward(params: Parameters, name: str, x, kind: str, eps: float):
    """LayerNorm (gain name.g, shift name.b) or RMSNorm (gain name.g) over the last axis of x.

    A non-finite x is an error (the op's); when a parameter holds nan or inf the error names
    that parameter instead (looked for only once the norm has failed)."""
    try:
        return _norm_forward(params, name, x, kind, eps)
    except ValueError as err:
        xp = backend.namespace(x)
        if not bool(xp.all(xp.isfinite(x))):
            blame_parameters(params, f"the input of {name}", err)
        raise


def _norm_forward(params, name, x, kind, eps):
    values = params._values
    if kind == "layernorm":
        return ops.layernorm_forward(x, values[name + ".g"], values[name + ".b"], eps,
                                     trusted=True)
    if kind == "rmsnorm":
        return ops.rmsnorm_forward(x, values[name + ".g"], eps, trusted=True)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


def norm_backward(params: Parameters, name: str, dy, cache, kind: str):
    """Adds dgain (and dshift) into the gradient views; returns dx."""
    grads = params._grads
    if kind == "layernorm":
        dx, dgain, dshift = ops.layernorm_backward(dy, cache, trusted=True)
        view = grads[name + ".b"]
        view += dshift
    else:
        dx, dgain = ops.rmsnorm_backward(dy, cache, trusted=True)
    view = grads[name + ".g"]
    view += dgain
    return dx
