"""Every combination the library does not train is one rule of tfcore.parallel.layout.REFUSALS,
and the cases here are generated from that list, not restated: for each rule, a smallest
layout that it refuses (without any one of its fields, it does not) is refused by
Layout.validate with the rule's one-line message, by the command line before any work
(status 2, nothing on stdout, one line `error: OPTIONS: MESSAGE` on stderr, no training
function called), by plan() and, where a builder takes those options, by the builder
before anything moves. The command line's --help and the README's list of refused
combinations are generated from the rules (checked here), and every pair of command-line
options that the validation refuses as a combination is refused by a rule."""
from __future__ import annotations

import dataclasses
import itertools
import os
import re

import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import Layout, LayoutError, SimulatedGroup, plan
from tfcore.parallel import __main__ as cli
from tfcore.parallel import harness
from tfcore.parallel.layout import CONFIG_FIELDS, LAYOUT_FIELDS, REFUSALS, readme_list

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The values that switch each field on; "absent" is the field's default (None, 1, False).
VALUES = {"dp": [2], "tp": [2], "pp": [2], "cp": [2], "ep": [2], "ulysses": [True],
          "zero": [1, 2, 3],
          "sp": [True],
          "micro_batches": [2], "virtual": [2], "schedule": ["gpipe", "1f1b", "interleaved"],
          "clip": [1.0], "bucket_bytes": [1024], "algorithm": ["native"],
          "transport": ["simulated"], "balanced": [False], "dropout": [0.1],
          "n_kv_heads": [2, 1], "n_heads": [4], "recompute": ["full", "selective"],
          "n_experts": [2], "attention": ["tiled"]}
DEFAULT = {f.name: f.default for f in dataclasses.fields(Layout)}


def _config(n_layers=4, **changes):
    base = dict(vocab_size=31, max_seq_len=16, d_model=16, n_layers=n_layers, n_heads=4,
                d_ff=32, dtype="float64")
    return DecoderConfig(**{**base, **changes})


def _split(values):
    """{field: value} -> (Layout, config)."""
    layout = Layout(**{k: v for k, v in values.items() if k in LAYOUT_FIELDS})
    config = _config(**{k: v for k, v in values.items() if k in CONFIG_FIELDS})
    return layout, config


def _refused_by(values):
    try:
        layout, config = _split(values)
    except ValueError:                   # a field out of range, or a config that cannot be
        return "invalid"
    rule = layout.refusal(config)
    return None if rule is None else rule


def smallest_case(rule):
    """The first {field: value} over the rule's fields (each on or absent) that this rule,
    and no earlier one, refuses, and that it no longer refuses without any one of them."""
    fields = [f for f in rule.fields if f in VALUES]
    options = [[None] + VALUES[f] for f in fields]        # None: the field's default
    for combo in itertools.product(*options):
        values = {f: v for f, v in zip(fields, combo) if v is not None}
        if _refused_by(values) is not rule:
            continue
        if all(_refused_by({g: w for g, w in values.items() if g != f}) is not rule
               for f in values):
            return values                 # the smallest: without any field, not this rule
    raise AssertionError(f"no layout found that only '{rule.name}' refuses")


CASES = [(rule, smallest_case(rule)) for rule in REFUSALS]
IDS = [rule.name for rule in REFUSALS]


def test_the_rules_are_a_list_of_named_predicates():
    names = [rule.name for rule in REFUSALS]
    assert len(names) == len(set(names)) >= 1
    for rule in REFUSALS:
        assert rule.fields and set(rule.fields) <= set(LAYOUT_FIELDS) | set(CONFIG_FIELDS)
        assert "\n" not in rule.why and rule.why
    assert Layout().refusal(_config()) is None            # one device trains


@pytest.mark.parametrize("rule,values", CASES, ids=IDS)
def test_layout_validate_refuses_with_the_rule(rule, values):
    layout, config = _split(values)
    with pytest.raises(LayoutError) as caught:
        layout.validate(config)
    message = str(caught.value)
    assert caught.value.rule is rule and message == rule.message(layout, config)
    assert message.startswith(rule.name + " (") and message.endswith("): " + rule.why)
    assert "\n" not in message
    for field in rule.fields:                              # the values that clash are named
        assert f"{field}=" in message


