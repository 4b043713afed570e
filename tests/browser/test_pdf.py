"""The PDF of the whole book (`make pdf`): one file, every chapter in it, its math typeset.

`make test` builds it before the tests run (`make pdf`: the single-page HTML build printed by
headless chromium, tools/print_pdf.py). Its text is extracted with pypdf: every page of the
table of contents must appear under its title, and no raw TeX may be left in the text outside
code (MathJax's SVG output is drawn, not written, so typeset math leaves no TeX behind; code
is set in the monospace font and may hold TeX in its strings).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PDF = ROOT / "_build" / "pdf" / "book.pdf"
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{|\\frac\{|\\mathrm\{|\\sum_")


def _titles() -> list[str]:
    """The title (first '# ' heading) of every page listed in _toc.yml, in order."""
    titles = []
    for rel in re.findall(r"file:\s*(\S+)", (ROOT / "_toc.yml").read_text()):
        notebook, markdown = ROOT / f"{rel}.ipynb", ROOT / f"{rel}.md"
        if notebook.exists():
            cells = json.loads(notebook.read_text())["cells"]
            text = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])
        else:
            text = markdown.read_text()
        heading = next(line for line in text.splitlines() if line.startswith("# "))
        titles.append(heading[2:].strip())
    return titles


@pytest.fixture(scope="module")
def pdf_spans() -> list[tuple[str, str]]:
    """(font, text) of every span of text in the PDF, in reading order."""
    if not PDF.is_file():
        pytest.fail(f"{PDF} does not exist: run `make pdf` first", pytrace=False)
    import pymupdf

    with pymupdf.open(PDF) as doc:
        assert doc.page_count > 20, f"{PDF} has only {doc.page_count} pages"
        return [(span["font"], span["text"])
                for page in doc for block in page.get_text("dict")["blocks"]
                for line in block.get("lines", []) for span in line["spans"]]


@pytest.fixture(scope="module")
def pdf_text(pdf_spans) -> str:
    return "\n".join(text for _, text in pdf_spans)


@pytest.fixture(scope="module")
def prose_text(pdf_spans) -> str:
    return "\n".join(text for font, text in pdf_spans if "Mono" not in font)


def _words(text: str) -> str:
    """Letters and digits only, lower case: the PDF's text wraps and hyphenates headings."""
    return re.sub(r"[^a-z0-9]+", "", text.lower())


def test_every_chapter_is_in_the_pdf(pdf_text):
    flat = _words(pdf_text)
    missing = [t for t in _titles() if _words(re.sub(r"\$[^$]*\$", "", t)) not in flat]
    assert not missing, f"chapters missing from {PDF.name}: {missing}"


def test_the_pdf_has_no_raw_tex(prose_text):
    found = sorted({m.group(0) for m in RAW_TEX.finditer(prose_text)})
    if found:
        at = RAW_TEX.search(prose_text).start()
        pytest.fail(f"raw TeX {found} in {PDF.name}: {prose_text[max(0, at - 60):at + 60]!r}")


def test_the_raw_tex_check_sees_untypeset_math():
    # What an untypeset equation leaves in the text is caught; code-like prose is not.
    assert RAW_TEX.search(r"the loss $$L = \frac{1}{N} \sum_i \ell_i$$ is")
    assert not RAW_TEX.search("the loss L = (1/N) sum_i l_i is a mean over N tokens")
