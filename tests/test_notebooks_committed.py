"""The chapters are committed executed and listed in the book.

nbval compares a fresh run with the outputs saved in each notebook, but a cell saved
unexecuted has no outputs to compare and would pass silently; the book shows the saved
outputs (it never executes at build time). So every code cell must carry its run.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb"))


def test_there_are_chapters():
    assert len(NOTEBOOKS) >= 6, f"expected the six chapters in chapters/, found {len(NOTEBOOKS)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_was_executed_in_order(path):
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    counts = [c.get("execution_count") for c in code]
    missing = [i for i, n in enumerate(counts) if not n]
    assert not missing, f"{path.name}: code cells {missing} were saved without being executed"
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: not executed top to bottom in one run: {counts}"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: saved with an error output: {errors[0].get('ename')}"


def test_every_chapter_is_in_the_table_of_contents():
    toc = (ROOT / "_toc.yml").read_text()
    listed = set(re.findall(r"file:\s*chapters/(\S+)", toc))
    for path in NOTEBOOKS:
        assert path.stem in listed, f"{path.name} is not listed in _toc.yml, so the book leaves it out"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_chapter_has_the_book_structure(path):
    # Opens with what it proves, ends with a summary and exercises, and its set-up code
    # (the first code cell: the imports) is collapsed so the derivation reads first.
    cells = json.loads(path.read_text())["cells"]
    markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    assert markdown and markdown[0].startswith("# "), f"{path.name}: the first cell must be the chapter's title"
    assert "What this chapter proves" in markdown[0], f"{path.name}: the first cell must say what the chapter proves"
    headings = [line for text in markdown for line in text.splitlines() if line.startswith("## ")]
    assert headings[-2:] == ["## Summary", "## Exercises"], f"{path.name}: must end with Summary and Exercises, ends with {headings[-2:]}"
    first_code = next(c for c in cells if c["cell_type"] == "code")
    assert "hide-input" in first_code.get("metadata", {}).get("tags", []), f"{path.name}: the set-up cell is not collapsed (tag hide-input)"
