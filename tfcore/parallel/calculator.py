"""An offline layout calculator: plan()'s numbers for the fullest rank, in plain JavaScript.

    html = calculator_html()                  # the HTML fragment chapter 23 displays
    html = calculator_html({"mine": config})  # other models (dense decoders)

The fragment is a form (model, dp, tp, pp, ZeRO stage, sequence parallelism, recompute,
rows per micro-batch, micro-batches, virtual stages, schedule, sequence length, dtype) and
a script that needs no library and no network. For a layout it shows what
tfcore.parallel.plan returns for it: the fullest rank's parameters, gradients, AdamW state,
gathered units, activations and total (plan's `memory`), the bytes the busiest rank sends
in one step by group and collective (`traffic`, and their sum, max(`sent`)) and the bubble,
for every layout of the form: data, tensor (with sequence parallelism) and pipeline
parallelism (GPipe, 1F1B, interleaved over virtual stages), ZeRO, recomputation and
gradient accumulation; "not priced" where plan gives None (the activations in bfloat16 and
float16), and plan's own refusal where it raises ValueError.

The split of work: what depends on the model alone is computed here in Python and embedded
per model (every tensor's shape and its tensor-parallel shard rule, parts.shard_rule, in
the ZeRO units of fsdp.unit_names, from which the script takes a pipeline stage's tensors
and their replicated elements as layout_traffic does; the refusals of layout.REFUSALS that
the form can reach); the arithmetic that depends on the layout runs in the browser, one
JavaScript function for each closed form it mirrors:

    chunk, ringSent            comm.chunk_bounds, volume.collective_bytes (ring)
    localElements, units       volume.local_shape, unit_elements, local_parameters
    zeroMemory, zeroCalls      volume.zero_memory, zero_collectives (K micro-batches)
    spanCalls                  volume.span_collectives (one chunk's forward and backward)
    blockBytes                 models.sizes.block_activation_bytes (one block, any rank)
    activationBytes            models.sizes.decoder_sizes' activation_bytes (one device)
    rankActivationBytes        volume.rank_activation_bytes (a span of the parallel decoder)
    makeSchedule               pipeline.make_schedule (one rank's operations)
    stageTensors               pipeline.stage_param_names (a stage's tensors)
    priceLayout                volume.layout_traffic (cp = 1, no buckets, no clipping),
                               planning._held and planning._activations (the peak of a
                               pipeline rank's caches over its schedule), per world rank
    plan                       plan()'s checks, in its order, and its branches

The schedule is computed in the browser, not embedded: the form takes any p, m and v, and
a rank's schedule is a few lines (one loop per schedule). Byte counts are BigInt, so every
one is exact however large. The global batch is dp x micro-batches x rows, which every
layout divides. The layout has no ring (cp = 1), no gradient buckets, no clipping and the
ring algorithm. tests/browser/test_calculator_page.py runs the script in chromium over a grid of
models and layouts and compares every number with plan(). It sits beside plan in parallel
(it draws nothing: tfcore.viz holds the matplotlib figures).
"""
from __future__ import annotations

import html
import json
import math

from ..models.decoder import RECOMPUTE, DecoderConfig
from .fsdp import unit_names
from .layout import REFUSALS, SCHEDULES, ZERO_STAGES
from .parts import shard_rule
from .planning import ITEMSIZE
from .harness import CONFIGS
from .volume import SCALAR


def _llama(**sizes) -> DecoderConfig:
    return DecoderConfig.llama(dtype="float32", **sizes)


# The models of the form. The book's own: chapter 23's 4-layer Llama-style model (its runs),
# GPT-2 small (chapters 9 and 23), Llama 7B (chapter 9) and Llama 2 70B (chapter 16's
# grouped-query attention, H_kv = 8); and Llama 3 8B (H_kv = 8, a 128 256-token
# vocabulary). plan takes the dtype separately: a config's own dtype does not matter here.
PRESETS = {
    "tiny Llama, 4 layers (this chapter's runs)":
        lambda: DecoderConfig(**{**CONFIGS["tiny-llama"]().to_dict(), "n_layers": 4}),
    "GPT-2 small (124 M)":
        lambda: DecoderConfig(vocab_size=50257, max_seq_len=1024, d_model=768, n_layers=12,
                              n_heads=12, dtype="float32"),
    "Llama 7B":
        lambda: _llama(vocab_size=32000, max_seq_len=2048, d_model=4096, n_layers=32,
                       n_heads=32),
    "Llama 3 8B":
        lambda: _llama(vocab_size=128256, max_seq_len=8192, d_model=4096, n_layers=32,
                       n_heads=32, n_kv_heads=8, d_ff=14336, rope_base=500000.0),
    "Llama 2 70B":
        lambda: _llama(vocab_size=32000, max_seq_len=4096, d_model=8192, n_layers=80,
                       n_heads=64, n_kv_heads=8, d_ff=28672),
}

# plan prices the activations in the dtypes DecoderLM runs in (backend.FLOAT_DTYPES).
ACTIVATION_DTYPES = ("float32", "float64")

