"""Models built from the op pairs: configs, parameters in one flat buffer, hand-written backward.

    decoder             DecoderConfig, DecoderLM (GPT-2 / Llama style language model), KVCache
    encoder_classifier  EncoderClassifierConfig, EncoderClassifier (seed 001's encoder)
    mlp                 MLPConfig, MLPClassifier (seed 001's 2-layer ReLU network)
    autoencoder         AutoencoderConfig, Autoencoder (seed 002's post-norm encoder)
    sizes               parameter, gradient, optimizer and activation bytes as formulas
"""
from .decoder import DecoderConfig, DecoderLM, KVCache, sample_next, swiglu_width  # noqa: F401

__all__ = ["DecoderConfig", "DecoderLM", "KVCache", "sample_next", "swiglu_width"]
