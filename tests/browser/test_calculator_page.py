"""Chapter 23's offline layout calculator (tfcore.parallel.calculator), run in chromium against plan().

The calculator is a form and a plain script; for every (model, layout) of the grid below the
test fills in the form as a reader would, reads the numbers the page shows (each row of its
table carries the exact bytes in data-value) and compares them with
tfcore.parallel.plan(config, layout=Layout(...), batch=, seq=, dtype=): the fullest rank's
params, grads, optimizer, gathered, activations and total, the busiest rank's bytes per
collective and their sum, and the bubble, exactly (integers of bytes); a None of plan's must
read "not priced" (data-value "none"), and a layout plan refuses must show plan's own
message. The expected numbers are plan()'s at the time the test runs, for every case:
pipelines (GPipe, 1F1B, interleaved; with dp, tp, sp, ZeRO-1, recomputation, tied heads)
and gradient accumulation (with dp, tp, ZeRO 0-3) included.

Three pages:
* a page made now from calculator_html(), with the book's models and a few small ones that
  reach the branches they do not (uneven vocabulary, biases, ReLU, post-norm, tiled
  attention, dropout, an untied head with a bias): a broken generator fails here even when
  the built book is stale;
* the same page with a formula of the script changed (a planted bug): the grid must catch it;
* chapter 23 of the built book (`make book`): the calculator the reader gets.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.parallel import Layout, plan
from tfcore.parallel.harness import CONFIGS
from tfcore.parallel.calculator import DEFAULTS, PRESETS, calculator_html

BOOK = "GPT-2 small (124 M)", "Llama 7B", "Llama 3 8B", "Llama 2 70B"
TINY = "tiny Llama, 4 layers (this chapter's runs)"

# Small models for the branches the book's models leave out.
EXTRA = {
    "tiny": CONFIGS["tiny"](),                       # V = 31: uneven vocabulary chunks
    "small relu post-norm": DecoderConfig(vocab_size=257, max_seq_len=64, d_model=32,
                                          n_layers=4, n_heads=4, mlp="relu",
                                          norm_placement="post", tied_head=False,
                                          bias=True, position="sinusoidal"),
    "tiled dropout gqa": DecoderConfig.llama(vocab_size=61, max_seq_len=32, d_model=32,
                                             n_layers=4, n_heads=4, n_kv_heads=2,
                                             attention="tiled", dropout=0.1,
                                             attention_block_size=8, multiple_of=16),
}


# One device, two rows of float32: each case names what it changes.
BASE = dict(DEFAULTS, dp=1, tp=1, pp=1, zero=0, sp=False, recompute="none", rows=2,
            microbatches=1, virtual=1, schedule="", dtype="float32")


def _case(model, seq, **layout):
    return dict(BASE, preset=model, seq=seq, **layout)


def _grid() -> list[dict]:
    """Form values, one dict a case: the layouts of chapter 23 and their neighbours."""
    cases = []
    layouts = [
        dict(dp=8, zero=0),
        dict(dp=8, zero=1),
        dict(dp=8, zero=2, dtype="bfloat16"),
        dict(dp=6, zero=3, rows=2),                  # uneven ZeRO chunks
        dict(dp=4, tp=2),
        dict(dp=4, tp=2, zero=3, sp=True),
        dict(dp=2, tp=4, zero=1, sp=True, recompute="full", dtype="float64"),
        dict(dp=2, recompute="selective", rows=2),
        dict(dp=2, pp=4, microbatches=8, rows=1),    # 1F1B
        dict(dp=2, pp=4, microbatches=8, virtual=2, rows=1, schedule="interleaved"),
        dict(pp=2, tp=2, microbatches=4, rows=2),    # pipeline x TP
        dict(dp=2, pp=2, zero=1, microbatches=2, rows=2),   # pipeline x ZeRO-1
        dict(dp=2, microbatches=4, rows=2),          # accumulation
        dict(dp=2, pp=4, microbatches=8, rows=1, schedule="gpipe"),
        dict(pp=2, virtual=2, tp=4, sp=True, microbatches=4, rows=1),  # interleaved x SP
        dict(dp=2, pp=2, tp=2, zero=1, microbatches=4, rows=1, recompute="full"),
        dict(microbatches=4, rows=1),                # accumulation on one device
        dict(dp=4, microbatches=2, rows=1, zero=2),  # accumulation x ZeRO-2
        dict(dp=2, tp=2, microbatches=4, rows=1, zero=3, sp=True),  # x ZeRO-3 x SP
        dict(dp=2, tp=2, microbatches=2, zero=1, recompute="selective"),
        dict(tp=16, rows=1),                         # shared key/value heads (H_kv = 8)
        dict(pp=2, zero=3, microbatches=2),          # refused: ZeRO-3 with a pipeline
    ]
    seqs = {"GPT-2 small (124 M)": 1024, "Llama 7B": 2048, "Llama 3 8B": 2048,
            "Llama 2 70B": 2048}
    for model in BOOK:
        for layout in layouts:
            cases.append(_case(model, seqs[model], **layout))
    # The chapter's own model at its runs' sizes, and what plan refuses.
    cases += [
        _case(TINY, 8, dp=2, zero=3, rows=2),
        _case(TINY, 8, tp=2, rows=4, sp=True),
        _case(TINY, 8, pp=2, microbatches=4, rows=1, schedule="gpipe"),
        _case(TINY, 8, pp=2, microbatches=4, rows=1, virtual=2),
        _case(TINY, 8, dp=2, pp=2, tp=2, sp=True, zero=1, microbatches=4, rows=1, virtual=2),
        _case(TINY, 8, pp=4, microbatches=8, rows=1, schedule="1f1b", recompute="full"),
        _case(TINY, 8, dp=3, microbatches=4, rows=1, zero=3),     # uneven chunks, K = 4
        _case(TINY, 8, pp=4, microbatches=2, rows=2, schedule="interleaved"),  # m % pp
        _case(TINY, 8, pp=2, virtual=2, schedule="1f1b"),        # one-chunk schedule
        _case(TINY, 8, schedule="gpipe"),                         # schedule without pp
        _case(TINY, 8, virtual=2),                                # virtual without pp
        _case(TINY, 8, pp=3),                                     # 4 layers on 3 stages
        _case(TINY, 32, dp=1),                                    # seq > max_seq_len
        _case(TINY, 8, tp=3),                                     # heads
        _case("GPT-2 small (124 M)", 1024, tp=5, rows=1),
    ]
    for model, seq in (("tiny", 16), ("small relu post-norm", 64), ("tiled dropout gqa", 32)):
        for layout in (dict(dp=3, zero=2, rows=1), dict(dp=2, tp=2, zero=3, sp=True),
                       dict(tp=4, recompute="full"), dict(dp=2, zero=3, recompute="selective"),
                       dict(dp=2, pp=2, microbatches=2, rows=2), dict(dp=5, zero=1),
                       dict(dp=2, pp=2, tp=2, sp=True, microbatches=4, rows=1,
                            schedule="gpipe"),
                       dict(dp=3, pp=2, virtual=2, zero=1, microbatches=4, rows=1),
                       dict(pp=4, tp=4, microbatches=4, rows=1, recompute="full"),
                       dict(dp=3, tp=2, microbatches=4, rows=1, zero=3),
                       dict(tp=2, microbatches=2, rows=2, recompute="selective")):
            cases.append(_case(model, seq, **layout))
    return cases


GRID = _grid()
ALL_MODELS = {**{k: f() for k, f in PRESETS.items()}, **EXTRA}


def expected(case: dict) -> dict:
    """What the page must show for `case`, from plan(): {row key: exact bytes or 'none'},
    or {'refused': plan's message}."""
    config = replace(ALL_MODELS[case["preset"]], recompute=case["recompute"])
    layout = Layout(dp=case["dp"], tp=case["tp"], pp=case["pp"] if case["pp"] > 1 else None,
                    zero=case["zero"], sp=case["sp"], micro_batches=case["microbatches"],
                    virtual=case["virtual"], schedule=case["schedule"] or None)
    batch = case["dp"] * case["microbatches"] * case["rows"]
    try:
        p = plan(config, layout=layout, batch=batch, seq=case["seq"], dtype=case["dtype"])
    except ValueError as e:
        return {"refused": str(e)}
    rows = {}
    for key in ("params", "grads", "optimizer", "gathered", "activations", "total"):
        value = None if p.memory is None else p.memory[key]
        rows[f"memory {key}"] = "none" if value is None else str(value)
    rows["sent"] = "none" if p.sent is None else str(max(p.sent))
    for key, value in (p.traffic or {}).items():
        rows[f"sent {key}"] = str(value)
    rows["bubble"] = p.bubble
    return rows


# Fills in the form (every field, as a reader would) and reads what the page shows.
_DRIVE_JS = r"""
(cases) => cases.map((c) => {
  const root = document.querySelector(".tfcore-calculator");
  const form = root.querySelector("form");
  const unset = [];
  for (const [name, value] of Object.entries(c)) {
    const field = form.elements[name];
    if (!field) { unset.push(name); continue; }
    if (field.type === "checkbox") field.checked = value;
    else field.value = String(value);
    if (field.type !== "checkbox" && field.value !== String(value)) unset.push(name);
  }
  form.dispatchEvent(new Event("input", { bubbles: true }));
  const refused = root.querySelector(".tc-refused");
  if (refused) return { unset, refused: refused.textContent };
  const rows = {};
  for (const tr of root.querySelectorAll("tr[data-key]")) rows[tr.dataset.key] = tr.dataset.value;
  const shown = [...root.querySelectorAll("tr[data-key]")]
    .filter((tr) => tr.dataset.value === "none")
    .map((tr) => tr.textContent);
  return { unset, rows, shown };
})
"""


def _differences(cases: list[dict], results: list[dict]) -> list[str]:
    """Every case whose page disagrees with plan(), one line each."""
    assert len(results) == len(cases)
    problems = []
    for case, got in zip(cases, results):
        name = ", ".join(f"{k}={v}" for k, v in case.items() if BASE.get(k) != v
                         or k in ("preset", "seq"))
        if got["unset"]:
            problems.append(f"{name}: the form has no value {got['unset']}")
            continue
        want = expected(case)
        if "refused" in want or "refused" in got:
            if got.get("refused") != "Refused: " + want.get("refused", "(priced)"):
                problems.append(f"{name}: plan says {want.get('refused', 'priced')!r}, the "
                                f"page {got.get('refused', 'priced')!r}")
            continue
        rows = dict(got["rows"])
        bubble = rows.pop("bubble", None)
        want_bubble = want.pop("bubble")
        if bubble is None or float(bubble) != want_bubble:
            problems.append(f"{name}: bubble {bubble} != plan's {want_bubble}")
        if rows != want:
            diff = {k: (rows.get(k), want.get(k)) for k in sorted(set(rows) | set(want))
                    if rows.get(k) != want.get(k)}
            problems.append(f"{name}: (page, plan) differ: {diff}")
        if any("not priced" not in text for text in got["shown"]):
            problems.append(f"{name}: a None of plan's is not shown as 'not priced'")
    return problems


def _open(page, problems):
    """Fail the page on a console error or an exception. The browser's own request for
    /favicon.ico (the book has none) is not the page's."""
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" and not m.location.get("url", "").endswith("/favicon.ico")
            else None)
    page.on("pageerror", lambda e: problems.append(f"uncaught exception: {e}"))


