"""Every refusal the command line documents (the "Not supported" list of its --help, read
from the text, not restated here) is refused in the simulation before any work: status 2,
nothing on stdout, one line `error: ...` on stderr naming both options, no training
function called; each option alone is accepted, so the refusal is the combination's. And
the other way round: every pair of options that the validation (parse, check_combination,
check_layout) refuses is in the documented list."""
from __future__ import annotations

import itertools
import re

import pytest

from tfcore.parallel import __main__ as cli
from tfcore.parallel import context, fsdp, pipeline, runner

# A value for each option that the command line accepts when it is given alone.
EXAMPLES = {"--cp": ["2"], "--pp": ["2"], "--tp": ["2"], "--dp": ["2"], "--sp": [],
            "--zero": ["1"], "--dropout": ["0.1"], "--micro-batches": ["2"], "--clip": ["1"],
            "--bucket-bytes": ["1024"], "--schedule": ["gpipe"], "--virtual": ["2"],
            "--algorithm": ["native"], "--layers": ["4"]}


def documented() -> list[tuple[str, str | None, str, list, list]]:
    """The "Not supported" list of the module docstring, one line a rule:
    `SUBJECTS with OPTIONS [without OPTIONS]`, or `SUBJECTS without OPTIONS`. A subject is
    an option with an optional value spec (`--zero 2 or 3`: the values 2 and 3; `--virtual
    2 or more`: 2); an option may carry a value (`--schedule interleaved`). -> [(subject,
    value, kind, [option, value?] it is refused with or without, [context options])]."""
    text = cli.__doc__.split("Not supported, and refused before any work")[1]
    body = text.split("\n\n")[0].split("\n", 1)[1]
    out = []
    for line in re.sub(r",\n\s+", ", ", body).strip().splitlines():
        parts = re.split(r" (with|without) ", line.strip())
        conditions = {kind: [o.split(" ") for o in options.split(", ")]
                      for kind, options in zip(parts[1::2], parts[2::2])}
        for subject in parts[0].split(", "):
            flag, _, spec = subject.partition(" ")
            for value in spec.replace(" or more", "").split(" or ") if spec else [None]:
                kind = "without" if "without" in conditions else "with"
                context = conditions.get("with", []) if kind == "without" else []
                for other in conditions[kind]:
                    out.append((flag, value, kind, other, context))
    return out


RULES = documented()


def _argv(flag, *value):
    if flag == "--simulate":
        return []                                   # every run here is simulated
    return [flag, *(value or EXAMPLES[flag])]


def _refused(argv, simulate=True):
    """The UsageError message of parse + check_layout (the simulation's world), or None."""
    try:
        args = cli.parse(["--simulate", *argv] if simulate else argv)
        cli.check_layout(args, cli.simulated_size(args))
    except cli.UsageError as err:
        return str(err)
    return None


def cases():
    out = []
    for flag, value, kind, other, context in RULES:
        subject = _argv(flag, *([value] if value else []))
        extra = [a for option in context for a in _argv(*option)]
        if kind == "with":
            out.append((subject + _argv(*other), flag, other, kind))
        else:
            out.append((subject + extra, flag, other, kind))
    return out


CASES = cases()


def test_the_documented_list_was_read():
    """The reading itself, spot-checked."""
    pairs = {(s, o[0]) for _, s, o, _ in CASES}
    assert ("--cp", "--bucket-bytes") in pairs and ("--cp", "--pp") in pairs
    assert ("--pp", "--dropout") in pairs and ("--bucket-bytes", "--sp") in pairs
    assert ("--virtual", "--schedule") in pairs and ("--schedule", "--pp") in pairs
    assert [argv for argv, s, o, _ in CASES if s == "--zero" and o == ["--sp"]] == [
        ["--zero", "2", "--sp"], ["--zero", "3", "--sp"]]
    assert (["--virtual", "2", "--pp", "2"], "--virtual", ["--schedule", "interleaved"],
            "without") in CASES
    assert len(CASES) >= 20


def _forbid_training(monkeypatch):
    def no_training(*a, **k):
        raise AssertionError("a refused combination must stop before any training")

    for module, name in ((runner, "train_parallel"), (fsdp, "train_sharded"),
                         (pipeline, "train_pipeline"), (context, "train_context_parallel"),
                         (runner, "train_single")):
        monkeypatch.setattr(module, name, no_training)


@pytest.mark.parametrize("argv,subject,other,kind", CASES,
                         ids=[" ".join(c[0]) + f" ({c[3]} {c[2][0]})" for c in CASES])
def test_every_documented_refusal(argv, subject, other, kind, capsys, monkeypatch):
    if kind == "with":           # each alone is accepted: the refusal is the combination's
        assert _refused(argv[:len(argv) - len(_argv(*other))],
                        simulate=other[0] != "--simulate") is None
        assert _refused(_argv(*other)) is None
    message = _refused(argv)
    if kind == "without":        # what is missing, given, lifts this refusal
        assert _refused(argv + _argv(*other)) != message
    _forbid_training(monkeypatch)
    assert cli.main(["--simulate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: {message}\n"                       # one line
    assert subject in message and other[0] in message, message


def test_every_refused_pair_is_documented():
    """Each pair of options (example values) that the validation refuses as a combination
    (alone, each is accepted) is in the documented list."""
    documented_pairs = {frozenset((s, o[0])) for _, s, o, _ in CASES}
    missing = []
    for a, b in itertools.combinations(EXAMPLES, 2):
        if _refused(_argv(a)) or _refused(_argv(b)):
            continue
        message = _refused(_argv(a) + _argv(b))
        if message is not None and frozenset((a, b)) not in documented_pairs:
            missing.append((a, b, message))
    assert not missing, missing
