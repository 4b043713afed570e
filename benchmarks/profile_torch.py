"""Where a step's time goes in tfcore and in PyTorch, side by side, at each thread count.

    .venv/bin/python benchmarks/profile_torch.py                          # tiny, float32
    .venv/bin/python benchmarks/profile_torch.py --config long2k --threads 1 2 --steps 5

tfcore's side is tfcore.bench's op-by-op profile (exclusive time of each op); PyTorch's is
torch.profiler's self CPU time of each aten op, the step run with its forward, backward and
optimizer marked (record_function). Both are sorted into the same groups: the linear
layers' and the head's products, attention (the fused op with its head split and merge),
GELU, the norms, the loss, the optimizer (zero_grad and AdamW), and the rest (embeddings,
residual sums, copies, each library's Python between ops). A group whose ratio is well
above the step's is where tfcore loses. Both profilers add their own cost to each op (a few
microseconds), so the totals run above the benchmark's times; on the tiny configuration,
with some hundred ops a step, noticeably so. For a quiet machine: no other work running.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfcore import backend, bench, kernels  # noqa: E402

GROUPS = ("products", "attention", "gelu", "norm", "loss", "optimizer", "other")

TFCORE_GROUPS = (     # (substring of tfcore's op label, group), the first that matches
    ("linear_", "products"), ("attention_", "attention"), ("split_heads", "attention"),
    ("merge_heads", "attention"), ("qkv_", "attention"), ("gelu_", "gelu"),
    ("norm", "norm"), ("cross_entropy", "loss"), ("adamw", "optimizer"),
    ("zero_grad", "optimizer"))

TORCH_GROUPS = (      # (aten op name, group) outside the optimizer's ranges
    ("aten::mm", "products"), ("aten::addmm", "products"), ("aten::bmm", "products"),
    ("scaled_dot_product", "attention"), ("aten::gelu", "gelu"), ("layer_norm", "norm"),
    ("log_softmax", "loss"), ("nll_loss", "loss"))


def tfcore_groups(name, dtype, steps):
    total, ops, _ = bench.profile_totals(name, dtype, steps=steps, tiled=True)
    groups = dict.fromkeys(GROUPS, 0.0)
    for label, ms in ops.items():
        group = next((g for key, g in TFCORE_GROUPS if key in label), "other")
        groups[group] += ms
    groups["other"] += total - sum(ops.values())        # Python between the ops
    return total, groups


def torch_groups(torch_step, name, dtype, steps):
    from torch.profiler import ProfilerActivity, profile, record_function

    cfg, batch, seq = bench.decoder_config(name, dtype, True)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(batch, seq + 1))
    ours = bench.TfcoreStep(cfg, tokens[:, :-1], tokens[:, 1:])
    step = torch_step.TorchStep(cfg, ours.model.params, tokens[:, :-1], tokens[:, 1:])

    def one():
        with record_function("optimizer"):
            step.opt.zero_grad(set_to_none=False)
        with record_function("forward"):
            loss = step.forward()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            step.opt.step()

    for _ in range(2):
        one()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            one()
    groups = dict.fromkeys(GROUPS, 0.0)
    total = 0.0
    for event in prof.events():
        if event.name in ("forward", "backward", "optimizer"):
            if event.cpu_parent is None:
                total += event.cpu_time_total / 1e3 / steps
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name not in ("forward", "backward", "optimizer"):
            parent = parent.cpu_parent
        if parent is None:
            continue
        if parent.name == "optimizer":
            group = "optimizer"
        else:
            group = next((g for key, g in TORCH_GROUPS if key in event.name), "other")
        groups[group] += event.self_cpu_time_total / 1e3 / steps
    groups["other"] += total - sum(groups.values())     # Python between the ops
    return total, groups


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", choices=list(bench.CONFIGS))
    parser.add_argument("--dtype", default="float32", choices=bench.DTYPES)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=10, help="profiled steps (default 10)")
    args = parser.parse_args(argv)
    backend.set_backend("numpy")
    kernels.keep_freed_memory()
    torch_step, why = bench.load_torch_step()
    if torch_step is None:
        parser.error(why)
    kernels.warm_up([args.dtype])
    for threads in args.threads:
        limiter = bench.set_threads(threads)
        ours_total, ours = tfcore_groups(args.config, args.dtype, args.steps)
        theirs_total, theirs = torch_groups(torch_step, args.config, args.dtype, args.steps)
        print(f"{args.config} {args.dtype}, {threads} thread(s): ms per step under each "
              f"profiler")
        print(f"{'group':10s} {'tfcore':>8s} {'PyTorch':>8s} {'ratio':>6s}")
        for group in GROUPS + ("step",):
            a = ours_total if group == "step" else ours[group]
            b = theirs_total if group == "step" else theirs[group]
            ratio = f"{a / b:6.2f}" if b > 0.005 else f"{'-':>6s}"
            print(f"{group:10s} {a:8.2f} {b:8.2f} {ratio}")
        del limiter
    return 0


if __name__ == "__main__":
    sys.exit(main())
