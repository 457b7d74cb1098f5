"""Draws the explanatory diagrams of docs/usage.md and docs/overlap.md (schematics, no measurements).

Usage (from the repository root; needs matplotlib)::

    python docs/diagrams.py            # rewrites docs/diagram-*.png
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parent
COMPUTE, WIRE, LOCAL, IDLE = "#4c72b0", "#dd8452", "#55a868", "#c8c8c8"


def box(
    ax: Axes,
    x: float,
    y: float,
    w: float,
    h: float,
    color: str,
    text: str = "",
    size: float = 8,
    text_color: str = "white",
) -> None:
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.6))
    if text:
        ax.text(
            x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=text_color
        )


def arrow(
    ax: Axes,
    start: tuple[float, float],
    end: tuple[float, float],
    color: str = "black",
    style: str = "-|>",
    width: float = 1.0,
) -> None:
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle=style, mutation_scale=10, color=color, linewidth=width
        )
    )


def finish(fig: Figure, ax: Axes, name: str) -> None:
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(DOCS / f"diagram-{name}.png", dpi=110)
    plt.close(fig)
    print(f"wrote docs/diagram-{name}.png")


def bucketing_overlap() -> None:
    """Backward produces layer gradients last layer first; buckets start on the wire as soon
    as they are complete, while backward computes the earlier layers."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 6.2)
    ax.text(0, 5.8, "serial: backward, then one allreduce", fontsize=9, weight="bold")
    box(ax, 0, 4.6, 8, 0.8, COMPUTE, "backward: layer 4, 3, 2, 1")
    box(ax, 8, 4.6, 6, 0.8, WIRE, "allreduce of every gradient")
    ax.text(
        0,
        3.3,
        "bucketed and overlapped (allreduce_gradients, overlap=True)",
        fontsize=9,
        weight="bold",
    )
    for i, layer in enumerate([4, 3, 2, 1]):
        box(ax, 2 * i, 2.1, 2, 0.8, COMPUTE, f"grad layer {layer}")
    ax.text(-0.1, 2.5, "compute", ha="right", va="center", fontsize=8)
    ax.text(-0.1, 0.9, "wire", ha="right", va="center", fontsize=8)
    box(ax, 4, 0.5, 3.5, 0.8, WIRE, "bucket A (layers 4, 3)")
    box(ax, 8, 0.5, 3.5, 0.8, WIRE, "bucket B (layers 2, 1)")
    arrow(ax, (4, 2.1), (4.2, 1.3))
    arrow(ax, (8, 2.1), (8.2, 1.3))
    ax.text(4.2, 1.55, "start", fontsize=7)
    ax.text(8.2, 1.55, "start", fontsize=7)
    ax.annotate(
        "", xy=(11.5, 0.3), xytext=(14, 0.3), arrowprops=dict(arrowstyle="<->", color="black")
    )
    ax.text(12.75, 0.05, "time saved", ha="center", fontsize=8)
    finish(fig, ax, "overlap")


def hierarchical() -> None:
    """Reduce inside each node, allreduce across nodes (each local rank owns a slice:
    multi-leader), gather inside each node."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 7)
    steps = [
        "1. reduce-scatter\ninside the node",
        "2. allreduce across nodes\n(per slice, dense or compressed)",
        "3. allgather\ninside the node",
    ]
    for n, x0 in enumerate([1, 9]):
        ax.add_patch(
            Rectangle((x0 - 0.4, 0.4), 6.8, 5.4, facecolor="none", edgecolor="gray", linestyle="--")
        )
        ax.text(x0 + 3, 6.0, f'node {n} (mesh axis "node")', ha="center", fontsize=9)
        for local in range(2):
            y = 3.6 - 2.4 * local
            box(ax, x0, y, 6, 1.4, IDLE, "", text_color="black")
            ax.text(x0 + 0.1, y + 1.15, f"local rank {local}", fontsize=7)
            box(ax, x0 + 3 * local, y + 0.2, 3, 0.7, LOCAL, f"owns slice {local}")
    for local in range(2):
        y = 3.6 - 2.4 * local + 0.55
        arrow(
            ax, (1 + 3 * local + 3.0, y), (9 + 3 * local, y), color=WIRE, style="<|-|>", width=1.6
        )
    ax.text(8, 6.55, "   ".join(steps).replace("\n", " "), ha="center", fontsize=7.5)
    finish(fig, ax, "hierarchical")


def gtopk_tree() -> None:
    """gTop-k: log2(P) rounds of pairwise merges that keep the top k of the sum, then the
    final k entries go back down the tree."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.set_xlim(-0.5, 8)
    ax.set_ylim(-0.6, 4.2)
    levels = [list(range(8)), [0, 2, 4, 6], [0, 4], [0]]
    for depth, ranks in enumerate(levels):
        y = depth * 1.2
        for r in ranks:
            box(ax, r - 0.35, y, 0.7, 0.5, LOCAL if depth == 0 else WIRE, f"{r}", size=8)
        if depth:
            step = 2 ** (depth - 1)
            for r in ranks:
                for child in (r, r + step):
                    arrow(ax, (child, y - 0.7), (r, y), color="black")
    ax.text(-0.45, 0.25, "local top-k\n(k entries)", fontsize=7, ha="right", va="center")
    ax.text(7.7, 1.45, "merge two sparse sets,\nkeep the top k of the sum", fontsize=7.5)
    ax.text(7.7, 3.65, "root: global top k;\nbroadcast back down\n(log2 P rounds)", fontsize=7.5)
    ax.text(
        3.5,
        -0.5,
        "P = 8 ranks: each round sends k entries (2k numbers); TopK-allgather sends k·(P − 1)",
        ha="center",
        fontsize=8,
    )
    finish(fig, ax, "gtopk")


def streaming_diloco() -> None:
    """DiLoCo with delay τ: every H inner steps the outer allreduce of Δ starts, runs on
    jaxcomm's engine behind the next τ inner steps, and is applied when it lands."""
    fig, ax = plt.subplots(figsize=(8, 2.8))
    H, tau = 6, 2
    ax.set_xlim(-1.5, 2 * H + 1)
    ax.set_ylim(0, 4)
    for t in range(2 * H):
        box(ax, t, 2.4, 0.9, 0.8, COMPUTE, f"{t}", size=7)
    ax.text(-0.2, 2.8, "inner\nsteps", ha="right", va="center", fontsize=8)
    ax.text(-0.2, 1.0, "outer\nallreduce", ha="right", va="center", fontsize=8)
    for start in (H - 1, 2 * H - 1):
        if start + tau <= 2 * H:
            box(ax, start + 0.95, 0.6, tau - 0.05, 0.8, WIRE, f"Δ, τ = {tau}", size=7)
            arrow(ax, (start + 0.9, 2.4), (start + 1.0, 1.4))
            arrow(ax, (start + tau + 0.9, 1.4), (start + tau + 1.0, 2.4), color=LOCAL)
            ax.text(start + tau + 1.1, 1.8, "lands: mix into\nlocal weights", fontsize=7)
        else:
            arrow(ax, (start + 0.9, 2.4), (start + 1.0, 1.4))
    ax.text(H / 2, 3.5, f"H = {H} inner steps, no communication", ha="center", fontsize=8)
    finish(fig, ax, "diloco")


if __name__ == "__main__":
    bucketing_overlap()
    hierarchical()
    gtopk_tree()
    streaming_diloco()
