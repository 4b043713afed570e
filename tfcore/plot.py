"""Draw a run's loss curves: ``python -m tfcore.plot RUN_DIR`` -> RUN_DIR/loss.png.

Reads the JSON-lines log that ``python -m tfcore.train`` writes into its output folder
(``log.jsonl``) and draws the training loss of every step, its moving average, and the
validation loss of each evaluation against the step, with matplotlib's Agg backend (no
display needed). The figure is tfcore.viz.loss's (plot_run); this is its command line.
"""
from __future__ import annotations

import sys
from pathlib import Path

from .train import LOG_NAME, ArgumentParser
from .viz.loss import plot_run


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m tfcore.plot",
                            description="Draw the train and validation loss of a "
                                        "tfcore.train run (its log.jsonl) to a PNG.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder")
    parser.add_argument("--out", help="the PNG to write (default RUN_DIR/loss.png)")
    parser.add_argument("--smooth", type=int, default=20,
                        help="window of the moving average of the train loss (1: none)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if args.smooth < 1:
        print(f"error: argument --smooth: must be >= 1, got {args.smooth}", file=sys.stderr)
        return 2
    if not (run_dir / LOG_NAME).is_file():
        print(f"error: argument RUN_DIR: {run_dir} holds no {LOG_NAME} (give the output "
              "folder of a tfcore.train run)", file=sys.stderr)
        return 2
    try:
        path = plot_run(run_dir, args.out, args.smooth)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
