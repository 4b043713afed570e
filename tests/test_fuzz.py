"""Fuzz every public op of tfcore.functional with classes of bad input.

For every op, every argument and every class of input below, the op must either raise a
clear error (TypeError or ValueError whose message names the argument) or return the
correct result (checked against a NumPy float64 formula). The classes:

* array arguments: a Python list, a tuple, a Python number, a 0-d array, a zero width,
  an empty batch, an integer / bool / float16 array, the other float precision, an array of
  another library, a NumPy masked array, a strided view, a transposed view;
* integer ids: also float ids, negative ids, ids >= V, uint64 ids beyond the int64 range,
  and other integer widths;
* settings (eps, p, rng, dtype, length, ...): wrong types, non-finite and out-of-range values;
* upstream gradients of every backward: all of the above plus the right number of elements
  in the wrong layout and a smaller gradient that would broadcast.

Type-level classes (a list, a wrong dtype or library, a masked array) must name the argument
itself; shape-level classes (0-d, zero width, empty batch) may name whichever argument the
mismatch is reported on, since it involves two.

The ops are enumerated from the package, so a new op is covered only once it has a spec in
SPECS below: `test_every_public_op_has_a_fuzz_spec` fails and lists the ops without one.
To cover a new op, add a function decorated with `@spec("<op>_forward")` that returns a
Spec (valid inputs, which arguments are floats / ids / settings, a reference formula and
the backward, if any). Specs for ops that do not exist yet are skipped.
"""
from __future__ import annotations

import inspect
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
from scipy.special import erf

from tfcore import backend
from tfcore import functional as F
from tfcore.backend import asarray, to_numpy

pytestmark = pytest.mark.usefixtures("backend_name")


@dataclass
class Spec:
    """How to call one op with valid input, and what its correct result is.

    inputs(rng) -> {argument name: value}: NumPy float64 arrays for `floats`, NumPy integer
    arrays for `ids`, plain values for everything else (moved to the backend when called).
    reference(inputs) -> the correct result (NumPy float64) for `inputs` (NumPy float64 or
    integer arrays and plain settings); or, for a random op, check(inputs, out) asserts it.
    """

    inputs: Callable[[np.random.Generator], dict]
    reference: Callable[[dict], np.ndarray] | None
    floats: tuple[str, ...] = ()
    ids: tuple[str, ...] = ()
    settings: dict[str, list] = field(default_factory=dict)
    backward: Callable | None = None        # the op's backward; None for plain functions
    pair: bool = True                       # the forward returns (out, cache)
    scalar_loss: bool = False               # the backward takes a scalar upstream gradient
    any_dtype: bool = False                 # a layout op: integer, bool, float16 arrays are fine
    check: Callable[[dict, np.ndarray], None] | None = None
    id_high: Callable[[dict], int] | None = None    # ids lie in [0, id_high(inputs)); default V
    upstream: Callable | None = None        # the forward's output the backward's gradient matches

    def assert_correct(self, inputs, out):
        """out (NumPy) is the correct result: 1e-10 in float64, 1e-5 for a float32 result."""
        if self.check is not None:
            self.check(inputs, out)
        else:
            expected = self.reference(inputs)
            outs, refs = (out, expected) if isinstance(out, tuple) else ((out,), (expected,))
            assert len(outs) == len(refs), f"{len(outs)} results, expected {len(refs)}"
            for o, r in zip(outs, refs):
                close(o, r, tol=1e-5 if o.dtype == np.float32 else 1e-10)


SPECS: dict[str, Callable[[], Spec]] = {}


def spec(name: str):
    def register(make: Callable[[], Spec]):
        SPECS[name] = make
        return make

    return register


def close(actual, expected, tol=1e-10):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape}, expected {expected.shape}"
    assert np.allclose(actual, expected, rtol=tol, atol=tol), "wrong values"


def rows(rng, lead=2, width=None):
    """A random float64 array [lead random sizes..., width]."""
    lead_shape = tuple(int(rng.integers(1, 4)) for _ in range(lead))
    return rng.standard_normal(lead_shape + (width or int(rng.integers(2, 6)),))


# --------------------------------------------------------------------------------------
# The specs: one per public op (its backward is covered with it)

BAD_DTYPES = ["int64", "float16", None, 3, np.int64, "float"]
BAD_EPS = [0.0, -1e-5, math.inf, math.nan, "1e-5", True, None]


@spec("linear_forward")
def _linear():
    def inputs(rng):
        x = rows(rng)
        return dict(x=x, W=rng.standard_normal((x.shape[-1], 3)), b=rng.standard_normal(3))

    return Spec(inputs, lambda i: i["x"] @ i["W"] + i["b"],
                floats=("x", "W", "b"), backward=F.linear_backward)


@spec("embedding_forward")
def _embedding():
    def inputs(rng):
        return dict(ids=rng.integers(0, 5, (2, 3)), W=rng.standard_normal((5, 4)))

    return Spec(inputs, lambda i: i["W"][i["ids"]], floats=("W",), ids=("ids",),
                backward=F.embedding_backward)