# The refusals of Layout.validate the form can reach, by name; the script holds their
# predicates. The others read a field the calculator keeps at a default under which they
# cannot refuse (no ring, no buckets, no clipping, the ring algorithm, a dense model, no
# Ulysses, no expert parallelism).
REACHABLE_REFUSALS = ("pipeline schedule without pipeline parallelism",
                      "virtual stages without pipeline parallelism",
                      "ZeRO-2/3 with pipeline parallelism",
                      "virtual stages with a one-chunk schedule")
_FIXED_FIELDS = {"cp", "bucket_bytes", "clip", "algorithm", "transport", "n_experts",
                 "ulysses", "ep"}

# The form's first layout: chapter 23's "ZeRO-1 8" row of GPT-2 small.
DEFAULTS = dict(preset="GPT-2 small (124 M)", dp=8, tp=1, pp=1, zero=1, sp=False,
                recompute="none", rows=8, microbatches=1, virtual=1, schedule="",
                seq=1024, dtype="float32")


def model_data(config: DecoderConfig) -> dict:
    """What the script needs of one model: its sizes and every tensor as [name, shard rule,
    shape], grouped as the ZeRO units (embed, one block, which every block repeats, head).
    Raises ValueError for a model the closed forms do not price (experts, unequal blocks)."""
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"a preset must be a DecoderConfig, got {type(config).__name__}")
    config.validate()
    if config.n_experts:
        raise ValueError(f"the calculator prices dense decoders only; this config has "
                         f"n_experts = {config.n_experts}")
    shapes = config.param_shapes()
    units = dict(unit_names(config))

    def tensors(names, prefix=""):
        return [[n[len(prefix):], shard_rule(n), list(shapes[n])] for n in names]

    covered = {n for names in units.values() for n in names}
    if covered != set(shapes):                  # stageTensors reads the units alone
        raise ValueError(f"tensors outside fsdp's units: {sorted(set(shapes) - covered)}")
    block = tensors(units["h0"], "h0.")
    for i in range(1, config.n_layers):
        if tensors(units[f"h{i}"], f"h{i}.") != block:
            raise ValueError(f"block h{i} differs from h0: the calculator prices models whose "
                             "blocks are all alike")
    return dict(V=config.vocab_size, D=config.d_model, F=config.d_ff, L=config.n_layers,
                H=config.n_heads, Hkv=config.n_kv_heads, Dh=config.head_dim,
                maxSeq=config.max_seq_len, bias=bool(config.bias),
                tied=bool(config.tied_head), pre=config.norm_placement == "pre",
                mlp=config.mlp, rotary=config.position == "rotary",
                attention=config.attention, dropout=config.dropout > 0,
                embed=tensors(units["embed"]), block=block,
                head=tensors(units.get("head", [])),
                parameters=sum(math.prod(s) for s in shapes.values()))


def refusal_data() -> list[dict]:
    """[{name, fields, why}] of the reachable refusals, in Layout.validate's order."""
    out = []
    for rule in REFUSALS:
        if rule.name in REACHABLE_REFUSALS:
            out.append(dict(name=rule.name, fields=list(rule.fields), why=rule.why))
        elif not set(rule.fields) & _FIXED_FIELDS:
            raise RuntimeError(f"the calculator does not know the refusal {rule.name!r} "
                               f"(fields {rule.fields}): add its predicate to the script")
    missing = set(REACHABLE_REFUSALS) - {r["name"] for r in out}
    if missing:
        raise RuntimeError(f"layout.REFUSALS no longer has {sorted(missing)}")
    return out


def _options(name, values, selected, labels=None) -> str:
    items = []
    for value in values:
        label = (labels or {}).get(value, value)
        mark = " selected" if str(value) == str(selected) else ""
        items.append(f'<option value="{html.escape(str(value))}"{mark}>'
                     f'{html.escape(str(label))}</option>')
    return f'<select name="{name}">{"".join(items)}</select>'


def _number(name, value) -> str:
    return f'<input name="{name}" type="number" min="1" step="1" value="{value}">'


