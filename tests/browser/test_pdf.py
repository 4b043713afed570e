"""The PDF of the whole book (`make pdf`): every chapter in it, readable, with its code and outline.

`make test` builds it before the tests run (`make pdf`: the single-page HTML build printed by
headless chromium, tools/print_pdf.py). PyMuPDF reads it back, and it fails on

* a chapter of the table of contents missing from the text, or raw TeX left in the prose
  (MathJax's SVG output is drawn, not written, so typeset math leaves no TeX behind; code is
  set in the monospace font and may hold TeX in its strings);
* a code cell printed as an empty box: for every code cell of every notebook, its most
  distinctive line must be in the PDF's text AND drawn in ink there (a cell printed at
  opacity 0 leaves no text; one printed faint or transparent leaves text but no ink);
* a page left nearly blank (its ink ends above the middle of the page) that is not the last
  page of a chapter, nor followed by a figure too tall for the room left;
* a chapter that is not an entry at the top of the PDF's outline (bookmarks), or that does
  not start at the top of a new page;
* an exercise's hint or solution printed open in its chapter (they print collapsed, as a
  reader first sees them; the code cells print open), or a page that holds nothing but
  closed Hint and Solution bars (they belong on the page of their question);
* a solution missing from the part "Solutions to the exercises" at the end, which prints
  every chapter's solutions (a hint is printed nowhere).

The checks are functions of the PDF, and the last tests print a small page through the same
tools/print_pdf.py with a planted blank code box and a planted half-empty page, and show that
each is reported.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# TFCORE_PDF checks another build of the PDF (tools/print_pdf.py's output) than `make pdf`'s.
PDF = Path(os.environ.get("TFCORE_PDF", ROOT / "_build" / "pdf" / "book.pdf"))
SOLUTIONS_TITLE = "Solutions to the exercises"  # tools/print_pdf.py's last part
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$|\\begin\{|\\frac\{|\\mathrm\{|\\sum_")
# A page whose ink ends above this fraction of the text area is nearly blank (A4, 16 mm
# margins top and bottom; the page number in the bottom margin does not count).
BLANK_BELOW = 0.6
MARGIN_FRACTION = 16 / 297


def _toc_files() -> list[Path]:
    return [ROOT / rel for rel in re.findall(r"file:\s*(\S+)", (ROOT / "_toc.yml").read_text())]


def _titles() -> list[str]:
    """The title (first '# ' heading) of every page listed in _toc.yml, in order."""
    titles = []
    for stem in _toc_files():
        notebook, markdown = stem.with_suffix(".ipynb"), stem.with_suffix(".md")
        if notebook.exists():
            cells = json.loads(notebook.read_text())["cells"]
            text = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])
        else:
            text = markdown.read_text()
        heading = next(line for line in text.splitlines() if line.startswith("# "))
        titles.append(heading[2:].strip())
    return titles


def _words(text: str) -> str:
    """Letters and digits only, lower case: the PDF's text wraps and hyphenates headings."""
    return re.sub(r"[^a-z0-9]+", "", text.lower())


def _squash(text: str) -> str:
    """Without white space: a line of code as the PDF's text gives it back, wrapped or not."""
    return re.sub(r"\s+", "", text)


# ---------------------------------------------------------------------------------------------
# The checks, as functions of an open PyMuPDF document.

def code_lines(sources: list[str], shortest: int = 12) -> list[str]:
    """For each cell source, its most distinctive line (squashed): the longest line found in no
    other cell, else its longest line; "" for a cell with no line of `shortest` characters."""
    lines = [[_squash(line) for line in source.splitlines()] for source in sources]
    lines = [[line for line in cell if len(line) >= shortest] for cell in lines]
    seen: dict[str, int] = {}
    for cell in lines:
        for line in set(cell):
            seen[line] = seen.get(line, 0) + 1
    return [max((line for line in cell if seen[line] == 1), key=len, default="")
            or max(cell, key=len, default="") for cell in lines]


def _page_lines(page) -> list[tuple[str, object]]:
    """(squashed text, bbox) of every line of text on the page that is not fully transparent."""
    import pymupdf

    found = []
    for block in page.get_text("dict")["blocks"]:
        for line in block.get("lines", []):
            text = _squash("".join(span["text"] for span in line["spans"] if span["alpha"] > 0))
            if text:
                found.append((text, pymupdf.Rect(line["bbox"])))
    return found


