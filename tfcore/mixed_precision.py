"""Mixed precision (chapter 18): bfloat16 and float16 matmuls with float32 accumulation, float32
master weights and optimizer state, and dynamic loss scaling for float16.

The formats come from ``ml_dtypes`` (bfloat16 as a NumPy dtype; float16 is NumPy's own), and
every constant of a format (bits, unit round-off, range) is read from ``ml_dtypes.finfo``:
:func:`float_format`.

The design, as the hardware does it
-----------------------------------
* **Matmuls in the low precision, accumulated in float32.** Inside ``with autocast(dtype):``
  every product of tfcore's reference ops (``backend.matmul``: the linears, attention's
  q k^T and A v, and all their backward products) rounds both operands to ``dtype``,
  multiplies them in float32 and rounds the result to ``dtype`` (autocast stores a matmul's
  output in the low dtype). The product of two bfloat16 numbers has at most 8 + 8 = 16
  significant bits, of two float16 numbers 11 + 11 = 22, and float32 holds 24: each product
  a_ik b_kj is *exact* in float32 (while it stays inside float32's normal range, 2^-126 to
  2^128), so a float32 GEMM on rounded operands is exactly "low-precision inputs, float32
  multiply-accumulate" as a tensor core computes it, up to the order of the float32 sums,
  which no standard fixes either. The arrays stay float32 and hold only values of the low
  format: the numbers are the hardware's, the bytes are not (see the chapter's size table).
* **Everything else in float32**: softmax, LayerNorm / RMSNorm, GELU, the residual sums,
  the cross-entropy and every reduction (sums over the batch of bias gradients, the
  normalizations' statistics). PyTorch runs element-wise ops on a bf16 tensor in bf16, one
  more rounding each; here they read the rounded matmul outputs and compute in float32, and
  the next matmul rounds its inputs again. The bias add follows the rounded product (a GPU
  epilogue adds it before the one rounding): the two differ by one rounding of the sum.
* **float32 master weights and optimizer state.** The model's parameters (``params.data``)
  and AdamW's m and v stay float32; the low-precision copy of a weight is made from the
  master at each product of each step (what autocast's weight cast does), so an update
  smaller than half a bfloat16 ulp of the weight is kept by the master and not lost
  (:func:`lost_updates` counts the ones a bfloat16 store would lose).
* **Dynamic loss scaling for float16** (:class:`LossScaler`, PyTorch's GradScaler): the
  loss's gradient is multiplied by the scale (2^16 to start) before the backward pass so
  that small gradients do not flush to zero in float16's narrow exponent range; the float32
  gradients are divided by it before the update; a step whose gradient holds inf or nan is
  skipped and the scale halved; after ``growth_interval`` clean steps it doubles. bfloat16
  has float32's 8 exponent bits and needs no scaling: a scaler for it is refused.

Kernels: ``autocast`` switches tfcore's fused CPU kernels off inside its block
(``ops.reference_only()``), so every product goes through ``backend.matmul`` and the reference
ops run: the rounding happens in one place, the one the book proves.

Error bars (the chapter derives them): one product C = A B with reduction length K computed
this way satisfies, element by element,

    |C_hat - C| <= c_K |A| |B|,   c_K = (1 + u)^3 (1 + gamma_K(u_32)) - 1,
    gamma_K(u) = K u / (1 - K u),

u the low format's unit round-off (two operand roundings and one output rounding) and
u_32 = 2^-24 float32's (the accumulation): :func:`matmul_error_constant`,
:func:`matmul_error_bound`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import backend, checks, ops
from .backend import namespace

FORMATS = ("float32", "bfloat16", "float16")
LOW_PRECISION = ("bfloat16", "float16")       # what autocast computes its products in


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a format name ('bfloat16' is ml_dtypes')."""
    name = _format_name("dtype", name, FORMATS)
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _format_name(argument: str, name, allowed: tuple) -> str:
    if not isinstance(name, str):
        name = backend.dtype_string(name) if isinstance(name, (type, np.dtype)) else name
    if name not in allowed:
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, allowed))}, "
                         f"got {name!r}")
    return name