def calculator_html(presets: dict | None = None, defaults: dict | None = None) -> str:
    """The self-contained HTML fragment: a form and its script (see the module docstring).
    presets: {label: DecoderConfig or a function returning one}; None: PRESETS."""
    presets = PRESETS if presets is None else presets
    if not isinstance(presets, dict) or not presets:
        raise ValueError("presets must be a non-empty dict {label: DecoderConfig}")
    models = {}
    for label, make in presets.items():
        models[str(label)] = model_data(make() if callable(make) else make)
    d = dict(DEFAULTS, **(defaults or {}))
    unknown = set(d) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown default(s) {sorted(unknown)}; expected {sorted(DEFAULTS)}")
    if d["preset"] not in models:
        d["preset"] = next(iter(models))
    data = dict(models=models, refusals=refusal_data(), itemsize=ITEMSIZE, scalar=SCALAR,
                activationDtypes=list(ACTIVATION_DTYPES))
    fields = [
        ("model", _options("preset", list(models), d["preset"])),
        ("data-parallel ranks dp", _number("dp", d["dp"])),
        ("tensor-parallel ranks tp", _number("tp", d["tp"])),
        ("pipeline stages pp", _number("pp", d["pp"])),
        ("ZeRO stage", _options("zero", ZERO_STAGES, d["zero"])),
        ("recompute", _options("recompute", RECOMPUTE, d["recompute"])),
        ("rows per micro-batch", _number("rows", d["rows"])),
        ("micro-batches", _number("microbatches", d["microbatches"])),
        ("virtual stages", _number("virtual", d["virtual"])),
        ("schedule", _options("schedule", ("",) + tuple(SCHEDULES), d["schedule"],
                              {"": "default"})),
        ("sequence length", _number("seq", d["seq"])),
        ("dtype", _options("dtype", tuple(ITEMSIZE), d["dtype"])),
    ]
    checked = " checked" if d["sp"] else ""
    labels = "".join(f"<label><span>{html.escape(text)}</span>{control}</label>"
                     for text, control in fields)
    labels += (f'<label class="tc-check"><input name="sp" type="checkbox"{checked}>'
               "<span>sequence parallelism</span></label>")
    payload = json.dumps(data, sort_keys=True, separators=(",", ":")).replace("</", "<\\/")
    return (f'<div class="tfcore-calculator">\n<style>{_STYLE}</style>\n'
            f'<form autocomplete="off" onsubmit="return false">{labels}</form>\n'
            '<div class="tc-out" aria-live="polite"></div>\n'
            f"<script>\n{_SCRIPT.replace('__DATA__', payload)}</script>\n</div>\n")


_STYLE = """
.tfcore-calculator { margin: 0.5em 0 1em; }
.tfcore-calculator form { display: grid; gap: 0.4em 0.8em;
  grid-template-columns: repeat(auto-fill, minmax(9em, 1fr)); margin-bottom: 0.8em; }
.tfcore-calculator label { display: flex; flex-direction: column; font-size: 0.85em;
  justify-content: space-between; }
.tfcore-calculator label.tc-check { flex-direction: row; align-items: center; gap: 0.4em; }
.tfcore-calculator select, .tfcore-calculator input[type=number] { width: 100%;
  box-sizing: border-box; font: inherit; }
.tfcore-calculator .tc-scroll { overflow-x: auto; max-width: 100%; }
.tfcore-calculator table { width: auto; margin: 0; border-collapse: collapse;
  font-size: 0.85em; font-variant-numeric: tabular-nums; }
.tfcore-calculator th, .tfcore-calculator td { padding: 0.15em 0.6em; text-align: left;
  border-bottom: 1px solid var(--pst-color-border, #ccc); white-space: nowrap; }
.tfcore-calculator td.tc-n { text-align: right; }
.tfcore-calculator th.tc-sub { padding-left: 1.6em; font-weight: normal; }
.tfcore-calculator .tc-refused { font-size: 0.9em; }
.tfcore-calculator .tc-note { font-size: 0.85em; margin: 0 0 0.4em; }
"""


