"""Data for training: a character-level corpus and synthetic tasks with a measurable success.

* ``load_corpus()`` reads three Shakespeare plays shipped inside the package (public domain;
  provenance and licence in ``tfcore/corpus/PROVENANCE.md``): nothing is downloaded.
* ``CharTokenizer`` maps characters to ids and back; ``train_val_split`` cuts the ids;
  ``TextBatches`` samples random windows, seeded, with a state a checkpoint can save.
* ``DigitTask`` makes sequences ``d_1 .. d_n = a_1 .. a_n`` whose answer is the digits
  reversed (or sorted). Only the answer is scored: the prompt's targets are ignore_index,
  and a fixed tenth of all digit strings is held out of training, so ``exact_match``
  measures generalization, not memory.

Every sampler draws on the host with a NumPy generator (PCG64), whatever the backend, so
the same seed gives the same batches on NumPy, CuPy and array-api-strict; the batches are
then moved to the selected backend as int64 [B, S].
"""
from __future__ import annotations

from importlib import resources

import numpy as np

from . import backend, checks

IGNORE_INDEX = -100
CORPORA = {"shakespeare": "shakespeare.txt"}


def load_corpus(name: str = "shakespeare") -> str:
    """The text of a corpus shipped with tfcore ('shakespeare': Hamlet, Macbeth, The Tempest)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}: expected one of {', '.join(CORPORA)}")
    return (resources.files("tfcore") / "corpus" / CORPORA[name]).read_text(encoding="ascii")


def read_text_file(path) -> str:
    """The text of a UTF-8 file, for training on your own text (``--text FILE``).

    ValueError, saying what to do, for a missing or unreadable file, a folder, an empty
    file, or bytes that are not UTF-8 (with the offset of the first one).
    """
    try:
        raw = open(path, "rb").read()
    except FileNotFoundError:
        raise ValueError(f"{str(path)!r}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{str(path)!r} is a folder, not a text file") from None
    except OSError as err:
        raise ValueError(f"{str(path)!r} cannot be read: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{str(path)!r} is not UTF-8 text: byte {raw[err.start]:#04x} at "
                         f"offset {err.start} cannot be decoded (convert the file to UTF-8, "
                         "e.g. with iconv)") from None
    if not text:
        raise ValueError(f"{str(path)!r} is empty")
    return text


class CharTokenizer:
    """One id per distinct character, in sorted order: id i is chars[i].

    Any Python character is a token, lone surrogates included: text read with
    ``errors="surrogateescape"`` (each byte that is not UTF-8 becomes one of U+DC80..U+DCFF)
    round-trips, ``decode(encode(text)) == text``, so writing it back with the same error
    handler restores the bytes.
    """

    def __init__(self, chars: str):
        if not isinstance(chars, str):
            raise TypeError(f"chars must be a string, got {type(chars).__name__}")
        if len(set(chars)) != len(chars) or not chars:
            repeated = sorted({c for c in chars if chars.count(c) > 1})
            detail = f" ({''.join(repeated)!r} repeated)" if repeated else " (it is empty)"
            raise ValueError(f"chars must be a non-empty string of distinct characters{detail}")
        self.chars = "".join(sorted(chars))
        self._ids = {c: i for i, c in enumerate(self.chars)}
        self._table = np.array([ord(c) for c in self.chars], dtype=np.uint32)

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """text -> ids [len(text)] int64 (host); names the first character it does not know."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        try:
            return np.fromiter((self._ids[c] for c in text), dtype=np.int64, count=len(text))
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the tokenizer's vocabulary "
                             f"of {self.vocab_size} characters") from None

    def decode(self, ids) -> str:
        """ids [n] (any backend, or a list) of integers -> text; a float id is a TypeError
        (it would be truncated into another character), an id outside [0, vocab_size) a
        ValueError naming it."""
        host = np.asarray(backend.to_numpy(ids)).reshape(-1)
        if not host.size:
            return ""
        if host.dtype.kind not in "iu":
            raise TypeError(f"ids must be integers, got {host.dtype} (e.g. {host[0].item()!r})")
        checks.integer_ids("ids", host, self.vocab_size)
        # surrogatepass: a lone surrogate (text read with surrogateescape) decodes as itself
        return self._table[host].tobytes().decode("utf-32-le", "surrogatepass")