def _generated_page(browser_context, html: str):
    page = browser_context.new_page()
    problems: list[str] = []
    _open(page, problems)
    page.route("**/*", lambda route: (problems.append(f"request: {route.request.url}"),
                                      route.abort())[1])
    page.set_content(f"<!DOCTYPE html><html><body>{html}</body></html>")
    return page, problems


def test_grid_covers_the_models_and_layouts():
    assert len(GRID) >= 30
    assert {c["preset"] for c in GRID} == set(PRESETS) | set(EXTRA)
    outcomes = [expected(c) for c in GRID]
    refused = sum("refused" in o for o in outcomes)
    unpriced = sum("refused" not in o and o["sent"] == "none" for o in outcomes)
    no_activations = sum(o.get("memory activations") == "none" and o.get("sent") != "none"
                         for o in outcomes)
    priced = len(GRID) - refused - unpriced
    # every kind of answer is in the grid: priced, priced without activations (bfloat16
    # and float16), refused (plan now prices every layout the form reaches); and every
    # collective of the closed forms
    assert refused >= 12 and unpriced == 0 and no_activations >= 3 and priced >= 100, (
        refused, unpriced, no_activations, priced)
    keys = {k for o in outcomes for k in o}
    for key in ("sent tp all_reduce", "sent tp reduce_scatter", "sent tp all_gather",
                "sent dp all_reduce", "sent dp reduce_scatter", "sent dp all_gather",
                "sent kv all_reduce", "sent pp send", "sent pp broadcast",
                "sent embedding all_reduce"):
        assert key in keys, key
    # the pipelines and accumulations the page prices: every schedule, with dp, tp (sp),
    # ZeRO-1 and recomputation; K = 2 and 4 micro-batches under ZeRO 0-3
    done = [c for c, o in zip(GRID, outcomes) if "refused" not in o]
    pipes = [c for c in done if c["pp"] > 1]
    accumulations = [c for c in done if c["pp"] == 1 and c["microbatches"] > 1]
    assert len(pipes) + len(accumulations) >= 45, (len(pipes), len(accumulations))
    assert {c["schedule"] or ("interleaved" if c["virtual"] > 1 else "1f1b")
            for c in pipes} == {"gpipe", "1f1b", "interleaved"}
    assert {c["pp"] for c in pipes} >= {2, 4} and any(c["virtual"] == 2 for c in pipes)
    for want in (dict(sp=True), dict(zero=1), dict(recompute="full")):
        (k, v), = want.items()
        assert any(c[k] == v and c["dp"] > 1 < c["tp"] for c in pipes), want
    assert {c["zero"] for c in accumulations} == {0, 1, 2, 3}
    assert {c["microbatches"] for c in accumulations} >= {2, 4}
    assert any(c["tp"] > 1 for c in accumulations) and any(
        c["dp"] * c["tp"] == 1 for c in accumulations)


