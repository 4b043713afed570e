"""Continue a prompt with a trained model: ``python -m tfcore.sample --checkpoint PATH ...``.

Loads the checkpoint written by ``python -m tfcore.train`` (its parameters and the
tokenizer saved with them: the Shakespeare or your own text's characters, or the digit
tasks' vocabulary) and prints the prompt followed by the continuation, token by token as
it is produced: greedy with ``--temperature 0``, else softmax sampling at that temperature,
optionally restricted by ``--top-k`` / ``--top-p``. ``--num-samples N`` prints N
continuations of the same prompt; sample i is drawn with seed ``--seed + i``, so sample 0
is what ``DecoderLM.generate(..., seed=--seed)`` returns. Every bad argument ends in one
line ``error: ...`` with exit status 2.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from . import backend, checks, data
from .models.decoder import DecoderConfig, DecoderLM, check_sampling
from .train import ArgumentParser, CheckpointError, read_checkpoint

SEPARATOR = "-" * 40


def _check_model_config(values: dict, path) -> None:
    """Refuse a checkpoint whose switches are not booleans: a string 'no' is truthy."""
    for name in ("tied_head", "bias", "head_bias"):
        value = values.get(name)
        if value is not None and not isinstance(value, bool):
            raise CheckpointError(f"{path}: model_config {name} must be true or false, got "
                                  f"{value!r}")


def load_model(path) -> tuple[DecoderLM, object]:
    """(model, tokenizer) from a checkpoint; the tokenizer is a CharTokenizer for text and
    the DigitTask's vocabulary for the digit tasks. An autoencoder checkpoint is refused:
    it has no tokens to sample."""
    meta, arrays = read_checkpoint(path)
    task = meta["config"].get("task")
    if task == "autoencoder":
        raise CheckpointError(f"{path} holds a model of task 'autoencoder', which "
                              "reconstructs vectors: it has no tokens to sample (give a "
                              "checkpoint of a text or digit task)")
    _check_model_config(meta["model_config"], path)
    try:
        config = DecoderConfig.from_dict(meta["model_config"]).validate()
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: malformed model_config ({err})") from None
    tokenizer = _tokenizer(meta.get("tokenizer"), task, path)
    if len(tokenizer.chars) != config.vocab_size:
        raise CheckpointError(f"{path}: its tokenizer has {len(tokenizer.chars)} tokens, "
                              f"its model {config.vocab_size}")
    model = DecoderLM(config)
    try:
        layout = [(n, tuple(s)) for n, s in meta["layout"]]
    except (TypeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: malformed layout ({err})") from None
    if layout != model.params.layout():
        raise CheckpointError(f"{path}: the saved parameter layout does not match its config")
    try:
        model.params.load_flat(arrays["params"])
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    return model, tokenizer


def _tokenizer(chars, task, path):
    """The tokenizer a checkpoint stores: its characters (distinct, in the sorted order that
    gives each its id) or, for the digit tasks, none. CheckpointError for anything else."""
    if chars is None:
        if task in ("reverse", "sort"):
            return _DigitTokenizer()
        raise CheckpointError(f"{path}: a {task!r} checkpoint without its tokenizer")
    if not isinstance(chars, str) or not chars:
        raise CheckpointError(f"{path}: its tokenizer must be a non-empty string of "
                              f"characters, got {type(chars).__name__} {chars!r:.60}")
    try:
        tokenizer = data.CharTokenizer(chars)
    except ValueError as err:
        raise CheckpointError(f"{path}: malformed tokenizer ({err})") from None
    if tokenizer.chars != chars:      # ids are positions in the sorted string
        raise CheckpointError(f"{path}: its tokenizer's characters are not in sorted order, "
                              "so the ids they stand for cannot be known")
    return tokenizer


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
        host = np.asarray(backend.to_numpy(ids)).ravel()
        if host.size and host.dtype.kind not in "iu":
            raise TypeError(f"ids must be integers, got {host.dtype}")
        if host.size:
            checks.integer_ids("ids", host, len(self.chars))
        return "".join(self.chars[int(i)] for i in host)


def encode_prompt(tokenizer, prompt: str) -> np.ndarray:
    """prompt -> ids [S0] int64; ValueError for an empty prompt or a character outside the
    checkpoint's vocabulary (naming it and listing the vocabulary)."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("the prompt must hold at least one character")
    unknown = sorted({c for c in prompt if c not in tokenizer.chars})
    if unknown:
        raise ValueError(f"character(s) {''.join(unknown)!r} are not in this checkpoint's "
                         f"vocabulary of {len(tokenizer.chars)}: {tokenizer.chars!r}")
    return tokenizer.encode(prompt)


