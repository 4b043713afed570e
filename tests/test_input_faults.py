"""Bad model and data inputs: each is refused before any work with an error that names the
argument and says what was expected, or it works (the tokenizer's lone surrogates).

Model configs (float fields checked when the config is made), the decoder's and the
autoencoder's inputs, a non-finite parameter named as the cause of a non-finite activation,
generation's sampling settings, the tokenizer, the samplers, and the training command line's
autoencoder width. (The loss scaler's floor and mixed_precision_step's grad_clip are in
test_mixed_precision.py, a malformed tokenizer in a checkpoint in test_checkpoint_faults.py.)
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tfcore import backend, data, nn
from tfcore import train as train_mod
from tfcore.backend import asarray
from tfcore.models import (Autoencoder, AutoencoderConfig, DecoderConfig, DecoderLM,
                           EncoderClassifierConfig, MLPConfig)

SMALL = dict(vocab_size=11, max_seq_len=8, d_model=8, n_layers=2, n_heads=2)
INF, NAN = math.inf, math.nan


def ids(batch=2, seq=5, seed=0):
    return asarray(np.random.default_rng(seed).integers(0, SMALL["vocab_size"], (batch, seq)),
                   "int64")


# ---------------------------------------------------------------------------------------
# Model configs: every float field finite and in range, named, when the config is made


@pytest.mark.parametrize("field, value, error, message", [
    ("eps", INF, ValueError, "eps must be finite, got inf"),
    ("eps", NAN, ValueError, "eps must be positive, got nan"),
    ("eps", "1e-5", TypeError, "eps must be a real number, got str '1e-5'"),
    ("rope_base", INF, ValueError, "rope_base must be finite, got inf"),
    ("rope_base", -2.0, ValueError, "rope_base must be positive, got -2.0"),
    ("init_std", INF, ValueError, "init_std must be finite, got inf"),
    ("init_std", NAN, ValueError, "init_std must be positive, got nan"),
    ("init_std", None, TypeError, "init_std must be a real number, got NoneType"),
    ("dropout", NAN, ValueError, r"dropout must lie in \[0, 1\), got nan"),
    ("dropout", "0.1", TypeError, "dropout must be a real number, got str '0.1'"),
])
def test_decoder_config_float_fields_are_checked_when_made(field, value, error, message):
    with pytest.raises(error, match=message):
        DecoderConfig(**SMALL, **{field: value})
    config = DecoderConfig(**SMALL)
    setattr(config, field, value)               # set afterwards: validate() sees it too
    with pytest.raises(error, match=message):
        DecoderLM(config)


def test_an_infinite_eps_no_longer_gives_zero_logits():
    """eps = inf normalised every row to 0, and the logits were all 0 without a word."""
    with pytest.raises(ValueError, match="eps must be finite, got inf"):
        DecoderConfig(**SMALL, eps=INF)
    model = DecoderLM(DecoderConfig(**SMALL, eps=1e30)).init(seed=0)   # huge but finite
    logits, _ = model.forward(ids())
    assert np.isfinite(backend.to_numpy(logits)).all()


@pytest.mark.parametrize("make", [
    lambda **kw: AutoencoderConfig(8, 2, 16, 1, 8, **kw),
    lambda **kw: MLPConfig(3, 4, 5, 2, **kw),
    lambda **kw: EncoderClassifierConfig(3, 4, 4, 2, **kw),
    lambda **kw: DecoderConfig.llama(11, 8, 8, 1, 2, **kw),
])
@pytest.mark.parametrize("field, value, message", [
    ("eps", INF, "eps must be finite, got inf"),
    ("eps", 0.0, "eps must be positive, got 0.0"),
    ("init_std", INF, "init_std must be finite, got inf"),
    ("init_std", NAN, "init_std must be positive, got nan"),
])
def test_every_model_config_checks_its_float_fields(make, field, value, message):
    with pytest.raises(ValueError, match=message):
        make(**{field: value})


def test_autoencoder_config_checks_dropout():
    with pytest.raises(ValueError, match=r"dropout must lie in \[0, 1\), got nan"):
        AutoencoderConfig(8, 2, 16, 1, 8, dropout=NAN)


def test_an_init_std_too_large_for_the_dtype_names_init_std():
    """Finite, but its draws overflow float32: named at init, not as load_flat's nan."""
    model = DecoderLM(DecoderConfig(**SMALL, init_std=1e300, dtype="float32"))
    with pytest.raises(ValueError, match=r"init_std\) = 1e\+300 draws values beyond float32"):
        model.init(seed=0)
    assert not np.any(backend.to_numpy(model.params.data))      # nothing was loaded


# ---------------------------------------------------------------------------------------
# The decoder's inputs


