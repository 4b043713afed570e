"""Print the book to one PDF: the single-page HTML build, typeset by MathJax, printed by chromium.

    python tools/print_pdf.py _build/singlehtml _build/pdf/book.pdf
    python tools/print_pdf.py _build/singlehtml /tmp/part.pdf --only 06_attention,12_tensor

The single-page build holds every chapter in order. Headless Debian chromium (the browser the
tests use) loads it from a local server, waits for MathJax to typeset every equation (SVG
output, so the PDF holds vector math) and prints it with these rules:

* the collapsed code cells are opened, without their fade-in animation (printed during the
  animation, a cell's code came out at opacity 0: an empty box); the exercises' hints and
  solutions stay closed, so a reader can try the exercise first, and each closed bar stays on
  the page of its question (no page holds only an exercise's Hint and Solution bars);
* a last part, "Solutions to the exercises", collects every exercise's solution, chapter by
  chapter and numbered as the exercises, so that the printed book holds what its closed
  bars hide (the HTML book is left as it is: it opens the bars in place);
* every chapter starts on a new page;
* a box the themes keep in one piece (an admonition, and a collapsed cell is one; a code block;
  a table) may break across pages when it is taller than a third of a page: kept whole, it
  jumps to the next page and leaves the rest of this one blank;
* the PDF has an outline (bookmarks): one entry per chapter, its sections below it.

``--only`` prints just the chapters whose file names contain one of the given strings (the
front page always), for a quick look at a layout change. The file is written next to its
destination first and moved into place at the end, so a failed run leaves the previous PDF
intact.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import os
import threading
from pathlib import Path

CHROMIUM = Path(os.environ.get("TFCORE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]

# A4 with these margins leaves 182 x 265 mm, 688 x 1002 CSS px, for the text.
MARGIN_MM = {"top": 16, "bottom": 16, "left": 14, "right": 14}
PRINT_WIDTH_PX = round((210 - MARGIN_MM["left"] - MARGIN_MM["right"]) / 25.4 * 96)
PRINT_HEIGHT_PX = round((297 - MARGIN_MM["top"] - MARGIN_MM["bottom"]) / 25.4 * 96)

# Print layout: the theme's print stylesheet already hides the sidebars and buttons; these
# rules keep equations, code and figures inside A4 and avoid breaking a line of code.
PRINT_CSS = """
@page { size: A4; }
/* Nothing moves on paper. MyST-NB fades an opened cell in (collapsed-fade-in, 0.3 s, from
   opacity 0) and sphinx-design its dropdowns: a page printed before the end shows nothing. */
*, *::before, *::after { animation: none !important; transition: none !important; }
details.hide[open] > *, details.hide .cell_input { opacity: 1 !important; }
/* An opened cell prints its code without the "Hide code cell source" line above it. */
details.hide > summary { display: none !important; }
/* Each chapter of the single-page build (a section after its document anchor) on a new page. */
span[id^="document-"] + section { break-before: page; }
.tfcore-may-break { break-inside: auto !important; }
mjx-container[display="true"] { overflow: visible !important; }
mjx-container[display="true"] svg { max-width: 100%; height: auto; }
pre { white-space: pre-wrap !important; word-break: break-all; font-size: 8pt !important; }
img { max-width: 100% !important; break-inside: avoid; }
/* An exercise's closed Hint and Solution bars go to the page of its question: the question
   and its bars are one box (_PREPARE_JS), kept whole unless it is taller than a third of a
   page; no page break before a bar nor inside one. */
