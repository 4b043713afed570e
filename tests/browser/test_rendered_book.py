"""Every page of the built book, opened in a real browser (headless Debian chromium).

One test per HTML file of _build/html, so that a failure names the page. A page fails on

* any request that would leave the machine (host other than 127.0.0.1/localhost; it is
  aborted, so the page sees what an offline reader sees),
* any failed request or HTTP status >= 400, any console error, any uncaught exception,
* any <img> that did not load,
* any link into the build that does not resolve: the target file must exist and its
  #fragment must be the id of an element of the target page,
* any MathJax error, and any math that was not typeset: after MathJax.startup.promise every
  element of class "math" holds an <mjx-container>, and no raw TeX delimiter (\\( \\) \\[ \\] $$)
  is left in the visible text outside code.

Every page of the build is opened, genindex.html and search.html included: both are plain
local pages (search.html loads searchindex.js from the build).

Build the book first (`make book`); `make test` does both.
"""
from __future__ import annotations

import html.parser
import posixpath
import re
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest


BUILD = Path(__file__).resolve().parents[2] / "_build" / "html"
LOCAL_HOSTS = {"127.0.0.1", "localhost"}
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$")


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
    raw: a.getAttribute("href"), url: a.href }));
  const liveIds = Array.from(document.querySelectorAll("[id]")).map(el => el.id);
  return { badImages, mathCount: mathElements.length, mathjax, untypeset, errors, texts, links, liveIds };
}
"""


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
        page.wait_for_load_state("networkidle", timeout=10_000)
    finally:
        page.close()

    problems += [f"request leaves the machine: {u}" for u in remote]
    problems += [f"image did not load: {src}" for src in state["badImages"]]
    problems += _check_links(page_rel, book_server, state["links"], set(state["liveIds"]))
    if state["mathCount"] and state["mathjax"] != "typeset":
        problems.append(f"{state['mathCount']} math elements but MathJax is {state['mathjax']}")
    problems += [f"math not typeset: {tex!r}" for tex in state["untypeset"]]
    problems += [f"MathJax error: {err!r}" for err in state["errors"]]
    raw = sorted({m.group(0) for t in state["texts"] for m in RAW_TEX.finditer(t)})
    if raw:
        sample = next(t for t in state["texts"] if RAW_TEX.search(t)).strip()[:120]
        problems.append(f"raw TeX {raw} left in the visible text, e.g. {sample!r}")

    assert not problems, f"{page_rel}:\n  " + "\n  ".join(problems)
