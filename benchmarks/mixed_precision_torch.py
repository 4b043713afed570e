"""One-off comparison, outside the test suite: tfcore's bfloat16 mixed precision against
PyTorch's own bf16 autocast, on the same decoder, the same weights and the same batch.

Both gradients are compared with tfcore's float64 gradient of the same float32 weights
(normwise relative error over the whole flat gradient); the first-order bound of chapter 18
(sum of c_K over the step's products) is computed from tfcore's recorded products. PyTorch's
model is TorchStep of benchmarks/torch_step.py (naive attention), run under
torch.autocast("cpu", torch.bfloat16). PyTorch is not a dependency of tfcore: run this in any
environment that has torch (CPU build) and tfcore's requirements (ml_dtypes included), from
the repository root:

    python benchmarks/mixed_precision_torch.py        # writes benchmarks/mixed_precision.json

Chapter 18 reads and prints the JSON; it never imports torch.
"""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch

from tfcore import kernels
from tfcore import mixed_precision as mp
from tfcore.models import DecoderConfig, DecoderLM
from torch_step import TorchStep         # benchmarks/torch_step.py, beside this script

OUT = Path(__file__).with_name("mixed_precision.json")
CONFIG = dict(vocab_size=65, max_seq_len=32, d_model=64, n_layers=2, n_heads=4)
BATCH, SEQ, SEED = 8, 32, 0


def rel(g, ref) -> float:
    return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))


def main() -> int:
    torch.set_num_threads(1)
    cfg32 = DecoderConfig(**CONFIG, dtype="float32")
    m32 = DecoderLM(cfg32).init(SEED)
    m64 = DecoderLM(DecoderConfig(**CONFIG, dtype="float64"))
    m64.params.data[:] = m32.params.data.astype(np.float64)
    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, CONFIG["vocab_size"], (BATCH, SEQ))
    targets = rng.integers(0, CONFIG["vocab_size"], (BATCH, SEQ))

    m64.forward(ids, targets)
    m64.backward()
    ref = m64.params.grad.copy()                                   # [N] float64
    with kernels.disabled():                                       # the reference ops
        m32.forward(ids, targets)
        m32.backward()
    ours32 = m32.params.grad.astype(np.float64)
    m32.params.zero_grad()
    record = []
    with mp.autocast("bfloat16", record=record):
        m32.forward(ids, targets)
        m32.backward()
    ours = m32.params.grad.astype(np.float64)
    reductions = [a.shape[-1] for a, _, _ in record]

    def torch_grad(autocast: bool) -> np.ndarray:
        step = TorchStep(cfg32, m32.params, ids, targets, attention="math")
        for t in step.w.values():
            t.grad = None
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = step.forward()
        else:
            loss = step.forward()
        loss.backward()
        return np.concatenate([step.w[n].grad.detach().double().numpy().ravel()
                               for n in m32.params.names])

    theirs, theirs32 = torch_grad(True), torch_grad(False)
    result = {
        "command": "python benchmarks/mixed_precision_torch.py",
        "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
        "config": dict(CONFIG, batch=BATCH, seq=SEQ, seed=SEED,
                       parameters=int(m32.params.size)),
        "u_bfloat16": mp.unit_roundoff("bfloat16"),
        "products": len(reductions), "max_reduction": int(max(reductions)),
        "first_order_bound": mp.composed_bound(reductions, "bfloat16"),
        "relative_error": {
            "tfcore_bfloat16": rel(ours, ref), "torch_autocast_bfloat16": rel(theirs, ref),
            "tfcore_float32": rel(ours32, ref), "torch_float32": rel(theirs32, ref)},
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    errs = result["relative_error"]
    ok = (errs["torch_float32"] < 1e-5 and errs["tfcore_float32"] < 1e-5   # the same model
          and errs["tfcore_bfloat16"] < result["first_order_bound"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