def test_generated_calculator_agrees_with_plan(browser_context):
    html = calculator_html({**PRESETS, **EXTRA})
    assert "http" not in html.replace("aria-live", "")     # nothing to fetch
    page, problems = _generated_page(browser_context, html)
    try:
        results = page.evaluate(_DRIVE_JS, GRID)
    finally:
        page.close()
    problems += _differences(GRID, results)
    assert not problems, "\n  ".join([f"{len(problems)} problems:"] + problems[:20])


# A formula of the script changed, as a slip would change it: each must make a case of the
# grid disagree with plan().
PLANTS = [
    # ZeRO-3 holds the gathered units once, not with the gradients' as well
    ("grads: Z + u.Mmax, optimizer: 2n * Z", "grads: Z, optimizer: 2n * Z"),
    # ring all-gather: M - c_{r+1} taken as M - c_r (differs where chunks are uneven)
    ('if (op === "all_gather") return M - c(r + 1);',
     'if (op === "all_gather") return M - c(r);'),
    # the cross-entropy's three all-reduces of [B, S] forgotten
    ('if (last) calls.push(["all_reduce", tok, 3]);', ""),
    # GELU keeps its input and output: counted once
    ("{ gelu: 2, relu: 1, swiglu: 3 }", "{ gelu: 1, relu: 1, swiglu: 3 }"),
    # 1F1B warms up with p - r forwards, one too many: a deeper peak of caches
    ("const warm = Math.min(p - r - 1, m);", "const warm = Math.min(p - r, m);"),
    # the pipeline's gradient messages counted from the last virtual stage, not from all
    # but virtual stage 0
    ("+ chunks.filter((c) => c !== 0).length;",
     "+ chunks.filter((c) => c !== pp * v - 1).length;"),
]


