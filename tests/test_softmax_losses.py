"""Softmax (plain, masked, causal), log-softmax, cross-entropy and MSE (float64)."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import functional as F
from tfcore.backend import asarray, to_numpy
from tfcore.gradcheck import assert_close, check_gradients, random_upstream

pytestmark = pytest.mark.usefixtures("backend_name")


def _softmax_ref(z: np.ndarray) -> np.ndarray:
    """exp(z) / sum exp(z), unshifted: a different code path, fine for moderate z."""
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _shape(rng, ndim=3):
    return tuple(int(n) for n in rng.integers(1, 5, size=ndim))


def _finite(*arrays):
    return all(np.all(np.isfinite(to_numpy(a))) for a in arrays)


# --------------------------------------------------------------------------------------
# Softmax


def test_softmax_forward_matches_reference(rng):
    z = rng.standard_normal(_shape(rng))
    s, _ = F.softmax_forward(asarray(z))
    assert_close("s", s, _softmax_ref(z))
    assert_close("row sums", np.sum(to_numpy(s), axis=-1), np.ones(z.shape[:-1]))


def test_softmax_gradient(rng):
    z = rng.standard_normal(_shape(rng))
    s, cache = F.softmax_forward(asarray(z))
    G = random_upstream(z.shape, rng)
    dz = F.softmax_backward(asarray(G), cache)
    check_gradients(lambda z: F.softmax_forward(z)[0], {"z": z}, {"z": dz}, G)


def test_softmax_closed_form_against_jacobian(rng):
    """dz = J^T G with J = diag(s) - s s^T built row by row (an independent formula)."""
    z = rng.standard_normal((3, 5))
    s, cache = F.softmax_forward(asarray(z))
    G = random_upstream(z.shape, rng)
    dz = F.softmax_backward(asarray(G), cache)
    sn = _softmax_ref(z)
    expected = np.stack([(np.diag(r) - np.outer(r, r)).T @ g for r, g in zip(sn, G)])
    assert_close("dz", dz, expected)


def test_softmax_additive_mask(rng):
    """A finite mask shifts the logits; -inf entries get exactly 0 probability and 0 gradient."""
    shape = (2, 3, 5)
    z = rng.standard_normal(shape)
    mask = rng.standard_normal(shape[1:])  # finite, broadcast over the batch
    mask[rng.random(mask.shape) < 0.4] = -np.inf
    mask[:, 0] = 0.0  # every row keeps at least one entry
    s, cache = F.softmax_forward(asarray(z), asarray(mask))
    expected = _softmax_ref(np.where(np.isinf(mask), -np.inf, z + mask))
    assert_close("s", s, expected)
    masked = np.broadcast_to(np.isinf(mask), shape)
    assert np.all(to_numpy(s)[masked] == 0.0)
    G = random_upstream(shape, rng)
    dz = F.softmax_backward(asarray(G), cache)
    assert np.all(to_numpy(dz)[masked] == 0.0)
    check_gradients(lambda z: F.softmax_forward(z, asarray(mask))[0], {"z": z}, {"z": dz}, G)


def test_softmax_causal_mask(rng):
    """Scores [B, H, S, S] with one [S, S] causal table broadcast over batch and heads."""
    batch, heads, seq = 2, 2, 4
    z = rng.standard_normal((batch, heads, seq, seq))
    mask = F.causal_mask(seq)
    s, cache = F.softmax_forward(asarray(z), mask)
    sn = to_numpy(s)
    above = np.triu_indices(seq, k=1)
    assert np.all(sn[..., above[0], above[1]] == 0.0)  # no query sees a later key
    assert np.all(sn[..., 0, 0] == 1.0)  # the first query sees only itself
    for q in range(seq):
        assert_close(f"s[..., {q}, :]", sn[..., q, : q + 1], _softmax_ref(z[..., q, : q + 1]))
    G = random_upstream(z.shape, rng)
    dz = F.softmax_backward(asarray(G), cache)
    check_gradients(lambda z: F.softmax_forward(z, F.causal_mask(seq))[0], {"z": z}, {"z": dz}, G)


def test_softmax_rows_masked_but_one(rng):
    """A row with one kept entry is exactly one-hot, and its gradient is finite (exactly 0)."""
    z = rng.standard_normal((2, 3, 4))
    mask = np.zeros((3, 4))
    mask[1, [0, 1, 3]] = -np.inf  # row 1 keeps only column 2
    s, cache = F.softmax_forward(asarray(z), asarray(mask))
    sn = to_numpy(s)
    assert np.array_equal(sn[:, 1, :], np.tile([0.0, 0.0, 1.0, 0.0], (2, 1)))
    G = random_upstream(z.shape, rng)
    dz = F.softmax_backward(asarray(G), cache)
    assert _finite(dz)
    assert np.all(to_numpy(dz)[:, 1, :] == 0.0)
    check_gradients(lambda z: F.softmax_forward(z, asarray(mask))[0], {"z": z}, {"z": dz}, G)


def test_softmax_huge_logits_do_not_overflow(rng):
    """Logits of +-1e4: exp would overflow unshifted; the result is finite, sums to 1, and differentiates."""
    shape = (3, 6)
    z = 1e4 * rng.choice([-1.0, 1.0], size=shape) + rng.standard_normal(shape)
    z[:, :2] = 1e4 + rng.standard_normal((3, 2))  # at least two competing entries per row
    with np.errstate(over="raise", invalid="raise"):
        s, cache = F.softmax_forward(asarray(z))
    sn = to_numpy(s)
    assert _finite(sn)
    assert_close("row sums", sn.sum(axis=-1), np.ones(3))
    assert np.all(sn[z < 0] == 0.0)
    G = random_upstream(shape, rng)
    dz = F.softmax_backward(asarray(G), cache)
    assert _finite(dz)
    # eps 1e-5: a step of 1e-6 on a value of 1e4 is rounded by ~1e-12, a 1e-6 relative error.
    check_gradients(lambda z: F.softmax_forward(z)[0], {"z": z}, {"z": dz}, G, eps=1e-5)


def test_softmax_single_class(rng):
    """K = 1: the softmax is exactly 1 and its gradient exactly 0."""
    z = rng.standard_normal((2, 3, 1))
    s, cache = F.softmax_forward(asarray(z))
    assert np.all(to_numpy(s) == 1.0)
    dz = F.softmax_backward(asarray(random_upstream(z.shape, rng)), cache)
    assert np.all(to_numpy(dz) == 0.0)


# --------------------------------------------------------------------------------------
# Log-softmax


def test_log_softmax_forward_and_gradient(rng):
    z = rng.standard_normal(_shape(rng))
    y, cache = F.log_softmax_forward(asarray(z))
    assert_close("y", y, np.log(_softmax_ref(z)))
    G = random_upstream(z.shape, rng)
    dz = F.log_softmax_backward(asarray(G), cache)
    check_gradients(lambda z: F.log_softmax_forward(z)[0], {"z": z}, {"z": dz}, G)


def test_log_softmax_huge_logits(rng):
    z = np.array([[1e4, -1e4, 1e4 - 1.0], [-1e4, -1e4 + 2.0, -1e4]])
    y, cache = F.log_softmax_forward(asarray(z))
    yn = to_numpy(y)
    assert _finite(yn)
    assert_close("sum exp y", np.exp(yn).sum(axis=-1), np.ones(2))
    assert_close("y[0, 1]", yn[0, 1], -2e4 - np.log1p(np.exp(-1.0)), tol=1e-15)
    G = random_upstream(z.shape, rng)
    dz = F.log_softmax_backward(asarray(G), cache)
    check_gradients(lambda z: F.log_softmax_forward(z)[0], {"z": z}, {"z": dz}, G, eps=1e-5)


# --------------------------------------------------------------------------------------
# Cross-entropy


def _labels_with_ignored(rng, lead, vocab, ignore_index=-100):
    labels = rng.integers(0, vocab, size=lead)
    flat = labels.reshape(-1)
    flat[rng.random(flat.size) < 0.3] = ignore_index
    flat[0] = int(rng.integers(0, vocab))  # at least one label is kept
    return labels


def _ce_reference(logits, labels, ignore_index=-100):
    """-mean over the kept rows of log softmax(logits)[label], one row at a time."""
    z = logits.reshape(-1, logits.shape[-1])
    total, count = 0.0, 0
    for row, label in zip(z, labels.reshape(-1)):
        if label == ignore_index:
            continue
        total -= np.log(_softmax_ref(row)[label])
        count += 1
    return total / count


@pytest.mark.parametrize("lead_ndim", [1, 2], ids=["logits2d", "logits3d"])
def test_cross_entropy_value_and_fused_gradient(rng, lead_ndim):
    lead = tuple(int(n) for n in rng.integers(2, 4, size=lead_ndim))
    vocab = int(rng.integers(2, 6))
    logits = rng.standard_normal(lead + (vocab,))
    labels = _labels_with_ignored(rng, lead, vocab)
    loss, cache = F.cross_entropy_forward(asarray(logits), asarray(labels, "int64"))
    assert tuple(loss.shape) == ()
    assert_close("loss", loss, _ce_reference(logits, labels))

    # The fused gradient is (softmax - onehot) / N_valid on kept rows, 0 on ignored rows (not z - onehot).
    dlogits = F.cross_entropy_backward(1.0, cache)
    kept = labels != -100
    onehot = (labels[..., None] == np.arange(vocab)).astype(np.float64)
    expected = np.where(kept[..., None], _softmax_ref(logits) - onehot, 0.0) / kept.sum()
    assert_close("dlogits", dlogits, expected)
    assert np.all(to_numpy(dlogits)[~kept] == 0.0)


def test_cross_entropy_gradient_check(rng):
    lead = (2, 3)
    vocab = 5
    logits = rng.standard_normal(lead + (vocab,))
    labels = asarray(_labels_with_ignored(rng, lead, vocab), "int64")
    _, cache = F.cross_entropy_forward(asarray(logits), labels)
    G = random_upstream((), rng)
    dlogits = F.cross_entropy_backward(G, cache)
    check_gradients(lambda logits: F.cross_entropy_forward(logits, labels)[0], {"logits": logits}, {"logits": dlogits}, G)


def test_cross_entropy_custom_ignore_index(rng):
    logits = rng.standard_normal((4, 3))
    labels = np.array([2, 0, 2, 1])
    loss, cache = F.cross_entropy_forward(asarray(logits), asarray(labels, "int64"), ignore_index=2)
    assert_close("loss", loss, _ce_reference(logits, labels, ignore_index=2))
    dlogits = to_numpy(F.cross_entropy_backward(1.0, cache))
    assert np.all(dlogits[[0, 2]] == 0.0)


def test_cross_entropy_every_label_ignored(rng):
    """Nothing to average: the loss is 0 and so is the gradient, with no nan from 0/0."""
    logits = rng.standard_normal((2, 3, 4))
    labels = np.full((2, 3), -100)
    with np.errstate(all="raise"):
        loss, cache = F.cross_entropy_forward(asarray(logits), asarray(labels, "int64"))
        dlogits = F.cross_entropy_backward(random_upstream((), rng), cache)
    assert float(loss) == 0.0
    assert tuple(dlogits.shape) == logits.shape
    assert _finite(dlogits)
    assert np.all(to_numpy(dlogits) == 0.0)


def test_cross_entropy_single_row_and_single_class(rng):
    """S=1 (one row) and V=1 (one class: probability 1, loss 0, gradient 0)."""
    logits = rng.standard_normal((1, 1, 4))
    labels = np.array([[3]])
    loss, cache = F.cross_entropy_forward(asarray(logits), asarray(labels, "int64"))
    assert_close("loss", loss, _ce_reference(logits, labels))
    G = random_upstream((), rng)
    check_gradients(lambda logits: F.cross_entropy_forward(logits, asarray(labels, "int64"))[0],
                    {"logits": logits}, {"logits": F.cross_entropy_backward(G, cache)}, G)

    loss1, cache1 = F.cross_entropy_forward(asarray(rng.standard_normal((3, 1))), asarray(np.zeros(3), "int64"))
    assert float(loss1) == 0.0
    assert np.all(to_numpy(F.cross_entropy_backward(1.0, cache1)) == 0.0)


def test_cross_entropy_huge_logits(rng):
    logits = np.array([[1e4, -1e4, 0.0], [-1e4, 1e4, 1e4]])
    labels = np.array([1, 2])
    loss, cache = F.cross_entropy_forward(asarray(logits), asarray(labels, "int64"))
    # row 0: -log softmax = 2e4 (the label is 2e4 below the max); row 1: log 2.
    assert_close("loss", loss, (2e4 + np.log(2.0)) / 2, tol=1e-15)
    assert _finite(F.cross_entropy_backward(1.0, cache))


# --------------------------------------------------------------------------------------
# Mean squared error


def test_mse_value_and_gradients(rng):
    shape = _shape(rng)
    pred = rng.standard_normal(shape)
    target = rng.standard_normal(shape)
    loss, cache = F.mse_forward(asarray(pred), asarray(target))
    assert tuple(loss.shape) == ()
    assert_close("loss", loss, np.mean((pred - target) ** 2))
    G = random_upstream((), rng)
    dpred = F.mse_backward(G, cache)
    assert_close("dpred", dpred, 2.0 * G * (pred - target) / pred.size)
    # target is differentiable too: dtarget = -dpred.
    check_gradients(lambda pred, target: F.mse_forward(pred, target)[0],
                    {"pred": pred, "target": target}, {"pred": dpred, "target": -to_numpy(dpred)}, G)


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8"])
def test_cross_entropy_accepts_every_integer_dtype(rng, dtype):
    """Labels of any integer dtype, with the default ignore_index = -100 (which an unsigned dtype
    cannot even hold, so no label of it is ignored): the same loss and gradient as int64 labels."""
    logits = rng.standard_normal((2, 3, 5))
    labels = rng.integers(0, 5, size=(2, 3))
    loss, cache = F.cross_entropy_forward(asarray(logits), asarray(labels, dtype))
    assert_close("loss", loss, _ce_reference(logits, labels))
    dlogits = F.cross_entropy_backward(1.0, cache)
    onehot = (labels[..., None] == np.arange(5)).astype(np.float64)
    assert_close("dlogits", dlogits, (_softmax_ref(logits) - onehot) / labels.size)
