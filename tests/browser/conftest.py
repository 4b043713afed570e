"""Fixtures of the browser test: a local web server for _build/html and a headless Chromium.

The browser is Debian's chromium (``/usr/bin/chromium``, installed by ``make test``), driven
by the pip package ``playwright`` through ``executable_path``: no browser is downloaded.
The server is a thread of the test session bound to 127.0.0.1, so every request a page makes
either goes to it or is a request that leaves the machine (and fails the test).
"""
from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# TFCORE_BOOK_HTML checks another HTML build of the book than `make book`'s _build/html.
BUILD = Path(os.environ.get("TFCORE_BOOK_HTML", ROOT / "_build" / "html"))
CHROMIUM = Path(os.environ.get("TFCORE_CHROMIUM", "/usr/bin/chromium"))

# Headless, and quiet: no background traffic of the browser itself (updates, sync, QUIC probes).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the build directory; logs nothing (the test reports what went wrong)."""

    def log_message(self, format, *args):  # noqa: A002 (the base class's signature)
        pass


@pytest.fixture(scope="session")
def book_server():
    """Base URL (ending in '/') of a local HTTP server for _build/html, for the whole session."""
    if not BUILD.is_dir():
        pytest.fail(f"{BUILD} does not exist: run `make book` first", pytrace=False)
    handler = functools.partial(_QuietHandler, directory=str(BUILD))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="book-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="session")
def browser():
    """One headless Debian chromium for the session."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium "
            "(`apt-get install -y --no-install-recommends chromium`, or run `make test` as root)",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def browser_context(browser):
    """A browser context with no service workers and a fixed viewport."""
    context = browser.new_context(service_workers="block", viewport={"width": 1280, "height": 900})
    context.set_default_timeout(90_000)  # generous: a busy 2-core machine is slow
    try:
        yield context
    finally:
        context.close()
