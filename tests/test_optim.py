"""tfcore.optim: each update against a hand-written reference, loop-free closed forms over
several steps, clipping, the schedule, and state_dict round trips."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tfcore import backend, optim


class FlatParams:
    """The part of tfcore.nn.Parameters an optimizer uses: data [N], grad [N], decay_mask()."""

    def __init__(self, data, mask):
        self.data = dev(data)
        self.grad = dev(np.zeros_like(data))
        self._mask = np.asarray(mask, dtype="float64")

    def decay_mask(self):
        return dev(self._mask)


def dev(x):
    """A float64 copy of x on the selected backend (asarray alone may share NumPy memory)."""
    return backend.asarray(np.array(x, dtype="float64"), "float64")


def host(x):
    return np.array(backend.to_numpy(x))


def adam_reference(p, grads, lr, b1, b2, eps, wd=0.0, mask=None):
    """Seed 002's Adam, element by element in Python floats, with decoupled decay."""
    p = [float(x) for x in p]
    mask = [1.0] * len(p) if mask is None else [float(x) for x in mask]
    m = [0.0] * len(p)
    v = [0.0] * len(p)
    for t, g in enumerate(grads, start=1):
        for i, gi in enumerate(g):
            p[i] = p[i] - lr * wd * mask[i] * p[i]
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            m_hat = m[i] / (1 - b1**t)
            v_hat = v[i] / (1 - b2**t)
            p[i] = p[i] - lr * m_hat / (math.sqrt(v_hat) + eps)
    return np.array(p)


