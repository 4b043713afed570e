"""tfcore.parallel.calculator without a browser: the fragment is self-contained and deterministic,
its models are the book's, and bad presets are refused by name. The numbers the script
computes are compared with plan() in chromium (tests/browser/test_calculator_page.py)."""
from __future__ import annotations

import re
from dataclasses import replace
from html import escape as html_escape

import pytest

from tfcore.models.decoder import DecoderConfig
from tfcore.models.sizes import decoder_sizes
from tfcore.parallel import comm, parts, pipeline, planning, volume
from tfcore.models import sizes
from tfcore.parallel.layout import REFUSALS
from tfcore.parallel.calculator import (
    PRESETS,
    REACHABLE_REFUSALS,
    calculator_html,
    model_data,
    refusal_data,
)


def test_fragment_is_self_contained_and_deterministic():
    html = calculator_html()
    assert html == calculator_html()                     # nbval compares it
    assert html.count("<script>") == 1 and html.count("</script>") == 1
    assert not re.search(r"https?:|//cdn|\bsrc=|\bhref=|@import|fetch\(|XMLHttpRequest", html)
    assert "$" not in html.split("<script>")[0]           # no raw TeX in the visible text
    for label in PRESETS:
        assert f'<option value="{html_escape(label)}"' in html


def test_presets_are_the_books_models():
    counts = {label: model_data(make())["parameters"] for label, make in PRESETS.items()}
    assert counts["GPT-2 small (124 M)"] == 124_439_808            # chapter 9
    assert counts["Llama 7B"] == 6_738_415_616                     # chapter 9
    assert round(counts["Llama 2 70B"] / 1e9, 1) == 69.0           # chapter 16
    assert round(counts["Llama 3 8B"] / 1e9, 2) == 8.03
    for make in PRESETS.values():
        config = make()
        assert model_data(config)["parameters"] == decoder_sizes(config, 1, 1)["parameters"]


def test_refusals_are_layouts_own():
    rules = {r.name: r for r in REFUSALS}
    data = refusal_data()
    assert [r["name"] for r in data] == [r.name for r in REFUSALS
                                         if r.name in REACHABLE_REFUSALS]
    for r in data:
        assert r["why"] == rules[r["name"]].why and r["fields"] == list(rules[r["name"]].fields)


def test_bad_presets_are_refused_by_name():
    tiny = DecoderConfig(vocab_size=31, max_seq_len=16, d_model=16, n_layers=2, n_heads=4)
    with pytest.raises(ValueError, match="non-empty dict"):
        calculator_html({})
    with pytest.raises(TypeError, match="DecoderConfig, got dict"):
        calculator_html({"x": {"d_model": 16}})
    with pytest.raises(ValueError, match="n_experts = 4"):
        calculator_html({"moe": replace(tiny, n_experts=4)})
    with pytest.raises(ValueError, match="n_heads"):
        calculator_html({"bad": replace(tiny, n_heads=5)})
    with pytest.raises(ValueError, match=r"unknown default\(s\) \['dpp'\]"):
        calculator_html(defaults={"dpp": 2})


def test_the_script_names_helpers_that_exist():
    """Each function of the script names the Python closed form it mirrors (module.name):
    every name must still be there, so a renamed or removed helper shows up as a stale
    comment here; and the pipeline's and accumulation's are among them."""
    html = calculator_html()
    modules = dict(comm=comm, parts=parts, pipeline=pipeline, planning=planning,
                   volume=volume, sizes=sizes)
    named = set(re.findall(r"\b(comm|parts|pipeline|planning|volume|sizes)\.([A-Za-z_]+)",
                           html))
    missing = sorted(f"{m}.{n}" for m, n in named if not hasattr(modules[m], n))
    assert not missing, missing
    for name in ("volume.layout_traffic", "volume.span_collectives", "pipeline.make_schedule",
                 "pipeline.stage_param_names", "pipeline.pipeline_bytes_sent",
                 "planning._activations", "planning._held", "volume.zero_collectives"):
        assert tuple(name.split(".")) in named, name
