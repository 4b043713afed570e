"""The tensor-, sequence- and data-parallel decoder equals one device in float64: the loss of
every step, every gradient and the parameters after several AdamW steps, for GPT-style and
Llama-style configurations; the bytes of every step equal their closed form; impossible
layouts fail before any work is done."""
from __future__ import annotations

import numpy as np
import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import SimulatedGroup
from tfcore.parallel.harness import CONFIGS, train_parallel, train_single
from tfcore.parallel.volume import local_parameters, step_bytes

STEPS, BATCH, SEQ = 3, 4, 8
TOL = 1e-12

CASES = {
    "gpt": CONFIGS["tiny"](),
    "llama": CONFIGS["tiny-llama"](),
    # post-norm, sinusoidal positions, untied head with a bias, ReLU, dropout in training
    "post-dropout": DecoderConfig(vocab_size=23, max_seq_len=16, d_model=16, n_layers=2,
                                  n_heads=4, d_ff=32, norm_placement="post",
                                  position="sinusoidal", mlp="relu", tied_head=False,
                                  dropout=0.1),
}
LAYOUTS = [  # (tp, dp, sequence_parallel, zero)
    (1, 1, False, False), (2, 1, False, False), (4, 1, False, False), (2, 1, True, False),
    (4, 1, True, False), (1, 2, False, False), (1, 2, False, True), (2, 2, False, False),
    (2, 2, True, True),
]
_reference = {}


def _single(name):
    if name not in _reference:
        _reference[name] = train_single(CASES[name], STEPS, BATCH, SEQ)
    return _reference[name]


def _rel(a, b):
    """Largest difference relative to the largest entry (entrywise relative error is
    meaningless for entries that are zero on one device, such as unused vocabulary rows)."""
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tp,dp,sp,zero", LAYOUTS)
def test_parallel_training_equals_one_device(name, tp, dp, sp, zero):
    ref = _single(name)
    out = SimulatedGroup(tp * dp).run(train_parallel, CASES[name], STEPS, BATCH, SEQ, tp=tp,
                                      dp=dp, sequence_parallel=sp, zero=zero)
    for rank in out:
        assert _rel(rank["losses"], ref["losses"]) < TOL
        assert _rel(rank["params"], ref["params"]) < TOL
        if not zero:
            assert _rel(rank["grads"], ref["grads"]) < TOL
    assert all(np.array_equal(o["params"], out[0]["params"]) for o in out)
    assert out[0]["local_params"] == local_parameters(CASES[name], tp, 0)


