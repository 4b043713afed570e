# The two commands of the README:
#   make book   set up .venv and build the book into _build/html/
#   make test   set up, build the book (warnings are errors) and run the whole test suite:
#               the unit tests in tests/, every notebook in chapters/ (nbval) and the
#               browser test of the rendered pages, in one pytest run.
# Both are idempotent: a second run installs nothing, and builds the book again only if a
# source of it changed.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := book

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Written after a successful install; pip runs again only when one of these files changes.
STAMP  := $(VENV)/.installed
# Written into _build/html after a build with zero warnings. The book is built again only
# when a source changed since (a page, the configuration, the table of contents, the
# bibliography, the vendored MathJax, the installed packages; the folders are listed too, so
# that adding or removing a page counts), and then always from scratch: an incremental
# Sphinx build forgets the warnings of unchanged pages and keeps pages that were removed.
BOOK_OK := _build/html/.book-ok
BOOK_SOURCES := index.md _config.yml _toc.yml references.bib chapters book/mathjax \
    $(shell find chapters book -type f -not -path '*/.ipynb_checkpoints/*' -not -path '*/__pycache__/*' 2>/dev/null)

# pytest-xdist: notebooks are distributed whole (one kernel per notebook) over 2 workers.
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: book pdf test setup chromium clean help

help:
	@echo "make book   set up .venv and build the book into _build/html/"
	@echo "make test   set up, build the book and run every test (unit, notebooks, browser)"
	@echo "make pdf    set up, build, and print the whole book to _build/pdf/book.pdf"
	@echo "make clean  remove _build/ (keeps .venv)"

setup: $(STAMP)

$(BIN)/python:
	@echo "$(PYTHON) -m venv $(VENV)"
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	    echo "error: '$(PYTHON) -m venv' failed; on Debian install python3-venv" >&2; exit 1; }

$(STAMP): requirements.txt constraints.txt pyproject.toml | $(BIN)/python
	@echo "Installing requirements.txt and tfcore into $(VENV) (about a minute the first time) ..."
	$(BIN)/python -m pip install --disable-pip-version-check -q -r requirements.txt -c constraints.txt -e .
	@# Build matplotlib's font cache now, so that no notebook prints it on stderr.
	$(BIN)/python -c "import matplotlib.pyplot"
	touch $@

book: $(BOOK_OK)
	@echo "The book is in _build/html/ (open _build/html/index.html)."

$(BOOK_OK): $(STAMP) $(BOOK_SOURCES)
	rm -rf _build/html _build/.doctrees
	$(BIN)/jupyter-book build -W -n --keep-going .
	touch $@

# The whole book as one PDF: the single-page HTML build, printed by headless chromium with
# every equation typeset (tools/print_pdf.py). Rebuilt whenever the HTML book was.
PDF := _build/pdf/book.pdf

pdf: $(PDF)
	@echo "The PDF is $(PDF)."

$(PDF): $(BOOK_OK) | chromium
	rm -rf _build/singlehtml
	$(BIN)/jupyter-book build -W -n --keep-going --builder singlehtml . >/dev/null
	$(BIN)/python tools/print_pdf.py _build/singlehtml $@

chromium:
	@bash tools/install-chromium.sh

test: book pdf chromium
	OPENBLAS_NUM_THREADS=$${OPENBLAS_NUM_THREADS:-1} $(BIN)/python -m pytest tests chapters \
	    --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
	    -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

clean:
	rm -rf _build
