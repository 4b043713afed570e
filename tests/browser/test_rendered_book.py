"""Every page of the built book, opened in a real browser (headless Debian chromium).

One test per HTML file of _build/html, so that a failure names the page. A page fails on

* any request that would leave the machine (host other than 127.0.0.1/localhost; it is
  aborted, so the page sees what an offline reader sees),
* any failed request or HTTP status >= 400, any console error, any uncaught exception,
* any <img> that did not load,
* any link into the build that does not resolve: the target file must exist and its
  #fragment must be the id of an element of the target page,
* any MathJax error, and any math that was not typeset: after MathJax.startup.promise every
  element of class "math" holds an <mjx-container>, and no raw TeX (a delimiter \\( \\) \\[ \\]
  $ or $$, or a \\begin{) is left in the visible text outside code,
* any equation that renders less than its source says: every letter of an equation's TeX
  (outside command names, environment names and spacing) must appear in MathJax's rendering
  of it, counted with multiplicity, so that an equation whose left-hand side TeX swallowed
  (``\\begin{aligned}[Q_i | K_i | V_i] = ...``: the bracket is read as aligned's position
  option) is reported; and no inline math may hold prose (Markdown emphasis or a run of
  words: what a stray $ does to the text that follows it),
* any citation whose label is not readable: the literature's alpha labels ([VSP+17]) and
  the source notes' [note 004], never a label mangled out of a name ([Sourcen00425]),
* any display equation, table, code block or printed output wider than the text column at a
  1280 px window (content a reader would have to scroll sideways to see), and, at a 400 px
  window (a phone), any page that scrolls sideways as a whole or whose text column is cut,
  and any wide equation, table, code block or output that does not scroll inside its own
  box (the element or its wrapper, lying within the window).

Every page of the build is opened, search.html included: both are plain
local pages (search.html loads searchindex.js from the build).

Build the book first (`make book`); `make test` does both.
"""
from __future__ import annotations

import html
import html.parser
import os
import posixpath
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest


# TFCORE_BOOK_HTML checks another HTML build of the book than `make book`'s _build/html.
BUILD = Path(os.environ.get("TFCORE_BOOK_HTML",
                           Path(__file__).resolve().parents[2] / "_build" / "html"))
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
# A TeX delimiter, a lone $ (a $$ display that Markdown split, as in a list item) included,
# or an environment that was never typeset.
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$|\\begin\{")


def _pages() -> list:
    if not BUILD.is_dir():
        return [pytest.param(None, id="no-build")]
    pages = sorted(
        p.relative_to(BUILD).as_posix()
        for p in BUILD.rglob("*.html")
        if not p.relative_to(BUILD).parts[0].startswith("_")  # _static/, _sources/: not pages
    )
    return pages or [pytest.param(None, id="no-pages")]


class _IdCollector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is not None and (name == "id" or (tag == "a" and name == "name")):
                self.ids.add(value)


@lru_cache(maxsize=None)
def _ids_of(path: Path) -> frozenset[str]:
    """The element ids of a built HTML file, as they are written in the file."""
    collector = _IdCollector()
    collector.feed(path.read_text(encoding="utf-8"))
    return frozenset(collector.ids)


# Runs in the page after load: images, links and the state of the math.
_INSPECT_JS = r"""
async () => {
  // Images: make lazy ones load now, then wait (bounded) for every one to settle.
  const imgs = Array.from(document.images);
  for (const img of imgs) { if (img.loading === "lazy") img.loading = "eager"; }
  await Promise.race([
    Promise.all(imgs.map(img => img.complete ? null :
      new Promise(resolve => { img.addEventListener("load", resolve); img.addEventListener("error", resolve); }))),
    new Promise(resolve => setTimeout(resolve, 10000)),
  ]);
  const badImages = imgs.filter(img => !(img.complete && img.naturalWidth > 0))
                        .map(img => img.getAttribute("src"));

  // Math: wait for MathJax's first typesetting pass, if MathJax is on the page.
  const mathElements = Array.from(document.querySelectorAll(".math"));
  let mathjax = "absent";
  if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise) {
    await window.MathJax.startup.promise;
    mathjax = "typeset";
  } else if (window.MathJax) {
    mathjax = "configured-but-not-loaded";
  }
  const untypeset = mathElements.filter(el => !el.querySelector("mjx-container"))
                                .map(el => el.textContent.trim().slice(0, 80));
  // A TeX error: <mjx-merror> in CHTML output, an merror node in SVG output.
  const errors = Array.from(document.querySelectorAll('mjx-merror, [data-mml-node="merror"]'))
                      .map(el => (el.getAttribute("data-mjx-error") || el.textContent || "").slice(0, 120));

  // Visible text outside code, scripts and typeset math: no raw TeX may be left in it.
  const skip = "pre, code, script, style, textarea, noscript, mjx-container, .highlight, .cell_input";
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const texts = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const parent = n.parentElement;
    if (parent && !parent.closest(skip) && n.textContent.trim()) texts.push(n.textContent);
  }

  const links = Array.from(document.querySelectorAll("a[href]")).map(a => ({
    raw: a.getAttribute("href"), url: a.href, text: a.textContent.trim() }));
  const liveIds = Array.from(document.querySelectorAll("[id]")).map(el => el.id);
  return { badImages, mathCount: mathElements.length, mathjax, untypeset, errors, texts, links, liveIds,
           citationLabels: Array.from(document.querySelectorAll("div.citation > .label"))
                                .map(el => el.textContent.replace(/[\[\]]/g, "").trim()) };
}
"""

# Runs in the page after MathJax: the TeX source of every typeset equation next to MathJax's
# internal MathML for it (what it renders), for the comparison of _math_problems.
_MATH_JS = r"""
() => {
  if (!(window.MathJax && MathJax.startup && MathJax.startup.document && MathJax.startup.toMML)) return [];
  return Array.from(MathJax.startup.document.getMathItemsWithin(document.body)).map(item => ({
    tex: item.math, display: item.display, mml: MathJax.startup.toMML(item.root) }));
}
"""


# Runs in the page after MathJax: every display equation, table, code block and printed output
# must fit the text column. `strict` (the 1280 px check) fails on anything wider than its
# column, scrollbar or not; otherwise (the 400 px check) wide content fails unless it scrolls
# inside its own box, and the page may not scroll sideways. Each entry names the element by its text (the TeX of an equation).
_OVERFLOW_JS = r"""
(strict) => {
  const article = document.querySelector("article.bd-article") || document.body;
  const column = article.clientWidth - parseFloat(getComputedStyle(article).paddingLeft)
                                     - parseFloat(getComputedStyle(article).paddingRight);
  const tex = new Map();
  if (window.MathJax && MathJax.startup && MathJax.startup.document) {
    for (const item of MathJax.startup.document.getMathItemsWithin(document.body)) {
      if (item.typesetRoot) tex.set(item.typesetRoot, item.math);
    }
  }
  const describe = (el) => (tex.get(el) || el.textContent || "").replace(/\s+/g, " ").trim().slice(0, 70);
  // Wide content must scroll inside its own box: the element itself or the wrapper made for it
  // (a table's scroll container, a code block's div.highlight), and that box must fit the
  // window. A scrollbar further out would move the text around it too.
  const scrolls = (el) => {
    for (const e of [el, el.parentElement]) {
      if (!e || e === article) break;
      const o = getComputedStyle(e).overflowX;
      const box = e.getBoundingClientRect();
      if ((o === "auto" || o === "scroll") && e.scrollWidth > e.clientWidth
          && box.left >= -1 && box.right <= window.innerWidth + 1) return true;
    }
    return false;
  };
  const kinds = [["display equation", 'mjx-container[display="true"]'], ["table", "table"],
                 ["code block", "div.highlight pre"], ["printed output", ".cell_output pre"]];
  const problems = [];
  for (const d of article.querySelectorAll("details")) d.open = true;  // collapsed cells count too
  for (const [kind, selector] of kinds) {
    for (const el of article.querySelectorAll(selector)) {
      const width = Math.max(el.scrollWidth, el.getBoundingClientRect().width);
      const wide = width > Math.min(column, el.parentElement.clientWidth) + 1;
      if (wide && (strict || !scrolls(el))) {
        problems.push(`${kind} ${Math.round(width)} px wide in a ${Math.round(column)} px column`
                      + (strict ? "" : " and cut without a scrollbar") + `: ${JSON.stringify(describe(el))}`);
      }
    }
  }
  // No page-level horizontal scroll, and no column cut by the window (an ancestor that hides
  // its overflow would keep the page's own width while cutting the text).
  const pageWidth = Math.max(document.documentElement.scrollWidth, document.body.scrollWidth);
  if (pageWidth > window.innerWidth + 1) {
    problems.push(`the page itself is ${pageWidth} px wide in a ${window.innerWidth} px window`);
  }
  const columnBox = article.getBoundingClientRect();
  if (columnBox.left < -1 || columnBox.right > window.innerWidth + 1) {
    problems.push(`the text column spans ${Math.round(columnBox.left)} to ${Math.round(columnBox.right)} px in a ${window.innerWidth} px window`);
  }
  return problems;
}
"""


def _overflow_problems(page) -> list[str]:
    """What does not fit at 1280 px, and what is cut at 400 px (the viewport is restored)."""
    problems = [f"at 1280 px: {p}" for p in page.evaluate(_OVERFLOW_JS, True)]
    page.set_viewport_size({"width": 400, "height": 900})
    page.wait_for_timeout(100)  # one layout pass
    problems += [f"at 400 px: {p}" for p in page.evaluate(_OVERFLOW_JS, False)]
    page.set_viewport_size({"width": 1280, "height": 900})
    return problems


# What of an equation's TeX draws nothing by itself: comments, environment names (and an array's
# column spec), labels, colours, and the lengths of spacing commands and of a line break's
# optional skip. A bracket after \begin{aligned} is NOT removed: TeX reads it as the position
# option and drops it, which is the bug the comparison is for.
_TEX_SILENT = re.compile(
    r"(?<!\\)%[^\n]*"
    r"|\\begin\{array\}\{[^{}]*\}|\\begin\{(?:alignat|alignedat)\*?\}\{\d+\}"
    r"|\\(?:begin|end)\{[a-zA-Z*]+\}"
    r"|\\(?:label|color|textcolor|hspace\*?|vspace\*?|mspace|rule)\{[^{}]*\}"
    r"|\\(?:kern|mkern|mskip|hskip)\s*-?[\d.]+\s*(?:em|ex|mu|pt|px|cm|mm|in)"
    r"|\\\\\s*\[[^\]]*\]"
)
_TEX_COMMAND = re.compile(r"\\(?:[a-zA-Z]+|.)", re.DOTALL)
_TAG = re.compile(r"<[^>]*>")
# Prose inside inline math: Markdown emphasis, or four words in a row (outside \text{}).
_PROSE_IN_MATH = re.compile(r"\*\*\s*[A-Za-z]|(?:\b[a-z]{2,}[ ,.:;]+){3}[a-z]{2,}\b")
_TEXT_ARGUMENT = re.compile(r"\\(?:text|textrm|textit|textbf|mbox|operatorname\*?|mathrm|mathit|mathbf|mathsf|mathtt)\s*\{[^{}]*\}")


def _source_letters(tex: str) -> Counter:
    """The Latin letters an equation's TeX asks to be drawn, with multiplicity."""
    return Counter(re.findall(r"[A-Za-z]", _TEX_COMMAND.sub(" ", _TEX_SILENT.sub(" ", tex))))


def _rendered_letters(mml: str) -> Counter:
    """The Latin letters in the token elements of MathJax's MathML (mi, mn, mo, mtext)."""
    return Counter(re.findall(r"[A-Za-z]", html.unescape(_TAG.sub(" ", mml))))


def _raw_tex_problems(texts: list[str]) -> list[str]:
    """Raw TeX in the visible text outside code and typeset math, one entry per text."""
    return [f"raw TeX {sorted({m.group(0) for m in RAW_TEX.finditer(t)})} left in the visible "
            f"text: {' '.join(t.split())[:120]!r}" for t in texts if RAW_TEX.search(t)]


def _math_problems(items: list[dict]) -> list[str]:
    """Equations that render less than their TeX, and inline math that swallowed prose.

    Each item is {"tex", "display", "mml"} (_MATH_JS). The letters of the source must all be
    in the rendering; a letter the rendering lacks is a piece of the equation TeX consumed as
    something else (an option, a length) instead of drawing it.
    """
    problems = []
    for item in items:
        kind = "display equation" if item["display"] else "inline math"
        missing = _source_letters(item["tex"]) - _rendered_letters(item["mml"])
        tex = " ".join(item["tex"].split())
        if missing:
            problems.append(f"{kind} renders without {''.join(sorted(missing.elements()))!r} of its "
                            f"source (a lost left-hand side?): {tex[:110]!r}")
        if not item["display"] and _PROSE_IN_MATH.search(_TEXT_ARGUMENT.sub(" ", item["tex"])):
            problems.append(f"inline math holds prose (a stray $ before it?): {tex[:110]!r}")
    return problems


# Citation labels: the alpha labels of pybtex ([VSP+17], [Sha20], [BPRS18], [ALTdJ+23] for a
# "de Jong", with a letter added to tell two apart) and the shorthand of the source notes
# ([note 004]).
READABLE_CITATION = re.compile(r"[A-Z][A-Za-z]{1,5}\+?\d{2}[a-z]?|note \d{3}")


def _citation_problems(base_url: str, links: list[dict], labels: list[str]) -> list[str]:
    """Every citation on the page, and every label of a bibliography on it, is readable.

    A citation is a link to a bibliography entry (an id of a div.citation in the build)."""
    base = urlsplit(base_url)
    cited = []
    for link in links:
        url = urlsplit(link["url"])
        target = posixpath.normpath(unquote(url.path)[len(base.path):] or ".")
        if url.netloc == base.netloc and unquote(url.fragment) in _citation_ids().get(target, ()):
            cited.append(link["text"])
    return [f"citation label {label!r} is not readable (expected e.g. [VSP+17] or [note 004])"
            for label in sorted(set(cited + labels)) if not READABLE_CITATION.fullmatch(label)]


@lru_cache(maxsize=None)
def _citation_ids() -> dict[str, frozenset[str]]:
    """The ids of the bibliography entries, by page: {"chapters/references.html": {...}}."""
    found = {}
    for path in BUILD.rglob("*.html"):
        ids = re.findall(r'<div class="citation" id="([^"]+)"', path.read_text(encoding="utf-8"))
        if ids:
            found[path.relative_to(BUILD).as_posix()] = frozenset(ids)
    return found


def _check_links(page_rel: str, base_url: str, links: list[dict], live_ids: set[str]) -> list[str]:
    """Every link into the build points to an existing file and, with a fragment, to an existing id."""
    problems = []
    base = urlsplit(base_url)
    for link in links:
        url = urlsplit(link["url"])
        if url.scheme not in ("http", "https") or url.netloc != base.netloc:
            continue  # mailto:, javascript:, or an external link (never loaded)
        rel = posixpath.normpath(unquote(url.path)[len(base.path):] or ".")
        if rel.startswith(".."):
            problems.append(f"link {link['raw']!r} leaves the build")
            continue
        target = BUILD / rel
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            problems.append(f"link {link['raw']!r}: {target.relative_to(BUILD)} does not exist")
            continue
        fragment = unquote(url.fragment)
        if not fragment:
            continue
        if target.suffix != ".html":
            problems.append(f"link {link['raw']!r}: a #fragment into a non-HTML file")
        elif fragment not in _ids_of(target) and not (
            target == BUILD / page_rel and fragment in live_ids
        ):
            problems.append(f"link {link['raw']!r}: no element with id {fragment!r} in {target.relative_to(BUILD)}")
    return sorted(set(problems))


@pytest.mark.parametrize("page_rel", _pages())
def test_page(page_rel, book_server, browser_context):
    if page_rel is None:
        pytest.fail(f"no HTML pages in {BUILD}: run `make book` first", pytrace=False)

    problems: list[str] = []
    remote: list[str] = []
    page = browser_context.new_page()

    def route(route_obj):
        host = urlsplit(route_obj.request.url).hostname
        if route_obj.request.url.startswith(("http:", "https:", "ws:", "wss:")) and host not in LOCAL_HOSTS:
            remote.append(route_obj.request.url)
            route_obj.abort("blockedbyclient")
        else:
            route_obj.continue_()

    def on_request_failed(request):
        if request.url not in remote:  # aborted remote requests are reported once, below
            problems.append(f"request failed: {request.url} ({request.failure})")

    def on_response(response):
        if response.status >= 400:
            problems.append(f"HTTP {response.status}: {response.url}")

    def on_console(message):
        if message.type == "error":
            problems.append(f"console error: {message.text} ({message.location.get('url', '')})")

    page.route("**/*", route)
    page.on("requestfailed", on_request_failed)
    page.on("response", on_response)
    page.on("console", on_console)
    page.on("pageerror", lambda exc: problems.append(f"uncaught exception: {exc}"))

    url = book_server + page_rel
    try:
        response = page.goto(url, wait_until="load")
        assert response is not None and response.ok, f"{page_rel}: HTTP {response and response.status}"
        state = page.evaluate(_INSPECT_JS)
        math_items = page.evaluate(_MATH_JS)
        page.wait_for_load_state("networkidle", timeout=10_000)
        problems += _overflow_problems(page)
    finally:
        page.close()

    problems += [f"request leaves the machine: {u}" for u in remote]
    problems += [f"image did not load: {src}" for src in state["badImages"]]
    problems += _check_links(page_rel, book_server, state["links"], set(state["liveIds"]))
    if state["mathCount"] and state["mathjax"] != "typeset":
        problems.append(f"{state['mathCount']} math elements but MathJax is {state['mathjax']}")
    problems += [f"math not typeset: {tex!r}" for tex in state["untypeset"]]
    problems += [f"MathJax error: {err!r}" for err in state["errors"]]
    problems += _raw_tex_problems(state["texts"])
    problems += _math_problems(math_items)
    problems += _citation_problems(book_server, state["links"], state["citationLabels"])

    assert not problems, f"{page_rel}:\n  " + "\n  ".join(problems)


# The overflow check itself, shown failing: a deliberately wide equation, code line and table
# are added to a real page of the build, and each must be reported.
_PLANT_JS = r"""
async () => {
  const article = document.querySelector("article.bd-article");
  const math = document.createElement("div");
  math.className = "math notranslate nohighlight";
  math.textContent = "\\[" + Array.from({length: 60}, (_, i) => `x_{${i}}`).join(" + ") + "\\]";
  const code = document.createElement("div");
  code.className = "highlight";
  code.innerHTML = "<pre>" + "planted_wide_code_line = 1; ".repeat(12) + "</pre>";
  const table = document.createElement("table");
  table.innerHTML = "<tr>" + "<td>planted&nbsp;wide&nbsp;table&nbsp;cell</td>".repeat(12) + "</tr>";
  // The same table in the scroll container the theme gives every table of the book.
  const wrapped = document.createElement("div");
  wrapped.className = "pst-scrollable-table-container";
  wrapped.innerHTML = "<table><tr>" + "<td>planted&nbsp;wrapped&nbsp;table&nbsp;cell</td>".repeat(12) + "</tr></table>";
  article.append(math, code, table, wrapped);
  await MathJax.typesetPromise([math]);
}
"""


def test_overflow_check_reports_planted_wide_content(book_server, browser_context):
    page = browser_context.new_page()
    try:
        page.goto(book_server + "index.html", wait_until="load")
        page.evaluate("async () => { await MathJax.startup.promise; }")
        assert page.evaluate(_OVERFLOW_JS, True) == [], "index.html must fit before planting"
        page.evaluate(_PLANT_JS)
        problems = _overflow_problems(page)
    finally:
        page.close()
    wide = [p for p in problems if p.startswith("at 1280 px")]
    assert any("display equation" in p and "x_{0} + x_{1}" in p for p in wide), problems
    assert any("code block" in p and "planted_wide_code_line" in p for p in wide), problems
    assert any(p.startswith("at 1280 px: table") and "planted wide" in p for p in wide), problems
    assert any(p.startswith("at 1280 px: table") and "planted wrapped" in p for p in wide), problems
    # At 400 px the equation, the code and the wrapped table scroll inside their own boxes
    # (book/tfcore.css and the theme); the bare table is cut, and so reported.
    narrow = [p for p in problems if p.startswith("at 400 px")]
    assert any(p.startswith("at 400 px: table") and "cut without a scrollbar" in p
               and "planted wide" in p for p in narrow), problems
    assert not [p for p in narrow if "x_{0}" in p or "planted_wide_code" in p or "wrapped" in p], narrow


# The math and citation checks themselves, shown failing: what chapter 12 once printed (a lone
# $ around an equation Markdown had split, and an aligned block whose first left-hand side
# TeX read as a position option) and a mangled citation label are added to a real page.
_PLANT_MATH_JS = r"""
async (citationHref) => {
  const article = document.querySelector("article.bd-article");
  const para = document.createElement("p");
  para.innerHTML = 'so by the chain rule $<span class="math notranslate nohighlight">\\(dX = \\sum_r G_r\\)</span>$'
                 + ' and <span class="math notranslate nohighlight">\\(\n the **identity**: each rank already holds the replicated \\)</span>G$.';
  const display = document.createElement("div");
  display.className = "math notranslate nohighlight";
  display.textContent = "\\[\\begin{aligned}\n[Q_i \\mid K_i \\mid V_i] &= \\tilde X W^{qkv}_i + b^{qkv}_i\\\\\n"
                      + "O_i &= \\operatorname{softmax}\\bigl(Q_i K_i^\\top/\\sqrt{D_h}\\bigr) V_i\n\\end{aligned}\\]";
  const cite = document.createElement("p");
  cite.innerHTML = `as the note says [<a class="reference internal" href="${citationHref}">Sourcen00425</a>]`;
  article.append(para, display, cite);
  await MathJax.typesetPromise([para, display]);
}
"""


def test_math_and_citation_checks_report_planted_errors(book_server, browser_context):
    bibliography, ids = sorted(_citation_ids().items())[0]
    page = browser_context.new_page()
    try:
        page.goto(book_server + "index.html", wait_until="load")
        before = page.evaluate(_INSPECT_JS)
        before_math = page.evaluate(_MATH_JS)
        page.evaluate(_PLANT_MATH_JS, f"{bibliography}#{sorted(ids)[0]}")
        after = page.evaluate(_INSPECT_JS)
        after_math = page.evaluate(_MATH_JS)
    finally:
        page.close()

    def found(state, math):
        return (_raw_tex_problems(state["texts"]) + _math_problems(math)
                + _citation_problems(book_server, state["links"], state["citationLabels"]))

    assert found(before, before_math) == [], "index.html must pass before planting"
    problems = found(after, after_math)
    assert any(p.startswith("raw TeX ['$']") and "chain rule $" in p for p in problems), problems
    assert any(p.startswith("inline math holds prose") and "**identity**" in p for p in problems), problems
    lost = [p for p in problems if p.startswith("display equation renders without")]
    assert len(lost) == 1 and "'KQViii'" in lost[0] and "[Q_i \\\\mid K_i" in lost[0], problems
    assert any("'Sourcen00425' is not readable" in p for p in problems), problems
    # The labels the book uses are readable.
    for label in ("VSP+17", "Sha20", "BPRS18", "KCL+23", "note 004", "ZS19a"):
        assert READABLE_CITATION.fullmatch(label), label


# A printed table (chapter 13's layouts: one line a row, columns aligned by spaces) wraps at
# the column's edge on a wide window, where it fits, and keeps its lines on a phone, where a
# wrapped row would scatter its columns over two lines: there it scrolls inside its own box.
_PRINTED_TABLE_JS = r"""
(needle) => {
  const pre = [...document.querySelectorAll(".cell_output pre")]
    .find(p => p.textContent.includes(needle));
  if (!pre) return null;
  const style = getComputedStyle(pre);
  return { whiteSpace: style.whiteSpace, overflowX: style.overflowX,
           scrollWidth: pre.scrollWidth, clientWidth: pre.clientWidth };
}
"""


def test_printed_tables_scroll_on_a_phone(book_server, browser_context):
    page = browser_context.new_page()
    try:
        page.goto(book_server + "chapters/13_data_parallel.html", wait_until="load")
        wide = page.evaluate(_PRINTED_TABLE_JS, "sent/rank/step")
        page.set_viewport_size({"width": 400, "height": 900})
        page.wait_for_timeout(100)  # one layout pass
        narrow = page.evaluate(_PRINTED_TABLE_JS, "sent/rank/step")
        page.set_viewport_size({"width": 1280, "height": 900})
    finally:
        page.close()
    assert wide is not None, "chapter 13 no longer prints its table of layouts"
    assert wide["whiteSpace"] == "pre-wrap" and wide["scrollWidth"] <= wide["clientWidth"], wide
    assert narrow["whiteSpace"] == "pre" and narrow["overflowX"] == "auto", narrow
    assert narrow["scrollWidth"] > narrow["clientWidth"], narrow  # kept whole, so it scrolls
