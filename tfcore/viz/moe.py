"""Pictures of a mixture of experts, drawn from what the code does rather than by hand.

As in viz.parallel, each `*_data` function runs the real thing (tfcore.functional.moe's
plan, tfcore.parallel.volume's send counts) and returns plain numbers; each `draw_*`
function draws those numbers on a matplotlib Axes. Chapter 24 asserts on the numbers and
shows the drawing.

    routing_data(experts, gates, n_experts, capacity_factor)
                            run moe_plan: every (token, slot)'s expert, gate, buffer slot
                            or drop, and each expert's buffer row by row
    draw_routing            tokens -> experts, a line per assignment (width: the gate;
                            dashed: dropped)
    draw_dispatch           the [N_E, C] dispatch buffer, each slot labelled with its token,
                            the overflow past C drawn crossed out
    send_matrix_data(load, n_ranks)
                            the all-to-all's rows from rank i to rank j and each rank's
                            received rows (volume.expert_send_counts)
    draw_send_matrix        that matrix, the busiest rank's column outlined
    draw_expert_load        each expert's share of the assignments, step by step

matplotlib is imported by the drawing functions only.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..functional import moe as M
from ..parallel.volume import expert_send_counts
from .parallel import RANK_COLOURS

EXPERT_COLOURS = RANK_COLOURS


def _expert_colour(e: int) -> str:
    return EXPERT_COLOURS[e % len(EXPERT_COLOURS)]


def routing_data(experts, gates, n_experts: int, capacity_factor=None) -> dict:
    """Run `tfcore.functional.moe.moe_plan` on a routing and return what the pictures show.

    experts [T, K] integers, gates [T, K] floats (the router's output), capacity_factor as
    in moe_plan (None: dropless) -> {'experts' [T, K], 'gates' [T, K], 'kept' [T, K] bool,
    'slot' [T, K] (the position in the expert's buffer, -1 where dropped), 'buffer'
    [N_E, C] (the token in each slot, -1 where unused), 'overflow' {expert: [tokens
    dropped, in token order]}, 'load' [N_E], 'capacity' C}.
    """
    chosen = np.asarray(backend.to_numpy(experts), dtype=np.int64)
    weights = np.asarray(backend.to_numpy(gates), dtype=np.float64)
    if chosen.ndim != 2 or weights.shape != chosen.shape:
        raise ValueError(f"experts and gates must both be [T, K], got {chosen.shape} and "
                         f"{weights.shape}")
    plan = M.moe_plan(chosen, n_experts, capacity_factor)
    cap = plan.capacity
    kept = np.asarray(backend.to_numpy(plan.kept), dtype=bool)            # [T, K]
    slot = np.full(chosen.shape, -1, dtype=np.int64)
    buffer = np.full((n_experts, cap), -1, dtype=np.int64)                # [N_E, C]
    flat = np.asarray(backend.to_numpy(plan.flat), dtype=np.int64)
    dest = np.asarray(backend.to_numpy(plan.dest), dtype=np.int64)
    top_k = chosen.shape[1]
    for a, d in zip(flat, dest):
        t, k = divmod(int(a), top_k)
        e, c = divmod(int(d), cap)
        slot[t, k] = c
        buffer[e, c] = t
    overflow = {e: [int(t) for t in range(chosen.shape[0]) for k in range(top_k)
                    if chosen[t, k] == e and not kept[t, k]] for e in range(n_experts)}
    return dict(experts=chosen, gates=weights, kept=kept, slot=slot, buffer=buffer,
                overflow=overflow, load=np.asarray(backend.to_numpy(plan.load)),
                capacity=cap)


def draw_routing(ax, data: dict) -> None:
    """Tokens (left) to experts (right): one line per (token, slot), its width the gate, in
    the expert's colour; a dropped assignment is dashed grey."""
    from matplotlib.patches import Rectangle

    chosen, gates, kept = data["experts"], data["gates"], data["kept"]
    n_tokens, top_k = chosen.shape
    n_experts = data["buffer"].shape[0]
    y_tok = np.linspace(1, 0, n_tokens) if n_tokens > 1 else np.array([0.5])
    y_exp = np.linspace(0.9, 0.1, n_experts) if n_experts > 1 else np.array([0.5])
    for t in range(n_tokens):
        for k in range(top_k):
            e = int(chosen[t, k])
            style = dict(color=_expert_colour(e), lw=0.6 + 4 * float(gates[t, k]))
            if not kept[t, k]:
                style = dict(color="0.6", lw=1.0, ls="--")
            ax.plot([0.08, 0.92], [y_tok[t], y_exp[e]], **style, zorder=1)
        ax.text(0.03, y_tok[t], f"t{t}", ha="right", va="center", fontsize=7)
    for e in range(n_experts):
        ax.add_patch(Rectangle((0.92, y_exp[e] - 0.04), 0.1, 0.08,
                               color=_expert_colour(e), zorder=2))
        ax.text(0.97, y_exp[e], f"E{e}", ha="center", va="center", fontsize=7,
                color="white", zorder=3)
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(-0.08, 1.08)
    ax.axis("off")


def draw_dispatch(ax, data: dict) -> None:
    """The dispatch buffer: row e holds expert e's C slots, each labelled with the token it
    holds (tokens in order: the drop rule); the assignments past C are drawn crossed out to
    the right of the buffer."""
    from matplotlib.patches import Rectangle

    buffer, overflow, cap = data["buffer"], data["overflow"], data["capacity"]
    n_experts = buffer.shape[0]
    widest = cap + max((len(v) for v in overflow.values()), default=0)
    for e in range(n_experts):
        y = n_experts - 1 - e
        ax.text(-0.3, y + 0.5, f"E{e}", ha="right", va="center", fontsize=7)
        for c in range(cap):
            t = int(buffer[e, c])
            ax.add_patch(Rectangle((c, y + 0.08), 0.92, 0.84, edgecolor="0.3", lw=0.6,
                                   facecolor=_expert_colour(e) if t >= 0 else "white",
                                   alpha=1.0 if t >= 0 else 0.4))
            if t >= 0:
                ax.text(c + 0.46, y + 0.5, f"t{t}", ha="center", va="center", fontsize=7,
                        color="white")
        for j, t in enumerate(overflow[e]):
            x = cap + 0.3 + j
            ax.add_patch(Rectangle((x, y + 0.08), 0.92, 0.84, edgecolor="0.6", lw=0.6,
                                   facecolor="white", ls="--"))
            ax.text(x + 0.46, y + 0.5, f"t{t}", ha="center", va="center", fontsize=7,
                    color="0.5")
            ax.plot([x + 0.1, x + 0.82], [y + 0.2, y + 0.8], color="#c44e52", lw=1)
    ax.axvline(cap + 0.12, color="#c44e52", lw=1)
    ax.text(cap + 0.12, n_experts + 0.05, f"C = {cap}", ha="center", va="bottom",
            fontsize=7, color="#c44e52")
    ax.set_xlim(-1.0, widest + 0.6)
    ax.set_ylim(-0.1, n_experts + 0.5)
    ax.set_aspect("equal")
    ax.axis("off")


def send_matrix_data(load, n_ranks: int) -> dict:
    """The all-to-all of an expert-parallel dispatch: load [N, N_E] (assignments of rank i's
    tokens kept by expert e) -> {'S' [N, N] rows rank i sends rank j (the diagonal stays
    on its rank), 'received' [N] rows arriving from other ranks, 'rows' [N] rows each
    rank's experts compute, 'busiest' the rank with the most rows (ties: the lowest)}."""
    S = np.asarray(expert_send_counts(load, n_ranks), dtype=np.int64)
    rows = S.sum(axis=0)
    received = rows - np.diag(S)
    busiest = int(max(range(n_ranks), key=lambda j: (rows[j], -j)))
    return dict(S=S, received=received, rows=rows, busiest=busiest)


def draw_send_matrix(ax, data: dict, title: str = "") -> None:
    """The matrix of sends: cell (i, j) the rows rank i sends rank j (the diagonal stays
    home, hatched); the busiest rank's column outlined, its received rows below."""
    from matplotlib.patches import Rectangle

    S = data["S"]
    n = S.shape[0]
    ax.imshow(S, cmap="Blues", vmin=0, vmax=max(int(S.max()), 1))
    for i in range(n):
        for j in range(n):
            dark = S[i, j] > 0.6 * S.max()
            ax.text(j, i, str(int(S[i, j])), ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")
        ax.add_patch(Rectangle((i - 0.5, i - 0.5), 1, 1, fill=False, hatch="///",
                               edgecolor="0.5", lw=0))
    b = data["busiest"]
    ax.add_patch(Rectangle((b - 0.5, -0.5), 1, n, fill=False, edgecolor="#c44e52", lw=2))
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"{j}\n+{int(r)}" for j, r in enumerate(data["received"])],
                       fontsize=7)
    ax.set_yticks(range(n))
    ax.set_yticklabels([str(i) for i in range(n)], fontsize=7)
    ax.set_xlabel("to rank j (+ rows received)", fontsize=8)
    ax.set_ylabel("from rank i", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)


def draw_expert_load(ax, loads, title: str = "") -> None:
    """loads [steps, N_E] assignment counts -> each expert's share per step, stacked (a
    balanced router gives N_E equal bands)."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2:
        raise ValueError(f"loads must be [steps, N_E], got shape {loads.shape}")
    share = loads / np.maximum(loads.sum(axis=1, keepdims=True), 1)
    steps = np.arange(1, loads.shape[0] + 1)
    ax.stackplot(steps, share.T, colors=[_expert_colour(e) for e in range(loads.shape[1])],
                 linewidth=0)
    for level in np.arange(1, loads.shape[1]) / loads.shape[1]:
        ax.axhline(level, color="white", lw=0.4, ls=":")
    ax.set_xlim(1, loads.shape[0])
    ax.set_ylim(0, 1)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("share of assignments", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