@dataclass(frozen=True)
class FloatFormat:
    """The constants of a binary floating-point format, read from ml_dtypes.finfo.

    bits = 1 (sign) + exponent_bits + mantissa_bits; the significand holds mantissa_bits + 1
    bits (the leading 1 is implicit). unit_roundoff u = 2^-(mantissa_bits + 1): a number x in
    the normal range is stored as x (1 + delta), |delta| <= u.
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    unit_roundoff: float       # u = eps / 2
    smallest_normal: float     # 2^(1 - bias)
    smallest_subnormal: float  # 2^(1 - bias - mantissa_bits)
    max: float                 # (2 - 2^-mantissa_bits) 2^bias
    min_exponent: int          # the exponent of smallest_normal
    max_exponent: int          # the exponent of the largest power of two below max


def float_format(name) -> FloatFormat:
    """float32, bfloat16 or float16 as a FloatFormat (every number from ml_dtypes.finfo)."""
    dt = numpy_dtype(name)
    info = ml_dtypes.finfo(dt)
    return FloatFormat(
        name=str(dt.name), bits=int(info.bits), exponent_bits=int(info.nexp),
        mantissa_bits=int(info.nmant), unit_roundoff=float(info.eps) / 2,
        smallest_normal=float(info.smallest_normal),
        smallest_subnormal=float(info.smallest_subnormal), max=float(info.max),
        min_exponent=int(info.minexp), max_exponent=int(info.maxexp) - 1)


def unit_roundoff(name) -> float:
    return float_format(name).unit_roundoff


# ---------------------------------------------------------------------------------------
# Rounding and the low-precision product


def round_to(x, dtype):
    """x (float32 or float64, any backend) rounded to the nearest value of `dtype` (ties to
    even; beyond the format's max: inf), returned in x's own dtype and library.

    [...] -> [...]. On NumPy the rounding is one astype to ml_dtypes' bfloat16 or float16 and
    back; other libraries round on the host (array-api-strict cannot hold ml_dtypes arrays).
    """
    checks.float_inputs(x=x)
    target = numpy_dtype(_format_name("dtype", dtype, FORMATS))
    host = backend.to_numpy(x)
    with np.errstate(over="ignore"):          # overflow to inf is the format's answer
        rounded = host.astype(target).astype(host.dtype)
    return rounded if backend.is_numpy(x) else namespace(x).asarray(rounded)


def low_precision_matmul(a, b, dtype: str = "bfloat16"):
    """a @ b as a tensor core computes it: operands rounded to `dtype`, exact products and
    sums in float32, the result rounded to `dtype` (stored in a float32 array).

    a [..., m, K] float32, b [..., K, n] float32 -> [..., m, n] float32 holding dtype values.
    """
    dtype = _format_name("dtype", dtype, LOW_PRECISION)
    for name, x in (("a", a), ("b", b)):
        checks.array(name, x)
        if checks.dtype_name(x) != "float32":
            raise TypeError(f"{name} must be float32 (the master weights and activations "
                            f"that autocast rounds), got {checks.dtype_name(x)}")
    xp = namespace(a, b)
    with backend.expected_overflow():      # inf/nan in float16 is the loss scaler's to see
        product = xp.matmul(round_to(a, dtype), round_to(b, dtype))
    return round_to(product, dtype)


@contextlib.contextmanager
def autocast(dtype: str = "bfloat16", record: list | None = None):
    """``with autocast("bfloat16"):`` every backend.matmul inside is low_precision_matmul.

    The fused kernels are off inside the block (every product then goes through
    backend.matmul). record: a list to which each product appends copies of (a, b, out), the
    float32 operands as given and the rounded result, for checking every product of a step.
    """
    dtype = _format_name("dtype", dtype, LOW_PRECISION)
    if record is not None and not isinstance(record, list):
        raise TypeError(f"record must be a list or None, got {type(record).__name__}")

    def product(a, b):
        out = low_precision_matmul(a, b, dtype)
        if record is not None:      # copies: an op may later write into any of the three
            xp = namespace(a, b)
            record.append((xp.asarray(a, copy=True), xp.asarray(b, copy=True),
                           xp.asarray(out, copy=True)))
        return out

    with ops.reference_only():
        previous = backend.set_matmul_policy(product)
        try:
            yield
        finally:
            backend.set_matmul_policy(previous)


# ---------------------------------------------------------------------------------------
# Error bars of one product


def gamma(k: int, u: float) -> float:
    """gamma_k(u) = k u / (1 - k u): |prod (1 + delta_i) - 1| <= gamma_k for k factors with
    |delta_i| <= u (Higham, Lemma 3.1); defined while k u < 1."""
    k = checks.integer("k", k, least=0)
    u = checks.positive("u", u)
    if k * u >= 1:
        raise ValueError(f"gamma_k(u) needs k u < 1, got k={k}, u={u} (k u = {k * u})")
    return k * u / (1 - k * u)


def matmul_error_constant(K: int, dtype: str = "bfloat16") -> float:
    """c_K = (1 + u)^3 (1 + gamma_K(u_32)) - 1: |C_hat - C| <= c_K |A| |B| element-wise for
    a low_precision_matmul with reduction length K (two operand roundings, one output
    rounding at the low format's u, K-term float32 sums)."""
    u = unit_roundoff(_format_name("dtype", dtype, LOW_PRECISION))
    return (1 + u) ** 3 * (1 + gamma(K, unit_roundoff("float32"))) - 1


def matmul_error_bound(a, b, dtype: str = "bfloat16") -> np.ndarray:
    """c_K |a| |b| in float64 on the host: the element-wise bound on
    |low_precision_matmul(a, b) - a @ b| (a @ b exact). a [..., m, K], b [..., K, n]."""
    a64 = np.abs(np.asarray(backend.to_numpy(a), dtype=np.float64))
    b64 = np.abs(np.asarray(backend.to_numpy(b), dtype=np.float64))
    return matmul_error_constant(a64.shape[-1], dtype) * (a64 @ b64)


def composed_bound(reductions, dtype: str = "bfloat16") -> float:
    """sum_p c_{K_p} over the products p of a step (K_p their reduction lengths): the
    first-order bound on the gradient's normwise relative error when every product's
    relative perturbation reaches the gradient unamplified (the chapter states where that
    assumption comes from and where it can fail). reductions: iterable of K."""
    return float(sum(matmul_error_constant(int(K), dtype) for K in reductions))


# ---------------------------------------------------------------------------------------
# What goes wrong without each piece (counted)


def flushed_to_zero(reference, computed) -> int:
    """How many entries are nonzero in `reference` but exactly zero in `computed` (same shape):
    gradients lost to underflow."""
    ref = np.asarray(backend.to_numpy(reference))
    got = np.asarray(backend.to_numpy(computed))
    if ref.shape != got.shape:
        raise ValueError(f"computed must have the shape of reference {ref.shape}, "
                         f"got {got.shape}")
    return int(np.count_nonzero((ref != 0) & (got == 0)))


def lost_updates(weights, update, dtype: str = "bfloat16") -> int:
    """How many nonzero updates vanish when the weights are stored in `dtype`:
    round(w + delta) == w with w = round(weights), delta != 0 (|delta| below half an ulp
    of w). weights, update [N] float32."""
    w = np.asarray(backend.to_numpy(round_to(weights, dtype)), dtype=np.float32)
    delta = np.asarray(backend.to_numpy(update), dtype=np.float32)
    if w.shape != delta.shape:
        raise ValueError(f"update must have the shape of weights {w.shape}, got {delta.shape}")
    stored = np.asarray(backend.to_numpy(round_to(w + delta, dtype)))
    return int(np.count_nonzero((delta != 0) & (stored == w)))


# ---------------------------------------------------------------------------------------
# Dynamic loss scaling (PyTorch's GradScaler)


class LossScaler:
    """Dynamic loss scaling for float16, as torch.amp.GradScaler does it.

    scale            multiplies the loss's gradient before the backward pass
    growth_tracker   clean steps since the scale last changed
    steps, skipped   updates attempted, and skipped for an inf or nan gradient

    The state machine, one step: unscale the float32 gradients (g /= scale); if any entry is
    inf or nan the update is skipped and scale = max(scale * backoff_factor, min_scale),
    growth_tracker = 0; otherwise the optimizer steps and growth_tracker += 1, and when it
    reaches growth_interval, scale *= growth_factor and growth_tracker = 0.

    The floor: the scale never falls below ``min_scale`` (2^-24 by default, float16's
    smallest subnormal: at a smaller scale a unit gradient already flushes to zero in
    float16, so scaling further down cannot help). Without it a run whose gradients stay
    non-finite (a nan parameter) would halve the scale about 1075 times, down to 0, and
    unscale_ would then divide by zero. At the floor such steps are still skipped and
    counted in ``skipped``; the scale stays at min_scale.
    """

    def __init__(self, dtype: str = "float16", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 2.0 ** -24):
        if dtype == "bfloat16" or (isinstance(dtype, (type, np.dtype))
                                   and np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)):
            raise ValueError(
                "dtype: loss scaling is for 'float16' only; bfloat16 has float32's 8 "
                "exponent bits (the same range, down to 1e-38) and needs no scaling: run "
                "autocast('bfloat16') without a LossScaler")
        _format_name("dtype", dtype, ("float16",))
        for name, value in (("init_scale", init_scale), ("growth_factor", growth_factor),
                            ("backoff_factor", backoff_factor), ("min_scale", min_scale)):
            if (isinstance(value, bool) or not isinstance(value, (int, float, np.floating,
                                                                   np.integer))
                    or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not min_scale > 0:
            raise ValueError(f"min_scale must be > 0 (2**-24 by default), got {min_scale!r}")
        if not init_scale >= min_scale:
            raise ValueError(f"init_scale must be > 0 (2**16 by default) and at least "
                             f"min_scale = {min_scale!r}, got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1 (2.0 by default), got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must lie in (0, 1) (0.5 by default), "
                             f"got {backoff_factor!r}")
        if (isinstance(growth_interval, bool) or not isinstance(growth_interval,
                                                                 (int, np.integer))
                or growth_interval < 1):
            raise ValueError(f"growth_interval must be an integer >= 1 (2000 by default), "
                             f"got {growth_interval!r}")
        self.dtype = "float16"
        self.scale = float(init_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0
        self.steps = 0
        self.skipped = 0

    def unscale_(self, grad) -> bool:
        """grad [N] float32 /= scale, in place; True when every entry is finite."""
        grad *= 1.0 / self.scale       # a power of two by default: exact
        xp = namespace(grad)
        return bool(xp.all(xp.isfinite(grad)))

    def update(self, found_inf: bool) -> None:
        """The scale's state machine after one step (see the class docstring)."""
        self.steps += 1
        if found_inf:
            self.skipped += 1
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)   # the floor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def step(self, optimizer) -> bool:
        """Unscale optimizer.params.grad, step the optimizer unless it holds inf/nan, update
        the scale. Returns True when the optimizer stepped."""
        finite = self.unscale_(optimizer.params.grad)
        if finite:
            optimizer.step()
        self.update(not finite)
        return finite


# ---------------------------------------------------------------------------------------
# One training step of a DecoderLM in mixed precision


def mixed_precision_step(model, optimizer, ids, targets, dtype: str = "bfloat16",
                         scaler: LossScaler | None = None, grad_clip: float = 0.0) -> dict:
    """One update of a float32 DecoderLM with its products in `dtype`.

    ids, targets [B, S]. The gradient of (scale * loss) runs backward under autocast into
    the float32 params.grad; the scaler (float16) unscales it and skips a non-finite step;
    the optimizer (tfcore.optim, float32 state) updates the float32 master weights.
    grad_clip: the max_norm of global-norm clipping of the unscaled gradient, a finite
    number >= 0 (0: no clipping), checked before anything runs.
    Returns {"loss": float, "stepped": bool, "scale": float (1.0 without a scaler)}.
    """
    from .models.decoder import IGNORE_INDEX
    from .ops import cross_entropy_backward, cross_entropy_forward

    grad_clip = checks.nonnegative("grad_clip", grad_clip)
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(f"scaler must be a LossScaler or None, got {type(scaler).__name__}")
    dtype = _format_name("dtype", dtype, LOW_PRECISION)
    if model.config.dtype != "float32":
        raise ValueError(f"model: mixed precision keeps float32 master weights, got a "
                         f"{model.config.dtype} model")
    if scaler is not None and dtype != "float16":
        raise ValueError("scaler: loss scaling is for float16; bfloat16 needs none")
    scale = 1.0 if scaler is None else scaler.scale
    model.params.zero_grad()
    overflow = backend.expected_overflow() if scaler is not None else contextlib.nullcontext()
    with autocast(dtype), overflow:     # with a scaler, inf/nan is detected and the step skipped
        logits, _ = model.forward(ids)                                   # [B, S, V]
        loss, c_loss = cross_entropy_forward(logits, targets, IGNORE_INDEX)   # float32
        model.backward(cross_entropy_backward(scale, c_loss))            # d(scale * loss)
    if scaler is not None:
        stepped = scaler.step(_ClippedOptimizer(optimizer, grad_clip))
    else:
        xp = namespace(model.params.grad)
        stepped = bool(xp.all(xp.isfinite(model.params.grad)))
        if stepped:
            _ClippedOptimizer(optimizer, grad_clip).step()
    return {"loss": float(loss), "stepped": stepped, "scale": scale}


class _ClippedOptimizer:
    """optimizer.step() preceded by global-norm clipping of the (unscaled) gradient."""

    def __init__(self, optimizer, grad_clip: float):
        self.optimizer, self.grad_clip, self.params = optimizer, grad_clip, optimizer.params

    def step(self):
        from .optim import clip_grad_norm

        if self.grad_clip:
            clip_grad_norm(self.params.grad, self.grad_clip)
        self.optimizer.step()
