"""Models built from the op pairs: configs, parameters in one flat buffer, hand-written backward.

    decoder             DecoderConfig, DecoderLM (GPT-2 / Llama style language model), KVCache
    encoder_classifier  EncoderClassifierConfig, EncoderClassifier (seed 001's encoder)
    mlp                 MLPConfig, MLPClassifier (seed 001's 2-layer ReLU network)
    autoencoder         AutoencoderConfig, Autoencoder (seed 002's post-norm encoder)
    blocks              the Transformer block (pre- or post-norm) the decoder and autoencoder share
    sizes               parameter, gradient, optimizer and activation bytes as formulas
"""
from .autoencoder import Autoencoder, AutoencoderConfig  # noqa: F401
from .blocks import BlockSpec, block_backward, block_forward  # noqa: F401
from .decoder import DecoderConfig, DecoderLM, KVCache, sample_next, swiglu_width  # noqa: F401
from .encoder_classifier import EncoderClassifier, EncoderClassifierConfig  # noqa: F401
from .mlp import MLPClassifier, MLPConfig  # noqa: F401
from .sizes import (  # noqa: F401
    autoencoder_sizes,
    decoder_sizes,
    encoder_classifier_sizes,
    held_bytes,
    mlp_sizes,
)

__all__ = [
    "Autoencoder", "AutoencoderConfig", "BlockSpec", "block_backward", "block_forward",
    "DecoderConfig", "DecoderLM", "KVCache", "sample_next", "swiglu_width",
    "EncoderClassifier", "EncoderClassifierConfig", "MLPClassifier", "MLPConfig",
    "autoencoder_sizes", "decoder_sizes", "encoder_classifier_sizes", "held_bytes", "mlp_sizes",
]