def stream(model: DecoderLM, prompt_ids, max_new_tokens: int, temperature: float = 1.0,
           top_k=None, top_p=None, seed: int = 0):
    """Yield max_new_tokens ids (Python ints), one as soon as it is sampled.

    prompt_ids [S0] integers. The same tokens as ``model.generate(prompt_ids[None],
    max_new_tokens, temperature, top_k, top_p, seed)``: the same KV cache, the same window
    that slides beyond max_seq_len, the same host generator.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    ids = np.asarray(backend.to_numpy(prompt_ids))
    if ids.dtype.kind not in "iu" or ids.ndim != 1 or ids.shape[0] < 1:
        raise ValueError(f"prompt_ids must be a 1-D integer array of at least one id, got "
                         f"{ids.dtype} {ids.shape}")
    ids = ids.astype(np.int64)[None, :]                                   # [1, S0]
    rng = np.random.default_rng(seed)
    S_max = model.config.max_seq_len
    cache = None
    for _ in range(max_new_tokens):
        if cache is None or cache.length >= S_max:
            cache = model.new_kv_cache(1)                                 # (re)fill the window
            logits = model.forward_with_cache(backend.asarray(ids[:, -S_max:]), cache)
        else:
            logits = model.forward_with_cache(backend.asarray(ids[:, -1:]), cache)
        last = np.asarray(backend.to_numpy(logits[:, -1, :]), dtype=np.float64)  # [1, V]
        nxt = model.sample_next(last, temperature, top_k, top_p, rng)    # [1]
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
        yield int(nxt[0])


def sample(path, prompt: str, tokens: int, temperature: float = 1.0, top_k=None, top_p=None,
           seed: int = 0) -> str:
    """The prompt followed by `tokens` generated characters, as one string."""
    if not prompt:
        raise ValueError("the prompt must hold at least one character")
    model, tokenizer = load_model(path)
    ids = backend.asarray(encode_prompt(tokenizer, prompt)[None, :], "int64")  # [1, S0]
    out = model.generate(ids, tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         seed=seed)                                           # [1, S0 + n]
    return tokenizer.decode(backend.to_numpy(out)[0])


class _ArgError(Exception):
    def __init__(self, flag: str, message: str):
        super().__init__(f"argument {flag}: {message}")


def _check_args(args) -> None:
    """Every value checked before the checkpoint is read, each error naming its flag."""
    if args.tokens < 0:
        raise _ArgError("--tokens", f"must be >= 0, got {args.tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise _ArgError("--temperature", f"must be a finite number >= 0 (0 is greedy), got "
                        f"{args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise _ArgError("--top-k", f"must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise _ArgError("--top-p", f"must lie in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2**63:
        raise _ArgError("--seed", f"must lie in [0, 2**63), got {args.seed}")
    if args.num_samples < 1:
        raise _ArgError("--num-samples", f"must be >= 1, got {args.num_samples}")
    if not args.prompt:
        raise _ArgError("--prompt", "must hold at least one character")


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m tfcore.sample",
                            description="Print a prompt's continuations sampled from a "
                                        "tfcore.train checkpoint, token by token.")
    parser.add_argument("--checkpoint", required=True, help="path of checkpoint.npz")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: newline)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0,
                        help="sample i is drawn with seed + i (default 0)")
    parser.add_argument("--num-samples", type=int, default=1,
                        help="continuations of the prompt to print (default 1)")
    parser.add_argument("--backend", choices=backend.BACKENDS)
    args = parser.parse_args(argv)
    try:
        _check_args(args)
        if args.backend:
            backend.set_backend(args.backend)
        try:
            model, tokenizer = load_model(args.checkpoint)
        except CheckpointError as err:
            raise _ArgError("--checkpoint", str(err)) from None
        try:
            ids = encode_prompt(tokenizer, args.prompt)
        except ValueError as err:
            raise _ArgError("--prompt", str(err)) from None
    except _ArgError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = sys.stdout
    try:
        for i in range(args.num_samples):
            if i:
                out.write("\n" + SEPARATOR + "\n")
            out.write(args.prompt)
            out.flush()
            for token in stream(model, ids, args.tokens, args.temperature, args.top_k,
                                args.top_p, args.seed + i):
                out.write(tokenizer.decode([token]))
                out.flush()
    except FloatingPointError as err:
        out.write("\n")
        out.flush()
        if "temperature" in str(err):      # a temperature so small that logits / T overflow
            print(f"error: argument --temperature: {err}", file=sys.stderr)
            return 2
        print(f"error: {err}", file=sys.stderr)   # a checkpoint whose model overflows
        return 1
    out.write("\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
