"""Bad model and data inputs: each is refused before any work with an error that names the
argument and says what was expected, or it works (the tokenizer's lone surrogates).

Model configs (float fields checked when the config is made), the decoder's and the
autoencoder's inputs, a non-finite parameter named as the cause of a non-finite activation,
generation's sampling settings, the tokenizer, the samplers, and the training command line's
autoencoder width. (The loss scaler's floor and mixed_precision_step's grad_clip are in
test_mixed_precision.py, a malformed tokenizer in a checkpoint in test_checkpoint_faults.py.)
"""
from __future__ import annotations

import numpy as np
import pytest

from tfcore import backend, data
from tfcore import train as train_mod


# ---------------------------------------------------------------------------------------
# The tokenizer and the samplers


def test_text_read_with_surrogateescape_round_trips():
    """Bytes that are not UTF-8 become lone surrogates U+DC80..U+DCFF: each is a token, and
    decoding gives them back, so writing with the same handler restores the bytes."""
    raw = "café au lait, ".encode("latin-1") * 3 + b"\xff\xfe end\n"
    text = raw.decode("utf-8", errors="surrogateescape")
    assert "\udce9" in text and "\udcff" in text
    tok = data.CharTokenizer.from_text(text)
    back = tok.decode(tok.encode(text))
    assert back == text
    assert back.encode("utf-8", errors="surrogateescape") == raw


@pytest.mark.parametrize("call, error, message", [
    (lambda t: t.decode([1.7]), TypeError, r"ids must be integers, got float64 \(e.g. 1.7\)"),
    (lambda t: t.decode(np.array([True])), TypeError, "ids must be integers, got bool"),
    (lambda t: t.decode([3]), ValueError, r"ids must lie in \[0, 3\), found 3"),
    (lambda t: t.decode([-1]), ValueError, r"ids must lie in \[0, 3\), found -1"),
    (lambda t: t.encode(None), TypeError, "text must be a string, got NoneType"),
    (lambda t: t.encode(["a"]), TypeError, "text must be a string, got list"),
    (lambda t: data.CharTokenizer(["a", "b"]), TypeError, "chars must be a string, got list"),
    (lambda t: data.CharTokenizer("aba"), ValueError, r"distinct characters \('a' repeated\)"),
    (lambda t: data.CharTokenizer.from_text(None), TypeError, "text must be a string"),
])
def test_tokenizer_inputs_are_named(call, error, message):
    tok = data.CharTokenizer("abc")
    with pytest.raises(error, match=message):
        call(tok)
    assert tok.decode([]) == "" and tok.decode(np.array([2, 0])) == "ca"


@pytest.mark.parametrize("make, error, message", [
    (lambda: data.TextBatches(np.arange(100), -1, 8), ValueError,
     "batch_size must be at least 1, got -1"),
    (lambda: data.TextBatches(np.arange(100), 0, 8), ValueError,
     "batch_size must be at least 1, got 0"),
    (lambda: data.TextBatches(np.arange(100), 2, 0), ValueError,
     "seq_len must be at least 1, got 0"),
    (lambda: data.TextBatches(np.arange(100), 2.0, 8), TypeError,
     "batch_size must be an integer, got float"),
    (lambda: data.DigitTask(batch_size=0), ValueError, "batch_size must be at least 1, got 0"),
    (lambda: data.DigitTask(n_digits=2.5), TypeError, "n_digits must be an integer"),
    (lambda: data.DigitTask().heldout(0), ValueError, "count must be at least 1, got 0"),
    (lambda: data.GaussianSequences(2, 3, 1), ValueError,
     r"width must be at least 2 with standardize=True .* got 1"),
    (lambda: data.GaussianSequences(0, 3, 4), ValueError, "count must be at least 1, got 0"),
    (lambda: data.GaussianSequences(2, 3, 4, standardize="yes"), TypeError,
     "standardize must be True or False"),
])
def test_sampler_settings_are_named(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_gaussian_sequences_of_width_one_without_standardizing_are_finite():
    x, _ = data.GaussianSequences(2, 3, 1, standardize=False).next()
    assert np.isfinite(backend.to_numpy(x)).all()
    x, _ = data.GaussianSequences(2, 3, 2).next()           # width 2: rows of -1, +1
    assert np.allclose(np.abs(backend.to_numpy(x)), 1.0)


# ---------------------------------------------------------------------------------------
# The training command line: the autoencoder's width


def test_train_refuses_an_autoencoder_width_of_one_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    status = train_mod.main(["--task", "autoencoder", "--d-model", "1", "--steps", "1",
                             "--warmup-steps", "0", "--out-dir", str(out), "--no-progress"])
    _, err = capsys.readouterr()
    assert status == 2 and err.count("\n") == 1
    assert err.startswith("error: argument --d-model must be at least 2 for task "
                          "'autoencoder' with standardize")
    assert not out.exists()
    config = train_mod.TrainConfig(task="autoencoder", d_model=1, n_heads=1, standardize=False)
    assert config.validate() is config           # unstandardized rows of one are fine
