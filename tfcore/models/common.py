"""Pieces the small models of seed 001 share."""
from __future__ import annotations

from .. import checks
from ..backend import namespace


def standardize(x, eps: float):
    """(x - mean) / sqrt(var + eps), mean and (biased) variance over all entries of each example.

    x [B, n, m] -> [B, n, m]. Seed 001's input standardization, eq. (1), with eps added so that
    a constant example stays finite. It is preprocessing: no parameter, and the models do not
    differentiate through it (the inputs are data).
    """
    checks.float_inputs(x=x)
    checks.ndim("x", x, 3)
    xp = namespace(x)
    mean = xp.mean(x, axis=(1, 2), keepdims=True)                          # [B, 1, 1]
    centered = x - mean
    var = xp.mean(centered * centered, axis=(1, 2), keepdims=True)         # [B, 1, 1]
    centered /= xp.sqrt(var + eps)
    return centered


def check_float_settings(config, positive=(), probabilities=()):
    """The float fields of a model config, checked when the config is made (and again by its
    validate()): each named field a real number (TypeError otherwise, naming it), finite and
    > 0 for `positive` (eps, init_std, rope_base: an inf eps normalises every row to 0, an inf
    init_std draws inf weights), in [0, 1) for `probabilities` (dropout); ValueError naming
    the field otherwise."""
    for name in positive:
        checks.positive(name, getattr(config, name))
    for name in probabilities:
        checks.probability(name, getattr(config, name))


def check_labels(labels, batch: int, n_classes: int):
    """labels [B] integers in [0, n_classes) (or -100 to skip an example)."""
    checks.array("labels", labels)
    checks.shape("labels", labels, (batch,))
    checks.integer_ids("labels", labels, n_classes, allowed=-100)
