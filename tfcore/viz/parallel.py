"""Pictures of the parallel layouts, drawn from what the code does rather than by hand.

Each `*_data` function runs (or reads) the real thing and returns plain numbers; each
`draw_*` function takes those numbers and a matplotlib Axes. The chapters assert on the
numbers and show the drawing, so a picture cannot disagree with the code it describes.

    ring_all_reduce_states(n, chunk)   run the simulated ring; what every rank holds per step
    linear_shard_layout(n, ...)        run column- and row-parallel linears; each rank's shapes
    mesh_groups(tp, dp)                build the DP x TP mesh; every rank's two groups
    zero1_layout(params, dp)           the real ZeRO-1 chunk bounds over a parameter buffer
    ring_rotation_data(n, seq, ...)    run ring attention; whose K/V each rank holds per step
    mesh3d_coords(dp, pp, tp)          build the DP x PP x TP mesh; every rank's three groups
    ulysses_layout_data(n, seq, heads) run Ulysses's all-to-all; which rank holds each
                                       (head, position) before and after

The pipeline timeline (draw_timeline) draws what tfcore.parallel.pipeline.measure_timeline
returns. viz sits above parallel in the layering: it imports tfcore.parallel, never the
reverse. matplotlib is imported by the drawing functions only, so the package does not
need it.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from .. import functional as F
from ..parallel import layers
from ..parallel.comm import SimulatedComm, SimulatedGroup, chunk_bounds
from ..parallel.context import DIAGONAL, SKIP, ContextLayout, ring_attention_forward
from ..parallel.mesh import Mesh

RANK_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860",
                "#da8bc3", "#8c8c8c")


# The colours of what a rank holds, in every memory figure (chapters 20 and 23): its
# parameters, their gradients and the optimizer state.
STATE_COLOURS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}


def _rank_colour(r: int) -> str:
    return RANK_COLOURS[r % len(RANK_COLOURS)]


# ---------------------------------------------------------------------------------------
# The ring all-reduce, step by step


class _WatchedComm(SimulatedComm):
    """A simulated rank that copies its whole work buffer each time it starts a send.

    The collectives send slices of one flat work buffer (`work[a:b]`), so the slice's base
    is the buffer as it stands at the start of that step; the offset of the slice says which
    chunk goes out."""

    def __init__(self, *args, log=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log if log is not None else []

    def send(self, dst, x):
        base = x.base if isinstance(x, np.ndarray) else None
        if base is None or base.ndim != 1:
            raise RuntimeError("the watched ring expects slices of a flat NumPy work buffer")
        offset = (x.__array_interface__["data"][0]
                  - base.__array_interface__["data"][0]) // x.itemsize
        self.log.append((base.copy(), int(offset), int(dst)))
        return super().send(dst, x)


class _WatchedGroup(SimulatedGroup):
    def __init__(self, size: int):
        super().__init__(size, "ring")
        self.logs = [[] for _ in range(size)]

    def comms(self, world):
        ranks = tuple(range(self.size))
        return [_WatchedComm(world, r, ranks, "world", "ring", self.traffic[r],
                             log=self.logs[r]) for r in range(self.size)]


def ring_all_reduce_states(n: int, chunk: int = 1) -> dict:
    """Run the simulated ring all-reduce on n ranks, rank r contributing 2**r in every entry
    (exact in float64 for n <= 52), so that any partial sum names the ranks it contains.

    -> dict(
        holds  int64 [n ranks, 2(n-1) + 1 states, n chunks]: the bit mask of the ranks whose
               contributions chunk c holds on rank r before step s (s = 2(n-1): the end),
        sends  int64 [n ranks, 2(n-1)]: the chunk rank r sends at step s,
        bounds the chunk bounds, calls: each rank's CallRecord of the all-reduce)."""
    if not isinstance(n, int) or not 2 <= n <= 52:
        raise ValueError(f"n must be an integer in 2..52 (exact bit masks), got {n!r}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    M = n * chunk
    group = _WatchedGroup(n)
    xs = [np.full(M, 2.0 ** r) for r in range(n)]
    # NumPy arrays whatever the backend: the watcher reads the work buffer's memory
    finals = group.run(lambda comm: comm.all_reduce(xs[comm.rank]))
    bounds = chunk_bounds(M, n)
    steps = 2 * (n - 1)
    holds = np.zeros((n, steps + 1, n), dtype=np.int64)
    sends = np.zeros((n, steps), dtype=np.int64)
    starts = [a for a, _ in bounds]
    for r in range(n):
        log = group.logs[r]
        if len(log) != steps:
            raise RuntimeError(f"rank {r} sent {len(log)} messages, expected {steps}")
        buffers = [buf for buf, _, _ in log] + [backend.to_numpy(finals[r])]
        for s, buf in enumerate(buffers):
            holds[r, s] = [int(buf[a]) for a, _ in bounds]
        sends[r] = [starts.index(offset) for _, offset, _ in log]
    calls = [t.calls[-1] for t in group.traffic]
    return dict(holds=holds, sends=sends, bounds=bounds, calls=calls)


def draw_ring_states(ax, states: dict) -> None:
    """A grid of ranks (rows) x steps (columns); inside each cell, one square per chunk,
    shaded by how many ranks' contributions it holds (dark: the whole sum), with the chunk
    that rank sends at that step outlined."""
    from matplotlib.patches import Rectangle
    import matplotlib.pyplot as plt

    holds, sends = states["holds"], states["sends"]
    n, n_states, _ = holds.shape
    cmap = plt.get_cmap("Blues")
    cell, gap = n + 1.2, 0.0
    for r in range(n):
        for s in range(n_states):
            x0, y0 = s * cell, (n - 1 - r) * 1.6
            for c in range(n):
                count = bin(int(holds[r, s, c])).count("1")
                face = cmap(0.15 + 0.8 * (count - 1) / max(n - 1, 1))
                sent = s < sends.shape[1] and sends[r, s] == c
                ax.add_patch(Rectangle((x0 + c, y0), 0.92, 0.92, facecolor=face,
                                       edgecolor="#c00000" if sent else "white",
                                       linewidth=2.2 if sent else 0.5))
                ax.text(x0 + c + 0.46, y0 + 0.46, str(count), ha="center", va="center",
                        fontsize=7, color="white" if count > n / 2 else "black")
    for s in range(n_states):
        phase = ("start" if s == 0 else "end" if s == n_states - 1
                 else f"RS {s}" if s < n else f"AG {s - n + 1}")
        ax.text(s * cell + n / 2, n * 1.6 + 0.1, phase, ha="center", va="bottom", fontsize=8)
    for r in range(n):
        ax.text(-0.4, (n - 1 - r) * 1.6 + 0.46, f"rank {r}", ha="right", va="center",
                fontsize=8)
    ax.axvline((n - 1) * cell + n + gap + 0.1, color="#888", linestyle=":", linewidth=1)
    ax.set_xlim(-3.2, n_states * cell)
    ax.set_ylim(-0.4, n * 1.6 + 0.8)
    ax.set_aspect("equal")
    ax.axis("off")


# ---------------------------------------------------------------------------------------
# Column- and row-parallel linears: each rank's shard


def linear_shard_layout(n: int, batch_rows: int = 3, d_in: int = 8, d_out: int = 8) -> dict:
    """Run tfcore's column- and row-parallel linears on n simulated ranks (x [rows, d_in],
    W [d_in, d_out]) and record, per rank, the index ranges of x, W and y it holds and the
    collectives it called.

    -> dict(kind -> list over ranks of dict(x=(rows, cols), w=(rows, cols), y=(rows, cols),
            partial (y is a partial sum), forward/backward: [op names])), where each
            (rows, cols) is a pair of (start, stop) ranges of the full matrix."""
    for name, value in (("n", n), ("batch_rows", batch_rows), ("d_in", d_in), ("d_out", d_out)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if d_in % n or d_out % n:
        raise ValueError(f"d_in ({d_in}) and d_out ({d_out}) must be multiples of n ({n})")
    rng = np.random.default_rng(0)
    x = backend.asarray(rng.standard_normal((1, batch_rows, d_in)))
    W = backend.asarray(rng.standard_normal((d_in, d_out)))
    G = backend.asarray(rng.standard_normal((1, batch_rows, d_out)))
    cols_out = chunk_bounds(d_out, n)
    rows_in = chunk_bounds(d_in, n)

    def column(comm):
        a, b = cols_out[comm.rank]
        y, cache = layers.column_parallel_linear_forward(x, W[:, a:b], None, comm)
        fwd = [c.op for c in comm.traffic.calls]
        layers.column_parallel_linear_backward(G[..., a:b], cache)
        bwd = [c.op for c in comm.traffic.calls][len(fwd):]
        return dict(x=((0, batch_rows), (0, d_in)), w=((0, d_in), (a, b)),
                    y=((0, batch_rows), (a, a + y.shape[-1])), partial=False,
                    forward=fwd, backward=bwd)

    def row(comm):
        a, b = rows_in[comm.rank]
        y, cache = layers.row_parallel_linear_forward(x[..., a:b], W[a:b, :], None, comm)
        fwd = [c.op for c in comm.traffic.calls]
        layers.row_parallel_linear_backward(G, cache)
        bwd = [c.op for c in comm.traffic.calls][len(fwd):]
        return dict(x=((0, batch_rows), (a, b)), w=((a, b), (0, d_out)),
                    y=((0, batch_rows), (0, y.shape[-1])), partial=True,
                    forward=fwd, backward=bwd)

    return dict(column=SimulatedGroup(n).run(column), row=SimulatedGroup(n).run(row),
                shape=dict(rows=batch_rows, d_in=d_in, d_out=d_out))


def draw_linear_shards(axes, layout: dict) -> None:
    """Two panels (column-parallel, row-parallel): x @ W = y, each matrix drawn whole in
    outline with every rank's block filled in its colour; a replicated block is hatched
    grey, a partial sum is drawn as the rank's full-size copy, stacked."""
    from matplotlib.patches import Rectangle

    shape = layout["shape"]
    R, Din, Dout = shape["rows"], shape["d_in"], shape["d_out"]
    for ax, kind in zip(axes, ("column", "row")):
        ranks = layout[kind]
        n = len(ranks)
        origin = {"x": (0.0, 0.0), "w": (Din + 2.5, 0.0), "y": (Din + Dout + 7.0, 0.0)}
        sizes = {"x": (R, Din), "w": (Din, Dout), "y": (R, Dout)}
        for name in ("x", "w", "y"):
            ox, oy = origin[name]
            rows, cols = sizes[name]
            top = Din
            if not (name == "y" and ranks[0]["partial"]):
                ax.add_patch(Rectangle((ox, top - rows), cols, rows, fill=False,
                                       edgecolor="black", linewidth=1.0))
            for r, rec in enumerate(ranks):
                (r0, r1), (c0, c1) = rec[name]
                whole = (r0, r1) == (0, rows) and (c0, c1) == (0, cols)
                if whole and name != "y":       # replicated: every rank holds all of it
                    if r == 0:
                        ax.add_patch(Rectangle((ox, top - rows), cols, rows,
                                               facecolor="#dddddd", hatch="//",
                                               edgecolor="#888888", linewidth=0.5))
                    continue
                if name == "y" and rec["partial"]:
                    # a full-size partial per rank, drawn as a stack of cards
                    shift = 0.45 * (n - 1 - r)
                    ax.add_patch(Rectangle((ox + shift, top - rows - shift), cols, rows,
                                           facecolor=_rank_colour(r), alpha=0.95,
                                           edgecolor="white", zorder=2 + r))
                    continue
                ax.add_patch(Rectangle((ox + c0, top - r1), c1 - c0, r1 - r0,
                                       facecolor=_rank_colour(r), alpha=0.85,
                                       edgecolor="white"))
            label = {"x": "X", "w": "W", "y": "Y"}[name]
            if name == "y" and ranks[0]["partial"]:
                label = f"Y = sum of {n} full-size partials"
            ax.text(ox + cols / 2, top + 0.4, label, ha="center", va="bottom", fontsize=10)
        ax.text(Din + 1.25, Din - R / 2, "@", ha="center", va="center", fontsize=12)
        ax.text(Din + Dout + 4.75, Din - R / 2, "=", ha="center", va="center", fontsize=12)
        fwd, bwd = ranks[0]["forward"], ranks[0]["backward"]
        what = ("Y: column blocks, no communication" if kind == "column"
                else "Y = sum of the ranks' partials")
        ax.set_title(f"{kind}-parallel: {what}\nforward {fwd or 'none'}, "
                     f"backward {bwd or 'none'}", fontsize=9)
        ax.set_xlim(-0.5, Din + Dout + 7.5 + Dout)
        if kind == "column":
            handles = [Rectangle((0, 0), 1, 1, facecolor=_rank_colour(r), alpha=0.85)
                       for r in range(n)]
            handles.append(Rectangle((0, 0), 1, 1, facecolor="#dddddd", hatch="//",
                                     edgecolor="#888888"))
            ax.legend(handles, [f"rank {r}" for r in range(n)] + ["every rank (replicated)"],
                      fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        ax.set_ylim(-0.5, Din + 1.6)
        ax.set_aspect("equal")
        ax.axis("off")


# ---------------------------------------------------------------------------------------
# Where f and g sit in a block


def draw_fg_block(ax, f_forward: str, f_backward: str, g_forward: str,
                  g_backward: str) -> None:
    """A pre-norm block as two rows (attention, MLP) of boxes, with f before each
    column-parallel linear and g after each row-parallel one, each labelled with what it
    does forward and backward (the chapters pass the collectives one layer recorded)."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    rows = [
        ("attention", ["LN", "f", "QKV\ncolumn", "heads", "W_O\nrow", "g", "+"]),
        ("MLP", ["LN", "f", "A\ncolumn", "GELU", "B\nrow", "g", "+"]),
    ]
    for i, (title, boxes) in enumerate(rows):
        y = 1.0 - i * 1.6
        ax.text(-0.7, y, title, ha="right", va="center", fontsize=9)
        for j, label in enumerate(boxes):
            x = j * 1.35
            colour = {"f": "#fde0c5", "g": "#c9e3c9"}.get(label, "#eeeeee")
            if "column" in label or "row" in label or label == "heads":
                colour = "#d6e0f0"
            ax.add_patch(FancyBboxPatch((x - 0.5, y - 0.3), 1.0, 0.6,
                                        boxstyle="round,pad=0.02", facecolor=colour,
                                        edgecolor="#555555", linewidth=0.8))
            ax.text(x, y, label, ha="center", va="center", fontsize=8)
            if j:
                ax.add_patch(FancyArrowPatch(((j - 1) * 1.35 + 0.5, y), (x - 0.5, y),
                                             arrowstyle="-|>", mutation_scale=8,
                                             color="#555555", linewidth=0.8))
            if label == "f":
                ax.text(x, y - 0.42, f"fwd: {f_forward}\nbwd: {f_backward}",
                        ha="center", va="top", fontsize=7)
            if label == "g":
                ax.text(x, y - 0.42, f"fwd: {g_forward}\nbwd: {g_backward}",
                        ha="center", va="top", fontsize=7)
        ax.add_patch(FancyBboxPatch((1.35 * 2 - 0.62, y - 0.42), 1.35 * 2 + 1.24, 0.84,
                                    boxstyle="round,pad=0.02", fill=False,
                                    edgecolor="#4c72b0", linestyle="--", linewidth=0.8))
    ax.text(1.35 * 3, 1.5, "rank-local: 1/N_T of the heads / of F", ha="center",
            fontsize=8, color="#4c72b0")
    ax.set_xlim(-2.2, 6 * 1.35 + 0.7)
    ax.set_ylim(-1.4, 1.8)
    ax.set_aspect("equal")
    ax.axis("off")


# ---------------------------------------------------------------------------------------
# The DP x TP mesh


def mesh_groups(tp: int, dp: int) -> list[dict]:
    """Build tfcore.parallel.mesh.Mesh on tp * dp simulated ranks. -> [dict(world, t, d,
    tp_group, dp_group)] in world-rank order (the groups as tuples of world ranks)."""
    def body(comm):
        mesh = Mesh(comm, tp=tp, dp=dp)
        return dict(world=comm.rank, t=mesh.tp_rank, d=mesh.dp_rank,
                    tp_group=mesh.tp.ranks, dp_group=mesh.dp.ranks)

    return SimulatedGroup(tp * dp).run(body)


def draw_mesh(ax, groups: list[dict], tp_ops=(), dp_ops=()) -> None:
    """Ranks at (t, d); a box around each tensor-parallel group (a row), a line through each
    data-parallel group (a column); `tp_ops`/`dp_ops` name the collectives run in each."""
    from matplotlib.patches import Circle, FancyBboxPatch

    tp = max(g["t"] for g in groups) + 1
    dp = max(g["d"] for g in groups) + 1
    pos = {g["world"]: (g["t"] * 1.6, (dp - 1 - g["d"]) * 1.4) for g in groups}
    for members in sorted({g["tp_group"] for g in groups}):
        xs = [pos[m][0] for m in members]
        y = pos[members[0]][1]
        ax.add_patch(FancyBboxPatch((min(xs) - 0.55, y - 0.45), max(xs) - min(xs) + 1.1, 0.9,
                                    boxstyle="round,pad=0.02", facecolor="#fde0c5",
                                    edgecolor="#dd8452", linewidth=1.2, zorder=0))
    for members in sorted({g["dp_group"] for g in groups}):
        xs, ys = zip(*(pos[m] for m in members))
        ax.plot(xs, ys, color="#55a868", linewidth=3, zorder=1, solid_capstyle="round")
    for g in groups:
        x, y = pos[g["world"]]
        ax.add_patch(Circle((x, y), 0.32, facecolor="white", edgecolor="#333333", zorder=2))
        ax.text(x, y, str(g["world"]), ha="center", va="center", fontsize=9, zorder=3)
        if g["d"] == 0:
            ax.text(x, (dp - 1) * 1.4 + 0.6, f"t = {g['t']}", ha="center", fontsize=8)
        if g["t"] == 0:
            ax.text(-0.75, y, f"d = {g['d']}", ha="right", va="center", fontsize=8)
    right = (tp - 1) * 1.6 + 0.9
    ax.text(right, (dp - 1) * 1.4, "tensor-parallel group\n" + "\n".join(tp_ops),
            color="#b35a1f", fontsize=8, va="center")
    ax.text(right, 0.0, "data-parallel group\n" + "\n".join(dp_ops), color="#2f7a3f",
            fontsize=8, va="center")
    ax.set_xlim(-1.8, right + 3.6)
    ax.set_ylim(-0.7, (dp - 1) * 1.4 + 1.0)
    ax.set_aspect("equal")
    ax.axis("off")


# ---------------------------------------------------------------------------------------
# ZeRO-1's shards of the optimizer state


def zero1_layout(params, dp: int) -> dict:
    """The tensors of a flat parameter buffer and the ZeRO-1 chunks of dp ranks over it.

    -> dict(tensors [(name, start, stop)] in buffer order, bounds [(start, stop)] per rank
            (chunk_bounds, the bounds the ZeRO1 strategy uses), size P)."""
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    tensors = [(name, *params.offsets[name]) for name in params.names]
    return dict(tensors=tensors, bounds=chunk_bounds(params.size, dp), size=params.size)


def draw_zero1(ax_strip, ax_bars, layout: dict, itemsize: int = 8) -> None:
    """Top: the flat buffer as a strip, one segment per tensor (grey shades), with each
    rank's ZeRO-1 chunk marked below it. Bottom: bytes per rank, replicated against ZeRO-1
    (parameters, gradients, AdamW's m and v), as stacked bars."""
    from matplotlib.patches import Rectangle

    P = layout["size"]
    for i, (name, a, b) in enumerate(layout["tensors"]):
        ax_strip.add_patch(Rectangle((a, 0.6), b - a, 0.6,
                                     facecolor="#bbbbbb" if i % 2 else "#e0e0e0",
                                     edgecolor="none"))
    for r, (a, b) in enumerate(layout["bounds"]):
        ax_strip.add_patch(Rectangle((a, 0.0), b - a, 0.45, facecolor=_rank_colour(r),
                                     edgecolor="white"))
        ax_strip.text((a + b) / 2, 0.22, f"rank {r}: m, v of [{a}, {b})", ha="center",
                      va="center", fontsize=7, color="white")
    ax_strip.text(0, 1.3, f"flat parameter buffer, {len(layout['tensors'])} tensors, "
                  f"N = {P}", fontsize=8)
    ax_strip.set_xlim(0, P)
    ax_strip.set_ylim(0, 1.7)
    ax_strip.axis("off")

    dp = len(layout["bounds"])
    parts = ("parameters", "gradients", "m", "v")
    colours = ("#4c72b0", "#8fb0dc", "#dd8452", "#f0b98a")
    labels = []
    for k, zero in enumerate((False, True)):
        for r, (a, b) in enumerate(layout["bounds"]):
            x = k * (dp + 1) + r
            state = b - a if zero else P
            heights = (P, P, state, state)
            bottom = 0.0
            for part, h, colour in zip(parts, heights, colours):
                ax_bars.bar(x, h * itemsize / 1e3, bottom=bottom, color=colour,
                            label=part if (k, r) == (0, 0) else None, width=0.8)
                bottom += h * itemsize / 1e3
            labels.append((x, f"{r}"))
    ax_bars.set_xticks([x for x, _ in labels], [t for _, t in labels])
    ax_bars.text((dp - 1) / 2, -0.16, "replicated (rank)", ha="center", va="top",
                 transform=ax_bars.get_xaxis_transform(), fontsize=8)
    ax_bars.text(dp + 1 + (dp - 1) / 2, -0.16, "ZeRO-1 (rank)", ha="center", va="top",
                 transform=ax_bars.get_xaxis_transform(), fontsize=8)
    ax_bars.set_ylabel("kB per rank")
    ax_bars.legend(fontsize=7, ncol=4, loc="upper right")


# ---------------------------------------------------------------------------------------
# Ring attention (context parallelism), drawn from a recorded run


def ring_rotation_data(n: int, seq: int, balanced: bool, causal: bool = True,
                       batch: int = 1, heads: int = 1, d_h: int = 2, seed: int = 0) -> dict:
    """Run ring attention on n simulated ranks and record what each rank did at each step.

    -> dict(layout, owner int [n ranks, n steps]: whose K/V block rank r holds at step t,
            pairs [rank][step]: [(q chunk, k chunk, kind, rows, cols)], work [per rank]:
            score entries computed, sent [per rank]: bytes counted, error: the worst
            relative error of the output against the dense op)."""
    layout = ContextLayout(seq, n, balanced)
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((batch, heads, seq, d_h)) for _ in range(3))
    logs = [[] for _ in range(n)]

    def body(comm):
        shard = lambda x: layout.shard(x, comm.rank, axis=2)  # noqa: E731
        out, _ = ring_attention_forward(shard(backend.asarray(q)), shard(backend.asarray(k)),
                                        shard(backend.asarray(v)), comm, layout,
                                        causal=causal, block_size=seq, log=logs[comm.rank])
        return np.asarray(backend.to_numpy(out))

    group = SimulatedGroup(n)
    outs = group.run(body)
    ref, _ = F.attention_forward(backend.asarray(q), backend.asarray(k), backend.asarray(v),
                                 causal=causal)
    ref = np.asarray(backend.to_numpy(ref))
    got = layout.unshard(outs, axis=2)
    owner = np.array([[entry["owner"] for entry in log] for log in logs], dtype=np.int64)
    pairs = [[entry["pairs"] for entry in log] for log in logs]
    work = [sum(rows * cols for step in p for _, _, kind, rows, cols in step if kind != SKIP)
            for p in pairs]
    return dict(layout=layout, owner=owner, pairs=pairs, work=work,
                sent=[t.sent for t in group.traffic],
                error=float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))


def draw_ring_rotation(ax, data: dict) -> None:
    """Ranks (rows) x steps (columns): the K/V block each rank holds, in its owner's colour,
    with the chunks it carries and how many score blocks the rank computes against it
    (a greyed cell: every pair skipped by the causal mask)."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    owner, pairs, layout = data["owner"], data["pairs"], data["layout"]
    n = owner.shape[0]
    for r in range(n):
        for t in range(n):
            o = int(owner[r, t])
            done = sum(kind != SKIP for _, _, kind, _, _ in pairs[r][t])
            y = n - 1 - r
            ax.add_patch(Rectangle((t * 1.25, y), 1.0, 0.8, facecolor=_rank_colour(o),
                                   alpha=0.9 if done else 0.25, edgecolor="white"))
            chunks = ",".join(str(c) for c in layout.chunks_of(o))
            ax.text(t * 1.25 + 0.5, y + 0.52, f"K,V of {o}", ha="center", va="center",
                    fontsize=7, color="white" if done else "black")
            ax.text(t * 1.25 + 0.5, y + 0.2, f"chunk {chunks}: {done}", ha="center",
                    va="center", fontsize=6, color="white" if done else "black")
            if t < n - 1 and r < n - 1:       # the block moves to rank r + 1
                ax.add_patch(FancyArrowPatch((t * 1.25 + 1.0, y + 0.4),
                                             (t * 1.25 + 1.25, y - 0.4),
                                             arrowstyle="-|>", mutation_scale=6,
                                             color="#777777", linewidth=0.6))
        ax.text(-0.15, n - 1 - r + 0.4, f"rank {r}", ha="right", va="center", fontsize=8)
    for t in range(n):
        ax.text(t * 1.25 + 0.5, n + 0.05, f"step {t}", ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-1.3, n * 1.25)
    ax.set_ylim(-0.2, n + 0.5)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_causal_tiles(ax, data: dict) -> None:
    """The S x S score matrix cut into the layout's chunks: each block a rank computes is
    filled in that rank's colour (hatched: on the diagonal, under the causal mask); white
    blocks lie above the diagonal and are never computed."""
    from matplotlib.patches import Rectangle

    layout = data["layout"]
    S = layout.seq_len
    for r, per_step in enumerate(data["pairs"]):
        for step in per_step:
            for qc, kc, kind, _, _ in step:
                (a, b), (c, d) = layout.bounds[qc], layout.bounds[kc]
                if kind == SKIP:
                    ax.add_patch(Rectangle((c, a), d - c, b - a, facecolor="white",
                                           edgecolor="#cccccc", linewidth=0.5))
                    continue
                ax.add_patch(Rectangle((c, a), d - c, b - a, facecolor=_rank_colour(r),
                                       alpha=0.85, edgecolor="white", linewidth=0.8,
                                       hatch="///" if kind == DIAGONAL else None))
    ax.plot([0, S], [0, S], color="black", linewidth=0.8)
    ax.set_xlim(0, S)
    ax.set_ylim(S, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("key position", fontsize=8)
    ax.set_ylabel("query position", fontsize=8)
    ax.tick_params(labelsize=7)


# ---------------------------------------------------------------------------------------
# Pipeline parallelism: measured timelines and the DP x PP x TP mesh


def draw_timeline(ax, timeline: dict, n_microbatches: int, title: str = "") -> None:
    """A Gantt chart: one row per rank, a box per operation at its measured interval,
    coloured by micro-batch (forward light, backward dark), labelled i or i.c (chunk c)."""
    from matplotlib.colors import to_rgb

    intervals = timeline["intervals"]
    chunks = max((c for row in intervals for *_, c in row), default=0) + 1
    for r, row in enumerate(intervals):
        for start, stop, op, i, c in row:
            base = np.array(to_rgb(_rank_colour(i)))
            colour = base if op == "B" else 1 - 0.45 * (1 - base)
            ax.barh(r, float(stop - start), left=float(start), height=0.8, color=colour,
                    edgecolor="white", linewidth=0.6)
            label = str(i) if chunks == 1 else f"{i}.{c}"
            if float(stop - start) * 4 >= len(label):      # room for the label
                ax.text(float(start + stop) / 2, r, label, ha="center", va="center",
                        fontsize=6, color="white" if op == "B" else "#222222")
    ax.set_yticks(range(len(intervals)), [f"rank {r}" for r in range(len(intervals))],
                  fontsize=7)
    ax.set_ylim(len(intervals) - 0.5, -0.5)
    ax.set_xlim(0, float(timeline["span"]))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(title, fontsize=8, loc="left")


def mesh3d_coords(dp: int, pp: int, tp: int) -> list[dict]:
    """Build Mesh(pp=...) on dp * pp * tp simulated ranks: [dict(world, d, s, t, tp_group,
    pp_group, dp_group)] in world-rank order."""
    def body(comm):
        mesh = Mesh(comm, tp=tp, dp=dp, pp=pp)
        return dict(world=comm.rank, d=mesh.dp_rank, s=mesh.pp_rank, t=mesh.tp_rank,
                    tp_group=mesh.tp.ranks, dp_group=mesh.dp.ranks,
                    pp_group=mesh.pp.ranks if mesh.pp is not None else (comm.rank,))

    return SimulatedGroup(dp * pp * tp).run(body)


def draw_mesh3d(ax, ranks: list[dict]) -> None:
    """The DP x PP x TP mesh as a block per data-parallel replica: stages left to right,
    tensor-parallel ranks stacked in each stage (orange boxes: tp groups), arrows along the
    pp groups, dashed lines joining the replicas' copies of a rank (dp groups)."""
    from matplotlib.patches import Circle, FancyBboxPatch

    dp = max(g["d"] for g in ranks) + 1
    pp = max(g["s"] for g in ranks) + 1
    tp = max(g["t"] for g in ranks) + 1
    width = pp * 1.6 + 0.8
    pos = {g["world"]: (g["d"] * width + g["s"] * 1.6, -g["t"] * 1.0) for g in ranks}
    for members in sorted({g["tp_group"] for g in ranks}):
        xs, ys = zip(*(pos[m] for m in members))
        ax.add_patch(FancyBboxPatch((xs[0] - 0.45, min(ys) - 0.42), 0.9,
                                    max(ys) - min(ys) + 0.84, boxstyle="round,pad=0.02",
                                    facecolor="#fde0c5", edgecolor="#dd8452", zorder=0))
    for members in sorted({g["pp_group"] for g in ranks}):
        for a, b in zip(members, members[1:]):
            (xa, ya), (xb, yb) = pos[a], pos[b]
            ax.annotate("", (xb - 0.34, yb), (xa + 0.34, ya),
                        arrowprops=dict(arrowstyle="->", color="#4c72b0", lw=1.4))
    for members in sorted({g["dp_group"] for g in ranks}):
        xs, ys = zip(*(pos[m] for m in members))
        ax.plot(xs, [y - 0.3 for y in ys], color="#55a868", linestyle=":", lw=1.0,
                zorder=0)
    for g in ranks:
        x, y = pos[g["world"]]
        ax.add_patch(Circle((x, y), 0.3, facecolor="white", edgecolor="#333333", zorder=2))
        ax.text(x, y, str(g["world"]), ha="center", va="center", fontsize=8, zorder=3)
        if g["t"] == 0:
            ax.text(x, 0.62, f"stage {g['s']}", ha="center", fontsize=7)
    for d in range(dp):
        ax.text(d * width + (pp - 1) * 0.8, -(tp - 1) - 0.9, f"replica d = {d}",
                ha="center", fontsize=8, color="#2f7a3f")
    ax.set_xlim(-0.7, dp * width - 0.5)
    ax.set_ylim(-(tp - 1) - 1.2, 1.0)
    ax.set_aspect("equal")
    ax.axis("off")


# ---------------------------------------------------------------------------------------
# Ulysses: sequence-sharded -> head-sharded by one all-to-all


def ulysses_layout_data(n: int, seq: int, heads: int) -> dict:
    """Run the all-to-all Ulysses sends q with (tfcore.parallel.mappings.all_to_all_forward,
    the head axis split, the sequence axis joined) on n simulated ranks, each entry of q
    holding the rank it starts on: -> {'before' [H, S], 'after' [H, S]: the rank holding
    each (head, position) before and after, 'moved' [n]: entries each rank sent}."""
    from ..parallel import mappings

    def body(comm):
        r = comm.rank
        xp = backend.xp()
        mine = xp.full((1, heads, seq // n, 1), float(r))               # [B, H, S/N, 1]
        out, _ = mappings.all_to_all_forward(mine, comm, 1, 2)          # [B, H/N, S, 1]
        return np.asarray(backend.to_numpy(out))[0, :, :, 0]

    group = SimulatedGroup(n)
    blocks = group.run(body)                        # rank r: heads r H/N .., every position
    before = np.repeat(np.arange(n), seq // n)[None, :].repeat(heads, axis=0)
    after = np.concatenate([np.full(b.shape, r) for r, b in enumerate(blocks)], axis=0)
    came_from = np.concatenate(blocks, axis=0)      # the rank each entry started on
    assert np.array_equal(came_from, before)        # the all-to-all moved every entry whole
    moved = [t.sent // 8 for t in group.traffic]    # float64 entries
    return dict(before=before, after=after, moved=moved, n=n)


def draw_ulysses_layout(axes, data: dict) -> None:
    """Two grids of heads x positions coloured by the rank holding each entry: before (each
    rank a block of positions, every head) and after the all-to-all (a block of heads,
    every position)."""
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap([_rank_colour(r) for r in range(data["n"])])
    for ax, key, title in zip(axes, ("before", "after"),
                              ("before: S/N positions, all heads",
                               "after: H/N heads, all positions")):
        grid = data[key]
        ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=data["n"] - 0.5, aspect="auto")
        ax.set_xlabel("position", fontsize=8)
        ax.set_ylabel("head", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
