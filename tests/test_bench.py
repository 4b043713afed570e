"""The benchmark's load accounting and its command line (no timing is asserted).

A window counts as clean when other processes used at most --max-load CPUs during it: the
machine's busy time (/proc/stat) minus this process's own CPU time (getrusage). A busy child
process is another process's work until it is waited for, so it must make a window dirty on
any machine; the clean case is shown with made-up counters, since a shared test machine is
never guaranteed quiet.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tfcore import bench

ROOT = Path(__file__).resolve().parents[1]


def _benchmark(name: str) -> str:
    """The text of benchmarks/<name>, a stored run."""
    return (ROOT / "benchmarks" / name).read_text()


def _readme_says(pattern: str, name: str):
    """The README's sentence (its whitespace folded) on benchmarks/<name>, matched by
    `pattern` -> the match; the test fails, naming the file, where the README no longer
    says it."""
    said = re.search(pattern, " ".join((ROOT / "README.md").read_text().split()))
    assert said, f"the README no longer describes benchmarks/{name}"
    return said


pytestmark = pytest.mark.skipif(bench.machine_busy_seconds() is None,
                                reason="needs /proc/stat (Linux)")


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_busy_child_process_makes_the_window_dirty():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)                                     # the child is running
        window = bench.LoadMeter().measure(lambda: time.sleep(0.6))
    finally:
        child.kill()
        child.wait()
    # the child burnt about 0.6 CPU-seconds, far above 0.1 CPU plus the counters' resolution
    assert window.others is not None and window.others > 0.3
    assert not window.clean(0.1)


def test_own_work_is_not_counted_as_others():
    """Made-up machine counter that sees exactly this process: others = 0, clean."""
    meter = bench.LoadMeter(machine=bench.own_cpu_seconds)
    window = meter.measure(lambda: spin(0.2))
    assert window.others < 0.01 and window.clean(0.0)   # read a moment apart


def test_a_quiet_child_leaves_the_window_clean():
    """A sleeping child uses no CPU: with a machine counter of this process and its waited
    children only (what a quiet machine shows), the window stays clean."""
    meter = bench.LoadMeter(machine=bench.own_cpu_seconds)

    def step():
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.2)"], check=True)

    window = meter.measure(step)
    assert window.others < 0.01 and window.clean(0.1)


def fake_meter(machine_use, own_use, wall=1.0):
    """A meter whose counters advance by the given amounts over one measured call."""
    state = {"m": 100.0, "o": 5.0, "t": 0.0}

    def fn():
        state["m"] += machine_use
        state["o"] += own_use
        state["t"] += wall

    meter = bench.LoadMeter(machine=lambda: state["m"], own=lambda: state["o"],
                            clock=lambda: state["t"], cpus=2, tick=0.01)
    return meter.measure(fn)


def test_the_threshold_and_the_counters_resolution():
    # 2 CPUs, 10 ms ticks: 0.04 CPU-seconds of the difference are the counters' error
    assert fake_meter(1.0 + 0.03, 1.0).clean(0.0)
    assert fake_meter(1.0 + 0.13, 1.0).clean(0.1)
    assert not fake_meter(1.0 + 0.2, 1.0).clean(0.1)
    assert fake_meter(0.5, 2.0).others == 0.0               # never negative
    unknown = bench.Window(1.0, None, 1.0, 0.04)
    assert unknown.others is None and not unknown.clean(10.0)


def test_dirty_windows_are_dropped_and_too_few_clean_ones_give_no_ratio():
    """Steps that alternate; a made-up meter calls every window of the second step dirty."""
    calls = []

    class Meter:
        def measure(self, fn):
            fn()
            dirty = calls[-1] == "b"
            return bench.Window(1.0, 1.0 + (0.5 if dirty else 0.0), 1.0, 0.0)

    sides = bench._timed_rounds([lambda: calls.append("a"), lambda: calls.append("b")],
                                Meter(), repeats=3, max_load=0.1, per_window=1, max_rounds=5)
    # after 3 rounds the second step can no longer reach 3 clean windows in the 2 left
    assert len(sides[0].times) == 3 and sides[0].dropped == 0
    assert len(sides[1].times) == 0 and sides[1].dropped == 3
    assert calls[:4] == ["a", "b", "b", "a"]                # the order flips every round


def test_a_saved_table_prints_and_says_why_a_ratio_is_missing(tmp_path):
    side = dict(ms=None, clean=1, dropped=6, rss_bytes=None, load_max=0.05, pct_peak=None)
    results = dict(meta=dict(command="python -m tfcore.bench", date="d", cpu="c", cpus=2,
                             numpy="2", torch="2.13.0", kernels="on", max_load=0.1,
                             torch_attention="sdpa", peaks={"float32 1thr": 100.0}),
                   rows=[dict(threads=1, config="tiny", dtype="float32", tfcore=side,
                              torch=side, ratio=None)])
    text = bench.format_table(results)
    assert "no ratio" in text and "1 thr tiny float32" in " ".join(text.split())
    assert max(len(line) for line in text.splitlines()) <= 88
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    out = subprocess.run([sys.executable, "-m", "tfcore.bench", "--show", str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == text


def _scaling_row(threads, seq, attention, ms, torch_ms, mib, torch_mib):
    side = dict(ms=ms, clean=7, dropped=0, rss_bytes=mib * 2**20, load_max=0.0)
    return dict(threads=threads, config=f"s{seq}", dtype="float32", seq=seq, batch=2048 // seq,
                attention_tfcore=attention, tfcore=side, ratio=ms / torch_ms,
                memory_ratio=mib / torch_mib,
                torch=dict(side, ms=torch_ms, rss_bytes=torch_mib * 2**20))


def test_a_saved_scaling_table_prints_each_s_with_both_attentions(tmp_path):
    """--scaling's table: one line per (threads, dtype, S) with tfcore dense and tiled and
    PyTorch, each ratio from its own run; --show prints a saved one the same way."""
    rows = [_scaling_row(1, s, a, ms, 100.0, mib, 120.0)
            for s, dense_ms, dense_mib in ((256, 110.0, 130.0), (2048, 190.0, 280.0))
            for a, ms, mib in (("dense", dense_ms, dense_mib), ("tiled", 95.0, 115.0))]
    results = dict(meta=dict(command="python -m tfcore.bench --scaling", date="d", cpu="c",
                             cpus=2, numpy="2", torch="2.13.0", kernels="on", max_load=0.1,
                             torch_attention="sdpa", tfcore_attention="dense and tiled",
                             peaks={"float32 1thr": 100.0}, scaling=True), rows=rows)
    table = bench.scaling_rows(results)
    assert [(r["seq"], r["batch"]) for r in table] == [(256, 8), (2048, 1)]
    assert [round(r["dense"]["ratio"], 2) for r in table] == [1.1, 1.9]
    assert [r["tiled"]["mib"] for r in table] == [115.0, 115.0]
    text = bench.format_scaling(results)
    assert "2048  1 |  190.0   95.0  100.0 |  1.90  0.95 |  280.0  115.0  120.0" in text
    assert max(len(line) for line in text.splitlines()) <= 84
    path = tmp_path / "s.json"
    path.write_text(json.dumps(results))
    out = subprocess.run([sys.executable, "-m", "tfcore.bench", "--show", str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == text


@pytest.mark.parametrize("argv, words", [
    (["--configs", "huge"], "invalid choice"),
    (["--dtypes", "float16"], "invalid choice"),
    (["--threads", "0"], "--threads must be > 0"),
    (["--threads", "two"], "--threads must be an integer"),
    (["--repeats", "-1"], "--repeats must be > 0"),
    (["--max-load", "-0.5"], "--max-load must be >= 0"),
    (["--min-window", "x"], "--min-window must be a number"),
    (["--torch-attention", "flash"], "invalid choice"),
    (["--json", "/no/such/folder/r.json"], "does not exist"),
    (["--show", "/no/such/file.json"], "not a saved benchmark table"),
    (["--torch-step", "/no/such/torch_step.py"], "--torch-step"),
    (["--profile", "--json", "r.json"], "--profile"),
    (["--scaling", "--configs", "tiny"], "leave out --configs"),
    (["--scaling", "--tfcore-attention", "dense"], "leave out --tfcore-attention"),
    (["--scaling", "--no-torch"], "leave out --no-torch"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_every_bad_argument_is_one_error_line_and_status_2(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("fast", [True, False])
def test_the_counted_matmuls_of_a_step(fast):
    """Counted as they run, on the kernel path and on the reference path alike: the
    matmul FLOPs equal 6 N_mm T + 12 L S^2 D B, and the backward makes twice the forward's."""
    import numpy as np

    from tfcore import kernels
    from tfcore.models import DecoderConfig, DecoderLM

    cfg = DecoderConfig(vocab_size=11, max_seq_len=8, d_model=8, n_layers=2, n_heads=2,
                        dtype="float64")
    model = DecoderLM(cfg).init(seed=0)
    ids = np.arange(12).reshape(2, 6) % 11
    with (kernels.disabled() if not fast else _nothing()):
        count = bench.count_step_flops(model, ids, ids)
    assert count.flops == bench.step_flops(cfg, 2, 6) > 0
    assert count.total("backward") == 2 * count.total("forward")
    for label in ("linear", "attention"):
        assert count.total("backward", label) == 2 * count.total("forward", label) > 0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_tiled_attention_opt_in_gives_the_dense_gradients():
    """`--tfcore-attention tiled` builds the benchmark's decoder with attention="tiled" (the
    fused kernel on NumPy): the same loss and parameter gradients in float64 (1e-12)."""
    import numpy as np

    from tfcore.models import DecoderLM

    grads, losses = [], []
    for tiled in (False, True):
        cfg, _, _ = bench.decoder_config("tiny", "float64", tiled)
        assert cfg.attention == ("tiled" if tiled else "dense")
        cfg.max_seq_len, cfg.n_layers = 70, 2
        model = DecoderLM(cfg).init(seed=0)
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 70))
        _, loss = model.forward(ids, ids, training=True)
        model.backward()
        losses.append(float(loss))
        grads.append(np.array(model.params.grad))
    assert abs(losses[1] - losses[0]) <= 1e-12 * abs(losses[0])
    assert np.linalg.norm(grads[1] - grads[0]) <= 1e-12 * np.linalg.norm(grads[0])