def _has_ink(page, rect, darkest: int = 140) -> bool:
    """Whether anything in `rect` is drawn darker than `darkest` (0 black, 255 white)."""
    import pymupdf

    pixmap = page.get_pixmap(dpi=96, clip=rect, colorspace=pymupdf.csGRAY)
    return len(pixmap.samples) > 0 and min(pixmap.samples) < darkest


def blank_code(doc, lines: list[str]) -> list[str]:
    """The lines (squashed) that the PDF does not show: absent from its text, or without ink."""
    pages = []
    for page in doc:
        parts = _page_lines(page)
        pages.append((page, "".join(text for text, _ in parts), parts))
    missing = []
    for wanted in lines:
        if not wanted:
            continue
        shown = False
        for page, text, parts in pages:
            at = text.find(wanted)
            if at < 0:
                continue
            start, covered = 0, []
            for part, rect in parts:  # the lines of the page that hold the match
                if start < at + len(wanted) and at < start + len(part):
                    covered.append(rect)
                start += len(part)
            if any(_has_ink(page, rect) for rect in covered):
                shown = True
                break
        if not shown:
            missing.append(wanted)
    return missing


def ink_extent(page) -> float:
    """How far down the text area the page's ink reaches (0 top, 1 bottom; 0 when blank)."""
    import pymupdf

    pixmap = page.get_pixmap(dpi=36, colorspace=pymupdf.csGRAY)
    width, height, samples = pixmap.width, pixmap.height, pixmap.samples
    top, bottom = round(height * MARGIN_FRACTION), round(height * (1 - MARGIN_FRACTION))
    inked = [y for y in range(top, bottom) if min(samples[y * width:(y + 1) * width]) < 150]
    return (max(inked) - top + 1) / (bottom - top) if inked else 0.0


def chapter_first_pages(doc) -> list[int]:
    """0-based page of every top-level entry of the outline."""
    return [page - 1 for level, _, page in doc.get_toc() if level == 1]


BLOCK_GAP_FRACTION = 0.04


def _figure_too_tall_for(page, next_page, extent: float) -> bool:
    """Whether next_page begins with an image taller than the room left on page (an image
    cannot break across pages: the room it leaves is no layout fault)."""
    images = [info["bbox"] for info in next_page.get_image_info()]
    lines = [rect.y0 for _, rect in _page_lines(next_page)
             if rect.y1 < next_page.rect.height * (1 - MARGIN_FRACTION)]
    if not images:
        return False
    first = min(images, key=lambda box: box[1])
    # The room left below the last ink, less the space that separates an output from the
    # block above it (the cell's margin and the output area's padding, about 4% of a page).
    room = ((1 - extent) * (1 - 2 * MARGIN_FRACTION) - BLOCK_GAP_FRACTION) * page.rect.height
    return first[1] <= min(lines, default=first[1]) + 1 and first[3] - first[1] > room


def nearly_blank_pages(doc) -> list[tuple[int, float]]:
    """(1-based page, ink extent) of each page whose ink ends above BLANK_BELOW of the text
    area, except the last page of a chapter (the page before a chapter's first page), the
    last page of the PDF, and a page whose rest is too short for the figure that opens the
    next one."""
    chapter_ends = {first - 1 for first in chapter_first_pages(doc)} | {doc.page_count - 1}
    found = []
    for number, page in enumerate(doc):
        if number not in chapter_ends:
            extent = ink_extent(page)
            if extent < BLANK_BELOW and not _figure_too_tall_for(page, doc[number + 1], extent):
                found.append((number + 1, round(extent, 2)))
    return found


def outline_problems(doc, titles: list[str]) -> list[str]:
    """Every title must be a top-level outline entry, in order; each entry's page starts with it."""
    entries = [(title, page) for level, title, page in doc.get_toc() if level == 1]
    problems = []
    position = 0
    for wanted in titles:
        words = _words(re.sub(r"\$[^$]*\$", "", wanted))
        match = next((i for i in range(position, len(entries)) if words and words in _words(entries[i][0])),
                     None)
        if match is None:
            problems.append(f"{wanted!r} is not a top-level entry of the outline (after "
                            f"{entries[position - 1][0]!r})" if position else
                            f"{wanted!r} is not a top-level entry of the outline")
            continue
        position = match + 1
        title, page = entries[match]
        lines = sorted(((rect.y0, text) for text, rect in _page_lines(doc[page - 1])
                        if rect.y1 < doc[page - 1].rect.height * (1 - MARGIN_FRACTION)))
        first = _words(lines[0][1]) if lines else ""
        if not (first and _words(title).startswith(first)):
            problems.append(f"{wanted!r} does not start a new page: page {page} begins with "
                            f"{lines[0][1] if lines else 'nothing'!r}")
    return problems