def relerr(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_update_matches_the_elementwise_reference(backend_name, rng, weight_decay):
    n, steps = 11, 5
    p0 = rng.standard_normal(n)
    grads = rng.standard_normal((steps, n)) * np.logspace(-3, 1, n)  # wide range of scales
    mask = (rng.random(n) < 0.5).astype(float)
    p = dev(p0)
    m = dev(np.zeros(n))
    v = dev(np.zeros(n))
    for t in range(1, steps + 1):
        optim.adamw_update(p, dev(grads[t - 1]), m, v, t, 0.01,
                           0.9, 0.999, 1e-8, weight_decay, dev(mask))
    want = adam_reference(p0, grads, 0.01, 0.9, 0.999, 1e-8, weight_decay, mask)
    assert relerr(host(p), want) < 1e-12


def test_adam_with_a_constant_gradient_moves_lr_per_step(backend_name, rng):
    # Constant g: m_t = (1 - b1^t) g and v_t = (1 - b2^t) g^2 exactly, so the bias-corrected
    # m^ = g, v^ = g^2 and every step moves by lr g / (|g| + eps): p_t = p_0 - t lr g/(|g|+eps).
    n, t, lr, eps = 9, 7, 0.03, 1e-8
    p0, g = rng.standard_normal(n), rng.standard_normal(n)
    params = FlatParams(p0, np.ones(n))
    opt = optim.Adam(params, lr=lr, eps=eps)
    params.grad[...] = dev(g)
    for _ in range(t):
        opt.step()
    want = p0 - t * lr * g / (np.abs(g) + eps)
    assert relerr(host(params.data), want) < 1e-12
    assert opt.t == t


def test_adamw_decay_alone_is_geometric_and_only_where_the_mask_is_one(backend_name, rng):
    # g = 0: the Adam part is 0 / (0 + eps) = 0, so p_t = p_0 (1 - lr wd)^t where mask = 1.
    n, t, lr, wd = 8, 6, 0.1, 0.5
    p0 = rng.standard_normal(n)
    mask = np.array([1, 0, 1, 1, 0, 0, 1, 0], dtype=float)
    params = FlatParams(p0, mask)
    opt = optim.AdamW(params, lr=lr, weight_decay=wd)
    for _ in range(t):
        opt.step()
    want = np.where(mask == 1, p0 * (1 - lr * wd) ** t, p0)
    assert relerr(host(params.data), want) < 1e-12
    assert np.array_equal(host(params.data)[mask == 0], p0[mask == 0])


def test_adam_is_adamw_without_decay(backend_name, rng):
    n = 10
    p0, grads = rng.standard_normal(n), rng.standard_normal((4, n))
    a, b = FlatParams(p0, np.ones(n)), FlatParams(p0, np.ones(n))
    oa, ob = optim.Adam(a, lr=0.01), optim.AdamW(b, lr=0.01, weight_decay=0.0)
    for g in grads:
        a.grad[...] = dev(g)
        b.grad[...] = dev(g)
        oa.step()
        ob.step()
    assert np.array_equal(host(a.data), host(b.data))


def test_sgd_momentum_matches_reference_and_closed_form(backend_name, rng):
    n, lr, mu = 7, 0.05, 0.9
    p0, grads = rng.standard_normal(n), rng.standard_normal((5, n))
    params = FlatParams(p0, np.ones(n))
    opt = optim.SGD(params, lr=lr, momentum=mu)
    ref_p, ref_buf = p0.copy(), np.zeros(n)
    for g in grads:
        params.grad[...] = dev(g)
        opt.step()
        ref_buf = mu * ref_buf + g
        ref_p = ref_p - lr * ref_buf
    assert relerr(host(params.data), ref_p) < 1e-12
    # Constant gradient: buf_k = g (1 - mu^k) / (1 - mu), so after t steps
    # p_t = p_0 - lr g / (1 - mu) (t - mu (1 - mu^t) / (1 - mu)).
    t, g = 9, rng.standard_normal(n)
    params = FlatParams(p0, np.ones(n))
    opt = optim.SGD(params, lr=lr, momentum=mu)
    params.grad[...] = dev(g)
    for _ in range(t):
        opt.step()
    want = p0 - lr * g / (1 - mu) * (t - mu * (1 - mu**t) / (1 - mu))
    assert relerr(host(params.data), want) < 1e-12


def test_plain_sgd_needs_no_buffer(backend_name, rng):
    p0, g = rng.standard_normal(4), rng.standard_normal(4)
    p = dev(p0)
    optim.sgd_update(p, dev(g), None, 0.5, 0.0)
    assert np.array_equal(host(p), p0 - 0.5 * g)


def test_updates_work_on_a_slice_of_the_buffer(backend_name, rng):
    # A sharded optimizer updates its own slice; the rest of the buffer is untouched.
    n = 12
    p0, g = rng.standard_normal(n), rng.standard_normal(n)
    p = dev(p0)
    m = dev(np.zeros(n))
    v = dev(np.zeros(n))
    gd = dev(g)
    optim.adamw_update(p[4:8], gd[4:8], m[4:8], v[4:8], 1, 0.1)
    out = host(p)
    assert np.array_equal(out[:4], p0[:4]) and np.array_equal(out[8:], p0[8:])
    assert relerr(out[4:8], adam_reference(p0[4:8], [g[4:8]], 0.1, 0.9, 0.999, 1e-8)) < 1e-12


def test_clip_grad_norm(backend_name, rng):
    g0 = rng.standard_normal(50) * 3
    norm0 = float(np.linalg.norm(g0))
    g = dev(g0)
    returned = optim.clip_grad_norm(g, 1.0)
    assert abs(returned - norm0) < 1e-12 * norm0
    clipped = host(g)
    assert abs(np.linalg.norm(clipped) - norm0 / (norm0 + 1e-6)) < 1e-12
    assert relerr(clipped, g0 * (1.0 / (norm0 + 1e-6))) < 1e-12  # same direction
    # Below the threshold nothing changes, bit for bit.
    g = dev(g0)
    assert abs(optim.clip_grad_norm(g, 2 * norm0) - norm0) < 1e-12 * norm0
    assert np.array_equal(host(g), g0)


def test_clip_grad_norm_errors():
    with pytest.raises(ValueError, match="max_norm must be positive"):
        optim.clip_grad_norm(np.ones(3), 0.0)
    with pytest.raises(FloatingPointError, match="nan"):
        optim.clip_grad_norm(np.array([1.0, np.nan]), 1.0)
    with pytest.raises(TypeError, match=r"pieces\[1\] must be float32 or float64"):
        optim.clip_grad_norm([np.ones(3), np.ones(2, dtype=np.int64)], 1.0)
    with pytest.raises(ValueError, match="at least one gradient piece"):
        optim.clip_grad_norm([], 1.0)


def test_warmup_cosine_values():
    kw = dict(max_lr=1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert optim.warmup_cosine(0, **kw) == pytest.approx(0.1, rel=1e-15)
    assert optim.warmup_cosine(4, **kw) == pytest.approx(0.5, rel=1e-15)
    assert optim.warmup_cosine(9, **kw) == 1.0
    assert optim.warmup_cosine(10, **kw) == 1.0
    assert optim.warmup_cosine(60, **kw) == pytest.approx(0.55, rel=1e-15)  # half way
    assert optim.warmup_cosine(35, **kw) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi / 4)), rel=1e-15)
    assert optim.warmup_cosine(110, **kw) == pytest.approx(0.1, rel=1e-15)
    assert optim.warmup_cosine(500, **kw) == 0.1
    decay = [optim.warmup_cosine(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert optim.warmup_cosine(0, 1.0, 0, 10) == 1.0  # no warmup


def test_warmup_cosine_errors():
    with pytest.raises(ValueError, match="warmup_steps \\(20\\) must not exceed total_steps"):
        optim.warmup_cosine(0, 1.0, 20, 10)
    with pytest.raises(ValueError, match="min_lr"):
        optim.warmup_cosine(0, 1.0, 1, 10, min_lr=2.0)


@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
def test_state_dict_round_trip_continues_exactly(backend_name, rng, kind):
    n = 16
    p0, grads = rng.standard_normal(n), rng.standard_normal((6, n))
    mask = (rng.random(n) < 0.5).astype(float)
    kwargs = {"SGD": dict(lr=0.1, momentum=0.9), "Adam": dict(lr=0.01),
              "AdamW": dict(lr=0.01, weight_decay=0.1)}[kind]
    straight = FlatParams(p0, mask)
    opt = optim.OPTIMIZERS[kind](straight, **kwargs)
    for g in grads:
        straight.grad[...] = dev(g)
        opt.step()
    first = FlatParams(p0, mask)
    opt1 = optim.OPTIMIZERS[kind](first, **kwargs)
    for g in grads[:3]:
        first.grad[...] = dev(g)
        opt1.step()
    saved = {k: (host(v).copy() if hasattr(v, "shape") else v)
             for k, v in opt1.state_dict().items()}
    second = FlatParams(host(first.data), mask)
    opt2 = optim.OPTIMIZERS[kind](second, **kwargs)
    opt2.load_state_dict(saved)
    assert opt2.t == 3
    for g in grads[3:]:
        second.grad[...] = dev(g)
        opt2.step()
    assert np.array_equal(host(second.data), host(straight.data))


def test_load_state_dict_rejects_a_mismatch_and_changes_nothing(rng):
    params = FlatParams(rng.standard_normal(5), np.ones(5))
    opt = optim.AdamW(params, lr=0.01, weight_decay=0.1)
    other = optim.AdamW(FlatParams(rng.standard_normal(5), np.ones(5)), lr=0.01,
                        betas=(0.8, 0.999), weight_decay=0.1)
    other.m[...] = 1.0
    other.t = 4
    with pytest.raises(ValueError, match=r"betas=\(0.8, 0.999\)"):
        opt.load_state_dict(other.state_dict())
    assert opt.t == 0 and not np.any(host(opt.m))
    with pytest.raises(ValueError, match="for 'SGD', not 'AdamW'"):
        opt.load_state_dict(optim.SGD(params, lr=0.1).state_dict())
    wrong = dict(opt.state_dict(), m=np.zeros(4))
    with pytest.raises(ValueError, match=r"m has shape \(4,\), the parameters \(5,\)"):
        opt.load_state_dict(wrong)


def test_update_argument_errors():
    p, g, m, v = np.ones(3), np.ones(3), np.zeros(3), np.zeros(3)
    with pytest.raises(ValueError, match="starting at 1; got 0"):
        optim.adamw_update(p, g, m, v, 0, 0.1)
    with pytest.raises(ValueError, match=r"m must have shape \(3,\)"):
        optim.adamw_update(p, g, np.zeros(4), v, 1, 0.1)
    with pytest.raises(ValueError, match="beta2 must lie in"):
        optim.adamw_update(p, g, m, v, 1, 0.1, beta2=1.0)
    with pytest.raises(TypeError, match="an optimizer takes a tfcore.nn.Parameters"):
        optim.SGD(np.ones(3), lr=0.1)
    with pytest.raises(ValueError, match="with momentum needs a buffer"):
        optim.sgd_update(p, g, None, 0.1, 0.9)


def test_adamw_on_real_parameters_decays_only_weight_matrices(backend_name, rng):
    from tfcore.nn import Parameters

    params = Parameters({"fc.W": (3, 4), "fc.b": (4,), "ln.g": (3,), "wte": (5, 3)},
                        "float64")
    p0 = rng.standard_normal(params.size)
    params.load_flat(p0)
    opt = optim.AdamW(params, lr=0.1, weight_decay=0.5)   # no gradient: decay alone
    for _ in range(3):
        opt.step()
    out = host(params.data)
    for name in params.names:
        start, stop = params.offsets[name]
        factor = 0.95**3 if name.endswith(".W") else 1.0
        assert relerr(out[start:stop], p0[start:stop] * factor) < 1e-12, name


# -- no silent poison ----------------------------------------------------------------------

def _adamw(n=6, **kw):
    params = FlatParams(np.linspace(-1, 1, n), np.ones(n))
    return params, optim.AdamW(params, lr=1e-2, **kw)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
def test_a_non_finite_gradient_is_refused_before_anything_changes(kind, bad):
    params = FlatParams(np.linspace(-1, 1, 6), np.ones(6))
    opt = optim.OPTIMIZERS[kind](params, lr=1e-2)
    params.grad[...] = dev(np.arange(6.0))
    opt.step()
    before = {k: host(v) for k, v in opt.state_dict().items() if hasattr(v, "shape")}
    p_before, t_before = host(params.data), opt.t
    params.grad[2] = bad
    with pytest.raises(FloatingPointError, match="nan or inf"):
        opt.step()
    assert np.array_equal(host(params.data), p_before) and opt.t == t_before
    for k, v in before.items():
        assert np.array_equal(host(getattr(opt, k)), v)


def test_skip_nonfinite_skips_and_counts_the_step():
    params, opt = _adamw(skip_nonfinite=True)
    params.grad[...] = dev(np.ones(6))
    opt.step()
    p_before = host(params.data)
    params.grad[0] = np.nan
    opt.step()
    assert opt.skipped == 1 and opt.t == 1 and np.array_equal(host(params.data), p_before)
    state = opt.state_dict()
    assert state["skipped"] == 1
    _, other = _adamw(skip_nonfinite=True)
    other.load_state_dict(state)
    assert other.skipped == 1 and other.t == 1


@pytest.mark.parametrize("name, value", [
    ("lr", float("nan")), ("lr", -1e-3), ("lr", float("inf")), ("weight_decay", float("inf")),
    ("weight_decay", -0.1), ("eps", 0.0), ("eps", float("nan")), ("betas", (1.0, 0.9)),
    ("betas", (0.9, float("nan"))), ("betas", (0.9,)), ("lr", "0.1"), ("lr", True)])
def test_hyperparameters_are_checked_whenever_they_are_set(name, value):
    params, opt = _adamw()
    with pytest.raises((TypeError, ValueError), match=name.rstrip("s") if name != "betas"
                       else "beta"):
        setattr(opt, name, value)
    with pytest.raises((TypeError, ValueError)):
        optim.AdamW(params, **{"lr": 1e-2, name: value})


def test_a_schedule_cannot_set_a_bad_learning_rate_but_may_reach_zero():
    params, opt = _adamw()
    opt.lr = 0.0                                      # the end of a cosine to min_lr = 0
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="lr"):
            opt.lr = bad
    assert opt.lr == 0.0


@pytest.mark.parametrize("fn, kwargs, name", [
    (optim.adamw_update, dict(lr=float("nan")), "lr"),
    (optim.adamw_update, dict(lr=1e-3, weight_decay=float("inf")), "weight_decay"),
    (optim.adamw_update, dict(lr=1e-3, eps=float("inf")), "eps"),
    (optim.sgd_update, dict(lr=-1.0), "lr")])
def test_the_functional_updates_check_their_scalars(fn, kwargs, name):
    p, g, m, v = (dev(np.ones(3)) for _ in range(4))
    args = (p, g, m, v, 1) if fn is optim.adamw_update else (p, g, None)
    with pytest.raises(ValueError, match=name):
        fn(*args, **kwargs)


@pytest.mark.parametrize("change, match", [
    (lambda s: s.update(m=np.full(6, np.nan)), "m holds nan"),
    (lambda s: s.update(v=-np.ones(6)), "negative"),
    (lambda s: s.update(v=np.full(6, np.inf)), "v holds nan or inf"),
    (lambda s: s.update(t=0), "t = 0"),
    (lambda s: s.update(t=-1), "integer >= 0"),
    (lambda s: s.update(t=1.5), "integer >= 0"),
    (lambda s: s.update(lr=float("nan")), "lr"),
    (lambda s: s.update(betas=(0.5, 0.999)), "betas"),
    (lambda s: s.update(kind="SGD"), "SGD")])
def test_check_state_dict_refuses_a_poisoned_state_and_changes_nothing(change, match):
    params, opt = _adamw()
    params.grad[...] = dev(np.arange(6.0))
    opt.step()
    state = {k: (host(v) if hasattr(v, "shape") else v) for k, v in opt.state_dict().items()}
    change(state)
    fresh_params, fresh = _adamw()
    before = (host(fresh_params.data), host(fresh.m), host(fresh.v), fresh.t, fresh.lr)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
    after = (host(fresh_params.data), host(fresh.m), host(fresh.v), fresh.t, fresh.lr)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


# -- the shard view and the clip over pieces ------------------------------------------------
class MiddleView(optim.ShardView):
    """A view of elements a..b of the flat buffers, with a gradient a reduction hands over
    (here: twice the local one) and a publish that records the values it was given."""

    def __init__(self, a, b):
        self.a, self.b, self.published = a, b, []

    def size(self, params):
        return self.b - self.a

    def select(self, params, full):
        return full[self.a:self.b]

    def gradient(self, params):
        return 2 * params.grad[self.a:self.b]

    def parameters(self, params):
        return params.data[self.a:self.b]

    def publish(self, params, values):
        self.published.append(host(values).copy())


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_an_optimizer_steps_over_its_shard_view_only(backend_name, rng, kind):
    """m, v (or the momentum) are [Z]; the update is the reference's on the view's values
    with the view's gradient, elementwise; the rest of the buffer is untouched."""
    n, a, b = 10, 3, 8
    p0, g = rng.standard_normal(n), rng.standard_normal(n)
    mask = (np.arange(n) % 2).astype(float)
    params = FlatParams(p0, mask)
    view = MiddleView(a, b)
    if kind == "AdamW":
        opt = optim.AdamW(params, lr=0.1, weight_decay=0.2, shard=view)
        want = adam_reference(p0[a:b], [2 * g[a:b]] * 2, 0.1, 0.9, 0.999, 1e-8, 0.2,
                              mask[a:b])
        assert opt.m.shape == opt.v.shape == (b - a,)
    else:
        opt = optim.SGD(params, lr=0.1, momentum=0.5, shard=view)
        want = p0[a:b] - 0.1 * (2 * g[a:b]) - 0.1 * (1.5 * 2 * g[a:b])
        assert opt.momentum_buffer.shape == (b - a,)
    params.grad[...] = dev(g)
    opt.step()
    opt.step()
    out = host(params.data)
    assert np.array_equal(out[:a], p0[:a]) and np.array_equal(out[b:], p0[b:])
    assert relerr(out[a:b], want) < 1e-12
    assert len(view.published) == 2 and np.array_equal(view.published[-1], out[a:b])
    assert opt.state_bytes() == len(opt._buffers) * (b - a) * 8


def test_the_default_view_is_the_whole_buffer_bit_for_bit(rng):
    """AdamW without a shard is adamw_update on the whole buffers, to the last bit."""
    n = 50
    p0, g, mask = rng.standard_normal(n), rng.standard_normal(n), np.ones(n)
    params = FlatParams(p0, mask)
    params.grad[...] = g
    opt = optim.AdamW(params, lr=0.01, weight_decay=0.1)
    opt.step()
    p, m, v = p0.copy(), np.zeros(n), np.zeros(n)
    optim.adamw_update(p, g, m, v, 1, 0.01, 0.9, 0.999, 1e-8, 0.1, mask)
    assert np.array_equal(params.data, p) and np.array_equal(opt.m, m)


def test_clip_over_pieces_equals_the_clip_of_the_whole(rng):
    """The norm of pieces (masks selecting parts of one buffer, and a second buffer) is the
    norm of their concatenation, each buffer is scaled once, and a sum_squares callback
    replaces the local sum of squares."""
    from tfcore.parallel.grads import GradPiece

    g1, g2 = rng.standard_normal(12) * 3, rng.standard_normal(5) * 3
    whole = np.concatenate([g1, g2])
    truth = float(np.linalg.norm(whole))
    half = np.arange(12) < 6
    b1, b2 = g1.copy(), g2.copy()
    pieces = [GradPiece(b1, (), half), GradPiece(b1, (), ~half), b2]
    norm = optim.clip_grad_norm(pieces, 1.0)
    assert abs(norm - truth) <= 1e-14 * truth
    scale = 1.0 / (norm + 1e-6)
    assert np.array_equal(b1, g1 * scale) and np.array_equal(b2, g2 * scale)
    seen = []

    def sum_squares(got):
        seen.append(got)
        return 4.0 * truth**2                 # as if three other ranks held the same
    b = whole.copy()
    assert optim.clip_grad_norm(b, 1.0, sum_squares) == pytest.approx(2 * truth, rel=1e-15)
    assert len(seen) == 1 and seen[0][0] is b
    with pytest.raises(FloatingPointError, match="inf"):
        optim.clip_grad_norm(whole.copy(), 1.0, lambda got: math.inf)


def test_a_sharded_strategy_refuses_skip_nonfinite():
    """Each ZeRO rank holds another shard of the gradient: skipping on a local nan would
    let the ranks disagree, so the optimizer refuses skip_nonfinite there."""
    from tfcore.parallel import SimulatedGroup
    from tfcore.parallel.optimizer import Replicated, ZeRO1

    def body(comm):
        params = FlatParams(np.linspace(-1, 1, 6), np.ones(6))
        optim.AdamW(params, shard=Replicated(comm), skip_nonfinite=True)    # agrees
        with pytest.raises(ValueError, match="skip_nonfinite needs every rank to see "
                                             "the same gradient; under ZeRO1"):
            optim.AdamW(params, shard=ZeRO1(comm), skip_nonfinite=True)
        with pytest.raises(TypeError, match="shard must be a tfcore.optim.ShardView"):
            optim.AdamW(params, shard=comm)
        return True

    assert SimulatedGroup(2).run(body) == [True, True]
