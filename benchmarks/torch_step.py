"""The decoder's training step in PyTorch eager: the ratio column of `python -m tfcore.bench`.

tfcore imports no PyTorch code (DESIGN.md: PyTorch is an optional, independent cross-check),
so the PyTorch side of the benchmark lives here, beside crosscheck_torch.py. tfcore.bench
loads this file by its path when the repository checkout has it (or from
`--torch-step PATH`); without it, or without torch, the table has no PyTorch column.

    TorchStep(cfg, params, ids, targets, attention)   one step per call, as TfcoreStep's
    torch_version                                     torch.__version__, for the table

Weights are copied from tfcore's flat buffer by name; the hyperparameters (LR, BETAS, EPS,
WEIGHT_DECAY) are tfcore.bench's, so both libraries take the same step.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tfcore import backend
from tfcore.bench import BETAS, EPS, LR, WEIGHT_DECAY
from tfcore.models import DecoderConfig

torch_version = torch.__version__


class TorchStep:
    """The same GPT-style decoder in PyTorch eager, weights copied from tfcore's flat buffer.

    Weights keep tfcore's layout ([D_in, D_out]: y = x @ W + b, through torch.addmm);
    attention is PyTorch's scaled_dot_product_attention (causal); AdamW is torch.optim.AdamW
    (the default implementation) with weight decay on the weight matrices only.
    """

    def __init__(self, cfg: DecoderConfig, params, ids, targets, attention="sdpa"):
        self.torch, self.cfg, self.attention = torch, cfg, attention
        dt = getattr(torch, cfg.dtype)
        self.w = {n: torch.tensor(np.array(backend.to_numpy(params[n])), dtype=dt,
                                  requires_grad=True) for n in params.names}
        decay = [t for n, t in self.w.items() if n.endswith(".W")]
        rest = [t for n, t in self.w.items() if not n.endswith(".W")]
        self.opt = torch.optim.AdamW([dict(params=decay, weight_decay=WEIGHT_DECAY),
                                      dict(params=rest, weight_decay=0.0)],
                                     lr=LR, betas=BETAS, eps=EPS)
        self.ids = torch.tensor(np.asarray(ids))
        self.targets = torch.tensor(np.asarray(targets))
        self.loss = None
        for t in self.w.values():            # gradients live between steps, as tfcore's do
            t.grad = torch.zeros_like(t)

    def forward(self):
        torch, cfg, w = self.torch, self.cfg, self.w
        F = torch.nn.functional
        B, S = self.ids.shape
        D, H = cfg.d_model, cfg.n_heads

        def linear(x, name):
            y = torch.addmm(w[name + ".b"], x.reshape(-1, x.shape[-1]), w[name + ".W"])
            return y.view(*x.shape[:-1], y.shape[-1])

        x = w["wte"][self.ids] + w["wpe"][:S]
        for i in range(cfg.n_layers):
            h = F.layer_norm(x, (D,), w[f"h{i}.ln1.g"], w[f"h{i}.ln1.b"], cfg.eps)
            q, k, v = linear(h, f"h{i}.attn.qkv").split(D, -1)
            q, k, v = (t.view(B, S, H, D // H).transpose(1, 2) for t in (q, k, v))
            if self.attention == "sdpa":
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                z = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D // H))
                mask = torch.ones(S, S, dtype=torch.bool).triu(1)
                a = torch.softmax(z.masked_fill(mask, -math.inf), -1) @ v
            x = x + linear(a.transpose(1, 2).reshape(B, S, D), f"h{i}.attn.proj")
            h = F.layer_norm(x, (D,), w[f"h{i}.ln2.g"], w[f"h{i}.ln2.b"], cfg.eps)
            hidden = F.gelu(linear(h, f"h{i}.mlp.fc"), approximate=cfg.gelu_approximate)
            x = x + linear(hidden, f"h{i}.mlp.proj")
        x = F.layer_norm(x, (D,), w["lnf.g"], w["lnf.b"], cfg.eps)
        logits = x.view(-1, D) @ w["wte"].T
        return F.cross_entropy(logits, self.targets.view(-1), ignore_index=-100)

    def __call__(self):
        self.opt.zero_grad(set_to_none=False)
        loss = self.forward()
        loss.backward()
        self.opt.step()
        self.loss = float(loss.detach())

    def first_loss(self) -> float:
        with self.torch.no_grad():
            return float(self.forward())

    def state_bytes(self) -> int:
        n = sum(t.numel() for t in self.w.values())
        return 4 * n * self.w["wte"].element_size()