def test_a_table_records_the_machine_it_ran_on():
    """CPU model and family/model numbers, NumPy's SIMD level, the BLAS with its core type
    and the versions: a table from one CPU says nothing about another."""
    import numpy as np
    from numpy._core._multiarray_umath import __cpu_dispatch__

    seen = bench.machine()
    assert seen["cpus"] >= 1 and seen["numpy"] == np.__version__
    assert seen["simd"] in (*__cpu_dispatch__, "baseline")
    assert seen["cpu"] and seen["cpu_id"].startswith("family ")
    assert seen["blas"].split()[0] in ("openblas", "mkl", "blis", "accelerate")
    table = bench.format_table(dict(meta=dict(command="c", date="d", kernels="on", max_load=0.1,
                                              torch=None, torch_attention="sdpa", peaks={},
                                              **seen), rows=[]))
    assert f"SIMD {seen['simd']}" in table and seen["cpu_id"] in table


def test_the_readme_says_of_the_stored_table_what_it_holds():
    """The README's sentence on benchmarks/results.json: the CPU it names, each float32 ratio,
    the float64 range and medium's share of the peak are the stored table's, rounded."""
    stored = json.loads(_benchmark("results.json"))
    said = _readme_says(r"`benchmarks/results\.json` holds one run on a quiet 2-core (\w+ \w+)"
                        r".*?float32 tiny ([\d.]+) \(one thread\) and ([\d.]+) \(two\), small "
                        r"([\d.]+) and ([\d.]+), medium ([\d.]+) and ([\d.]+) with (\d+)% and "
                        r"(\d+)% of the GEMM peak.*?float64 ([\d.]+)-([\d.]+);", "results.json")
    assert stored["meta"]["cpu"].startswith(said.group(1))
    row = {(r["threads"], r["config"], r["dtype"]): r for r in stored["rows"]}
    ratios = [f"{row[(t, c, 'float32')]['ratio']:.2f}"
              for c in ("tiny", "small", "medium") for t in (1, 2)]
    assert list(said.group(2, 3, 4, 5, 6, 7)) == ratios
    peaks = [f"{row[(t, 'medium', 'float32')]['tfcore']['pct_peak']:.0f}" for t in (1, 2)]
    assert list(said.group(8, 9)) == peaks
    f64 = [r["ratio"] for r in stored["rows"] if r["dtype"] == "float64"]
    assert said.group(10, 11) == (f"{min(f64):.2f}", f"{max(f64):.2f}")


