"""One-off cross-check, outside the test suite: DecoderLM against the same model in PyTorch.

The model is written a second time with torch autograd (float64, CPU), loading tfcore's
weights by name; the loss and every parameter gradient are compared. PyTorch is not a
dependency of tfcore: install it (CPU build) into any environment that also has tfcore's
requirements, then

    python benchmarks/crosscheck_torch.py

It prints the largest relative difference of the loss and of the gradients, per variant,
and exits non-zero when one exceeds 1e-10. With torch 2.13.0+cpu: 2.6e-15 at most (4 variants,
B=4, S=32, D=48, 3 layers).
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

from tfcore import backend
from tfcore.backend import to_numpy
from tfcore.models import DecoderConfig, DecoderLM


def torch_forward(cfg: DecoderConfig, w: dict, ids, targets):
    """The decoder of tfcore.models.decoder written with torch ops, autograd does the rest."""
    B, S = ids.shape
    D, H = cfg.d_model, cfg.n_heads
    Dh = D // H

    def norm(x, name):
        if cfg.norm == "layernorm":
            return torch.nn.functional.layer_norm(x, (D,), w[name + ".g"], w[name + ".b"],
                                                  cfg.eps)
        return w[name + ".g"] * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.eps)

    def linear(x, name):
        y = x @ w[name + ".W"]
        return y + w[name + ".b"] if name + ".b" in w else y

    def rope(x):                                            # x [B, H, S, Dh], pairs (2i, 2i+1)
        inv = cfg.rope_base ** (-torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)
        angle = torch.arange(S, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = torch.cos(angle), torch.sin(angle)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)

    x = w["wte"][ids]
    if cfg.position == "learned":
        x = x + w["wpe"][:S]
    elif cfg.position == "sinusoidal":
        pos = torch.arange(S, dtype=torch.float64)[:, None]
        angle = pos / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64)[None, :] / D)
        x = x + torch.stack([torch.sin(angle), torch.cos(angle)], -1).flatten(-2)[:, :D]
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)

    def attn(h, i):
        q, k, v = linear(h, f"h{i}.attn.qkv").split(D, -1)
        q, k, v = (t.reshape(B, S, H, Dh).transpose(1, 2) for t in (q, k, v))
        if cfg.position == "rotary":
            q, k = rope(q), rope(k)
        z = (q @ k.transpose(-1, -2)) / math.sqrt(Dh)
        a = torch.softmax(z.masked_fill(causal, -math.inf), -1) @ v
        return linear(a.transpose(1, 2).reshape(B, S, D), f"h{i}.attn.proj")

    def mlp(h, i):
        up = linear(h, f"h{i}.mlp.fc")
        if cfg.mlp == "swiglu":
            hidden = torch.nn.functional.silu(linear(h, f"h{i}.mlp.gate")) * up
        elif cfg.mlp == "gelu":
            hidden = torch.nn.functional.gelu(up, approximate=cfg.gelu_approximate)
        else:
            hidden = torch.relu(up)
        return linear(hidden, f"h{i}.mlp.proj")

    for i in range(cfg.n_layers):
        if cfg.norm_placement == "pre":
            x = x + attn(norm(x, f"h{i}.ln1"), i)
            x = x + mlp(norm(x, f"h{i}.ln2"), i)
        else:
            x = norm(x + attn(x, i), f"h{i}.ln1")
            x = norm(x + mlp(x, i), f"h{i}.ln2")
    if cfg.norm_placement == "pre":
        x = norm(x, "lnf")
    logits = x @ (w["wte"].T if cfg.tied_head else w["head.W"])
    if "head.b" in w:
        logits = logits + w["head.b"]
    return torch.nn.functional.cross_entropy(logits.reshape(B * S, -1), targets.reshape(-1),
                                             ignore_index=-100)


VARIANTS = {
    "gpt2 (pre-LN, learned, GELU tanh, tied)": dict(),
    "llama (RMSNorm, RoPE, SwiGLU, untied, no bias)": "llama",
    "post-LN, sinusoidal, ReLU, untied with bias": dict(norm_placement="post",
                                                         position="sinusoidal", mlp="relu",
                                                         tied_head=False),
    "seed 003 (tied head with a bias, exact GELU)": dict(head_bias=True, gelu_approximate="none"),
}


def main() -> int:
    backend.set_backend("numpy")
    rng = np.random.default_rng(0)
    worst_overall = 0.0
    for label, overrides in VARIANTS.items():
        size = dict(vocab_size=50, max_seq_len=32, d_model=48, n_layers=3, n_heads=4)
        if overrides == "llama":
            cfg = DecoderConfig.llama(**size, d_ff=128)
        else:
            cfg = DecoderConfig(**size, **overrides)
        model = DecoderLM(cfg).init(seed=1)
        flat = to_numpy(model.params.data)
        model.params.load_flat(flat + 0.1 * rng.standard_normal(flat.shape))   # gains off 1
        ids = rng.integers(0, 50, (4, 32))
        targets = rng.integers(0, 50, (4, 32))
        targets[0, :5] = -100
        _, loss = model.forward(ids, targets)
        model.params.zero_grad()
        model.backward()
        w = {n: torch.tensor(to_numpy(model.params[n]), requires_grad=True)
             for n in model.params.names}
        t_loss = torch_forward(cfg, w, torch.tensor(ids), torch.tensor(targets))
        t_loss.backward()
        loss_diff = abs(float(loss) - t_loss.item()) / abs(t_loss.item())
        worst, worst_name = loss_diff, "loss"
        for n in model.params.names:
            ours = to_numpy(model.params.grad_of(n))
            theirs = w[n].grad.numpy()
            diff = np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-300)
            if diff > worst:
                worst, worst_name = diff, n
        worst_overall = max(worst_overall, worst)
        print(f"{label:48s} loss {float(loss):.6f}  relative difference: loss {loss_diff:.1e}, "
              f"largest over {len(w)} gradients {worst:.1e} ({worst_name})")
    print(f"largest relative difference: {worst_overall:.1e}")
    return 0 if worst_overall < 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())
