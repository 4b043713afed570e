"""A run's loss curves, drawn from the JSON-lines log that ``python -m tfcore.train`` writes
(``log.jsonl``: one object per step, ``{"step", "loss", "lr", "grad_norm",
"tokens_per_s"}``, and one per evaluation, ``{"step", "val_loss", "val_accuracy"}``).

    read_log(path)                     the per-step and per-evaluation records, in order
    moving_average(values, window)     the smoothed train loss
    plot_run(run_dir, out, smooth)     the training loss of every step, its moving average
                                       and the validation loss, to a PNG (matplotlib Agg)

``python -m tfcore.plot RUN_DIR`` is the command line. matplotlib is imported by plot_run
only, so tfcore does not need it.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..train import LOG_NAME


def read_log(path) -> tuple[list[dict], list[dict]]:
    """(steps, evals) of a log.jsonl: the per-step and per-evaluation records, in order;
    a step logged twice (a run resumed from an earlier checkpoint) keeps its last record.
    ValueError naming the line for anything that is not a record of the log."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    text = Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = record["step"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}, line {number}: not a record of a tfcore.train log") \
                from None
        if "val_loss" in record:
            evals[step] = record
        elif "loss" in record:
            steps[step] = record
        else:
            raise ValueError(f"{path}, line {number}: neither a step nor an evaluation")
    return ([steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)])


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of the last `window` values (fewer at the start), one per value."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(run_dir, out=None, smooth: int = 20) -> Path:
    """Draw run_dir/log.jsonl to `out` (default run_dir/loss.png); returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    steps, evals = read_log(run_dir / LOG_NAME)
    if not steps:
        raise ValueError(f"{run_dir / LOG_NAME} holds no training step yet")
    out = run_dir / "loss.png" if out is None else Path(out)
    x = [r["step"] for r in steps]
    loss = [r["loss"] for r in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, loss, lw=0.6, alpha=0.35, color="C0", label="train (batch)")
    if smooth > 1 and len(loss) > smooth:
        ax.plot(x, moving_average(loss, smooth), lw=1.2, color="C0",
                label=f"train (mean of {smooth})")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", ms=3,
                color="C1", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
