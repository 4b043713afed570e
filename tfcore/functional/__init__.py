"""Stateless forward/backward pairs, one pair per op, written against the array API standard.

The contract every pair follows:

* ``<op>_forward(...)`` returns ``(out, cache)``; the cache holds only what the backward
  pass needs, and nothing is kept anywhere else. A cache of several parts is a named tuple
  (``_caches``: ``cache.lse``, ``cache.has_bias``), still a tuple: a backward also takes a
  plain tuple of the same fields.
* ``<op>_backward(dout, cache)`` returns the gradient of the scalar loss with respect to
  each differentiable input, in the order of the forward's arguments. Parameter gradients
  are *returned*, never stored: a module that owns parameters adds them into its own
  gradient buffers with ``+=``, so tied and shared weights just work.

Bad input is refused, never guessed at: every forward checks its arrays (an array of the
array API, float32/float64 where floats are expected, one dtype and one library for all of
them, shapes, integer ids in range, no masked arrays) and its settings, and every backward
checks its upstream gradient against what the forward produced (shape, dtype and library),
raising TypeError or ValueError with a message that names the argument. An empty batch (a
zero-size leading axis) gives an empty, correct result; a zero width (D, K or V of 0) is an
error; float16 is refused (use float32 or float64).

Memory shared between inputs, outputs, caches and gradients (no op copies to protect you):

* Caches hold references, not copies: linear keeps x and W, GELU keeps x, embedding keeps
  a view of the ids, softmax and log-softmax return their output itself as the cache, and
  layernorm/rmsnorm keep their gain. So between a forward and its backward, do not edit in
  place the forward's inputs, its output, or anything in its cache: the gradient would
  silently change. Copy first (``xp.asarray(y, copy=True)``) if you must edit.
* Some outputs *are* inputs: dropout at eval (training=False or p == 0) returns x itself.
* Some gradients *are* the upstream gradient: ``residual_backward`` returns dy twice,
  ``positional_backward`` returns dy as dx, and ``dropout_backward`` at eval returns dy.
  Add them into other gradients out of place; never update one of them in place.
* Every other output and gradient is a new array, and no op writes into its arguments:
  forwards never modify their inputs, backwards never modify dout or the cache.

Shape letters: B batch, S sequence, D width, D_in/D_out a linear layer's widths, V the
vocabulary (or number of classes), "..." any leading shape, N the number of rows once
the leading axes are flattened (the mixture of experts, also reached as the module
``functional.moe``, adds T tokens, N_E experts, K experts per token and C slots per expert).
The book proves every backward formula here, one chapter per family of ops; the chapter is
named beside each pair.
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
from .tiled_attention import (  # noqa: F401
    tiled_attention_forward,
    tiled_attention_backward,
)
from .rope import (  # noqa: F401
    rope_tables,
    rope_forward,
    rope_backward,
)
from .moe import (  # noqa: F401
    ROUTERS,
    EXPERT_ACTIVATIONS,
    router_forward,
    router_backward,
    capacity,
    moe_plan,
    moe_dispatch_forward,
    moe_dispatch_backward,
    moe_combine_forward,
    moe_combine_backward,
    expert_mlp_forward,
    expert_mlp_backward,
    expert_load,
    load_balancing_loss_forward,
    load_balancing_loss_backward,
    sequence_balancing_loss_forward,
    sequence_balancing_loss_backward,
    router_z_loss_forward,
    router_z_loss_backward,
    expert_bias_update,
)
# the mixture of experts is also reached as one module: tfcore.functional.moe
from . import moe  # noqa: F401,E402