def _sinusoid(length, width, base=10000.0, **_):
    pos = np.arange(length)[:, None]
    angle = pos / base ** (2 * (np.arange(width) // 2) / width)
    return np.where(np.arange(width) % 2 == 0, np.sin(angle), np.cos(angle))


@spec("sinusoidal_positions")
def _sinusoidal():
    return Spec(lambda rng: dict(length=3, width=5, dtype="float64", base=100.0),
                lambda i: _sinusoid(**i), pair=False,
                settings=dict(length=[0, -1, 2.5, True, "3"], width=[0, 4.0, None],
                              base=[0.0, -2.0, math.inf, math.nan, "1e4"], dtype=BAD_DTYPES))


@spec("positional_forward")
def _positional():
    def inputs(rng):
        x = rows(rng, lead=2)
        return dict(x=x, P=rng.standard_normal((x.shape[1] + 1, x.shape[2])))

    return Spec(inputs, lambda i: i["x"] + i["P"][: i["x"].shape[1]],
                floats=("x", "P"), backward=F.positional_backward)


@spec("causal_mask")
def _causal_mask():
    return Spec(lambda rng: dict(length=4, dtype="float32"),
                lambda i: np.triu(np.full((4, 4), -np.inf), 1),
                pair=False, settings=dict(length=[2.5, -2, 0, True, "4", None], dtype=BAD_DTYPES))


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@spec("softmax_forward")
def _softmax_spec():
    def inputs(rng):
        z = rows(rng)
        mask = np.where(rng.random(z.shape[-2:]) < 0.3, -np.inf, 0.0)
        mask[:, 0] = 0.0
        return dict(z=z, mask=mask)

    return Spec(inputs, lambda i: _softmax(i["z"] + i["mask"]),
                floats=("z", "mask"), backward=F.softmax_backward)


@spec("log_softmax_forward")
def _log_softmax():
    return Spec(lambda rng: dict(z=rows(rng)), lambda i: np.log(_softmax(i["z"])), floats=("z",),
                backward=F.log_softmax_backward)


@spec("cross_entropy_forward")
def _cross_entropy():
    def inputs(rng):
        logits = rows(rng, width=5)
        labels = rng.integers(0, 5, logits.shape[:-1])
        labels.reshape(-1)[0] = -100
        return dict(logits=logits, labels=labels, ignore_index=-100)

    def reference(i):
        z, y = i["logits"].reshape(-1, i["logits"].shape[-1]), i["labels"].reshape(-1)
        keep = y != i["ignore_index"]
        logp = np.log(_softmax(z))
        nll = -logp[np.arange(len(y)), np.where(keep, y, 0)]
        return nll[keep].sum() / max(keep.sum(), 1)

    return Spec(inputs, reference, floats=("logits",), ids=("labels",),
                settings=dict(ignore_index=[1.5, True, "x", None]),
                backward=F.cross_entropy_backward, scalar_loss=True)


@spec("mse_forward")
def _mse():
    def inputs(rng):
        pred = rows(rng)
        return dict(pred=pred, target=rng.standard_normal(pred.shape))

    return Spec(inputs, lambda i: np.mean((i["pred"] - i["target"]) ** 2),
                floats=("pred", "target"), backward=F.mse_backward, scalar_loss=True)


@spec("relu_forward")
def _relu():
    return Spec(lambda rng: dict(x=rows(rng)), lambda i: np.maximum(i["x"], 0),
                floats=("x",), backward=F.relu_backward)


@spec("gelu_forward")
def _gelu():
    def reference(i):
        x = i["x"]
        if i["approximate"] == "none":
            return x * 0.5 * (1 + erf(x / np.sqrt(2)))
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    return Spec(lambda rng: dict(x=rows(rng), approximate=str(rng.choice(["none", "tanh"]))),
                reference, floats=("x",), settings=dict(approximate=["fast", None, 1, "None"]),
                backward=F.gelu_backward)


@spec("layernorm_forward")
def _layernorm():
    def inputs(rng):
        x = rows(rng)
        d = x.shape[-1]
        return dict(x=x, gamma=rng.standard_normal(d), beta=rng.standard_normal(d), eps=1e-5)

    def reference(i):
        x = i["x"]
        c = x - x.mean(-1, keepdims=True)
        return i["gamma"] * c / np.sqrt((c * c).mean(-1, keepdims=True) + i["eps"]) + i["beta"]

    return Spec(inputs, reference, floats=("x", "gamma", "beta"), settings=dict(eps=BAD_EPS),
                backward=F.layernorm_backward)


@spec("rmsnorm_forward")
def _rmsnorm():
    def inputs(rng):
        x = rows(rng)
        return dict(x=x, gain=rng.standard_normal(x.shape[-1]), eps=1e-6)

    def reference(i):
        x = i["x"]
        return i["gain"] * x / np.sqrt((x * x).mean(-1, keepdims=True) + i["eps"])

    return Spec(inputs, reference, floats=("x", "gain"), settings=dict(eps=BAD_EPS),
                backward=F.rmsnorm_backward)


@spec("dropout_forward")
def _dropout():
    def check(i, out):
        x = i["x"]
        if not i["training"] or i["p"] == 0:
            close(out, x)
            return
        scaled = x / (1 - i["p"])
        assert out.shape == x.shape
        assert np.all((out == 0) | np.isclose(out, scaled, rtol=1e-6, atol=0)), "not 0 or x/(1-p)"

    return Spec(lambda rng: dict(x=rows(rng), p=0.25, rng=backend.default_rng(0), training=True),
                None, check=check, floats=("x",),
                settings=dict(p=[-0.1, 1.0, 1.5, math.nan, True, "0.1", None],
                              rng=[0, 7, "seed", object()], training=["yes", None, 1]),
                backward=F.dropout_backward)


@spec("residual_forward")
def _residual():
    def inputs(rng):
        x = rows(rng)
        return dict(x=x, fx=rng.standard_normal(x.shape))

    return Spec(inputs, lambda i: i["x"] + i["fx"], floats=("x", "fx"),
                backward=F.residual_backward)


# The new families: silu and SwiGLU (activations), rotary positions and attention.


@spec("silu_forward")
def _silu():
    return Spec(lambda rng: dict(x=rows(rng)),
                lambda i: i["x"] / (1 + np.exp(-i["x"])), floats=("x",),
                backward=getattr(F, "silu_backward", None))


@spec("swiglu_forward")
def _swiglu():
    def inputs(rng):
        a = rows(rng)
        return dict(a=a, b=rng.standard_normal(a.shape))

    return Spec(inputs, lambda i: i["a"] / (1 + np.exp(-i["a"])) * i["b"],
                floats=("a", "b"), backward=getattr(F, "swiglu_backward", None))


def _merge(x):
    """[B, H, S, D_h] -> [B, S, H * D_h]"""
    b, h, s_, d = x.shape
    return np.transpose(x, (0, 2, 1, 3)).reshape(b, s_, h * d)


def _split(x, n_heads):
    """[B, S, D] -> [B, H, S, D / H]"""
    b, s_, d = x.shape
    return np.transpose(x.reshape(b, s_, n_heads, d // n_heads), (0, 2, 1, 3))


def _heads(rng, d_head=4):
    return rng.standard_normal((2, 2, int(rng.integers(2, 5)), d_head))


BAD_HEADS = [0, -2, 2.5, True, 3, "2", None]


@spec("split_heads")
def _split_heads():
    return Spec(lambda rng: dict(x=rows(rng, width=8), n_heads=2),
                lambda i: _split(i["x"], i["n_heads"]), any_dtype=True, floats=("x",), pair=False,
                settings=dict(n_heads=BAD_HEADS))


@spec("merge_heads")
def _merge_heads():
    return Spec(lambda rng: dict(x=_heads(rng)), lambda i: _merge(i["x"]), any_dtype=True,
                floats=("x",), pair=False)


@spec("qkv_split")
def _qkv_split():
    def reference(i):
        d = i["qkv"].shape[-1] // 3
        return tuple(_split(i["qkv"][..., j * d:(j + 1) * d], i["n_heads"]) for j in range(3))

    return Spec(lambda rng: dict(qkv=rows(rng, width=12), n_heads=2), reference,
                any_dtype=True, floats=("qkv",), pair=False, settings=dict(n_heads=BAD_HEADS))


@spec("qkv_merge_grads")
def _qkv_merge_grads():
    def inputs(rng):
        dq = _heads(rng)
        return dict(dq=dq, dk=rng.standard_normal(dq.shape), dv=rng.standard_normal(dq.shape))

    return Spec(inputs, lambda i: np.concatenate([_merge(i[k]) for k in ("dq", "dk", "dv")], -1),
                any_dtype=True, floats=("dq", "dk", "dv"), pair=False)


@spec("attention_forward")
def _attention():
    def inputs(rng):
        q = _heads(rng)
        k = rng.standard_normal(q.shape[:2] + (q.shape[2] + 1, q.shape[3]))
        return dict(q=q, k=k, v=rng.standard_normal(k.shape), dropout_p=0.0, training=True)

    def reference(i):
        q, k = i["q"], i["k"]
        scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        return _softmax(scores) @ i["v"]

    return Spec(inputs, reference, floats=("q", "k", "v"),
                settings=dict(dropout_p=[-0.1, 1.0, math.nan, "0.1", True, None],
                              training=["yes", None]),
                backward=getattr(F, "attention_backward", None))


@spec("tiled_attention_forward")
def _tiled_attention():
    def inputs(rng):
        q = _heads(rng)
        k = rng.standard_normal(q.shape[:2] + (q.shape[2] + 2, q.shape[3]))
        return dict(q=q, k=k, v=rng.standard_normal(k.shape), causal=True, dropout_p=0.0,
                    training=True, block_size=2, scale=0.5)

    def reference(i):
        q, k = i["q"], i["k"]
        s_q, s_k = q.shape[2], k.shape[2]
        hidden = np.arange(s_k)[None, :] > np.arange(s_q)[:, None] + (s_k - s_q)
        scores = q @ np.swapaxes(k, -1, -2) * 0.5 + np.where(hidden, -np.inf, 0.0)
        return _softmax(scores) @ i["v"]

    return Spec(inputs, reference, floats=("q", "k", "v"),
                settings=dict(causal=[1, "yes", None],
                              dropout_p=[-0.1, 1.0, math.nan, "0.1", True, None],
                              training=["yes", None],
                              block_size=[0, -1, 2.5, True, "4", None],
                              scale=[0.0, -1.0, math.inf, math.nan, "1", True]),
                backward=getattr(F, "tiled_attention_backward", None))


def _rope_angles(length, head_dim, base=10000.0, offset=0):
    inverse_wavelength = base ** (-2 * np.arange(head_dim // 2) / head_dim)
    return (offset + np.arange(length))[:, None] * inverse_wavelength


@spec("rope_tables")
def _rope_tables():
    def reference(i):
        angle = _rope_angles(i["length"], i["head_dim"], i["base"], i["offset"])
        return np.cos(angle), np.sin(angle)

    return Spec(lambda rng: dict(length=5, head_dim=6, base=100.0, dtype="float64", offset=2),
                reference, pair=False,
                settings=dict(length=[0, -1, 2.5, True], head_dim=[0, 5, 4.0, None],
                              base=[0.0, -1.0, math.inf, math.nan, "1e4"], dtype=BAD_DTYPES,
                              offset=[-1, 1.5, None]))


@spec("rope_forward")
def _rope():
    def inputs(rng):
        x = _heads(rng, d_head=6)
        angle = _rope_angles(x.shape[2], 6)
        return dict(x=x, cos=np.cos(angle), sin=np.sin(angle))

    def reference(i):
        x, cos, sin = i["x"], i["cos"], i["sin"]
        even, odd = x[..., 0::2], x[..., 1::2]
        y = np.empty_like(x)
        y[..., 0::2] = even * cos - odd * sin
        y[..., 1::2] = even * sin + odd * cos
        return y

    return Spec(inputs, reference, floats=("x", "cos", "sin"),
                backward=getattr(F, "rope_backward", None))


# The mixture of experts (tfcore.functional.moe). Each reference follows the rules stated in
# the module's docstring, written here with plain NumPy loops.


def _sigmoid_np(z):
    return 1.0 / (1.0 + np.exp(-z))


def _distinct_experts(rng, tokens, n_experts, top_k):
    """[tokens, top_k] integers: top_k distinct experts in each row."""
    return np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :top_k]


def _plan_reference(experts, n_experts, capacity_factor):
    """The dispatch plan, assignment by assignment: expert e takes the assignments routed to it
    in token order and keeps its first C, C = ceil(c T K / N_E) (or, dropless, the largest
    load). -> (T, K, N_E, C, token [A], flat [A], dest [A], kept [T, K], load, kept_load)."""
    experts = np.asarray(experts, np.int64)
    tokens, top_k = experts.shape
    load = np.zeros(n_experts, np.int64)
    position = np.zeros((tokens, top_k), np.int64)
    for t in range(tokens):
        for k in range(top_k):
            position[t, k] = load[experts[t, k]]
            load[experts[t, k]] += 1
    if capacity_factor is None:
        cap = int(load.max()) if tokens else 0
    else:
        cap = math.ceil(capacity_factor * tokens * top_k / n_experts)
    kept = position < cap
    kept_load = np.zeros(n_experts, np.int64)
    token, flat, dest = [], [], []
    for t in range(tokens):
        for k in range(top_k):
            if kept[t, k]:
                e = experts[t, k]
                kept_load[e] += 1
                token.append(t)
                flat.append(t * top_k + k)
                dest.append(e * cap + position[t, k])
    return (tokens, top_k, n_experts, cap, np.array(token, np.int64), np.array(flat, np.int64),
            np.array(dest, np.int64), kept, load, kept_load)


BAD_CAPACITY = [0.0, -1.0, math.inf, math.nan, "1", True]
BAD_COUNT = [0, -1, 2.5, True, "4", None]


@spec("router_forward")
def _router():
    def inputs(rng):
        n_experts = int(rng.integers(3, 6))
        return dict(logits=rng.standard_normal((int(rng.integers(2, 5)), n_experts)), top_k=2,
                    score=str(rng.choice(["softmax", "sigmoid"])),
                    normalize=bool(rng.integers(2)), bias=0.1 * rng.standard_normal(n_experts))

    def reference(i):
        z, score = i["logits"], i["score"]
        s = _softmax(z) if score == "softmax" else _sigmoid_np(z)        # [T, N_E]
        probs = s / s.sum(-1, keepdims=True)
        select = s if i["bias"] is None else s + i["bias"]
        experts = np.argsort(-select, axis=-1, kind="stable")[:, : i["top_k"]]
        gates = np.take_along_axis(s, experts, axis=-1)
        normalize = (score == "sigmoid") if i["normalize"] is None else i["normalize"]
        if normalize:
            gates = gates / gates.sum(-1, keepdims=True)
        return gates, experts, probs

    return Spec(inputs, reference, floats=("logits", "bias"),
                settings=dict(top_k=[0, -1, 99, 1.5, True, "2", None],
                              score=["tanh", "Softmax", None, 1],
                              normalize=["yes", 1, 0.0]),
                backward=F.router_backward, upstream=lambda out: out[0])


@spec("capacity")
def _capacity():
    return Spec(lambda rng: dict(n_tokens=10, top_k=2, n_experts=4, capacity_factor=1.1),
                lambda i: np.asarray(6), pair=False,       # ceil(1.1 * 10 * 2 / 4) = ceil(5.5)
                settings=dict(n_tokens=[-1, 2.5, True, "10", None],
                              top_k=[0, -1, 1.5, True, None], n_experts=BAD_COUNT,
                              capacity_factor=BAD_CAPACITY))


@spec("moe_plan")
def _moe_plan():
    def inputs(rng):
        # T K = 2 T assignments for 4 C = 4 ceil(T / 4) slots: some are dropped
        return dict(experts=_distinct_experts(rng, int(rng.integers(5, 8)), 4, 2), n_experts=4,
                    capacity_factor=0.5)

    return Spec(inputs, lambda i: _plan_reference(i["experts"], i["n_experts"],
                                                  i["capacity_factor"]),
                ids=("experts",), id_high=lambda i: i["n_experts"], pair=False,
                settings=dict(n_experts=BAD_COUNT, capacity_factor=BAD_CAPACITY))


def _routing(rng):
    """A routing of 5 tokens to K = 2 of N_E = 4 experts with C = ceil(0.75 * 10 / 4) = 2 slots:
    10 assignments for 8 slots, so some are dropped. -> (experts [T, K], N_E, c, plan)."""
    experts = _distinct_experts(rng, 5, 4, 2)
    return experts, 4, 0.75, F.moe_plan(asarray(experts), 4, 0.75)


BAD_PLAN = [None, "plan", (5, 2, 4, 2), 0]


@spec("moe_dispatch_forward")
def _moe_dispatch():
    routing = {}

    def inputs(rng):
        experts, n_experts, factor, plan = _routing(rng)
        routing.update(experts=experts, n_experts=n_experts, factor=factor)
        return dict(x=rng.standard_normal((5, 3)), plan=plan)

    def reference(i):
        experts = routing["experts"]
        _, _, n_experts, cap, token, _, dest, *_ = _plan_reference(
            experts, routing["n_experts"], routing["factor"])
        x = i["x"]
        xe = np.zeros((n_experts * cap, x.shape[-1]))
        for t, row in zip(token, dest):
            xe[row] = x[t]
        return xe.reshape(n_experts, cap, x.shape[-1])

    return Spec(inputs, reference, floats=("x",), settings=dict(plan=BAD_PLAN),
                backward=F.moe_dispatch_backward)


@spec("moe_combine_forward")
def _moe_combine():
    routing = {}

    def inputs(rng):
        experts, n_experts, factor, plan = _routing(rng)
        routing.update(experts=experts, n_experts=n_experts, factor=factor)
        cap = math.ceil(factor * 5 * 2 / n_experts)
        return dict(ye=rng.standard_normal((n_experts, cap, 3)), gates=rng.random((5, 2)),
                    plan=plan)

    def reference(i):
        experts = routing["experts"]
        *_, kept, _, _ = _plan_reference(experts, routing["n_experts"], routing["factor"])
        ye, gates = i["ye"], i["gates"]
        y = np.zeros((experts.shape[0], ye.shape[-1]))
        slot = np.zeros(routing["n_experts"], np.int64)
        for t in range(experts.shape[0]):          # the kept slots of each expert, token order
            for k in range(experts.shape[1]):
                if kept[t, k]:
                    e = experts[t, k]
                    y[t] += gates[t, k] * ye[e, slot[e]]
                    slot[e] += 1
        return y

    return Spec(inputs, reference, floats=("ye", "gates"), settings=dict(plan=BAD_PLAN),
                backward=F.moe_combine_backward)


@spec("expert_mlp_forward")
def _expert_mlp():
    def inputs(rng):
        n, c, d, f = 2, int(rng.integers(1, 5)), 3, 4
        return dict(xe=rng.standard_normal((n, c, d)), W_fc=rng.standard_normal((n, d, f)),
                    b_fc=rng.standard_normal((n, f)), W_proj=rng.standard_normal((n, f, d)),
                    b_proj=rng.standard_normal((n, d)), activation="swiglu",
                    W_gate=rng.standard_normal((n, d, f)), b_gate=rng.standard_normal((n, f)),
                    approximate="tanh")

    def reference(i):
        xe = i["xe"]
        gate = xe @ i["W_gate"] + i["b_gate"][:, None, :]                  # [N_E, C, F]
        up = xe @ i["W_fc"] + i["b_fc"][:, None, :]
        return (gate * _sigmoid_np(gate) * up) @ i["W_proj"] + i["b_proj"][:, None, :]

    return Spec(inputs, reference,
                floats=("xe", "W_fc", "b_fc", "W_proj", "b_proj", "W_gate", "b_gate"),
                settings=dict(activation=["GELU", "tanh", None, 1],
                              approximate=["fast", "None", None, 1]),
                backward=F.expert_mlp_backward)


def _shares(experts, n_experts):
    """f_i: the share of the (token, slot) assignments routed to expert i."""
    return np.array([np.sum(experts == e) for e in range(n_experts)]) / experts.size


@spec("expert_load")
def _expert_load():
    return Spec(lambda rng: dict(experts=_distinct_experts(rng, int(rng.integers(2, 6)), 5, 2),
                                 n_experts=5),
                lambda i: np.array([np.sum(i["experts"] == e) for e in range(i["n_experts"])]),
                ids=("experts",), id_high=lambda i: i["n_experts"], pair=False,
                settings=dict(n_experts=BAD_COUNT))


BAD_COEF = [-0.5, math.inf, math.nan, "1", True, None]


@spec("load_balancing_loss_forward")
def _load_balancing():
    def inputs(rng):
        tokens = int(rng.integers(2, 6))
        return dict(probs=_softmax(rng.standard_normal((tokens, 4))),
                    experts=_distinct_experts(rng, tokens, 4, 2), coef=0.5)

    def reference(i):
        probs = i["probs"]
        n_experts = probs.shape[-1]
        return i["coef"] * n_experts * np.sum(_shares(i["experts"], n_experts) * probs.mean(0))

    return Spec(inputs, reference, floats=("probs",), ids=("experts",),
                id_high=lambda i: i["probs"].shape[-1], settings=dict(coef=BAD_COEF),
                backward=F.load_balancing_loss_backward, scalar_loss=True)


@spec("sequence_balancing_loss_forward")
def _sequence_balancing():
    def inputs(rng):
        batch, length = 3, int(rng.integers(2, 5))
        experts = np.stack([_distinct_experts(rng, length, 4, 2) for _ in range(batch)])
        return dict(probs=_softmax(rng.standard_normal((batch, length, 4))), experts=experts,
                    coef=0.5)

    def reference(i):
        probs, experts = i["probs"], i["experts"]
        n_experts = probs.shape[-1]
        per_sequence = [np.sum(_shares(experts[b], n_experts) * probs[b].mean(0))
                        for b in range(probs.shape[0])]
        return i["coef"] * n_experts * np.mean(per_sequence)

    return Spec(inputs, reference, floats=("probs",), ids=("experts",),
                id_high=lambda i: i["probs"].shape[-1], settings=dict(coef=BAD_COEF),
                backward=F.sequence_balancing_loss_backward, scalar_loss=True)


@spec("router_z_loss_forward")
def _router_z_loss():
    def reference(i):
        z = i["logits"]
        if z.shape[0] == 0:
            return np.asarray(0.0)
        lse = np.log(np.sum(np.exp(z), axis=-1))
        return i["coef"] * np.mean(lse**2)

    return Spec(lambda rng: dict(logits=rng.standard_normal((int(rng.integers(2, 6)), 4)),
                                 coef=0.25),
                reference, floats=("logits",), settings=dict(coef=BAD_COEF),
                backward=F.router_z_loss_backward, scalar_loss=True)


@spec("expert_bias_update")
def _expert_bias_update():
    def inputs(rng):
        return dict(bias=0.1 * rng.standard_normal(5),
                    load=asarray(np.array([3, 1, 2, 2, 2])), rate=0.01)   # mean load 2

    def reference(i):
        return i["bias"] + i["rate"] * np.array([-1.0, 1.0, 0.0, 0.0, 0.0])

    return Spec(inputs, reference, floats=("bias",), pair=False,
                settings=dict(rate=[-0.1, math.inf, math.nan, "0.1", True, None],
                              load=[None, [3, 1, 2, 2, 2], "3",
                                    np.ma.masked_array(np.array([3, 1, 2, 2, 2]))]))


# --------------------------------------------------------------------------------------
# The classes of bad input


def _foreign(host):
    """`host` on a library other than the selected backend's."""
    if backend.get_backend() == "strict":
        return np.asarray(host)
    import array_api_strict

    return array_api_strict.asarray(host)


def _strided(host):
    """A non-contiguous view with the values of `host` (every other entry of a wider array)."""
    return asarray(np.stack([host, np.zeros_like(host)], axis=-1))[..., 0]


def _transposed(host):
    """A transposed view (reversed strides) with the values of `host`."""
    xp = backend.xp()
    axes = tuple(reversed(range(host.ndim)))
    return xp.permute_dims(asarray(np.ascontiguousarray(np.transpose(host))), axes)


def float_classes(host, any_dtype=False):
    """(class name, bad value, what it must give, NumPy float64 value or None) for a float array.

    'error' must raise naming the argument; 'shape' may raise naming any argument; 'either'
    may raise naming the argument or must give the correct result.
    """
    cases = [
        ("list", host.tolist(), "error", None),
        ("tuple", tuple(np.atleast_1d(host).tolist()), "error", None),
        ("python number", 0.5, "error", None),
        ("int64 array", asarray(np.round(np.nan_to_num(host, neginf=-1.0, posinf=1.0)), "int64"),
         *(("either", np.round(np.nan_to_num(host, neginf=-1.0, posinf=1.0))) if any_dtype
           else ("error", None))),
        ("bool array", asarray(host > 0, "bool"),
         *(("either", (host > 0).astype(float)) if any_dtype else ("error", None))),
        ("float16 array", np.asarray(host, np.float16),
         *(("either", host.astype(np.float16).astype(float)) if any_dtype else ("error", None))),
        ("masked array", np.ma.masked_array(host, mask=np.zeros(host.shape, bool)), "error", None),
        ("float32", asarray(host, "float32"), "either", host.astype(np.float32).astype(np.float64)),
        ("other library", _foreign(host), "either", host),
        ("strided view", _strided(host), "either", host),
        ("0-d array", asarray(np.array(0.75)), "shape", np.array(0.75)),
    ]
    if host.ndim >= 1:
        zero_width = np.zeros(host.shape[:-1] + (0,))
        cases.append(("zero width", asarray(zero_width), "shape", zero_width))
    if host.ndim >= 2:
        empty = np.zeros((0,) + host.shape[1:])
        cases.append(("empty batch", asarray(empty), "shape", empty))
        cases.append(("transposed view", _transposed(host), "either", host))
    return cases


def id_classes(host, high):
    host = np.asarray(host)
    huge = host.astype(np.uint64)
    huge.reshape(-1)[0] = np.uint64(2**63 + 7)
    cases = [
        ("list", host.tolist(), "error", None),
        ("float ids", asarray(host, "float64"), "error", None),
        ("bool ids", asarray(host > 0, "bool"), "error", None),
        ("negative id", asarray(np.full(host.shape, -1), "int64"), "error", None),
        ("id >= V", asarray(np.full(host.shape, high), "int64"), "error", None),
        ("uint64 beyond int64", asarray(huge), "error", None),
        ("masked ids", np.ma.masked_array(host), "error", None),
        ("other library", _foreign(host), "either", host),
        ("uint8 ids", asarray(host, "uint8"), "either", host),
        ("int32 ids", asarray(host, "int32"), "either", host),
        ("strided view", _strided(host), "either", host),
        ("0-d ids", asarray(np.array(1), "int64"), "shape", np.array(1)),
    ]
    if host.ndim >= 1:
        empty = np.zeros((0,) + host.shape[1:], dtype=np.int64)
        cases.append(("empty batch", asarray(empty), "shape", empty))
    return cases


def upstream_classes(host):
    """Bad upstream gradients for a backward whose forward output is `host`'s shape."""
    shape = host.shape
    cases = [c for c in float_classes(host) if c[0] not in ("float32", "other library")]
    cases = [(n, v, "error" if kind == "shape" else kind, ref) for n, v, kind, ref in cases]
    cases += [
        ("float32", asarray(host, "float32"), "error", None),
        ("other library", _foreign(host), "error", None),
    ]
    if len(shape) >= 2 and shape[0] != shape[1]:
        swapped = host.reshape((shape[1], shape[0]) + shape[2:])
        cases.append(("wrong layout", asarray(swapped), "error", None))
    if len(shape) >= 1:
        cases.append(("broadcastable", asarray(np.ones(shape[-1:])), "error", None))
        cases.append(("one more axis", asarray(host[None]), "error", None))
    return [c for c in cases if not (c[0] in ("empty batch", "zero width") and c[3].shape == shape)]


# --------------------------------------------------------------------------------------
# Running the cases


def _public_ops():
    return sorted(
        name for name, value in vars(F).items()
        if callable(value) and not name.startswith("_") and not inspect.ismodule(value)
        and getattr(value, "__module__", "").startswith("tfcore.functional")
    )


def _covered(name):
    if name in SPECS:
        return True
    for op, make in SPECS.items():
        backward = make().backward if hasattr(F, op) else None
        if backward is not None and (backward.__name__ == name or backward is getattr(F, name)):
            return True
    return False


def test_every_public_op_has_a_fuzz_spec():
    uncovered = [name for name in _public_ops() if not _covered(name)]
    assert not uncovered, f"public ops of tfcore.functional with no fuzz spec in SPECS: {uncovered}"


def _on_backend(spec_, values):
    return {k: asarray(v) if (k in spec_.floats or k in spec_.ids) and isinstance(v, np.ndarray)
            and not isinstance(v, np.ma.MaskedArray) else v for k, v in values.items()}


def _assert_clear(err, names):
    assert type(err) in (TypeError, ValueError), f"{type(err).__name__}: {err}"
    text = str(err)
    assert any(re.search(rf"\b{re.escape(n)}\b", text) for n in names), (
        f"the message does not name {' or '.join(names)}: {text!r}"
    )


def _run(call, names, kind, check):
    """Call; on an error assert it is clear (names one of `names`), else run `check(out)`."""
    try:
        with np.errstate(all="ignore"):
            out = call()
    except Exception as err:  # noqa: BLE001 -- the point is to inspect any error
        _assert_clear(err, names)
        return "raised"
    assert kind != "error", "bad input was accepted"
    check(out)
    return "returned"


def _cases(s, valid):
    """Every (argument, class, value, kind, NumPy value) for a forward's arguments."""
    for arg in s.floats:
        for case in float_classes(valid[arg], s.any_dtype):
            yield arg, *case
    for arg in s.ids:
        if s.id_high is not None:
            high = s.id_high(valid)
        else:
            high = valid["W"].shape[0] if "W" in valid else valid["logits"].shape[-1]
        for case in id_classes(valid[arg], high):
            yield arg, *case
    for arg, bad_values in s.settings.items():
        for bad in bad_values:
            yield arg, f"setting {bad!r}", bad, "error", None


def _ops():
    return [op for op in SPECS if hasattr(F, op)]


@pytest.mark.parametrize("op", _ops())
def test_forward_bad_inputs(op):
    s = SPECS[op]()
    fn = getattr(F, op)
    valid = s.inputs(np.random.default_rng(zlib.crc32(op.encode())))
    everyone = list(valid)
    failures = []
    for arg, name, bad, kind, host in _cases(s, valid):
        args = _on_backend(s, valid) | {arg: bad}

        def check(result, host=host):
            if host is None:
                raise AssertionError("accepted")
            out = result[0] if s.pair else result
            s.assert_correct(valid | {arg: host}, _host(out))

        shape_level = kind == "shape" or name.startswith(("0-d", "zero", "empty"))
        names = everyone if shape_level else (arg,)
        try:
            _run(lambda: fn(**args), names, kind, check)
        except AssertionError as err:
            failures.append(f"{op}({arg}=<{name}>): {err}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("op", [op for op in _ops() if SPECS[op]().backward is not None])
def test_backward_bad_upstream(op):
    s = SPECS[op]()
    fn = getattr(F, op)
    valid = s.inputs(np.random.default_rng(zlib.crc32(op.encode()) + 1))
    out, cache = fn(**_on_backend(s, valid))
    grad_name = next(iter(inspect.signature(s.backward).parameters))
    failures = []
    if s.scalar_loss:
        reference = [to_numpy(g) for g in _as_tuple(s.backward(1.0, cache))]
        cases = [
            ("list", [1.0], "error"), ("1-d array", asarray(np.ones(1)), "error"),
            ("bool", True, "error"), ("int array", asarray(np.array(1), "int64"), "error"),
            ("string", "1.0", "error"), ("masked", np.ma.masked_array(1.0), "error"),
            ("python int", 1, "either"), ("0-d array", asarray(np.array(1.0)), "either"),
            ("numpy float32", np.float32(1.0), "either"),
        ]
    else:
        like = out if s.upstream is None else s.upstream(out)
        host = np.random.default_rng(1).standard_normal(tuple(like.shape))
        grads = _as_tuple(s.backward(asarray(host), cache))
        reference = [to_numpy(g) for g in grads if g is not None]
        cases = [(n, v, k) for n, v, k, _ in upstream_classes(host)]
    for name, bad, kind in cases:
        def check(result):
            got = [to_numpy(g) for g in _as_tuple(result) if g is not None]
            assert len(got) == len(reference)
            for g, r in zip(got, reference):
                close(g, r, tol=1e-12)

        try:
            _run(lambda: s.backward(bad, cache), (grad_name,), kind, check)
        except AssertionError as err:
            failures.append(f"{s.backward.__name__}({grad_name}=<{name}>): {err}")
    assert not failures, "\n".join(failures)


def _host(out):
    """A result as NumPy: an array, or a tuple of arrays for ops that return several."""
    return tuple(to_numpy(o) for o in out) if isinstance(out, tuple) else to_numpy(out)


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)
