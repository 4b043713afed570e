"""Mixed precision (tfcore.mixed_precision, chapter 18): the formats, the low-precision product
and its error bound, autocast over a decoder step, loss scaling, and the refusals."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from tfcore import backend, kernels
from tfcore import functional as F
from tfcore import mixed_precision as mp
from tfcore import optim
from tfcore.models import DecoderConfig, DecoderLM

STRICT_REASON = ("array-api-strict holds only the standard's dtypes (no bfloat16, no float16 "
                 "in its matmul): ml_dtypes arrays cannot live there, so autocast rounds on "
                 "the host for it (covered by test_round_to_on_every_backend)")


def small_decoder(dtype="float32", seed=0, **overrides):
    cfg = DecoderConfig(vocab_size=29, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                        dtype=dtype, **overrides)
    return DecoderLM(cfg).init(seed)


def batch(rng, B=4, S=16, V=29):
    return (backend.asarray(rng.integers(0, V, (B, S)), "int64"),
            backend.asarray(rng.integers(0, V, (B, S)), "int64"))


# ---------------------------------------------------------------------------------------
# formats


@pytest.mark.parametrize("name", mp.FORMATS)
def test_format_constants_follow_from_the_bit_counts(name):
    f = mp.float_format(name)
    assert f.bits == 1 + f.exponent_bits + f.mantissa_bits
    assert f.unit_roundoff == 2.0 ** -(f.mantissa_bits + 1)
    bias = 2 ** (f.exponent_bits - 1) - 1
    assert f.smallest_normal == 2.0 ** (1 - bias) == 2.0 ** f.min_exponent
    assert f.smallest_subnormal == 2.0 ** (1 - bias - f.mantissa_bits)
    assert f.max == (2 - 2.0 ** -f.mantissa_bits) * 2.0 ** bias
    x = np.array(f.max, dtype=mp.numpy_dtype(name))
    with np.errstate(over="ignore"):
        assert np.isinf(x * np.array(2, dtype=x.dtype))       # nothing above max


def test_bfloat16_has_float32s_range_and_float16_does_not():
    f32, bf16, f16 = (mp.float_format(n) for n in mp.FORMATS)
    assert bf16.exponent_bits == f32.exponent_bits and bf16.smallest_normal == f32.smallest_normal
    assert f16.exponent_bits < bf16.exponent_bits and f16.max < 1e5
    assert bf16.unit_roundoff > f16.unit_roundoff > f32.unit_roundoff


@pytest.mark.parametrize("dtype", mp.LOW_PRECISION)
def test_products_of_two_low_precision_numbers_are_exact_in_float32(rng, dtype):
    a = mp.round_to(rng.standard_normal(20000).astype(np.float32), dtype)
    b = mp.round_to(rng.standard_normal(20000).astype(np.float32), dtype)
    assert np.array_equal((a * b).astype(np.float64), a.astype(np.float64) * b.astype(np.float64))
    # and not exact for float32 operands: 24 + 24 bits do not fit in 24
    x, y = (rng.standard_normal(20000).astype(np.float32) for _ in range(2))
    assert not np.array_equal((x * y).astype(np.float64), x.astype(np.float64) * y)


def test_round_to_on_every_backend(backend_name, rng):
    host = rng.standard_normal((5, 7)).astype(np.float32)
    x = backend.asarray(host)
    for dtype in mp.LOW_PRECISION:
        r = mp.round_to(x, dtype)
        assert type(r) is type(x) and r.dtype == x.dtype
        expected = host.astype(mp.numpy_dtype(dtype)).astype(np.float32)
        assert np.array_equal(backend.to_numpy(r), expected)
        assert not np.array_equal(expected, host)


def test_low_precision_arrays_on_the_backend(backend_name):
    if backend_name == "strict":
        pytest.skip(STRICT_REASON)
    x = backend.asarray(np.array([1.0, 1 + 2.0 ** -8], dtype=np.float32))
    y = backend.asarray(backend.to_numpy(x).astype(ml_dtypes.bfloat16))
    assert backend.to_numpy(y)[1] == 1.0                      # a tie, rounded to even


# ---------------------------------------------------------------------------------------
# the product and its bound


@pytest.mark.parametrize("dtype", mp.LOW_PRECISION)
@pytest.mark.parametrize("K", [1, 7, 64, 1000])
def test_low_precision_matmul_within_its_bound(rng, dtype, K):
    a = rng.standard_normal((9, K)).astype(np.float32)
    b = rng.standard_normal((K, 11)).astype(np.float32)
    out = mp.low_precision_matmul(a, b, dtype)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = mp.matmul_error_bound(a, b, dtype)
    assert np.all(np.abs(out - exact) <= bound)
    assert np.max(np.abs(out - exact) / bound) > 0.01          # the bound is not vacuous
    # it equals the float32 product of the rounded operands, rounded once more
    ra, rb = mp.round_to(a, dtype), mp.round_to(b, dtype)
    assert np.array_equal(out, mp.round_to(ra @ rb, dtype))


def test_bound_fails_on_a_planted_error(rng):
    a = rng.standard_normal((8, 32)).astype(np.float32)
    b = rng.standard_normal((32, 8)).astype(np.float32)
    wrong = mp.round_to(a @ b, "bfloat16") * np.float32(1 + 2.0 ** -5)   # 8 ulps off
    bound = mp.matmul_error_bound(a, b, "bfloat16")
    assert not np.all(np.abs(wrong - a.astype(np.float64) @ b) <= bound)


def test_gamma_and_the_constant():
    u32 = mp.unit_roundoff("float32")
    assert mp.gamma(0, u32) == 0
    assert mp.gamma(10, u32) == pytest.approx(10 * u32 / (1 - 10 * u32), rel=1e-15)
    u = mp.unit_roundoff("bfloat16")
    assert mp.matmul_error_constant(64, "bfloat16") == pytest.approx(
        (1 + u) ** 3 * (1 + 64 * u32 / (1 - 64 * u32)) - 1, rel=1e-14)
    with pytest.raises(ValueError, match="k u < 1"):
        mp.gamma(2 ** 24, u32)
    with pytest.raises(ValueError, match="k"):
        mp.gamma(-1, u32)


# ---------------------------------------------------------------------------------------
# autocast over a decoder step


def test_autocast_rounds_every_product_of_a_decoder_step_within_its_bound(rng):
    model = small_decoder()
    ids, targets = batch(rng)
    record = []
    with mp.autocast("bfloat16", record=record), backend.count_matmuls() as count:
        model.forward(ids, targets)
        model.backward()
    assert len(record) == count.calls > 0
    tiny = mp.float_format("bfloat16").smallest_normal
    for a, b, out in record:
        for x in (a, b, out):          # the bound's premise: no value below the normal range
            assert not np.any((x != 0) & (np.abs(x) < tiny))
        assert np.array_equal(out, mp.round_to(out, "bfloat16"))           # stored as bf16
        exact = a.astype(np.float64) @ b.astype(np.float64)
        finite = np.isfinite(out)                              # the causal mask's -inf
        err = np.abs(out - exact)[finite]
        assert np.all(err <= mp.matmul_error_bound(a, b)[finite])


def test_autocast_gradient_close_to_float64_and_not_equal_to_float32(rng):
    m32 = small_decoder()
    m64 = small_decoder("float64")
    m64.params.data[:] = m32.params.data.astype(np.float64)
    ids, targets = batch(rng)
    m64.forward(ids, targets)
    m64.backward()
    m32.forward(ids, targets)
    m32.backward()
    g32 = m32.params.grad.astype(np.float64)
    m32.params.zero_grad()
    with mp.autocast("bfloat16"):
        m32.forward(ids, targets)
        m32.backward()
    g = m32.params.grad.astype(np.float64)
    ref = m64.params.grad
    rel = np.linalg.norm(g - ref) / np.linalg.norm(ref)
    rel32 = np.linalg.norm(g32 - ref) / np.linalg.norm(ref)
    u = mp.unit_roundoff("bfloat16")
    assert u / 10 < rel < 10 * u           # bf16-sized: rounding happened, nothing broke
    assert rel32 < rel / 100


def test_autocast_restores_the_policy_and_the_kernels():
    before = kernels.enabled()
    with pytest.raises(RuntimeError, match="inside"):
        with mp.autocast("float16"):
            assert not kernels.enabled()
            raise RuntimeError("inside")
    assert kernels.enabled() == before
    a = np.full((2, 3), 1 + 2.0 ** -10, dtype=np.float32)
    assert np.array_equal(backend.matmul(a, a.T), a @ a.T)      # plain again


def test_autocast_on_every_backend(backend_name, rng):
    x = backend.asarray(rng.standard_normal((3, 5)).astype(np.float32))
    W = backend.asarray(rng.standard_normal((5, 4)).astype(np.float32))
    with mp.autocast("bfloat16"):
        y, cache = F.linear_forward(x, W)
        dx, dW, _ = F.linear_backward(backend.asarray(np.ones((3, 4), np.float32)), cache)
    for got in (y, dx, dW):
        assert type(got) is type(x)
        host = backend.to_numpy(got)
        assert np.array_equal(host, host.astype(ml_dtypes.bfloat16).astype(np.float32))
    exact = backend.to_numpy(x).astype(np.float64) @ backend.to_numpy(W)
    assert np.all(np.abs(backend.to_numpy(y) - exact) <= mp.matmul_error_bound(x, W))


def test_autocast_and_products_refuse_bad_input():
    with pytest.raises(ValueError, match="dtype.*'bfloat16', 'float16'"):
        with mp.autocast("float32"):
            pass
    with pytest.raises(TypeError, match="record"):
        with mp.autocast("bfloat16", record=()):
            pass
    with pytest.raises(TypeError, match="a must be float32"):
        mp.low_precision_matmul(np.ones((2, 2)), np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        mp.round_to(np.ones(2, np.float32), "float8")
    with pytest.raises(TypeError, match="policy"):
        backend.set_matmul_policy("bfloat16")


# ---------------------------------------------------------------------------------------
# what goes wrong without each piece


def test_float16_gradients_underflow_without_loss_scaling(rng):
    model = small_decoder(seed=3)
    ref = small_decoder("float64", seed=3)
    ref.params.data[:] = model.params.data.astype(np.float64)
    ids, targets = batch(rng, B=8)
    ref.forward(ids, targets)
    ref.backward()
    counts = {}
    for scale in (1.0, 2.0 ** 16):
        model.params.zero_grad()
        with mp.autocast("float16"):
            logits, _ = model.forward(ids)
            _, c_loss = F.cross_entropy_forward(logits, targets)
            model.backward(F.cross_entropy_backward(scale, c_loss))
        counts[scale] = mp.flushed_to_zero(ref.params.grad, model.params.grad / scale)
    assert counts[1.0] > 0 and counts[2.0 ** 16] == 0


def test_updates_below_half_an_ulp_are_lost_in_bfloat16_and_kept_in_float32():
    w = np.float32([1.0, 1.0, 0.5, -2.0])
    delta = np.float32([2.0 ** -10, 2.0 ** -8 * 1.5, 2.0 ** -12, 0.0])
    # 1 + 2^-10 < 1 + ulp/2 (ulp of 1 is 2^-7): lost; 1.5 * 2^-8 > ulp/2: kept; 0: not counted
    assert mp.lost_updates(w, delta) == 2
    assert np.count_nonzero((w + delta != w) & (delta != 0)) == 3


# ---------------------------------------------------------------------------------------
# loss scaling


def test_loss_scaler_state_machine():
    s = mp.LossScaler(growth_interval=3)
    assert s.scale == 2.0 ** 16
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 2.0 ** 17 and s.growth_tracker == 0
    s.update(found_inf=False)
    s.update(found_inf=True)
    assert s.scale == 2.0 ** 16 and s.growth_tracker == 0 and s.skipped == 1
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 2.0 ** 16 and s.growth_tracker == 2 and s.steps == 7


def test_loss_scaler_skips_a_step_with_inf_and_takes_a_finite_one():
    model = small_decoder()
    opt = optim.AdamW(model.params, lr=1e-2)
    before = model.params.data.copy()
    scaler = mp.LossScaler()
    model.params.grad[:] = 1.0
    model.params.grad[3] = np.inf
    assert not scaler.step(opt)
    assert np.array_equal(model.params.data, before) and opt.t == 0
    assert scaler.scale == 2.0 ** 15
    model.params.grad[:] = scaler.scale * 1e-3
    assert scaler.step(opt)
    assert opt.t == 1 and np.allclose(model.params.grad, 1e-3)   # unscaled before the update
    assert not np.array_equal(model.params.data, before)


def test_mixed_precision_step_float16_overflow_is_skipped_and_bf16_trains(rng):
    ids, targets = batch(rng)
    model = small_decoder()
    opt = optim.AdamW(model.params, lr=1e-2)
    before = model.params.data.copy()
    scaler = mp.LossScaler(init_scale=2.0 ** 40)     # far too large: float16 overflows
    out = mp.mixed_precision_step(model, opt, ids, targets, "float16", scaler)
    assert not out["stepped"] and scaler.scale == 2.0 ** 39
    assert np.array_equal(model.params.data, before)
    model2 = small_decoder()
    opt2 = optim.AdamW(model2.params, lr=1e-2)
    losses = [mp.mixed_precision_step(model2, opt2, ids, targets, "bfloat16", grad_clip=1.0)
              ["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1
    assert model2.params.data.dtype == np.float32 and opt2.m.dtype == np.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="bfloat16"), "bfloat16 has float32's 8 exponent bits"),
    (dict(dtype=ml_dtypes.bfloat16), "needs no scaling"),
    (dict(dtype="float32"), "dtype must be one of 'float16'"),
    (dict(dtype="fp8"), "dtype must be one of 'float16'"),
    (dict(init_scale=0.0), r"init_scale must be > 0"),
    (dict(init_scale=-1.0), r"init_scale must be > 0"),
    (dict(init_scale=math.inf), "init_scale must be a finite number"),
    (dict(init_scale="big"), "init_scale must be a finite number"),
    (dict(growth_factor=1.0), r"growth_factor must be > 1"),
    (dict(growth_factor=0.5), r"growth_factor must be > 1"),
    (dict(backoff_factor=0.0), r"backoff_factor must lie in \(0, 1\)"),
    (dict(backoff_factor=1.0), r"backoff_factor must lie in \(0, 1\)"),
    (dict(backoff_factor=math.nan), "backoff_factor must be a finite number"),
    (dict(growth_interval=0), "growth_interval must be an integer >= 1"),
    (dict(growth_interval=2.5), "growth_interval must be an integer >= 1"),
    (dict(growth_interval=True), "growth_interval must be an integer >= 1"),
])
def test_loss_scaler_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mp.LossScaler(**kwargs)


def test_mixed_precision_step_refuses_bad_settings(rng):
    ids, targets = batch(rng)
    model = small_decoder("float64")
    with pytest.raises(ValueError, match="model: mixed precision keeps float32"):
        mp.mixed_precision_step(model, optim.AdamW(model.params), ids, targets)
    model = small_decoder()
    with pytest.raises(ValueError, match="scaler: loss scaling is for float16"):
        mp.mixed_precision_step(model, optim.AdamW(model.params), ids, targets, "bfloat16",
                                mp.LossScaler())


def test_the_loss_scale_stops_at_its_floor():
    """Halving at every skipped step used to reach 0 after about 1075 steps, and unscale_
    then divided by zero; the scale now stops at min_scale (2^-24 by default)."""
    scaler = mp.LossScaler()
    assert scaler.min_scale == 2.0 ** -24
    for _ in range(1200):
        scaler.update(found_inf=True)
    assert scaler.scale == 2.0 ** -24 and scaler.skipped == 1200
    grad = np.full(4, 3.0, dtype=np.float32)
    assert scaler.unscale_(grad) and np.array_equal(grad, np.full(4, 3.0 * 2.0 ** 24))
    custom = mp.LossScaler(init_scale=4.0, min_scale=1.0)
    for _ in range(5):
        custom.update(found_inf=True)
    assert custom.scale == 1.0
    custom.update(found_inf=False)
    assert custom.scale == 1.0 and custom.growth_tracker == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_scale=0.0), "min_scale must be > 0"),
    (dict(min_scale=math.nan), "min_scale must be a finite number"),
    (dict(init_scale=1.0, min_scale=2.0), "init_scale must be > 0 .* at least min_scale"),
])
def test_the_loss_scale_floor_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mp.LossScaler(**kwargs)


@pytest.mark.parametrize("clip, error, message", [
    (-1.0, ValueError, "grad_clip must be >= 0, got -1.0"),
    (math.nan, ValueError, "grad_clip must be >= 0, got nan"),
    (math.inf, ValueError, "grad_clip must be finite, got inf"),
    ("1", TypeError, "grad_clip must be a real number, got str '1'"),
])
def test_mixed_precision_step_checks_grad_clip_before_any_work(clip, error, message):
    model = small_decoder()
    opt = optim.AdamW(model.params, lr=1e-2)
    ids, targets = batch(np.random.default_rng(0))
    model.params.grad[:] = 7.0                   # zero_grad (the first work) would clear it
    before = np.array(model.params.data, copy=True)
    with pytest.raises(error, match=message):
        mp.mixed_precision_step(model, opt, ids, targets, "bfloat16", grad_clip=clip)
    assert np.all(model.params.grad == 7.0) and np.array_equal(model.params.data, before)
    assert opt.t == 0


def test_composed_bound_and_the_counting_helpers_refuse_mismatched_shapes():
    assert mp.composed_bound([16, 256]) == pytest.approx(
        mp.matmul_error_constant(16) + mp.matmul_error_constant(256), rel=1e-15)
    assert mp.composed_bound([]) == 0
    with pytest.raises(ValueError, match="computed must have the shape"):
        mp.flushed_to_zero(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="update must have the shape"):
        mp.lost_updates(np.ones(3, np.float32), np.ones(4, np.float32))
