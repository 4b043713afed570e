"""Print the book to one PDF: the single-page HTML build, typeset by MathJax, printed by chromium.

    python tools/print_pdf.py _build/singlehtml _build/pdf/book.pdf

The single-page build holds every chapter in order. Headless Debian chromium (the browser the
tests use) loads it from a local server, waits for MathJax to typeset every equation (SVG
output, so the PDF holds vector math), opens the collapsed cells so that the PDF shows what
an expanded page shows, and prints it. The file is written next to its destination first
and moved into place at the end, so a failed run leaves the previous PDF intact.
"""
from __future__ import annotations

import functools
import http.server
import os
import sys
import threading
from pathlib import Path

CHROMIUM = Path(os.environ.get("TFCORE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]

# Print layout: the theme's print stylesheet already hides the sidebars and buttons; these
# rules keep equations, code and figures whole on A4 and avoid breaking a line of code.
PRINT_CSS = """
@page { size: A4; margin: 16mm 14mm; }
mjx-container[display="true"] { overflow: visible !important; }
mjx-container[display="true"] svg { max-width: 100%; height: auto; }
pre { white-space: pre-wrap !important; word-break: break-all; font-size: 8pt !important; }
img { max-width: 100% !important; break-inside: avoid; }
.bd-header-article, .bd-sidebar-primary, .bd-sidebar-secondary, .headerlink,
.copybtn, .toggle-button, button { display: none !important; }
"""


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's signature)
        pass


def print_pdf(site: Path, destination: Path) -> None:
    if not (site / "index.html").is_file():
        raise SystemExit(f"error: {site}/index.html is missing: build the single-page HTML first")
    if not CHROMIUM.exists():
        raise SystemExit(f"error: {CHROMIUM} is missing: install Debian's chromium")
    from playwright.sync_api import sync_playwright

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".partial")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1000, "height": 1400})
            # One page holds the whole book: loading it and typesetting every equation takes
            # a while on a small or busy machine.
            page.set_default_timeout(600_000)
            page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(
                f"http://127.0.0.1:{server.server_address[1]}/") else r.abort())
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html", wait_until="load")
            page.evaluate("""async () => {
                await MathJax.startup.promise;
                for (const d of document.querySelectorAll("details")) d.open = true;
            }""")
            page.add_style_tag(content=PRINT_CSS)
            page.emulate_media(media="print")
            page.pdf(path=str(partial), format="A4", print_background=True,
                     display_header_footer=True, header_template="<span></span>",
                     footer_template='<div style="font-size:8px;width:100%;text-align:center">'
                                     '<span class="pageNumber"></span></div>',
                     margin={"top": "16mm", "bottom": "16mm", "left": "14mm", "right": "14mm"})
            browser.close()
        os.replace(partial, destination)
    finally:
        partial.unlink(missing_ok=True)
        server.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python tools/print_pdf.py SINGLEHTML_DIR OUTPUT.pdf")
    print_pdf(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"wrote {sys.argv[2]}")