def _argv(values):
    """The command-line options of `values` (None when one has no option)."""
    argv = []
    for field, value in values.items():
        option = cli.OPTIONS[field]
        if option is None or option == "--config":
            return None
        if field == "transport":
            continue                                      # every run here is --simulate
        argv += [option] if value is True else [option, str(value)]
    return argv


def _forbid_training(monkeypatch):
    def no_training(*a, **k):
        raise AssertionError("a refused combination must stop before any training")

    for name in ("train_parallel", "train_sharded", "train_pipeline",
                 "train_context_parallel", "train_single", "train_layout"):
        monkeypatch.setattr(harness, name, no_training)


def _refused(argv):
    """The UsageError of parse + check_layout (the simulation's world), or None."""
    try:
        args = cli.parse(["--simulate", *argv])
        cli.check_layout(args, cli.simulated_size(args))
    except cli.UsageError as err:
        return err
    return None


CLI_CASES = [(rule, values) for rule, values in CASES if _argv(values) is not None]


def test_every_rule_a_command_line_can_reach_is_checked_there():
    reached = {rule.name for rule, _ in CLI_CASES}
    unreachable = {rule.name for rule in REFUSALS} - reached
    # only the rules on the model's own fields: no --config of the command line has them
    assert unreachable == {"context parallelism with selective recomputation",
                           "clipping with key/value heads shared across ranks",
                           "gradient buckets with key/value heads shared across ranks"} | {
        # an MoE model is --config tiny-moe, a whole config that _argv does not compose
        # (tests/test_expert_layouts.py runs those refusals on the command line)
        rule.name for rule, values in CASES if "n_experts" in values}