.tfcore-exercise { break-inside: avoid; }
details.sd-dropdown { break-before: avoid; break-inside: avoid !important; }
/* The solutions part: each solution's number stays with its first line. */
#tfcore-solutions > section > h3 { font-size: 1.25rem; margin-top: 1.2em; }
.tfcore-solution { margin-bottom: 0.8em; }
.tfcore-solution > .tfcore-solution-label { break-after: avoid; margin-bottom: 0.2em; }
.bd-header-article, .bd-sidebar-primary, .bd-sidebar-secondary, .headerlink,
.copybtn, .toggle-button, button { display: none !important; }
"""

# Runs once the page has loaded: typeset, open the code cells, close everything else.
_PREPARE_JS = r"""
async (only) => {
  if (only.length) {
    for (const anchor of document.querySelectorAll('span[id^="document-"]')) {
      if (!only.some(part => anchor.id.includes(part))) {
        const section = anchor.nextElementSibling;
        if (section && section.tagName === "SECTION") section.remove();
        anchor.remove();
      }
    }
  }
  if (window.MathJax && MathJax.startup) await MathJax.startup.promise;
  for (const d of document.querySelectorAll("details")) d.open = d.classList.contains("hide");
  // Each run of an exercise's closed bars (sphinx-design dropdowns), with the block before it
  // (its question), goes into one box that is kept on one page.
  for (const d of document.querySelectorAll("details.sd-dropdown")) {
    if (d.parentElement.classList.contains("tfcore-exercise")) continue;
    const run = [d];
    for (let n = d.nextElementSibling; n && n.matches("details.sd-dropdown"); n = n.nextElementSibling) {
      run.push(n);
    }
    const question = d.previousElementSibling;
    const box = document.createElement("div");
    box.className = "tfcore-exercise";
    d.before(box);
    if (question && !question.matches("details, h1, h2, h3, h4, h5, h6, section, span")) {
      box.append(question);
    }
    box.append(...run);
  }
}
"""

# Runs after the typesetting: appends the part that prints every exercise's solution. Each
# chapter (the section after a document anchor) with solutions gets a section titled as the
# chapter; each solution (a sphinx-design dropdown whose title is "Solution") is copied there,
# typeset math included, under the number of its exercise (the item of the numbered list
# before it). Copies lose their ids, so that no id of the page is repeated. The part is a
# chapter of its own (a document anchor and a section): it starts a page and is an entry of
# the outline. Returns {chapter title: number of solutions}.
_SOLUTIONS_JS = r"""
(title) => {
  const text = (el) => el.textContent.replace(/\s+/g, " ").trim();
  const solutionOf = (d) => {
    const summary = d.querySelector(":scope > summary");
    return summary && /^Solution\b/.test(text(summary));
  };
  // The question is the first block of the exercise's box (_PREPARE_JS): the last item of a
  // numbered list, or a paragraph that starts with its number.
  const exerciseNumber = (d) => {
    const item = d.closest("li");
    if (item && item.parentElement.tagName === "OL") {
      const list = item.parentElement;
      return Number(list.getAttribute("start") || 1) + [...list.children].indexOf(item);
    }
    const box = d.closest(".tfcore-exercise");
    const question = box && box.firstElementChild;
    if (!question || question.matches("details")) return null;
    if (question.tagName === "OL") {
      return Number(question.getAttribute("start") || 1) + question.children.length - 1;
    }
    const number = /^(\d+)\./.exec(text(question));
    return number ? Number(number[1]) : null;
  };
  const withoutIds = (node) => {
    if (node.nodeType !== Node.ELEMENT_NODE) return node;
    for (const el of [node, ...node.querySelectorAll("[id]")]) el.removeAttribute("id");
    return node;
  };
  const part = document.createElement("section");
  part.id = "tfcore-solutions";
  const heading = document.createElement("h2");
  heading.textContent = title;
  const intro = document.createElement("p");
  intro.textContent = "The chapters print each exercise's hint and solution closed, so that the "
    + "exercise can be tried first. Here is every solution, chapter by chapter, under the "
    + "number of its exercise.";
  part.append(heading, intro);
  const counts = {};
  const chapters = document.querySelectorAll('span[id^="document-"] + section');
  for (const chapter of chapters) {
    const solutions = [...chapter.querySelectorAll("details.sd-dropdown")].filter(solutionOf);
    const chapterHeading = chapter.querySelector(":scope > h1, :scope > h2");
    if (!solutions.length || !chapterHeading) continue;
    const section = document.createElement("section");
    const sub = withoutIds(chapterHeading.cloneNode(true));
    const h3 = document.createElement("h3");
    h3.append(...sub.childNodes);
    for (const link of h3.querySelectorAll(".headerlink")) link.remove();
    section.append(h3);
    let previous = 0;
    for (const d of solutions) {
      const number = exerciseNumber(d) ?? previous + 1;
      previous = number;
      const item = document.createElement("div");
      item.className = "tfcore-solution";
      const label = document.createElement("p");
      label.className = "tfcore-solution-label";
      const strong = document.createElement("strong");
      strong.textContent = `Exercise ${number}`;
      label.append(strong);
      item.append(label);
      const body = d.querySelector(".sd-summary-content") || d;
      for (const child of body.children) {
        if (child.tagName !== "SUMMARY") item.append(withoutIds(child.cloneNode(true)));
      }
      section.append(item);
    }
    part.append(section);
    counts[text(h3)] = solutions.length;
  }
  if (!Object.keys(counts).length) return counts;
  const anchor = document.createElement("span");
  anchor.id = "document-tfcore-solutions";
  const last = chapters[chapters.length - 1];
  last.after(anchor, part);
  return counts;
}
"""
SOLUTIONS_TITLE = "Solutions to the exercises"

# Runs in print layout: which boxes kept whole are too tall to be kept whole, and the outline:
# every chapter (the section after a document anchor of the single-page build; the front page
# is the first section) and its sections, each with its title and element id. A hidden link to
# each id makes chromium write it into the PDF as a named destination, with its page.
_LAYOUT_JS = r"""
(maxHeight) => {
  const boxes = ".admonition, details, .tfcore-exercise, div.highlight, div[class*=highlight-], "
              + "div.literal-block-wrapper, table, .cell, .cell_output, pre, figure, blockquote";
  let loosened = 0;
  for (const el of document.querySelectorAll(boxes)) {
    const avoid = getComputedStyle(el).breakInside;
    if ((avoid === "avoid" || avoid === "avoid-page") && el.getBoundingClientRect().height > maxHeight) {
      el.classList.add("tfcore-may-break");
      loosened += 1;
    }
  }
  const title = (heading) => {
    const copy = heading.cloneNode(true);
    for (const link of copy.querySelectorAll(".headerlink")) link.remove();
    for (const math of copy.querySelectorAll("mjx-container")) {
      const mml = math.querySelector("mjx-assistive-mml");
      math.replaceWith(mml ? mml.textContent : "");
    }
    return copy.textContent.replace(/\s+/g, " ").trim();
  };
  // The sections' own ids repeat from chapter to chapter ("summary", "exercises"), so each
  // heading gets an id of its own; the section's id is the second choice where it is unique
  // (chromium writes one destination where two elements start at the same place).
  const targets = (section, heading) => {
    heading.id = heading.id || `tfcore-outline-${outline.length}`;
    const unique = section.id && document.querySelectorAll(`[id="${CSS.escape(section.id)}"]`).length === 1;
    return unique ? [heading.id, section.id] : [heading.id];
  };
  const outline = [];
  const front = document.querySelector("article section, main section");
  const chapters = [front, ...document.querySelectorAll('span[id^="document-"] + section')];
  for (const chapter of chapters) {
    const heading = chapter && chapter.querySelector(":scope > h1, :scope > h2");
    if (!heading) continue;
    outline.push({ level: 1, title: title(heading), ids: targets(chapter, heading) });
    for (const section of chapter.querySelectorAll(":scope > section")) {
      const sub = section.querySelector(":scope > h2, :scope > h3");
      if (sub) outline.push({ level: 2, title: title(sub), ids: targets(section, sub) });
    }
  }
  const anchors = document.createElement("div");
  anchors.style.display = "none";
  for (const entry of outline) {
    for (const id of entry.ids) {
      const link = document.createElement("a");
      link.href = "#" + id;
      anchors.append(link);
    }
  }
  document.body.append(anchors);
  return { loosened, outline };
}
"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's signature)
        pass


