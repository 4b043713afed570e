"""The layers of DESIGN.md point down: backend -> checks -> functional -> ops -> nn -> models
-> optim -> training, parallel, bench. No module of the lower layers imports one of the upper
ones, at module level or inside a function (a deferred import is an arrow all the same)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tfcore"
LOWER = ["backend.py", "checks.py", "functional", "ops.py", "nn.py", "models"]
UPPER = ("parallel", "train", "bench", "tasks", "optim", "sample", "plot", "viz")


def _modules(entry):
    path = PACKAGE / entry
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _upward(path: Path, root: Path = PACKAGE) -> list[str]:
    """The imports of `path` (a module under the package folder `root`) that reach an upper
    layer, as 'file:line: module'."""
    package = path.relative_to(root.parent).with_suffix("").parts[:-1]      # ('tfcore', ..)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            target = base + (node.module.split(".") if node.module else [])
            names = [target + [a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        for parts in names:
            if len(parts) > 1 and parts[0] == "tfcore" and parts[1] in UPPER:
                found.append(f"{path.name}:{node.lineno}: {'.'.join(parts)}")
    return found


@pytest.mark.parametrize("entry", LOWER)
def test_the_lower_layers_never_import_the_upper_ones(entry):
    upward = [line for path in _modules(entry) for line in _upward(path)]
    assert not upward, upward


def test_the_check_sees_an_upward_import(tmp_path):
    """Not blind: a deferred `from ..parallel import experts` in a models module is found,
    and an import within the lower layers is not."""
    probe = tmp_path / "tfcore" / "models" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from ..functional import moe\n\n\ndef late():\n"
                     "    from ..parallel import experts\n")
    assert _upward(probe, tmp_path / "tfcore") == ["probe.py:5: tfcore.parallel.experts"]