def test_forward_of_a_python_list_names_ids():
    model = DecoderLM(DecoderConfig(**SMALL)).init(seed=0)
    with pytest.raises(TypeError, match="ids must be an array, got list"):
        model.forward([[1, 2, 3]])
    with pytest.raises(TypeError, match="targets must be an array, got list"):
        model.forward(ids(1, 3), [[1, 2, 3]])
    model.forward(ids(1, 3))
    with pytest.raises(TypeError, match="dlogits must be an array, got list"):
        model.backward([[0.0]])


@pytest.mark.parametrize("name", ["wte", "h0.attn.qkv.W", "h1.mlp.fc.b", "h1.ln2.g"])
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_a_non_finite_parameter_is_named(name, placement):
    """It used to be reported as the LayerNorm's input ('x has inf or nan entries')."""
    model = DecoderLM(DecoderConfig(**SMALL, norm_placement=placement)).init(seed=0)
    start, _ = model.params.offsets[name]
    model.params.data[start] = np.nan
    if placement == "post" and name == "h1.ln2.g":      # after the last norm: nan logits
        logits, _ = model.forward(ids())
        assert not np.isfinite(backend.to_numpy(logits)).all()
        return
    with pytest.raises(ValueError, match=rf"^parameter {name} holds nan or inf, which makes "
                                         r"the input of (h\d\.ln\d|lnf) non-finite"):
        model.forward(ids())


def test_several_non_finite_parameters_are_listed_and_generation_names_them():
    model = DecoderLM(DecoderConfig(**SMALL, tied_head=False)).init(seed=0)
    model.params["h0.attn.proj.W"][0, 0] = np.inf
    model.params["h1.mlp.proj.b"][1] = np.nan
    with pytest.raises(ValueError, match="parameters h0.attn.proj.W, h1.mlp.proj.b hold nan"):
        model.forward(ids())
    model.init(seed=0)
    model.params["head.W"][0, 0] = np.nan           # after the final norm: only the logits
    for use_cache in (True, False):
        with pytest.raises(FloatingPointError, match="parameter head.W holds nan or inf, "
                                                     "which makes the logits non-finite"):
            model.generate(np.zeros((1, 2), dtype=np.int64), 2, use_cache=use_cache)


def test_a_parameter_source_without_a_flat_buffer_is_read_tensor_by_tensor():
    """What a gather-on-use shard hands the model: views by name, no flat buffer."""
    class Source:
        def __init__(self, values):
            self._values = values

    source = Source({"a.W": np.ones((2, 2)), "b.g": np.array([1.0, np.inf])})
    assert nn.nonfinite_parameters(source) == ["b.g"]
    with pytest.raises(ValueError, match="parameter b.g holds nan or inf, which makes the "
                                         "input of b non-finite"):
        nn.norm_forward(source, "b", np.array([[np.nan, 1.0]]), "rmsnorm", 1e-5)
    assert nn.nonfinite_parameters(Source({"a.W": np.ones((2, 2))})) == []


def test_a_non_finite_input_is_not_blamed_on_the_parameters():
    model = Autoencoder(AutoencoderConfig(8, 2, 16, 1, 8)).init(seed=0)
    x = np.random.default_rng(0).standard_normal((1, 3, 8))
    x[0, 1, 2] = np.nan
    with pytest.raises(ValueError, match="^x has inf or nan entries"):
        model.forward(asarray(x))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(temperature="1"), TypeError, "temperature must be a real number, got str '1'"),
    (dict(temperature=INF), ValueError, "temperature must be finite, got inf"),
    (dict(temperature=NAN), ValueError, "temperature must be >= 0"),
    (dict(top_p="0.5"), TypeError, "top_p must be a real number, got str '0.5'"),
    (dict(top_k=True), ValueError, "top_k must be a positive integer or None, got True"),
    (dict(max_new_tokens=True), ValueError, "max_new_tokens must be a non-negative integer"),
])
def test_generate_names_a_bad_sampling_setting(kwargs, error, message):
    model = DecoderLM(DecoderConfig(**SMALL)).init(seed=0)
    kwargs = dict(dict(max_new_tokens=2), **kwargs)
    with pytest.raises(error, match=message):
        model.generate(np.zeros((1, 2), dtype=np.int64), **kwargs)


@pytest.mark.parametrize("shape", [(1, 0, 8), (0, 3, 8)])
def test_the_autoencoder_refuses_an_empty_sequence_or_batch(shape):
    model = Autoencoder(AutoencoderConfig(8, 2, 16, 1, 8)).init(seed=0)
    with pytest.raises(ValueError, match="x must hold at least one sequence of at least one "
                                         r"position .* got shape " + re.escape(str(shape))):
        model.forward(asarray(np.zeros(shape)))
    with pytest.raises(TypeError, match="target must be an array, got list"):
        model.forward(asarray(np.zeros((1, 3, 8))), [1.0])


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