def train_val_split(ids: np.ndarray, val_fraction: float = 0.1):
    """(train, val): the first 1 - val_fraction of ids and the rest (no shuffling: text is
    sequential, and windows must not straddle the two parts)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    cut = int(round(len(ids) * (1.0 - val_fraction)))
    return ids[:cut], ids[cut:]


class _Seeded:
    """A PCG64 generator on the host whose state is a JSON-able dict (for checkpoints)."""

    def __init__(self, seed: int):
        self.rng = np.random.Generator(np.random.PCG64(seed))

    @property
    def state(self) -> dict:
        return self.rng.bit_generator.state

    @state.setter
    def state(self, value: dict) -> None:
        self.check_state(value)
        self.rng.bit_generator.state = value

    def check_state(self, value) -> None:
        """Raise (ValueError, TypeError or KeyError) unless value is a PCG64 state; changes
        nothing (a checkpoint is checked whole before anything is loaded)."""
        if not isinstance(value, dict) or value.get("bit_generator") != "PCG64":
            raise ValueError(f"expected a PCG64 generator state, got {value!r:.80}")
        np.random.PCG64().state = value


class TextBatches(_Seeded):
    """Random windows of a token stream: x = ids[i : i+S], y = ids[i+1 : i+S+1].

    ids [N] int (host); each call to next() draws B starting points uniformly in [0, N-S-1]
    and returns x, y [B, S] int64 on the selected backend.
    """

    def __init__(self, ids: np.ndarray, batch_size: int, seq_len: int, seed: int = 0):
        batch_size = checks.integer("batch_size", batch_size, least=1)
        seq_len = checks.integer("seq_len", seq_len, least=1)
        super().__init__(seed)
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":   # floats would be truncated into other tokens
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64)
        if ids.ndim != 1 or len(ids) < seq_len + 2:
            raise ValueError(f"need a 1-D stream of at least seq_len + 2 = {seq_len + 2} ids, "
                             f"got shape {ids.shape}")
        self.ids, self.batch_size, self.seq_len = ids, int(batch_size), int(seq_len)
        self._offsets = np.arange(seq_len + 1)

    def next(self):
        starts = self.rng.integers(0, len(self.ids) - self.seq_len, size=self.batch_size)
        windows = self.ids[starts[:, None] + self._offsets]  # [B, S+1]
        return (backend.asarray(windows[:, :-1], "int64"),
                backend.asarray(windows[:, 1:], "int64"))


class DigitTask(_Seeded):
    """Sequences 'd_1 .. d_n = a_1 .. a_n': the answer is the digits reversed or sorted.

    Vocabulary: the digits 0-9 are ids 0-9 and '=' is id 10 (vocab_size 11). A sequence
    has 2n + 1 tokens; x = seq[:-1], y = seq[1:] [B, 2n], and y is IGNORE_INDEX on the n
    positions that would predict the prompt, so the loss counts the answer only.
    A digit string is held out of training when a multiplicative hash of it falls in the
    lowest tenth: about 10% of all strings, spread evenly, never drawn by next().
    """

    SEP = 10
    VOCAB = "0123456789="

    def __init__(self, n_digits: int = 6, kind: str = "reverse", batch_size: int = 64,
                 seed: int = 0):
        batch_size = checks.integer("batch_size", batch_size, least=1)
        n_digits = checks.integer("n_digits", n_digits)
        super().__init__(seed)
        if kind not in ("reverse", "sort"):
            raise ValueError(f"kind must be 'reverse' or 'sort', got {kind!r}")
        if not 2 <= n_digits <= 18:
            raise ValueError(f"n_digits must lie in [2, 18], got {n_digits}")
        self.n_digits, self.kind, self.batch_size = int(n_digits), kind, int(batch_size)
        self._powers = 10 ** np.arange(n_digits, dtype=np.uint64)

    vocab_size = 11

    @property
    def seq_len(self) -> int:
        """Length of x and y: 2n."""
        return 2 * self.n_digits

    def is_heldout(self, digits: np.ndarray) -> np.ndarray:
        """digits [B, n] -> bool [B]: True for the tenth of all strings kept for evaluation."""
        value = (digits.astype(np.uint64) * self._powers).sum(axis=1)
        mixed = (value * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)  # wraps mod 2^64
        return (mixed % np.uint64(10)) == 0

    def answer(self, digits: np.ndarray) -> np.ndarray:
        return digits[:, ::-1] if self.kind == "reverse" else np.sort(digits, axis=1)

    def _sequences(self, digits: np.ndarray):
        b = digits.shape[0]
        sep = np.full((b, 1), self.SEP, dtype=np.int64)
        seq = np.concatenate([digits, sep, self.answer(digits)], axis=1)  # [B, 2n+1]
        x, y = seq[:, :-1].copy(), seq[:, 1:].copy()
        y[:, : self.n_digits] = IGNORE_INDEX  # the model is never asked to guess the prompt
        return backend.asarray(x, "int64"), backend.asarray(y, "int64")

    def _draw(self, rng, count: int, heldout: bool) -> np.ndarray:
        rows = []
        while sum(len(r) for r in rows) < count:
            digits = rng.integers(0, 10, size=(2 * count + 16, self.n_digits), dtype=np.int64)
            rows.append(digits[self.is_heldout(digits) == heldout])
        return np.concatenate(rows)[:count]

    def next(self):
        """A training batch x, y [B, 2n], never a held-out string."""
        return self._sequences(self._draw(self.rng, self.batch_size, heldout=False))

    def heldout(self, count: int = 500, seed: int = 12345):
        """count held-out sequences x, y [count, 2n] (the same for the same seed)."""
        count = checks.integer("count", count, least=1)
        return self._sequences(self._draw(np.random.default_rng(seed), count, heldout=True))

    def format(self, ids) -> str:
        return "".join(self.VOCAB[i] for i in np.asarray(backend.to_numpy(ids)).reshape(-1))


def exact_match(logits, targets) -> float:
    """The fraction of rows whose every scored target is the argmax of its logits.

    logits [B, S, V], targets [B, S] with IGNORE_INDEX where nothing is scored. With
    teacher forcing this equals greedy generation's exact-match accuracy: if every argmax
    along the true answer is right, greedy decoding reproduces the answer token by token;
    if one is wrong, greedy decoding goes wrong there at the latest.
    """
    pred = np.argmax(backend.to_numpy(logits), axis=-1)
    y = np.asarray(backend.to_numpy(targets))
    ok = (pred == y) | (y == IGNORE_INDEX)
    return float(np.mean(np.all(ok, axis=1)))


class GaussianSequences:
    """Seed 002's reconstruction data: a fixed set of sequences x [N, T, W] to reproduce.

    Entries are drawn from N(0, 1). With standardize=True every token's W features are then
    shifted and scaled to mean 0 and variance 1 (what a LayerNorm outputs), so a post-norm
    model, whose output is a LayerNorm's, can reproduce them exactly; raw N(0, 1) rows have
    a per-row mean and spread that no LayerNorm output matches, which leaves an error floor.
    next() returns the whole set (one full-batch step is one epoch) as (x, x);
    heldout() a fresh set from another seed. A width of 1 cannot be standardized (a row of
    one feature has no spread: 0 / 0) and is refused with standardize=True.
    """

    def __init__(self, count: int, seq_len: int, width: int, standardize: bool = True,
                 seed: int = 0, dtype: str = "float64"):
        count = checks.integer("count", count, least=1)
        seq_len = checks.integer("seq_len", seq_len, least=1)
        width = checks.integer("width", width, least=1)
        standardize = checks.boolean("standardize", standardize)
        if standardize and width < 2:
            raise ValueError(f"width must be at least 2 with standardize=True (a row of one "
                             f"feature has no spread to scale to variance 1: 0 / 0), got "
                             f"{width}; widen it or pass standardize=False")
        self.count, self.seq_len, self.width = int(count), int(seq_len), int(width)
        self.standardize, self.dtype, self.seed = bool(standardize), dtype, int(seed)
        self.x = self._make(np.random.default_rng(seed))

    def _make(self, rng):
        x = rng.standard_normal((self.count, self.seq_len, self.width))      # [N, T, W]
        if self.standardize:
            x = (x - x.mean(axis=-1, keepdims=True)) / x.std(axis=-1, keepdims=True)
        return backend.asarray(x, self.dtype)

    @property
    def state(self) -> dict:
        return {"seed": self.seed}      # the set is fixed: nothing advances between epochs

    @state.setter
    def state(self, value: dict) -> None:
        self.check_state(value)

    def check_state(self, value) -> None:
        if value != {"seed": self.seed}:
            raise ValueError(f"sampler state {value} is not this data set's {{'seed': "
                             f"{self.seed}}}")

    def next(self):
        return self.x, self.x

    def heldout(self, count: int | None = None, seed: int = 12345):
        other = GaussianSequences(count or self.count, self.seq_len, self.width,
                                  self.standardize, seed, self.dtype)
        return other.x, other.x