def test_the_readme_says_of_the_intel_table_and_of_both_what_they_hold():
    """The README's sentences on benchmarks/results-intel-xeon.json and on what held on both
    CPUs: the CPU, the range of ratios, how many rows were at most 1.00, the two-thread rows
    it names, the range of the memory ratios (all below 1), the range over both tables and
    the memory margin are the stored tables'."""
    amd = json.loads(_benchmark("results.json"))
    intel = json.loads(_benchmark("results-intel-xeon.json"))
    said = _readme_says(r"`benchmarks/results-intel-xeon\.json` holds one run on a quiet 2-core "
                        r"Intel Xeon \(family (\d+) model (\d+),.*?tfcore took ([\d.]+)-([\d.]+) "
                        r"times PyTorch's time, at most 1\.00 \(rounded\) in (\d+) of the (\d+) "
                        r"rows, .*?\(tiny float32 ([\d.]+), small ([\d.]+), long2k ([\d.]+) and "
                        r"([\d.]+)\); its peak memory was below PyTorch's in every row "
                        r"\(([\d.]+)-([\d.]+) of it\)\. What held on both CPUs is only that "
                        r"tfcore's step took between ([\d.]+) and ([\d.]+) times .*?\(to within "
                        r"([\d.]+) MiB at tiny\)", "results-intel-xeon.json")
    meta = intel["meta"]
    assert meta["cpu"].startswith("Intel") and meta["cpu_id"].startswith(
        f"family {said.group(1)} model {said.group(2)} ")
    ratios = [r["ratio"] for r in intel["rows"]]
    assert said.group(3, 4) == (f"{min(ratios):.2f}", f"{max(ratios):.2f}")
    assert said.group(5, 6) == (str(sum(round(r, 2) <= 1.0 for r in ratios)),
                                str(len(ratios)))
    row = {(r["threads"], r["config"], r["dtype"]): r["ratio"] for r in intel["rows"]}
    named = [row[(2, "tiny", "float32")], row[(2, "small", "float32")],
             row[(2, "long2k", "float32")], row[(2, "long2k", "float64")]]
    assert list(said.group(7, 8, 9, 10)) == [f"{r:.2f}" for r in named]
    memory = [r["memory_ratio"] for r in intel["rows"]]
    assert max(memory) < 1
    assert said.group(11, 12) == (f"{min(memory):.3f}", f"{max(memory):.3f}")
    both = amd["rows"] + intel["rows"]
    assert said.group(13, 14) == (f"{min(r['ratio'] for r in both):.2f}",
                                  f"{max(r['ratio'] for r in both):.2f}")
    excess = max(r["tfcore"]["rss_bytes"] - r["torch"]["rss_bytes"] for r in both) / 2**20
    assert 0 < excess <= float(said.group(15))