@pytest.mark.parametrize("rule,values", CLI_CASES, ids=[r.name for r, _ in CLI_CASES])
def test_every_rule_refuses_on_the_command_line(rule, values, capsys, monkeypatch):
    argv = _argv(values)
    for field in values:                  # without any one of its options, not this rule
        rest = _argv({g: w for g, w in values.items() if g != field})
        if field != "transport":
            assert getattr(_refused(rest), "rule", None) is not rule, (field, rest)
    error = _refused(argv)
    assert error is not None and error.rule is rule
    _forbid_training(monkeypatch)
    assert cli.main(["--simulate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    layout, config = _split(values)
    message = rule.message(layout, config)                 # Layout.validate's, unchanged
    given, _, rest = captured.err.removeprefix("error: ").partition(": ")
    assert captured.err == f"error: {given}: {message}\n"  # one line
    assert rest == message + "\n"
    for option in {cli.OPTIONS[f] for f in values if f != "transport"}:
        assert option in given.split(), (option, given)


@pytest.mark.parametrize("rule,values", CASES, ids=IDS)
def test_every_rule_refuses_in_plan(rule, values):
    layout, config = _split(values)
    with pytest.raises(ValueError) as caught:
        plan(config, layout, batch=8, seq=8)
    assert str(caught.value) == rule.message(layout, config)


def _builder(layout):
    """(training function, its keyword arguments, the Layout fields it takes) of the one
    builder, harness.train_layout."""
    return (lambda world, config, steps, batch, seq: harness.train_layout(
        world, config, layout, steps, batch, seq)), {}, set(LAYOUT_FIELDS) - {"transport"}


BUILDER_CASES = [(rule, values) for rule, values in CASES
                 if {f for f in values if f in LAYOUT_FIELDS}
                 <= _builder(_split(values)[0])[2]]


def test_the_builders_take_the_rules_they_can_express():
    names = {rule.name for rule, _ in BUILDER_CASES}
    assert {"gradient buckets with ZeRO-2/3", "gradient buckets with sequence parallelism",
            "virtual stages with a one-chunk schedule",
            "context parallelism with selective recomputation",
            "context parallelism with dropout on dense attention"} <= names


@pytest.mark.parametrize("rule,values", BUILDER_CASES, ids=[r.name for r, _ in BUILDER_CASES])
def test_every_rule_refuses_in_the_builder_before_anything_moves(rule, values):
    layout, config = _split(values)
    train, kwargs, _ = _builder(layout)
    group = SimulatedGroup(layout.world_size)
    with pytest.raises(ValueError) as caught:
        group.run(train, config, 1, 8, 8, **kwargs)
    assert rule.message(layout, config) in str(caught.value)
    assert all(t.sent == 0 and not t.calls for t in group.traffic)


def _unwrap(text, indent):
    """Lines of a wrapped list (continuations start with `indent`) joined back."""
    out = []
    for line in text.splitlines():
        if line.startswith(indent) and out:
            out[-1] += " " + line.strip()
        else:
            out.append(line)
    return out


def test_help_lists_every_rule(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--simulate", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert cli.refusals_text() in text
    section = text.split("the list is tfcore.parallel.layout.REFUSALS:\n")[1].split("\n\n")[0]
    lines = [line.strip() for line in _unwrap(section, "        ")]
    assert len(lines) == len(REFUSALS)
    for line, rule in zip(lines, REFUSALS):
        options = " ".join(dict.fromkeys(cli.OPTIONS[f] for f in rule.fields
                                         if cli.OPTIONS[f]))
        assert line == f"{rule.name} ({options}): {rule.why}"


def test_the_readme_list_is_the_rules():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    block = re.search(r"<!-- refusals: generated from tfcore.parallel.layout.REFUSALS -->\n"
                      r"(.*?)\n<!-- end of refusals -->", readme, re.S)
    assert block is not None, "the README has no list of refused combinations"
    assert block.group(1) == readme_list()
    items = [line.removeprefix("- ") for line in _unwrap(block.group(1), "  ")]
    assert items == [f"{rule.name}: {rule.why}" for rule in REFUSALS]


# A value for each option that the command line accepts when it is given alone.
EXAMPLES = {"--cp": ["2"], "--pp": ["2"], "--tp": ["2"], "--dp": ["2"], "--sp": [],
            "--zero": ["1"], "--dropout": ["0.1"], "--micro-batches": ["2"], "--clip": ["1"],
            "--bucket-bytes": ["1024"], "--schedule": ["gpipe"], "--virtual": ["2"],
            "--algorithm": ["native"], "--layers": ["4"]}

def test_every_refused_pair_is_a_rule():
    """Each pair of options (example values) that the validation refuses, each alone being
    accepted, is refused by a rule of REFUSALS: no combination is refused anywhere else."""
    elsewhere = {}
    for a, b in itertools.combinations(EXAMPLES, 2):
        if _refused([a, *EXAMPLES[a]]) or _refused([b, *EXAMPLES[b]]):
            continue
        error = _refused([a, *EXAMPLES[a], b, *EXAMPLES[b]])
        if error is not None and getattr(error, "rule", None) is None:
            elsewhere[(a, b)] = str(error)
    assert not elsewhere, elsewhere


def test_the_mesh_of_a_layout_is_validated_first():
    from tfcore.parallel import Mesh

    layout = Layout(dp=2, tp=2)
    meshes = SimulatedGroup(4).run(lambda world: Mesh.of(world, layout))
    assert [(m.dp_rank, m.tp_rank) for m in meshes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    group = SimulatedGroup(2)
    with pytest.raises(ValueError, match=r"the layout dp=2 x tp=2 needs 4 ranks, but the "
                                         r"world has 2"):
        group.run(lambda world: Mesh.of(world, layout))
    refused = Layout(pp=2, zero=2)
    with pytest.raises(ValueError, match=r"ZeRO-2/3 with pipeline parallelism \(pp=2, zero=2\)"):
        group.run(lambda world: Mesh.of(world, refused))
    assert all(t.sent == 0 and not t.calls for t in group.traffic)