@pytest.mark.parametrize("algorithm", ["ring", "naive"])
@pytest.mark.parametrize("tp,dp,sp,zero", [(2, 1, False, False), (4, 1, True, False),
                                           (1, 2, False, True), (2, 2, True, True),
                                           (2, 2, False, False)])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_bytes_per_step_equal_the_closed_form(name, algorithm, tp, dp, sp, zero):
    group = SimulatedGroup(tp * dp, algorithm)
    out = group.run(train_parallel, CASES[name], 2, BATCH, SEQ, tp=tp, dp=dp,
                    sequence_parallel=sp, zero=zero, gather=False)
    formula = step_bytes(CASES[name], BATCH // dp, SEQ, tp, dp, sp, zero, algorithm)
    for step in range(2):
        measured = [sum(c.sent for c in o["step_calls"][step]) for o in out]
        received = [sum(c.received for c in o["step_calls"][step]) for o in out]
        assert measured == formula["sent"]
        assert sum(received) == sum(measured) == formula["total"]


def test_sequence_parallel_moves_what_tensor_parallel_moves_plus_the_norm_gradients():
    cfg = CASES["gpt"]
    tp_only = step_bytes(cfg, BATCH, SEQ, 4, 1, False, False)["total"]
    with_sp = step_bytes(cfg, BATCH, SEQ, 4, 1, True, False)["total"]
    from tfcore.parallel.volume import replicated_elements

    assert with_sp - tp_only == 2 * 3 * replicated_elements(cfg) * 8


def test_unequal_token_counts_weight_every_token_alike():
    """Rank 0 counts far fewer tokens than rank 1: the loss is the mean over all tokens of
    the global batch (and equals one device's), not the mean of the two ranks' means."""
    cfg = CASES["gpt"]
    from tfcore.parallel import harness

    original = harness.make_batches

    def lopsided(config, steps, batch, seq, seed=0, ignore_fraction=0.25):
        ids, targets = original(config, steps, batch, seq, seed, 0.0)
        targets[:, : batch // 2, 1:] = -100                     # rank 0: one token per row
        return ids, targets

    harness.make_batches = lopsided
    try:
        ref = harness.train_single(cfg, 2, BATCH, SEQ)
        out = SimulatedGroup(2).run(harness.train_parallel, cfg, 2, BATCH, SEQ, tp=1, dp=2)
    finally:
        harness.make_batches = original
    assert _rel(out[0]["losses"], ref["losses"]) < TOL
    assert _rel(out[0]["grads"], ref["grads"]) < TOL


@pytest.mark.parametrize("changes,layout,match", [
    (dict(n_heads=4), dict(tp=3), "n_heads \\(4\\) must be divisible by the tensor-parallel"),
    (dict(d_ff=30), dict(tp=4), "d_ff \\(30\\) must be divisible"),
    (dict(vocab_size=3, n_heads=4), dict(tp=4), "vocab_size \\(3\\) must be at least"),
    (dict(n_heads=6, n_kv_heads=2, d_ff=48), dict(tp=3),
     "n_kv_heads \\(2\\) and the tensor-parallel degree \\(3\\) must divide one another"),
    (dict(n_kv_heads=1, d_ff=48), dict(tp=2, clip=1.0),
     "clipping with key/value heads shared across ranks"),
])
def test_impossible_models_fail_before_any_work(changes, layout, match):
    base = dict(vocab_size=31, max_seq_len=16, d_model=24, n_layers=1, n_heads=4, d_ff=32)
    cfg = DecoderConfig(**{**base, **changes})
    with pytest.raises(ValueError, match=match):
        SimulatedGroup(layout["tp"]).run(train_parallel, cfg, 1, 2, 8, **layout)


def test_impossible_layouts_fail_before_any_work():
    cfg = CASES["gpt"]
    with pytest.raises(ValueError, match="world size 4 is not a multiple of tp=3"):
        SimulatedGroup(4).run(train_parallel, cfg, 1, 4, 8, tp=3)
    with pytest.raises(ValueError, match="needs 6 ranks, but the world has 4"):
        SimulatedGroup(4).run(train_parallel, cfg, 1, 4, 8, tp=2, dp=3)
    with pytest.raises(ValueError, match="sequence length \\(6\\) must be divisible"):
        SimulatedGroup(4).run(train_parallel, cfg, 1, 4, 6, tp=4, sequence_parallel=True)
    with pytest.raises(ValueError, match="global batch \\(3\\) must be divisible by dp=2"):
        SimulatedGroup(2).run(train_parallel, cfg, 1, 3, 8, dp=2)
    other = DecoderConfig(vocab_size=31, max_seq_len=16, d_model=16, n_layers=2, n_heads=4,
                          d_ff=32, eps=1e-6)
    with pytest.raises(ValueError, match="configuration .* differs across ranks"):
        SimulatedGroup(2).run(lambda c: train_parallel(c, cfg if c.rank else other, 1, 2, 8,
                                                       tp=2))


def test_tensor_and_sequence_parallel_on_every_backend(backend_name):
    """The rank-local code is array-API code: it runs on NumPy, array-api-strict (and CuPy)."""
    cfg = CASES["llama"]
    ref = train_single(cfg, 1, 2, SEQ)
    out = SimulatedGroup(2).run(train_parallel, cfg, 1, 2, SEQ, tp=2, sequence_parallel=True)
    assert _rel(out[0]["losses"], ref["losses"]) < TOL
    assert _rel(out[0]["params"], ref["params"]) < TOL