def test_the_readme_says_of_the_scaling_table_what_it_holds():
    """The README's sentence on benchmarks/scaling-intel-xeon.json: the tiled step's memory
    range and growth, that it stayed below PyTorch's, the dense step's memory, and the ranges
    of both ratios are the stored table's."""
    stored = json.loads(_benchmark("scaling-intel-xeon.json"))
    said = _readme_says(r"`benchmarks/scaling-intel-xeon\.json` .*? the same (\d+) tokens a step "
                        r"with S = (\d+) to (\d+),.*?peak memory stayed within (\d+) MiB .*?\("
                        r"(\d+)-(\d+) MiB in float32, below PyTorch's at every S and dtype\) where "
                        r"the dense step's went from (\d+) to (\d+) MiB; the tiled step took "
                        r"([\d.]+)-([\d.]+) times PyTorch's time \(([\d.]+)-([\d.]+) at S = "
                        r"(\d+)\), the dense one ([\d.]+)-([\d.]+)\.", "scaling-intel-xeon.json")
    assert stored["meta"]["scaling"]
    rows = bench.scaling_rows(stored)
    seqs = sorted(r["seq"] for r in rows)
    assert {r["seq"] * r["batch"] for r in rows} == {int(said.group(1))}
    assert (seqs[0], seqs[-1]) == (int(said.group(2)), int(said.group(3)))
    one = sorted((r for r in rows if (r["threads"], r["dtype"]) == (1, "float32")),
                 key=lambda r: r["seq"])
    tiled = [r["tiled"]["mib"] for r in one]
    assert max(tiled) - min(tiled) <= int(said.group(4))
    assert said.group(5, 6) == (f"{tiled[0]:.0f}", f"{tiled[-1]:.0f}")
    assert all(r["tiled"]["mib"] < r["torch"]["mib"] for r in rows)
    assert said.group(7, 8) == (f"{one[0]['dense']['mib']:.0f}", f"{one[-1]['dense']['mib']:.0f}")

    def spread(key, chosen):
        values = [r[key]["ratio"] for r in chosen]
        return f"{min(values):.2f}", f"{max(values):.2f}"

    assert said.group(9, 10) == spread("tiled", rows)
    longest = [r for r in rows if r["seq"] == int(said.group(13))]
    assert said.group(11, 12) == spread("tiled", longest) and seqs[-1] == int(said.group(13))
    assert said.group(14, 15) == spread("dense", rows)


