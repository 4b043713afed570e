"""Stateless forward/backward pairs, one pair per op, written against the array API standard.

The contract every pair follows:

* ``<op>_forward(...)`` returns ``(out, cache)``; the cache holds only what the backward
  pass needs, and nothing is kept anywhere else.
* ``<op>_backward(dout, cache)`` returns the gradient of the scalar loss with respect to
  each differentiable input, in the order of the forward's arguments. Parameter gradients
  are *returned*, never stored: a module that owns parameters adds them into its own
  gradient buffers with ``+=``, so tied and shared weights just work.

Shape letters: B batch, S sequence, D width, D_in/D_out a linear layer's widths, V the
vocabulary (or number of classes), "..." any leading shape, N the number of rows once
the leading axes are flattened. The book proves every backward formula here, one
chapter per family of ops; the chapter is named beside each pair.
"""
from __future__ import annotations

from .linear import (  # noqa: F401
    linear_forward,
    linear_backward,
)
from .embedding import (  # noqa: F401
    embedding_forward,
    embedding_backward,
    sinusoidal_positions,
    positional_forward,
    positional_backward,
)
from .softmax import (  # noqa: F401
    causal_mask,
    softmax_forward,
    softmax_backward,
    log_softmax_forward,
    log_softmax_backward,
    cross_entropy_forward,
    cross_entropy_backward,
    mse_forward,
    mse_backward,
)
from .activations import (  # noqa: F401
    relu_forward,
    relu_backward,
    gelu_forward,
    gelu_backward,
    GELU_APPROXIMATIONS,
    silu_forward,
    silu_backward,
    swiglu_forward,
    swiglu_backward,
)
from .normalization import (  # noqa: F401
    layernorm_forward,
    layernorm_backward,
    rmsnorm_forward,
    rmsnorm_backward,
)
from .regularization import (  # noqa: F401
    dropout_forward,
    dropout_backward,
    residual_forward,
    residual_backward,
)
from .attention import (  # noqa: F401
    attention_forward,
    attention_backward,
    split_heads,
    merge_heads,
    qkv_split,
    qkv_merge_grads,
)
from .rope import (  # noqa: F401
    rope_tables,
    rope_forward,
    rope_backward,
)