@pytest.mark.parametrize("plant", PLANTS, ids=range(len(PLANTS)))
def test_a_planted_formula_is_caught(browser_context, plant):
    old, new = plant
    html = calculator_html({**PRESETS, **EXTRA})
    assert html.count(old) == 1, f"the script no longer has {old!r}"
    page, problems = _generated_page(browser_context, html.replace(old, new))
    try:
        results = page.evaluate(_DRIVE_JS, GRID)
    finally:
        page.close()
    assert not problems, problems
    assert _differences(GRID, results), f"the grid does not notice {new!r} for {old!r}"


def test_book_calculator_agrees_with_plan(book_server, browser_context):
    page = browser_context.new_page()
    problems: list[str] = []
    _open(page, problems)
    try:
        page.goto(book_server + "chapters/23_planning_a_run.html", wait_until="load")
        assert page.locator(".tfcore-calculator form").count() == 1, (
            "chapter 23 does not show the calculator")
        models = page.evaluate(
            "() => [...document.querySelector('.tfcore-calculator select[name=preset]')"
            ".options].map((o) => o.value)")
        assert models == list(PRESETS), models
        book_grid = [c for c in GRID if c["preset"] in PRESETS]
        results = page.evaluate(_DRIVE_JS, book_grid)
    finally:
        page.close()
    problems += _differences(book_grid, results)
    assert not problems, "\n  ".join([f"{len(problems)} problems:"] + problems[:20])