def test_the_readme_says_of_the_gpu_attention_table_what_it_holds():
    """The README's sentence on benchmarks/attention-cupy-h100.txt: the GPU it names and the
    smallest and largest tiled/dense ratio with their configurations are the stored run's."""
    stored = _benchmark("attention-cupy-h100.txt")
    said = _readme_says(r"`benchmarks/attention-cupy-h100\.txt` \(`python "
                        r"benchmarks/attention_backends\.py --backend cupy` on an NVIDIA (\w+)\).*?"
                        r"the tiled step took ([\d.]+) \((\w+)\) to ([\d.]+) \(S = (\d+)\) times "
                        r"the dense one's time", "attention-cupy-h100.txt")
    assert f"NVIDIA {said.group(1)}" in stored and "backend cupy" in stored
    rows = re.findall(r"^(\w+)\s+S=\s*(\d+) .*tiled/dense\s+([\d.]+)", stored, re.M)
    assert len(rows) >= 6
    low = min(rows, key=lambda r: float(r[2]))
    high = max(rows, key=lambda r: float(r[2]))
    assert (said.group(2), said.group(3)) == (low[2], low[0])
    assert (said.group(4), said.group(5)) == (high[2], high[1])


def test_the_readme_says_of_the_gpu_tile_sizes_what_they_hold():
    """The README's sentence on benchmarks/attention-cupy-h100-blocks.txt: the tiled step's
    range of tiled/dense ratios with 1024-wide tiles at S >= 1024, and the memory the pool
    held at the longest S for each, are the stored run's."""
    stored = _benchmark("attention-cupy-h100-blocks.txt")
    said = _readme_says(r"`attention_block_size=(\d+)` the tiled step took ([\d.]+) \(S = (\d+)\) "
                        r"to ([\d.]+) \(S = (\d+)\) times the dense one's, for (\d+) MiB in CuPy's "
                        r"memory pool at S = \d+ against the dense step's (\d+)\.",
                        "attention-cupy-h100-blocks.txt")
    rows = re.findall(r"^\w+\s+S=\s*(\d+) .*?dense\s+[\d.]+ \(\s*[\d.]+\) MiB\s+([\d.]+)\s+"
                      r"tiled block\s+(\d+)\s+[\d.]+ \(\s*[\d.]+\) MiB\s+([\d.]+)\s+"
                      r"tiled/dense\s+([\d.]+)", stored, re.M)
    chosen = [r for r in rows if r[2] == said.group(1) and int(r[0]) >= 1024]
    assert len(chosen) >= 3
    low, high = chosen[0], chosen[-1]
    assert (said.group(2), said.group(3)) == (low[4], low[0])
    assert (said.group(4), said.group(5)) == (high[4], high[0])
    assert said.group(6, 7) == (f"{float(high[3]):.0f}", f"{float(high[1]):.0f}")


def test_the_pytorch_step_is_loaded_from_outside_the_package(tmp_path, monkeypatch):
    """tfcore imports no PyTorch code: the PyTorch side is benchmarks/torch_step.py of the
    checkout, loaded by file path. Without the file, or without torch (simulated here by
    hiding the module), there is no PyTorch column and one line says why."""
    assert Path(bench.TORCH_STEP) == ROOT / "benchmarks" / "torch_step.py"
    assert Path(bench.TORCH_STEP).is_file()
    module, why = bench.load_torch_step(str(tmp_path / "absent.py"))
    assert module is None and "tfcore alone" in why and "absent.py" in why
    assert "\n" not in why
    monkeypatch.setitem(sys.modules, "torch", None)         # `import torch` now fails
    module, why = bench.load_torch_step()
    assert module is None and why.startswith("PyTorch is not installed")
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no TorchStep"):
        bench.load_torch_step(str(tmp_path / "empty.py"))