def _closed_dropdowns(kind: str | None = None) -> list[tuple[str, str]]:
    """(page, a fragment of prose at least 30 letters long) of every hint and solution body,
    written in a ```{dropdown} or a :::{dropdown} fence; only those titled `kind` if given.
    The fragment is the longest that the text outside the dropdowns (of any page) does not
    hold, so that finding it in the PDF means the dropdown's body was printed."""
    fence = re.compile(r"^(```|:::)\{dropdown\}[ \t]*([^\n]*)\n(.*?)\n\1[ \t]*$",
                       re.DOTALL | re.MULTILINE)
    texts = {}
    for stem in _toc_files():
        notebook = stem.with_suffix(".ipynb")
        if notebook.exists():
            texts[notebook.stem] = "\n".join(
                "".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
                if c["cell_type"] == "markdown")
    outside = _words("\n".join(fence.sub("", text) for text in texts.values()))
    found = []
    for page, text in texts.items():
        for _, title, body in fence.findall(text):
            if kind is not None and title.strip() != kind:
                continue
            prose = re.sub(r"\$\$.*?\$\$|\$[^$]*\$|`[^`]*`|\[[^\]]*\]\([^)]*\)|\{[a-z]+\}", "|", body,
                           flags=re.DOTALL)
            pieces = [p for p in re.split(r"[|.:;()]", prose)
                      if len(_words(p)) >= 30 and _words(p) not in outside]
            if pieces:
                found.append((page, max(pieces, key=lambda p: len(_words(p)))))
    return found


BAR_TITLES = {"Hint", "Solution"}


def body_text(page) -> str:
    """The page's text above the bottom margin (without its page number), one line a line."""
    bottom = page.rect.height * (1 - MARGIN_FRACTION)
    return "\n".join(text for text, rect in _page_lines(page) if rect.y1 < bottom)


def bar_only_pages(doc) -> list[int]:
    """1-based pages whose text (the page number in the bottom margin aside) is nothing but
    closed dropdown bars, Hint and Solution: bars printed away from their question."""
    found = []
    for number, page in enumerate(doc):
        bottom = page.rect.height * (1 - MARGIN_FRACTION)
        lines = [text for text, rect in _page_lines(page) if rect.y1 < bottom]
        if lines and all(text in BAR_TITLES for text in lines):
            found.append(number + 1)
    return found


def solutions_part(doc) -> tuple[int, dict[str, str]]:
    """The 0-based first page of the part "Solutions to the exercises" (from the outline) and
    {chapter entry under it: the text of its pages}; (-1, {}) when the outline has no such
    part."""
    toc = doc.get_toc()
    start = next((i for i, (level, title, _) in enumerate(toc)
                  if level == 1 and _words(title) == _words(SOLUTIONS_TITLE)), None)
    if start is None:
        return -1, {}
    entries = []
    for level, title, page in toc[start + 1:]:
        if level == 1:
            break
        entries.append((title, page - 1))
    ends = [page for _, page in entries[1:]] + [doc.page_count - 1]
    texts = {title: "\n".join(body_text(doc[i]) for i in range(page, end + 1))
             for (title, page), end in zip(entries, ends)}
    return toc[start][2] - 1, texts


# ---------------------------------------------------------------------------------------------
# The book's PDF.

@pytest.fixture(scope="module")
def pdf_doc():
    if not PDF.is_file():
        pytest.fail(f"{PDF} does not exist: run `make pdf` first", pytrace=False)
    import pymupdf

    with pymupdf.open(PDF) as doc:
        assert doc.page_count > 20, f"{PDF} has only {doc.page_count} pages"
        yield doc


