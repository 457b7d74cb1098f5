"""The end-to-end report's pictures: ``e2e-curves.png`` (each cell's metric against training
wall clock, a panel per workload and network) and ``e2e-pays.png`` (workload × network,
coloured by the best jaxcomm speedup over the 16-bit baseline, ``auto``'s pick named)."""

from __future__ import annotations

import math
import pathlib
from typing import Any

from _bench import pyplot
from train_grid import ALGORITHMS, AUTO_LABELS, NETWORKS, network_dir


def draw_curves(cells: list[dict[str, Any]], path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None or not cells:
        return
    keys = sorted(
        {(c["workload"], network_dir(c["network"], c["nodes"], c.get("devices", 1))) for c in cells}
    )
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (workload, net) in zip(axes.flat, keys, strict=False):
        for c in cells:
            if (c["workload"], network_dir(c["network"], c["nodes"], c.get("devices", 1))) != (
                workload,
                net,
            ):
                continue
            if c["seed"] != 0:
                continue
            pts = [(h["seconds"], h[c["metric"]]) for h in c["history"]]
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker=".", markersize=3, label=c["label"])
            target = c["target"]
        ax.axhline(target, color="gray", linestyle=":", linewidth=1)
        ax.set_title(f"{workload} · {net}", fontsize=9)
        # Linear up to 1 s (the small workload's whole run), logarithmic beyond.
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlim(left=0)
        ax.set_xlabel("training wall clock (s)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    fig.tight_layout()
    # A panel per workload and network, each with a dozen dense curves: at the pays picture's
    # resolution the file outweighs every other result, and 80 dpi still reads.
    _save(fig, path, dpi=80)


def draw_pays(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    """Workload × network, coloured by the best jaxcomm speedup over the 16-bit baseline; the
    text names the best algorithm and ``auto``'s pick."""
    plt = pyplot()
    if plt is None or not rows:
        return
    workloads = sorted({r["workload"] for r in rows})
    networks = sorted(
        {r["network"] for r in rows}, key=lambda n: list(NETWORKS).index(n.split("-")[0])
    )
    import numpy as np

    grid = np.full((len(workloads), len(networks)), np.nan)
    fig, ax = plt.subplots(figsize=(2.2 + 2.0 * len(networks), 1.2 + 1.1 * len(workloads)))
    for i, w in enumerate(workloads):
        for j, n in enumerate(networks):
            cell = [r for r in rows if r["workload"] == w and r["network"] == n]
            jc = [r for r in cell if r["label"] not in ("psum", "psum-bf16") and r["speedup"]]
            autos = [r for r in cell if r["label"] in AUTO_LABELS]
            # The grid's auto (16-bit gradients, the workload's warm-up), else another.
            preferred = f"{ALGORITHMS.AUTO}-bf16"
            auto = next((r for r in autos if r["label"] == preferred), None) or next(
                iter(autos), None
            )
            if not jc:
                text = "no jaxcomm run\nreached the target" if cell else "not run"
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
                continue
            best = max(jc, key=lambda r: r["speedup"])
            grid[i, j] = math.log2(best["speedup"])
            text = f"{best['label']}\n{'≥' if best['speedup_is_lower_bound'] else ''}{best['speedup']:.2f}×"
            if auto is not None:
                pick = auto["auto_pick"] or "?"
                auto_s = "–" if auto["speedup"] is None else f"{auto['speedup']:.2f}"
                text += f"\nauto: {pick} {auto_s}×"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    lim = max(1.0, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0)
    im = ax.imshow(grid, cmap="RdYlGn", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(len(networks)), networks, fontsize=8)
    ax.set_yticks(range(len(workloads)), workloads, fontsize=8)
    cbar = fig.colorbar(im, ax=ax)
    cbar.set_label("log2 speedup over the fastest dense 16-bit run", fontsize=7)
    ax.set_title("When compression pays (time to target)", fontsize=9)
    fig.tight_layout()
    _save(fig, path, dpi=120)


def _save(fig: Any, path: pathlib.Path, dpi: int) -> None:
    """Saves ``fig`` as a PNG of 256 colours: a plot of lines and flat fills loses nothing to
    the palette, and the file is a third of the full-colour one."""
    from PIL import Image

    fig.savefig(path, dpi=dpi)
    with Image.open(path) as image:
        paletted = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    paletted.save(path, optimize=True)