def book_outline(doc, outline: list[dict]) -> list[list]:
    """PyMuPDF's table of contents for ``outline`` ({level, title, ids} in reading order).

    Each entry's first id that is a named destination of the printed PDF (chromium writes one for every element
    a link points to): its page and height are where the bookmark goes.
    """
    names = doc.resolve_names()
    toc = []
    for entry in outline:
        where = next((names[i] for i in entry["ids"] if i in names), None)
        if where is None:
            raise RuntimeError(f"no destination for {entry['title']!r} (#{', #'.join(entry['ids'])}) "
                               "in the PDF")
        height = doc[where["page"]].rect.height
        toc.append([entry["level"], entry["title"], where["page"] + 1,
                    {"kind": 1, "page": where["page"], "to": (0, height - where["to"][1]), "zoom": 0}])
    return toc


def print_pdf(site: Path, destination: Path, only: list[str] | None = None) -> dict:
    """Print ``site``/index.html to ``destination``; returns what the layout step did."""
    if not (site / "index.html").is_file():
        raise SystemExit(f"error: {site}/index.html is missing: build the single-page HTML first")
    if not CHROMIUM.exists():
        raise SystemExit(f"error: {CHROMIUM} is missing: install Debian's chromium")
    import pymupdf
    from playwright.sync_api import sync_playwright

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    destination.parent.mkdir(parents=True, exist_ok=True)
    printed = destination.with_name(destination.name + ".printed")
    partial = destination.with_name(destination.name + ".partial")
    origin = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            # The viewport is the printed text's width, so that the heights measured below are
            # those of the printed page.
            page = browser.new_page(viewport={"width": PRINT_WIDTH_PX, "height": PRINT_HEIGHT_PX})
            # One page holds the whole book: loading it and typesetting every equation takes
            # a while on a small or busy machine.
            page.set_default_timeout(600_000)
            page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(origin)
                       else r.abort())
            page.goto(origin + "index.html", wait_until="load")
            page.evaluate(_PREPARE_JS, only or [])
            solutions = page.evaluate(_SOLUTIONS_JS, SOLUTIONS_TITLE)
            page.add_style_tag(content=PRINT_CSS)
            page.emulate_media(media="print")
            layout = page.evaluate(_LAYOUT_JS, PRINT_HEIGHT_PX / 3)
            layout["solutions"] = solutions
            page.pdf(path=str(printed), format="A4", print_background=True,
                     display_header_footer=True, header_template="<span></span>",
                     footer_template='<div style="font-size:8px;width:100%;text-align:center">'
                                     '<span class="pageNumber"></span></div>',
                     margin={side: f"{mm}mm" for side, mm in MARGIN_MM.items()})
            browser.close()
        with pymupdf.open(printed) as doc:
            doc.set_toc(book_outline(doc, layout["outline"]))
            doc.save(partial, garbage=1, deflate=True)
        os.replace(partial, destination)
        return layout
    finally:
        printed.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
        server.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the single-page HTML build (_build/singlehtml)")
    parser.add_argument("output", type=Path, help="the PDF to write")
    parser.add_argument("--only", default="", help="comma-separated parts of chapter file names")
    args = parser.parse_args()
    layout = print_pdf(args.site, args.output, [s for s in args.only.split(",") if s])
    chapters = sum(entry["level"] == 1 for entry in layout["outline"])
    print(f"wrote {args.output}: {chapters} outline entries at the top level, "
          f"{layout['loosened']} tall boxes allowed to break across pages, "
          f"{sum(layout['solutions'].values())} solutions of {len(layout['solutions'])} "
          "chapters printed at the end")