@pytest.fixture(scope="module")
def pdf_spans(pdf_doc) -> list[tuple[str, str]]:
    """(font, text) of every span of text in the PDF, in reading order."""
    return [(span["font"], span["text"])
            for page in pdf_doc for block in page.get_text("dict")["blocks"]
            for line in block.get("lines", []) for span in line["spans"]]


@pytest.fixture(scope="module")
def pdf_text(pdf_spans) -> str:
    return "\n".join(text for _, text in pdf_spans)


@pytest.fixture(scope="module")
def prose_text(pdf_spans) -> str:
    return "\n".join(text for font, text in pdf_spans if "Mono" not in font)


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
    assert RAW_TEX.search(r"by the chain rule $dX = G$")
    assert not RAW_TEX.search("the loss L = (1/N) sum_i l_i is a mean over N tokens")


def test_every_code_cell_is_printed(pdf_doc):
    cells = []
    for stem in _toc_files():
        notebook = stem.with_suffix(".ipynb")
        if notebook.exists():
            for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
                tags = cell.get("metadata", {}).get("tags", [])
                if cell["cell_type"] == "code" and not {"remove-input", "remove-cell"} & set(tags):
                    cells.append((f"{notebook.name} cell {index}", "".join(cell["source"])))
    lines = code_lines([source for _, source in cells])
    assert sum(map(bool, lines)) > 100, "too few code cells found to check"
    blank = set(blank_code(pdf_doc, lines))
    empty = [f"{name}: {line[:60]!r}" for (name, _), line in zip(cells, lines) if line in blank]
    assert not empty, f"{len(empty)} code cells print as empty boxes:\n  " + "\n  ".join(empty)


def test_no_page_is_nearly_blank(pdf_doc):
    blank = nearly_blank_pages(pdf_doc)
    assert not blank, (f"{len(blank)} pages whose ink ends above {BLANK_BELOW:.0%} of the page "
                       f"(page, extent): {blank}")


def test_every_chapter_has_a_bookmark_and_starts_a_page(pdf_doc):
    problems = outline_problems(pdf_doc, _titles())
    assert not problems, "\n".join(problems)


def test_hints_and_solutions_print_closed(pdf_doc):
    # In the chapters, before the part that prints the solutions (which holds nothing else).
    hints, solutions = _closed_dropdowns("Hint"), _closed_dropdowns("Solution")
    assert len(hints) > 20 and len(solutions) > 20, "too few dropdowns found to check"
    first, _ = solutions_part(pdf_doc)
    assert first > 0, f"no part {SOLUTIONS_TITLE!r} in the outline"
    chapters = _words("".join(body_text(pdf_doc[i]) for i in range(first)))
    printed = [f"{kind} of {page}: {fragment.strip()[:70]!r}"
               for kind, found in (("hint", hints), ("solution", solutions))
               for page, fragment in found if _words(fragment) in chapters]
    assert not printed, "hints or solutions printed open:\n  " + "\n  ".join(printed)


def test_no_page_holds_only_dropdown_bars(pdf_doc):
    pages = bar_only_pages(pdf_doc)
    assert not pages, f"pages with nothing but Hint and Solution bars: {pages}"


def test_the_solutions_part_prints_every_solution(pdf_doc):
    first, parts = solutions_part(pdf_doc)
    assert first > 0, f"no part {SOLUTIONS_TITLE!r} in the outline"
    titles = dict(zip(map(str, _toc_files()), _titles()))
    missing = []
    by_chapter: dict[str, list[str]] = {}
    for page, fragment in _closed_dropdowns("Solution"):
        by_chapter.setdefault(page, []).append(fragment)
    assert len(by_chapter) >= 15, f"solutions found in only {len(by_chapter)} chapters"
    for stem, fragments in by_chapter.items():
        title = _words(re.sub(r"\$[^$]*\$", "", titles[str(ROOT / "chapters" / stem)]))
        text = next((t for entry, t in parts.items() if title and title in _words(entry)), None)
        if text is None:
            missing.append(f"{stem}: no entry of its own under {SOLUTIONS_TITLE!r}")
            continue
        missing += [f"{stem}: {fragment.strip()[:70]!r}" for fragment in fragments
                    if _words(fragment) not in _words(text)]
    assert not missing, f"solutions missing from {SOLUTIONS_TITLE!r}:\n  " + "\n  ".join(missing)