# The script. Every function names the Python closed form it mirrors; a byte count is a
# BigInt (elements times the itemsize), a rank or a degree a Number.
_SCRIPT = r"""(function () {
"use strict";
const DATA = __DATA__;
const script = document.currentScript;
const root = script && script.closest(".tfcore-calculator");
if (!root || root.dataset.ready) return;
root.dataset.ready = "1";
const form = root.querySelector("form");
const out = root.querySelector(".tc-out");
const B = BigInt;

// comm.chunk_bounds(M, N)[i]'s size: ceil/floor(M / N), the larger chunks first
function chunk(M, N, i) {
  const n = B(N), extra = M % n;
  return M / n + (B(i) < extra ? 1n : 0n);
}

// volume.collective_bytes(op, "ring", M, N, root=root)["sent"][r], in elements
function ringSent(op, M, N, r, root) {
  if (N === 1) return 0n;
  const c = (i) => chunk(M, N, i % N);
  if (op === "all_reduce") return 2n * M - c(r) - c(r + 1);
  if (op === "reduce_scatter") return M - c(r);
  if (op === "all_gather") return M - c(r + 1);
  if (op === "broadcast") return (r - root + N) % N < N - 1 ? M : 0n;   // a chain from root
  throw new Error("unknown collective " + op);
}

function prod(shape) { return shape.reduce((a, n) => a * B(n), 1n); }

// parts.kv_heads_of: the key/value heads [k0, k1) of tensor-parallel rank t
function kvHeads(m, tp, t) {
  if (m.Hkv >= tp) return [Math.floor(t * m.Hkv / tp), Math.floor((t + 1) * m.Hkv / tp)];
  const h = Math.floor(t * m.Hkv / tp);
  return [h, h + 1];
}

// volume.local_shape's elements: tensor [name, rule, shape] on tensor-parallel rank t
function localElements(m, tensor, tp, t) {
  const rule = tensor[1], shape = tensor[2];
  const lead = prod(shape.slice(0, -1)), tail = prod(shape.slice(1));
  const Vt = chunk(B(m.V), tp, t);
  if (rule === "vocab_rows") return Vt * tail;
  if (rule === "vocab_cols") return lead * Vt;
  if (rule === "qkv_cols") {                   // parts.qkv_columns: its q, k and v heads
    const q = Math.floor((t + 1) * m.H / tp) - Math.floor(t * m.H / tp);
    const [k0, k1] = kvHeads(m, tp, t);
    return lead * B((q + 2 * (k1 - k0)) * m.Dh);
  }
  if (rule === "cols") return lead * (B(shape[shape.length - 1]) / B(tp));
  if (rule === "rows") return (B(shape[0]) / B(tp)) * tail;
  if (rule === "replicated") return prod(shape);
  throw new Error("unknown shard rule " + rule);
}

// volume.unit_elements on rank t: M of the embed unit, of one block (all L alike), of the
// head (0: no head unit); P = volume.local_parameters, their sum
function units(m, tp, t) {
  const sum = (ts) => ts.reduce((a, x) => a + localElements(m, x, tp, t), 0n);
  const u = { embed: sum(m.embed), block: sum(m.block), head: sum(m.head) };
  u.P = u.embed + B(m.L) * u.block + u.head;
  // volume.unit_phases: the embedding, each block, the head (with embed when tied)
  const head = u.head + (m.tied ? u.embed : 0n);
  u.Mmax = [u.embed, u.block, head].reduce((a, x) => (x > a ? x : a), 0n);
  return u;
}

// volume.zero_memory of rank (d, t), in elements
function zeroMemory(m, u, dp, d, zero) {
  if (zero <= 1) {
    const opt = zero === 0 ? 2n * u.P : 2n * chunk(u.P, dp, d);
    return { params: u.P, grads: u.P, optimizer: opt, gathered: 0n };
  }
  const Z = chunk(u.embed, dp, d) + B(m.L) * chunk(u.block, dp, d) + chunk(u.head, dp, d);
  return { params: zero === 2 ? u.P : Z + u.Mmax, grads: Z + u.Mmax, optimizer: 2n * Z,
           gathered: u.Mmax };
}

// volume.zero_collectives(config, tp, t, dp, zero, K, P): [group, op, M, times] over dp of
// a step of K micro-batches; P the elements the rank holds (a pipeline stage's). ZeRO-0/1
// once per step; ZeRO-2/3 per unit and micro-batch (a tied embed unit is used twice)
function zeroCalls(m, u, P, dp, zero, K) {
  if (dp === 1) return [];
  if (zero === 0) return [["dp", "all_reduce", P, 1]];
  if (zero === 1) return [["dp", "reduce_scatter", P, 1], ["dp", "all_gather", P, 1]];
  const calls = [];
  // [M, uses of each, units alike]: the embed unit, the L blocks, the head
  const unitList = [[u.embed, m.tied ? 2 : 1, 1], [u.block, 1, m.L]];
  if (m.head.length) unitList.push([u.head, 1, 1]);
  for (const [M, uses, count] of unitList) {
    if (zero === 2) {
      calls.push(["dp", "reduce_scatter", M, uses * K * count], ["dp", "all_gather", M, count]);
    } else {
      calls.push(["dp", "all_gather", M, 2 * uses * K * count],
                 ["dp", "reduce_scatter", M, uses * K * count]);
    }
  }
  return calls;
}

// volume.span_collectives: [op, M, times] of one forward and backward of a span of n
// blocks over [b, S] tokens (a pipeline chunk, or the whole model): the embedding when
// first, the head and its cross-entropy when last; recompute='full' runs each block's
// forward exits again in the backward
function spanCalls(m, b, S, sp, n, first, last, recompute) {
  const act = b * S * B(m.D), tok = b * S;            // [B, S, D], [B, S]
  const enters = (first ? 1 : 0) + 2 * n, exits = 2 * n + (last ? 1 : 0);
  const calls = [];
  // forward then backward: g at each entry, f* at each exit, and their adjoints
  if (sp) calls.push(["reduce_scatter", act, enters + exits], ["all_gather", act, exits + enters]);
  else calls.push(["all_reduce", act, enters + exits]);
  if (last) calls.push(["all_reduce", tok, 3]);       // cross-entropy: max, sum, pick
  if (recompute === "full") {                         // each block's forward again
    if (sp) calls.push(["all_gather", act, 2 * n], ["reduce_scatter", act, 2 * n]);
    else calls.push(["all_reduce", act, 2 * n]);
  }
  return calls;
}

// the hidden layers an MLP keeps, in units of [N, F] (sizes.block_activation_bytes)
const HIDDEN = { gelu: 2, relu: 1, swiglu: 3 };

// models.sizes.block_activation_bytes: one block's caches on tensor-parallel rank t, one
// micro-batch of b rows (its heads, key/value heads and columns; the norms on N / tp rows
// under sp); tp = 1 is one device's block
function blockBytes(m, b, S, f, recompute, tp, t, sp) {
  const N = b * S, D = B(m.D), Dh = B(m.Dh), F = B(m.F) / B(tp);
  const rows = sp ? N / B(tp) : N;
  const h = B(m.H / tp), [k0, k1] = kvHeads(m, tp, t), g = B(k1 - k0);
  if (recompute === "full") return rows * D * f;      // only the block's input
  const scores = b * h * S * S;
  const hidden = B(HIDDEN[m.mlp]) * N * F;
  let kept = scores, masks = scores;
  if (m.attention === "tiled") { kept = b * h * S; masks = 0n; }
  else if (recompute === "selective") { kept = 0n; masks = 0n; }
  let qkv;                                            // the fused output, rotated, repeated
  if (g === h) qkv = N * (h + 2n * g) * Dh + (m.rotary ? N * (h + g) * Dh : 0n);
  else if (m.rotary) qkv = 3n * N * h * Dh;
  else qkv = N * (h + 2n * g) * Dh + 2n * N * h * Dh;
  const floats = 2n * rows * D + 2n * rows + 2n * N * D + qkv + kept + N * h * Dh + hidden;
  const bools = (m.dropout ? masks + 2n * rows * D : 0n) + (m.mlp === "relu" ? N * F : 0n);
  return floats * f + bools;
}

// models.sizes.decoder_sizes(config with dtype, b, S)["activation_bytes"], f bytes a float
function activationBytes(m, b, S, f, recompute) {
  const N = b * S, D = B(m.D);
  const final = (m.pre ? 2n * N * D + N : N * D) * f + (m.dropout ? N * D : 0n);
  const loss = N * B(m.V) * f + 8n * N + N;           // probabilities, int64 labels, mask
  return B(m.L) * blockBytes(m, b, S, f, recompute, 1, 0, false) + final + loss;
}

// volume.rank_activation_bytes(config, b, S, tp, t, sp, n, first, last): a span of n blocks
// of the parallel decoder on rank t, one micro-batch of b rows (blockBytes; when first the
// embedding's index and mask, when last the head's input, the cross-entropy's
// probabilities [N, V_t] with its index and two masks)
function rankActivationBytes(m, b, S, f, recompute, tp, t, sp, n, first, last) {
  const N = b * S, D = B(m.D);
  const rows = sp ? N / B(tp) : N;
  const embedding = 9n * N + (m.dropout ? rows * D : 0n);  // int64 index, bool mask; dropout
  const head = (m.pre ? (rows * D + rows) * f : 0n) + N * D * f
    + N * chunk(B(m.V), tp, t) * f + 10n * N;         // int64 index, two bool masks
  return B(n) * blockBytes(m, b, S, f, recompute, tp, t, sp)
    + (first ? embedding : 0n) + (last ? head : 0n);
}

// pipeline.make_schedule(name, p, m, v)[r]: rank r's operations [op, micro-batch, chunk]
// (gpipe_schedule, one_f_one_b_schedule, interleaved_schedule); computed here because the
// form takes any p, m and v (a table per (schedule, p, m, v) would not fit in the page)
function makeSchedule(name, p, m, v, r) {
  const ops = [];
  if (name === "gpipe") {                             // every forward, then every backward
    for (let i = 0; i < m; i++) ops.push(["F", i, 0]);
    for (let i = 0; i < m; i++) ops.push(["B", i, 0]);
    return ops;
  }
  if (name === "1f1b") {                              // p - r - 1 warm-up forwards, then F, B
    const warm = Math.min(p - r - 1, m);
    for (let i = 0; i < warm; i++) ops.push(["F", i, 0]);
    for (let i = 0; i < m - warm; i++) ops.push(["F", warm + i, 0], ["B", i, 0]);
    for (let i = m - warm; i < m; i++) ops.push(["B", i, 0]);
    return ops;
  }
  // interleaved: the k-th forward runs micro-batch (k // (p v)) p + k mod p on chunk
  // (k // p) mod v, the k-th backward the same micro-batch on chunk v - 1 - (k // p) mod v
  const total = v * m, fl = Math.floor;
  const forward = (k) => ["F", fl(k / (p * v)) * p + k % p, fl(k / p) % v];
  const backward = (k) => ["B", fl(k / (p * v)) * p + k % p, v - 1 - fl(k / p) % v];
  const warm = Math.min(2 * (p - r - 1) + (v - 1) * p, total);
  for (let k = 0; k < warm; k++) ops.push(forward(k));
  for (let i = 0; i < total - warm; i++) ops.push(forward(warm + i), backward(i));
  for (let k = total - warm; k < total; k++) ops.push(backward(k));
  return ops;
}

// the fullest rank (the first of the largest total) and the busiest (the first of the
// largest sum sent), as plan picks them; its traffic without the groups of one rank
function pick(memory, traffic) {
  let full = 0, busy = 0;
  const sent = traffic.map((r) => Object.values(r).reduce((a, x) => a + x, 0n));
  memory.forEach((r, w) => { if (r.total > memory[full].total) full = w; });
  sent.forEach((s, w) => { if (s > sent[busy]) busy = w; });
  const busiest = {};
  for (const k of Object.keys(traffic[busy]).sort()) {
    if (traffic[busy][k]) busiest[k] = traffic[busy][k];
  }
  return { memory: memory[full], traffic: busiest, sent: sent[busy] };
}

// pipeline.stage_param_names(config, pp, s, v): rank s's tensors as [tensor, copies]: the
// embedding when it holds virtual stage 0 (s = 0), L / pp blocks, the final norm and head
// when it holds the last (s = pp - 1; with a tied head its own copy of wte); pp = 1: all
function stageTensors(m, pp, s) {
  const first = s === 0, last = s === pp - 1, out = [];
  for (const x of m.embed) if (first || (last && m.tied && x[0] === "wte")) out.push([x, 1]);
  for (const x of m.block) out.push([x, m.L / pp]);
  if (last) for (const x of m.head) out.push([x, 1]);
  return { first, last, tensors: out };
}

// plan(): volume.layout_traffic's calls and planning._held's memory of every world rank
// w = (d pp + s) tp + t (mesh.py, cp = 1), then the fullest and busiest (pick). The calls of
// rank (s, t) are [group, op, M, times, bytes per element, root]; only the data-parallel
// rank d changes which share of them it sends, so they are made once per (s, t).
function priceLayout(m, x, f, schedule) {
  const K = x.microbatches, pp = x.pp, v = x.virtual, per = m.L / (pp * v);
  const b = B(x.rows), S = B(x.seq);                  // a micro-batch: batch / (dp K) rows
  const priced = DATA.activationDtypes.includes(x.dtype);
  const sharing = m.Hkv < x.tp ? Math.floor(x.tp / m.Hkv) : 1;
  const kvRows = m.block.filter((y) => y[1] === "qkv_cols")     // rows of the fused q, k, v
    .reduce((a, y) => a + prod(y[2].slice(0, -1)), 0n);
  const SCALAR = B(DATA.scalar);                      // volume.SCALAR: float64 bookkeeping
  const ranks = [];                                   // [s][t]: {P, calls, activations, u}
  for (let s = 0; s < pp; s++) {
    const stage = stageTensors(m, pp, s), row = [];
    const chunks = [];
    for (let j = 0; j < v; j++) chunks.push(j * pp + s);
    const ops = pp > 1 ? makeSchedule(schedule, pp, K, v, s) : null;
    for (let t = 0; t < x.tp; t++) {
      const u = units(m, x.tp, t);
      let P = 0n, replicated = 0n;
      for (const [y, copies] of stage.tensors) {
        const n = B(copies) * localElements(m, y, x.tp, t);
        P += n;
        if (y[1] === "replicated") replicated += n;
      }
      const [k0, k1] = kvHeads(m, x.tp, t);
      const kv = sharing > 1 ? B(m.L / pp) * kvRows * B(2 * (k1 - k0) * m.Dh) : 0n;
      const calls = [];
      for (const c of chunks) {                       // per chunk, each of K micro-batches
        const n = pp > 1 ? per : m.L;
        for (const [op, M, times] of spanCalls(m, b, S, x.sp, n, c === 0, c === pp * v - 1,
                                               x.recompute)) {
          calls.push(["tp", op, M, times * K, f, 0]);
        }
        if (x.sp && x.tp > 1 && replicated) calls.push(["tp", "all_reduce", replicated, K, f, 0]);
        if (kv) calls.push(["kv", "all_reduce", kv, K, f, 0]);   // shared key/value heads
      }
      const fixed = {};                               // bytes not of a collective
      if (pp > 1) {
        // pipeline.pipeline_bytes_sent: per micro-batch an activation from every chunk but
        // the last virtual stage, a gradient from every chunk but virtual stage 0
        const tokens = b * S / B(x.sp ? x.tp : 1);
        const messages = chunks.filter((c) => c !== pp * v - 1).length
          + chunks.filter((c) => c !== 0).length;
        fixed["pp send"] = B(messages * K) * tokens * B(m.D) * f;
        // pipeline.share_losses: the token count and the loss over dp on the last stage,
        // the loss broadcast from the last stage down the pipeline
        if (stage.last && x.dp > 1) calls.push(["dp", "all_reduce", 1n, 2, SCALAR, 0]);
        calls.push(["pp", "broadcast", 1n, 1, SCALAR, pp - 1]);
        if (m.tied && stage.first !== stage.last) {   // the two copies of wte summed
          const wte = m.embed.find((y) => y[0] === "wte");
          calls.push(["embedding", "all_reduce", localElements(m, wte, x.tp, t), 1, f, 0]);
        }
      } else if (x.dp > 1) {
        calls.push(["dp", "all_reduce", 2n, K, f, 0]);    // each micro-batch's loss and count
        if (K > 1) calls.push(["dp", "all_reduce", B(K), 1, SCALAR, 0]);  // the K counts
      }
      for (const [g, op, M, times] of zeroCalls(m, u, P, x.dp, x.zero, K)) {
        calls.push([g, op, M, times, f, 0]);
      }
      let activations = null;                         // planning._activations
      if (priced && pp > 1) {                         // the peak over the schedule
        const cache = chunks.map((c) => rankActivationBytes(m, b, S, f, x.recompute, x.tp, t,
                                                             x.sp, per, c === 0,
                                                             c === pp * v - 1));
        let held = 0n;
        activations = 0n;
        for (const [op, , c] of ops) {                // a forward adds, its backward frees
          held += op === "F" ? cache[c] : -cache[c];
          if (held > activations) activations = held;
        }
      } else if (priced) {
        activations = x.dp * x.tp === 1
          ? activationBytes(m, b, S, f, x.recompute)  // one device: DecoderLM
          : rankActivationBytes(m, b, S, f, x.recompute, x.tp, t, x.sp, m.L, true, true);
      }
      row.push({ u, P, calls, fixed, activations, last: stage.last });
    }
    ranks.push(row);
  }
  const memory = [], traffic = [];
  for (let d = 0; d < x.dp; d++) {
    for (let s = 0; s < pp; s++) {
      for (let t = 0; t < x.tp; t++) {
        const r = ranks[s][t];
        let mem;                                      // planning._held, in elements
        if (pp > 1) {                                 // the stage's tensors, ZeRO-1 at most
          mem = { params: r.P, grads: r.P, optimizer: 2n * (x.zero === 0 ? r.P
                  : chunk(r.P, x.dp, d)), gathered: 0n };
        } else {
          mem = zeroMemory(m, r.u, x.dp, d, x.zero);
        }
        for (const k of Object.keys(mem)) mem[k] *= f;
        mem.activations = r.activations;
        mem.total = mem.params + mem.grads + mem.optimizer + (mem.activations || 0n);
        memory.push(mem);
        const byOp = Object.assign({}, r.fixed);
        for (const [g, op, M, times, size, root] of r.calls) {
          const [n, i] = { tp: [x.tp, t], dp: [x.dp, d], kv: [sharing, t % sharing],
                           pp: [pp, s], embedding: [2, r.last ? 1 : 0] }[g];
          const key = g + " " + op;
          byOp[key] = (byOp[key] || 0n) + B(times) * ringSent(op, M, n, i, root) * size;
        }
        traffic.push(byOp);
      }
    }
  }
  return pick(memory, traffic);
}

function pyRepr(v) {
  if (v === null) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (typeof v === "string") return "'" + v + "'";
  return String(v);
}

// Layout.validate's predicates of the reachable refusals (layout.REFUSALS)
const WHEN = {
  "pipeline schedule without pipeline parallelism": (x) => x.pp === 1 && x.schedule !== null,
  "virtual stages without pipeline parallelism": (x) => x.pp === 1 && x.virtual !== 1,
  "ZeRO-2/3 with pipeline parallelism": (x) => x.pp > 1 && x.zero >= 2,
  "virtual stages with a one-chunk schedule":
    (x) => x.pp > 1 && x.virtual > 1 && (x.schedule === "gpipe" || x.schedule === "1f1b"),
};

// plan(config with recompute, layout, batch = dp m rows, seq, dtype): its checks in its
// order (a string: the ValueError's message), then its branches
function plan(m, x) {
  const layoutValue = { pp: x.pp > 1 ? x.pp : null, schedule: x.schedule, zero: x.zero,
                        virtual: x.virtual, sp: x.sp, tp: x.tp, n_kv_heads: m.Hkv };
  for (const rule of DATA.refusals) {
    if (WHEN[rule.name](x)) {
      const values = rule.fields.map((k) => k + "=" + pyRepr(layoutValue[k])).join(", ");
      return rule.name + " (" + values + "): " + rule.why;
    }
  }
  if (x.seq > m.maxSeq) {
    return "seq (" + x.seq + ") exceeds the config's max_seq_len (" + m.maxSeq + ")";
  }
  const pv = x.pp * x.virtual;
  if (m.L % pv) {
    return "n_layers (" + m.L + ") must be divisible by pp x virtual (" + x.pp + " x "
      + x.virtual + "): every stage holds whole blocks";
  }
  const schedule = x.schedule || (x.virtual > 1 ? "interleaved" : "1f1b");
  if (x.pp > 1 && schedule === "interleaved" && x.microbatches % x.pp) {
    return "the interleaved schedule needs n_microbatches (" + x.microbatches + ") divisible"
      + " by n_stages (" + x.pp + "): micro-batches go through the chunks in groups of"
      + " n_stages";
  }
  const tp = x.tp;                                    // parts.check_tensor_parallel
  if (m.H % tp) {
    return "n_heads (" + m.H + ") must be divisible by the tensor-parallel degree (" + tp
      + "): each rank computes whole heads";
  }
  if (m.Hkv % tp && tp % m.Hkv) {
    return "n_kv_heads (" + m.Hkv + ") and the tensor-parallel degree (" + tp + ") must"
      + " divide one another: each rank holds whole key/value heads, or shares one with"
      + " the ranks whose query heads read it";
  }
  if (m.F % tp) {
    return "d_ff (" + m.F + ") must be divisible by the tensor-parallel degree (" + tp
      + "): each rank holds d_ff / tp MLP columns";
  }
  if (m.D % tp) {
    return "d_model (" + m.D + ") must be divisible by the tensor-parallel degree (" + tp + ")";
  }
  if (m.V < tp) {
    return "vocab_size (" + m.V + ") must be at least the tensor-parallel degree (" + tp
      + "): every rank holds at least one row";
  }
  const f = B(DATA.itemsize[x.dtype]);
  const result = { schedule: schedule,                // pipeline.bubble_fraction
                   bubble: (x.pp - 1) / (x.virtual * x.microbatches) };
  return Object.assign(result, priceLayout(m, x, f, schedule));
}

// ---- the form -----------------------------------------------------------------------
const LIMIT = 4096;                                   // ranks of one kind, rows, chunks

function readForm() {
  const x = {}, el = form.elements;
  for (const k of ["dp", "tp", "pp", "rows", "microbatches", "virtual", "seq"]) {
    const text = el[k].value.trim();
    if (!/^[0-9]+$/.test(text) || Number(text) < 1) {
      return k + " must be a positive integer, got '" + text + "'";
    }
    x[k] = Number(text);
    if (k !== "seq" && x[k] > LIMIT) return k + " above " + LIMIT + " is beyond this calculator";
  }
  if (x.seq > 1 << 24) return "seq above " + (1 << 24) + " is beyond this calculator";
  if (x.pp * x.virtual * x.microbatches > 1 << 20) {   // the schedules' operations
    return "pp x virtual x micro-batches above " + (1 << 20) + " is beyond this calculator";
  }
  x.zero = Number(el.zero.value);
  x.sp = el.sp.checked;
  x.recompute = el.recompute.value;
  x.schedule = el.schedule.value || null;
  x.dtype = el.dtype.value;
  x.preset = el.preset.value;
  return x;
}

function human(bytes) {
  const n = Number(bytes);
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let k = 0;
  while (k < units.length - 1 && n >= 1024 ** (k + 1)) k++;
  return k === 0 ? n + " B" : (n / 1024 ** k).toFixed(2) + " " + units[k];
}

function grouped(bytes) { return String(bytes).replace(/\B(?=(\d{3})+(?!\d))/g, ","); }

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function row(table, key, label, bytes, sub) {
  const tr = el("tr", { "data-key": key, "data-value": bytes === null ? "none" : String(bytes) });
  tr.append(el("th", { scope: "row", class: sub ? "tc-sub" : "" }, label));
  if (bytes === null) {
    tr.append(el("td", { class: "tc-n" }, "not priced"), el("td", { class: "tc-n" }, ""));
  } else {
    tr.append(el("td", { class: "tc-n" }, human(bytes)),
              el("td", { class: "tc-n" }, grouped(bytes) + " B"));
  }
  table.append(tr);
}

const MEMORY = [["params", "parameters"], ["grads", "gradients"],
                ["optimizer", "AdamW state (m, v)"],
                ["gathered", "of which gathered units"],
                ["activations", "activations"], ["total", "total"]];

function render() {
  const x = readForm();
  out.replaceChildren();
  if (typeof x === "string") {
    out.append(el("p", { class: "tc-refused" }, "Refused: " + x));
    return;
  }
  const m = DATA.models[x.preset];
  const p = plan(m, x);
  if (typeof p === "string") {
    out.append(el("p", { class: "tc-refused" }, "Refused: " + p));
    return;
  }
  const world = x.dp * x.tp * x.pp, batch = x.dp * x.microbatches * x.rows;
  out.append(el("p", { class: "tc-note" },
    grouped(m.parameters) + " parameters on " + world + " rank" + (world > 1 ? "s" : "")
    + "; a global batch of " + batch + " rows of " + x.seq + " tokens"
    + (x.pp > 1 ? "; schedule " + p.schedule : "") + "."));
  const table = el("table");
  table.append(el("tr", {}, undefined));
  table.lastChild.append(el("th", { scope: "col" }, "fullest rank"),
                         el("th", { scope: "col", class: "tc-n" }, ""),
                         el("th", { scope: "col", class: "tc-n" }, "bytes"));
  for (const [k, label] of MEMORY) {
    const value = p.memory === null ? null : p.memory[k];
    row(table, "memory " + k, label, value, k === "gathered");
  }
  row(table, "sent", "sent per step (busiest rank)", p.sent, false);
  for (const [k, v] of Object.entries(p.traffic || {})) row(table, "sent " + k, k, v, true);
  const bubble = el("tr", { "data-key": "bubble", "data-value": String(p.bubble) });
  bubble.append(el("th", { scope: "row" }, "pipeline bubble"),
                el("td", { class: "tc-n" }, p.bubble.toFixed(3)), el("td"));
  table.append(bubble);
  const scroll = el("div", { class: "tc-scroll" });
  scroll.append(table);
  out.append(scroll);
  if (p.memory !== null && p.memory.activations === null) {
    out.append(el("p", { class: "tc-note" },
      "The total counts the priced rows: plan has no closed form yet for these"
      + " activations."));
  }
}

form.addEventListener("input", render);
form.addEventListener("change", render);
render();
})();
"""
