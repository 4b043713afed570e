"""One notation for the whole book: chapter 1's table defines every symbol once, the pages
use it, and every notebook stores its cells' sources as lists of lines.

The drift check reads the mathematics ($...$ and $$...$$) of every markdown cell of every
chapter and of the Markdown pages, and flags the uses that the table rules out: the MLP width
written D_ff (it is F), N_d for the data-parallel size (N_D), the loss written L(...) or as a
bare \\ell (it is \\mathcal{L}; \\ell carries a token's subscript), hidden states written
h_t or h^{(l)} (they are X; h is the finite-difference step), the token count written
N = BS or N_valid (it is T = BS and T_c), and, for the chapters on training at scale, the
micro-batches counted as K or m (it is n_\\mu; K is the key matrix, m a running maximum), the
pipeline stages as p (N_P; p is a dropout probability), the bytes per element as b (f; b is
a bias), the row log-sum-exp as \\lambda (lse) and a tile side as \\beta (B_r, B_c). The
errata appendices and the page of source notes quote the notes and the papers in their own
notation, so they are not checked.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
QUOTING = {"appendix_errata.ipynb", "appendix_errata_references.ipynb",
           "source_notes.md"}  # quote the notes' and the papers' notation

# The notation every contributor uses (chapter 1's table must define each, once).
REQUIRED = ("T", "T_c", "N", "L", "H", "D_h", "F", "N_T", "N_D", "X", "h", r"\epsilon",
            r"\mathcal{L}", r"\ell_t", "G",
            # the chapters on training at scale (15 to 23)
            "f", "m", r"n_\mu", r"B_\mu", "N_P", "N_C", "p", "B_r", "B_c", r"\mathrm{lse}",
            r"H_\text{kv}", "c", "c_r", r"\Psi")

NOT_AFTER = r"(?<![\\A-Za-z_{^])"  # not part of a longer name, a subscript or a command
DRIFT = {
    "D_ff (the MLP width is F)":
        re.compile(r"[Dd]_\{?\s*(?:\\(?:text|mathrm|rm)\s*\{\s*)?ff\b"),
    "N_d (the data-parallel size is N_D)": re.compile(r"N_\{?d\}?(?![A-Za-z_])"),
    # L(x), L(\theta): a function, the loss; L(4D^2 + ...) is the layer count times a sum
    # and the loss differentiated as \partial L, \nabla L or dL
    "L for the loss (it is \\mathcal{L})": re.compile(
        r"(?<!\\mathcal )(?<!\\mathcal)" + NOT_AFTER
        + r"L\s*\((?=\s*(?:\\theta|[a-z]))"
        + r"|\\(?:nabla|partial)\s*L(?![A-Za-z_{])|(?<![A-Za-z\\])dL(?![A-Za-z_])"
    ),
    "\\ell without a token subscript (the loss is \\mathcal{L})":
        re.compile(r"(?:\\ell|ℓ)(?![_A-Za-z])"),
    # h_t, h_l, h^{(l)}; h times a weight (h W, h\,W); a weight's gradient G^T h; h = tanh(.)
    "h for hidden states (they are X; h is the step)": re.compile(
        NOT_AFTER + r"h(?:_\{?[tl]\}?(?![A-Za-z0-9])|\^\{?\(l\))"
        + "|" + NOT_AFTER + r"h\s*(?:\\[,;: ]\s*)?W"
        + r"|\\top\s*h(?![A-Za-z_{^])"
        + "|" + NOT_AFTER + r"h\s*=\s*\\(?:tanh|operatorname|mathrm|max|sigma)"
    ),
    "N = BS for the tokens (it is T)":
        re.compile(r"(?<![A-Za-z_])N\s*=\s*B\s*(?:\\cdot\s*)?S"),
    "N_valid / N_tok for the counted tokens (it is T_c)":
        re.compile(r"N_\{?\\(?:text|mathrm)\{(?:valid|tok)"),
    # 1/K, T_c/K: an accumulation weight over K micro-batches (K is the key matrix)
    "K for the micro-batches (it is n_\\mu)":
        re.compile(r"(?<![A-Za-z_])(?:1|T_c)\s*/\s*K(?![A-Za-z_])"),
    # Mb, Nb, \Psi = Nb, (N + 2)\,b, N^{(t)} b, \lceil .. \rceil b: a count of elements times
    # b (a bias is added, never multiplied by a count)
    "b for bytes per element (it is f; b is a bias)": re.compile(
        r"(?:[MN]|\\Psi|\)|\\rceil|\(t\)\}|\\text\{loc\})\s*(?:\\[,;]\s*)?b(?![A-Za-z_{^])"),
    # p = N_P, the bubble (p - 1)/.., \min(p - r, ..), L/p and L/(pv) blocks, pv | L
    "p for the pipeline stages (it is N_P; p is a dropout probability)": re.compile(
        NOT_AFTER + r"p\s*=\s*N_P|\(\s*p\s*-\s*1\s*\)\s*/|\\min\s*\(\s*p\s*-|" + NOT_AFTER
        + r"p\s*-\s*r(?![A-Za-z_])|L\s*/\s*\(?\s*p\s*v?\s*\)?(?![A-Za-z_])|" + NOT_AFTER
        + r"p\s*v?\s*\\mid"),
    # the bubble ../m and ../(vm), B/(N_D m), \min(.., vm), m B_m: m counting micro-batches
    "m for the micro-batches (it is n_\\mu; m is a running maximum)": re.compile(
        r"-\s*1\s*\)\s*/\s*\(?\s*v?\s*(?:\\,\s*)?m(?![A-Za-z_])|N_D\s*m(?![A-Za-z_])"
        r"|\(\s*v\s*(?:\\,\s*)?m\s*\)|,\s*v\s*m\s*\)|(?<![A-Za-z_\\])m\s*B_"),
    # \lambda_i, \lambda = \log .., e^{.. - \lambda}, (Y, \lambda): a row's log-sum-exp (the
    # weight decay \lambda is neither subscripted nor an exponent's shift)
    "\\lambda for the log-sum-exp (it is \\mathrm{lse})": re.compile(
        r"\\lambda\s*_|\\lambda\s*=\s*\\log|-\s*\\lambda(?![A-Za-z])\s*\}|\(\s*Y\s*,\s*\\lambda\s*\)"),
    # n_\beta tiles, \beta x \beta tiles, \beta^2 per tile (\beta stays the seconds per byte of
    # the alpha-beta model and the optimizer's and normalization's parameters)
    "\\beta for a tile side (they are B_r, B_c)":
        re.compile(r"n_\{?\\beta|\\beta\s*\\times\s*\\beta|\\beta\s*\^\s*2"),
}
MATH = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$", re.S)


def math_of(text: str) -> list[str]:
    """The contents of every $...$ and $$...$$ in a Markdown text."""
    return [m.group(1) if m.group(1) is not None else m.group(2) for m in MATH.finditer(text)]


def drift(text: str) -> list[tuple[str, str]]:
    """[(rule, the offending math)] for every use of a symbol the table rules out."""
    found = []
    for math in math_of(text):
        for rule, pattern in DRIFT.items():
            if pattern.search(math):
                found.append((rule, math.strip()[:80]))
    return found


def markdown_of(path: Path) -> list[str]:
    if path.suffix == ".md":
        return [path.read_text()]
    cells = json.loads(path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def pages() -> list[Path]:
    return sorted(CHAPTERS.glob("*.ipynb")) + sorted(CHAPTERS.glob("*.md")) + [ROOT / "index.md"]


def _normalize(symbol: str) -> str:
    symbol = symbol.strip().strip("$").replace(" ", "")
    return re.sub(r"\\mathcal([A-Z])", r"\\mathcal{\1}", symbol)


def notation_table() -> dict[str, list[str]]:
    """{symbol: [meanings]} from the table under '| symbol | meaning |' in chapter 1."""
    texts = markdown_of(CHAPTERS / "01_introduction.ipynb")
    tables = [t for t in texts if "| symbol | meaning |" in t]
    assert len(tables) == 1, "chapter 1 must have exactly one notation table"
    rows = tables[0].split("| symbol | meaning |", 1)[1].splitlines()[2:]
    table: dict[str, list[str]] = {}
    for row in rows:
        if not row.startswith("|"):
            break
        first, meaning = row.strip("|").split("|", 1)
        # "$H$, $D_h$" and "$B, S, D$" both name several symbols; "$y = xW + b$" names one
        cell = first.strip()
        names = re.findall(r"\$([^$]+)\$", cell) or [cell]
        for name in names:
            parts = [name] if "=" in name else name.split(",")
            for part in parts:
                table.setdefault(_normalize(part), []).append(meaning.strip())
    return table


def test_the_table_defines_the_book_notation_once():
    table = notation_table()
    missing = [s for s in REQUIRED if s not in table]
    assert not missing, f"chapter 1's notation table lacks {missing}"
    twice = {s: m for s, m in table.items() if len(m) > 1}
    assert not twice, f"symbols defined in more than one row: {twice}"


def test_the_table_gives_the_agreed_meanings():
    table = notation_table()
    expected_words = {"T": "tokens", "T_c": "count", "N": "parameters", "L": "layers",
                      "F": "MLP", "N_T": "tensor-parallel", "N_D": "data-parallel",
                      "X": "hidden states", "h": "finite-difference step",
                      r"\epsilon": "normalization", r"\mathcal{L}": "loss",
                      r"\ell_t": "token", "G": "upstream gradient", "H": "heads",
                      "f": "bytes per element", r"n_\mu": "micro-batches",
                      "N_P": "pipeline stages", "p": "dropout", "m": "running maximum",
                      r"\mathrm{lse}": "log-sum-exp", "B_r": "tile", "B_c": "tile",
                      r"H_\text{kv}": "key/value heads", r"\Psi": "bytes"}
    for symbol, word in expected_words.items():
        assert word in table[symbol][0], (symbol, table[symbol][0], word)


@pytest.mark.parametrize("page", [p for p in pages() if p.name not in QUOTING],
                         ids=lambda p: p.name)
def test_pages_use_the_tables_notation(page):
    found = [(rule, math) for text in markdown_of(page) for rule, math in drift(text)]
    assert not found, f"{page.name}: " + "; ".join(f"{r}: ${m}$" for r, m in found)


PLANTED = [
    r"the MLP is $[B, S, D_\text{ff}]$", r"$D_{ff} = 4D$", r"$D_\mathrm{ff}$", r"$d_{ff}$",
    r"$N_d$ replicas", r"$N_{d}$ replicas", r"$L(\theta) = \frac1T \sum_t \ell_t$",
    r"$\ell = -\log p$", r"a loss $ℓ$", r"$h_t = \mathrm{LN}(x_t)$", r"$h^{(l)}$",
    r"$h_{l}$", r"$Z = h\,W_E^\top$", r"$dZ^\top h$", r"$h = \tanh(Z)$", r"$y = hW$",
    r"$N = B \cdot S$ tokens", r"$N = BS$", r"$dZ = P / N_\text{valid}$",
    r"$$\begin{aligned} y &= L(x) \end{aligned}$$", r"$\partial L / \partial X$",
    r"$\nabla L$", r"$\frac{dL}{dx}$", r"$w_k = 1/K$", r"$c_k = T_c/K$",
    r"$2\frac{N_T-1}{N_T}Mb$", r"$\Psi = Nb$", r"$(N + 2)\,b$", r"$2N^{(t)} b$",
    r"$2\lceil N/N_D\rceil b$", r"$p = N_P$ stages", r"$(p-1)/m$", r"$\min(p - r, m)$",
    r"$L/p$ blocks", r"$L/(pv)$", r"$pv \mid L$", r"$(N_P-1)/m$", r"$(N_P - 1)/(vm)$",
    r"$B_\mu = B/(N_D m)$", r"$\min(2, vm)$", r"$m B_\mu S D f$",
    r"$P = e^{Z - \lambda_I}$", r"$\lambda = \log(e^{a} + e^{b})$", r"$(Y, \lambda)$",
    r"$e^{z - \lambda}$", r"$n_\beta$ tiles", r"$\beta \times \beta$", r"$2\beta^2 D_h$",
]
CLEAN = [
    r"$F = 4D$", r"$N_D$ replicas", r"$N_T$ ranks", r"$\mathcal{L}(\theta)$", r"$\ell_t$",
    r"$\ell_{t}$", r"$X_L$ the last hidden states", r"$h = 10^{-6}$", r"$h^\ast$",
    r"$(\mathcal L(x + hU) - \mathcal L(x - hU))/2h$", r"$W_{Q,h}$", r"$(b, h)$",
    r"$T = B \cdot S$", r"$dZ = P / T_c$", r"$6NT$", r"$\mathcal L$", r"$D_h$",
    r"$\frac{\partial \mathcal{L}}{\partial X}$", "plain text: L(x) and N = BS outside math",
    r"$N_\text{mm} = L(4D^2 + 2DF) + DV$", r"$L(8TD + 2T)$", r"$\mathcal L(\theta + h u)$",
    r"$\partial \mathcal{L} / \partial X_L$", r"$\nabla_\theta \mathcal L$", r"$dX_L$",
    r"$w_k = c_k / T_c$", r"$1/n_\mu$", r"$\sum_{k=1}^{K} a_{ik} b_{kj}$", r"$1/K_J$",
    r"$y = xW + b$", r"$Y = XW + \mathbf{1} b$", r"$db = \sum_{b,s} G_{b,s}$",
    r"$2\frac{N_T-1}{N_T}Mf$", r"$\Psi = Nf$", r"$y = x \odot m / (1 - p)$", r"$(p-1)!!$",
    r"$\mathbb E[x^p]$", r"$(N_P - 1)/n_\mu$", r"$(N_P-1)/(v\,n_\mu)$", r"$s = c N_P + r$",
    r"$m_t = \beta_1 m_{t-1}$", r"$m = \max(m_X, m_Y)$", r"$\alpha + Mf/\beta$",
    r"$\theta_t = (1 - \eta\lambda)\,\theta_{t-1}$", r"$\mathrm{lse}_I$", r"$\beta_2^t$",
    r"$y = \gamma \odot \hat x + \beta$", r"$n_c(n_c + 1)/2$", r"$2 B_r B_c D_h$",
]


@pytest.mark.parametrize("text", PLANTED)
def test_the_checker_flags_a_planted_symbol(text):
    assert drift(text), f"not flagged: {text}"
    assert drift(f"Some prose, then {text} and more.")  # inside a longer text too


@pytest.mark.parametrize("text", CLEAN)
def test_the_checker_leaves_the_book_notation_alone(text):
    assert drift(text) == []


def test_a_planted_row_twice_in_the_table_is_caught(tmp_path, monkeypatch):
    nb = json.loads((CHAPTERS / "01_introduction.ipynb").read_text())
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if "| symbol | meaning |" in text:
            text = text.replace("| $u$ |", "| $T$ | the target of a regression |\n| $u$ |")
            cell["source"] = text.splitlines(keepends=True)
    (tmp_path / "01_introduction.ipynb").write_text(json.dumps(nb))
    monkeypatch.setattr(sys.modules[__name__], "CHAPTERS", tmp_path)
    with pytest.raises(AssertionError, match="more than one row"):
        test_the_table_defines_the_book_notation_once()


@pytest.mark.parametrize("notebook", sorted(CHAPTERS.glob("*.ipynb")), ids=lambda p: p.name)
def test_every_cell_source_is_a_list_of_lines(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    for i, cell in enumerate(cells):
        source = cell["source"]
        assert isinstance(source, list), f"{notebook.name} cell {i}: source is not a list"
        assert all(isinstance(line, str) for line in source)
        assert all(line.endswith("\n") for line in source[:-1]), (
            f"{notebook.name} cell {i}: a line other than the last lacks its newline")
        assert all("\n" not in line[:-1] for line in source), (
            f"{notebook.name} cell {i}: a list item holds more than one line")
