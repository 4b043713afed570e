"""The data behind the parallel chapters' pictures: what the simulated ring, the layers, the
mesh and ZeRO-1 really do, and that each drawing function runs on it."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tfcore.models.decoder import DecoderLM  # noqa: E402
from tfcore.parallel.harness import CONFIGS  # noqa: E402
from tfcore.viz import parallel as dg  # noqa: E402


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_states_follow_the_algorithm(n):
    states = dg.ring_all_reduce_states(n, chunk=2)
    holds, sends = states["holds"], states["sends"]
    full = 2 ** n - 1
    assert holds.shape == (n, 2 * (n - 1) + 1, n)
    for r in range(n):
        assert list(holds[r, 0]) == [1 << r] * n           # each rank starts with its own
        assert holds[r, n - 1, r] == full                   # reduce-scatter: chunk r summed
        assert all(holds[r, -1] == full)                    # all-gather: every chunk summed
        assert list(sends[r, : n - 1]) == [(r - s - 1) % n for s in range(n - 1)]
        # during the reduce-scatter a chunk gains exactly one rank per step it travels
        for s in range(n - 1):
            counts = [bin(int(v)).count("1") for v in holds[r, s]]
            assert max(counts) <= s + 1
    for call in states["calls"]:
        assert call.messages == 2 * (n - 1) and call.op == "all_reduce"


def test_ring_states_refuse_bad_sizes():
    with pytest.raises(ValueError, match="n must be"):
        dg.ring_all_reduce_states(1)
    with pytest.raises(ValueError, match="chunk must be"):
        dg.ring_all_reduce_states(3, chunk=0)


def test_linear_shards_and_their_collectives():
    layout = dg.linear_shard_layout(4, batch_rows=2, d_in=8, d_out=12)
    col, row = layout["column"], layout["row"]
    assert [rec["w"][1] for rec in col] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [rec["w"][0] for rec in row] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(rec["forward"] == [] and rec["backward"] == ["all_reduce"] for rec in col)
    assert all(rec["forward"] == ["all_reduce"] and rec["backward"] == [] for rec in row)
    with pytest.raises(ValueError, match="multiples of n"):
        dg.linear_shard_layout(3, d_in=8, d_out=9)


def test_mesh_groups_match_the_formula():
    groups = dg.mesh_groups(tp=2, dp=3)
    for g in groups:
        d, t = divmod(g["world"], 2)
        assert (g["d"], g["t"]) == (d, t)
        assert g["tp_group"] == tuple(d * 2 + u for u in range(2))
        assert g["dp_group"] == tuple(e * 2 + t for e in range(3))


def test_zero1_layout_covers_the_buffer():
    params = DecoderLM(CONFIGS["tiny"]()).params
    layout = dg.zero1_layout(params, 4)
    assert layout["bounds"][0][0] == 0 and layout["bounds"][-1][1] == params.size
    assert layout["tensors"][0][1] == 0 and layout["tensors"][-1][2] == params.size
    with pytest.raises(ValueError, match="dp must be"):
        dg.zero1_layout(params, 0)


def test_every_drawing_runs():
    fig, ax = plt.subplots()
    dg.draw_ring_states(ax, dg.ring_all_reduce_states(3))
    fig2, axes = plt.subplots(1, 2)
    dg.draw_linear_shards(axes, dg.linear_shard_layout(2, 2, 4, 4))
    fig3, ax3 = plt.subplots()
    dg.draw_fg_block(ax3, "identity", "all_reduce", "all_reduce", "identity")
    fig4, ax4 = plt.subplots()
    dg.draw_mesh(ax4, dg.mesh_groups(2, 2), ["all_reduce"], ["all_reduce"])
    fig5, (a5, b5) = plt.subplots(2, 1)
    dg.draw_zero1(a5, b5, dg.zero1_layout(DecoderLM(CONFIGS["tiny"]()).params, 2))
    for f in (fig, fig2, fig3, fig4, fig5):
        f.canvas.draw()
        pixels = np.asarray(f.canvas.buffer_rgba())
        assert pixels.size and pixels.min() < 255          # something was drawn
        plt.close(f)


def _imported_modules(path):
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_library_draws_nothing_and_imports_no_torch():
    """Pictures live in tfcore.viz (above parallel) and PyTorch in benchmarks/ (never
    imported by tfcore): no parallel module and not the benchmark imports matplotlib or
    torch; no module of tfcore outside viz imports matplotlib, and none imports torch."""
    from pathlib import Path

    package = Path(dg.__file__).resolve().parents[1]         # tfcore/
    library = sorted((package / "parallel").glob("*.py")) + [package / "bench.py"]
    assert len(library) > 10
    for path in library:
        assert not {"matplotlib", "torch"} & _imported_modules(path), path
    everything = sorted(package.rglob("*.py"))
    drawing = [p for p in everything if (package / "viz") in p.parents]
    assert package / "viz" / "parallel.py" in drawing and package / "viz" / "loss.py" in drawing
    assert all("matplotlib" in _imported_modules(p) for p in drawing if p.stem != "__init__")
    for path in everything:
        assert "torch" not in _imported_modules(path), path
        assert path in drawing or "matplotlib" not in _imported_modules(path), path