def test_the_bar_check_reports_a_planted_page():
    import pymupdf

    doc = pymupdf.open()
    for lines in (["3. An exercise's question, on the page of its bars.", "Hint", "Solution"],
                  ["Hint", "Solution"], ["Solution"], ["The next chapter."]):
        page = doc.new_page(width=595, height=842)
        for i, line in enumerate(lines):
            page.insert_text((72, 100 + 20 * i), line)
        page.insert_text((290, 830), "7")  # the page number, in the bottom margin
    assert bar_only_pages(doc) == [2, 3]


# ---------------------------------------------------------------------------------------------
# The checks themselves, shown failing: a small page printed by tools/print_pdf.py.

_PLANTED_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><style>
/* MyST-NB's fade-in of an opened cell, slowed down: printed during it, the code is invisible
   unless the print path stops the animation. */
@keyframes planted-fade { from { opacity: 0; } to { opacity: 1; } }
details.hide[open] > .cell_input { animation: planted-fade 600s; }
</style></head><body><article class="bd-article">
<section id="front"><h1>Planted front page</h1><p>The front page.</p></section>
<div class="toctree-wrapper">
<span id="document-chapters/alpha"></span><section id="alpha"><h2>1. Planted alpha</h2>
<details class="hide above-input"><summary>Show code cell source</summary>
<div class="cell_input"><div class="highlight"><pre>animated_cell_line = compute_the_planted_value(1)</pre></div></div>
</details>
<div class="cell"><div class="highlight"><pre>visible_cell_line = compute_the_planted_value(2)</pre></div></div>
<div class="cell"><div class="highlight"><pre style="opacity: 0">blank_cell_line = compute_the_planted_value(3)</pre></div></div>
<div class="cell"><div class="highlight"><pre style="color: transparent">clear_cell_line = compute_the_planted_value(4)</pre></div></div>
<p>A short paragraph, and then a forced page break leaves the rest of this page blank.</p>
<p style="break-before: page">The next page of the same chapter.</p>
<section id="alpha-section"><h3>A section</h3><p>Its text, to the end of the page.</p>
<div style="height: 200mm"></div><p>The last line.</p></section>
</section>
<span id="document-chapters/beta"></span><section id="beta"><h2>2. Planted beta</h2>
<p>The second chapter, which must start on a new page.</p></section>
</div></article></body></html>
"""


@pytest.fixture(scope="module")
def planted_pdf(tmp_path_factory):
    """A small page printed by tools/print_pdf.py (chapters, cells, a forced break)."""
    import pymupdf

    site = tmp_path_factory.mktemp("planted-site")
    (site / "index.html").write_text(_PLANTED_PAGE)
    destination = site / "planted.pdf"
    # In a process of its own, as `make pdf` runs it: Playwright's sync API cannot start
    # inside a worker where the browser tests' own Playwright already runs an event loop.
    subprocess.run([sys.executable, str(ROOT / "tools" / "print_pdf.py"), str(site),
                    str(destination)], check=True, timeout=300)
    with pymupdf.open(destination) as doc:
        yield doc


def test_blank_code_check_reports_a_planted_blank_box(planted_pdf):
    sources = [f"{name}_cell_line = compute_the_planted_value({i})"
               for i, name in enumerate(["animated", "visible", "blank", "clear"], start=1)]
    lines = code_lines(sources)
    assert blank_code(planted_pdf, lines) == [_squash(sources[2]), _squash(sources[3])]


def test_page_checks_report_a_planted_blank_page(planted_pdf):
    # Page 1: the front page, which ends its chapter; page 2: alpha's first page, cut short by
    # the forced break; page 3: its section; page 4: beta.
    assert planted_pdf.page_count == 4
    assert [page for page, _ in nearly_blank_pages(planted_pdf)] == [2]
    titles = ["Planted front page", "1. Planted alpha", "2. Planted beta"]
    assert outline_problems(planted_pdf, titles) == []
    assert [(level, title) for level, title, _ in planted_pdf.get_toc()] == [
        (1, titles[0]), (1, titles[1]), (2, "A section"), (1, titles[2])]
    assert outline_problems(planted_pdf, titles + ["3. Planted gamma"]) == [
        "'3. Planted gamma' is not a top-level entry of the outline (after '2. Planted beta')"]
