"""Continue a prompt with a trained model: ``python -m tfcore.sample --checkpoint PATH ...``.

Loads the checkpoint written by ``python -m tfcore.train`` (its parameters and the
tokenizer saved with them) and prints the prompt followed by the continuation that
``DecoderLM.generate`` samples: greedy with ``--temperature 0``, else softmax sampling at
that temperature, optionally restricted by ``--top-k`` / ``--top-p``, seeded by ``--seed``.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from . import backend, data
from .models.decoder import DecoderConfig, DecoderLM
from .train import CheckpointError, read_checkpoint


def load_model(path) -> tuple[DecoderLM, object]:
    """(model, tokenizer) from a checkpoint; the tokenizer is a CharTokenizer for text and
    the DigitTask's vocabulary for the digit tasks."""
    meta, arrays = read_checkpoint(path)
    model = DecoderLM(DecoderConfig.from_dict(meta["model_config"]))
    layout = [(n, tuple(s)) for n, s in meta["layout"]]
    if layout != model.params.layout():
        raise CheckpointError(f"{path}: the saved parameter layout does not match its config")
    model.params.load_flat(arrays["params"])
    tokenizer = data.CharTokenizer(meta["tokenizer"]) if meta["tokenizer"] else _DigitTokenizer()
    return model, tokenizer


class _DigitTokenizer:
    """The digit tasks' vocabulary: '0'-'9' are ids 0-9 and '=' is 10 (in that order)."""

    chars = data.DigitTask.VOCAB

    def encode(self, text: str) -> np.ndarray:
        bad = [c for c in text if c not in self.chars]
        if bad:
            raise ValueError(f"character {bad[0]!r} is not in the digit vocabulary "
                             f"{self.chars!r}")
        return np.array([self.chars.index(c) for c in text], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in np.asarray(backend.to_numpy(ids)).ravel())


def sample(path, prompt: str, tokens: int, temperature: float = 1.0, top_k=None, top_p=None,
           seed: int = 0) -> str:
    """The prompt followed by `tokens` generated characters, as one string."""
    if not prompt:
        raise ValueError("the prompt must hold at least one character")
    model, tokenizer = load_model(path)
    ids = backend.asarray(tokenizer.encode(prompt)[None, :], "int64")        # [1, S0]
    out = model.generate(ids, tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed)                                           # [1, S0 + n]
    return tokenizer.decode(backend.to_numpy(out)[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfcore.sample",
                                     description="Print a prompt's continuation sampled "
                                                 "from a tfcore.train checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="path of checkpoint.npz")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: newline)")
    parser.add_argument("--tokens", type=int, default=200, help="characters to generate")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=backend.BACKENDS)
    args = parser.parse_args(argv)
    if args.backend:
        backend.set_backend(args.backend)
    try:
        text = sample(args.checkpoint, args.prompt, args.tokens, args.temperature,
                      args.top_k, args.top_p, args.seed)
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
