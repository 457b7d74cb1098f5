"""What a trial window inherits from the window before it.

The learning ``auto`` (:mod:`jaxcomm.cost.learn`) runs its arms in interleaved windows over
one set of error-feedback residuals: a lossy arm's window starts from whatever the arm before
it left unsent. After a safe arm (dense leaves nothing; block int8 little) a sparse arm starts
from an empty residual and sends 1 % of one gradient; after another sparse arm it starts with
that arm's held-back signal and sends part of it. This script reads the windows the held-out
auto runs recorded and sets each lossy window's loss decrease per step beside the safe arms'
around it (the mean of the nearest safe window before and after it in the same round), and
beside what the full runs say the ratio should be: the safe arm's steps to target over the
arm's own (their medians over seeds, from the cells of the same workload and link).

``quotient`` is the window's ratio over the full runs' ratio: 1 where the window ranks the arm
as the full runs do, below 0 where the loss did not fall in the window. Its quartiles, by what
ran before the window, say how far one window is from the truth it stands for, and whether
the order of the windows moves it. The rounds' closing safe windows, which follow a lossy
one, are set beside their opening ones.

Usage:
  python benchmarks/window_order.py --cells benchmarks/results/e2e/cells
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

from jaxcomm.cost.learn import is_safe

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import write_result_and_plot  # noqa: E402

AFTER = ("after a safe arm", "after 1 lossy arm", "after 2 lossy arms", "after 3 or more")
"""The groups: how many lossy windows ran since the last safe one (each left its unsent
residual to the next)."""


def reached_steps(cells: pathlib.Path) -> dict[str, float]:
    """Each reduction's median steps to target over its seeds in one cell directory (its
    runs that reached it)."""
    steps: dict[str, list[int]] = {}
    for path in cells.glob("*-s*.json"):
        cell = json.loads(path.read_text())
        if cell.get("time_to_target_s") is not None:
            steps.setdefault(cell["label"], []).append(cell["steps"])
    return {label: statistics.median(v) for label, v in steps.items()}


def bracketed(windows: list[dict[str, Any]], i: int) -> float | None:
    """The safe arms' decrease per step around window ``i``: the mean of the nearest safe
    window before it and after it in the same round (None without both, or not above 0)."""
    before = next((w for w in reversed(windows[:i]) if is_safe(w["arm"])), None)
    after = next((w for w in windows[i + 1 :] if is_safe(w["arm"])), None)
    if before is None or after is None or before["round"] != after["round"]:
        return None
    safe = (before["loss_decrease_per_step"] + after["loss_decrease_per_step"]) / 2
    return safe if safe > 0 else None


def lossy_before(windows: list[dict[str, Any]], i: int) -> int:
    """How many lossy windows ran directly before window ``i`` since the last safe one."""
    n = 0
    while i - n - 1 >= 0 and not is_safe(windows[i - n - 1]["arm"]):
        n += 1
    return n


def rounds(learned: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The windows of an auto cell's ``auto_learned``, each with the number of its round
    (a decision ends one)."""
    out, number = [], 0
    for event in learned:
        if event["event"] == "decision":
            number += 1
        elif event["event"] == "window":
            out.append({**event, "round": number})
    return out


def cell_windows(path: pathlib.Path, steps: dict[str, float]) -> list[dict[str, Any]]:
    """Every lossy window of one auto cell that follows another window directly, with its
    ratio to the safe decrease around it and the full runs' ratio."""
    # The safe arms' steps to target in the full runs of the cell's workload and link.
    reference = min((steps[a] for a in ("dense-bf16", "blockquant") if a in steps), default=0)
    if not reference:
        return []
    cell = json.loads(path.read_text())
    windows = rounds(cell.get("auto_learned", []))
    rows = []
    for i, w in enumerate(windows):
        if i == 0 or is_safe(w["arm"]) or windows[i - 1]["last_step"] + 1 != w["first_step"]:
            continue
        safe = bracketed(windows, i)
        if safe is None or w["arm"] not in steps:
            continue
        ratio, truth = w["loss_decrease_per_step"] / safe, reference / steps[w["arm"]]
        rows.append({
            "cell": f"{cell['workload']} · {cell['network']} · s{cell['seed']}",
            "arm": w["arm"], "first_step": w["first_step"],
            "after": AFTER[min(lossy_before(windows, i), len(AFTER) - 1)],
            "window_ratio": ratio, "full_run_ratio": truth, "quotient": ratio / truth,
        })  # fmt: skip
    return rows


def closing_over_opening(path: pathlib.Path) -> list[dict[str, Any]]:
    """Each round of one auto cell whose safe arm opened it and closed it after a lossy
    window: the closing window's decrease per step over the opening one's (the loss falls
    more slowly later in training, so a closer reading more says what it inherited), and
    whether the closer was read past the flush of what the lossy arms held back
    (``settle`` beyond the opener's: :meth:`jaxcomm.cost.learn.Learner.flushes`)."""
    cell = json.loads(path.read_text())
    windows, out = rounds(cell.get("auto_learned", [])), []
    for number in sorted({w["round"] for w in windows}):
        ws = [w for w in windows if w["round"] == number]
        if len(ws) < 3 or not (is_safe(ws[0]["arm"]) and is_safe(ws[-1]["arm"])):
            continue
        opener, closer = ws[0], ws[-1]
        if is_safe(ws[-2]["arm"]) or opener["loss_decrease_per_step"] <= 0:
            continue
        out.append({
            "cell": f"{cell['workload']} · {cell['network']} · s{cell['seed']}",
            "ratio": closer["loss_decrease_per_step"] / opener["loss_decrease_per_step"],
            "past_flush": closer.get("settle", 0) > opener.get("settle", 0),
        })  # fmt: skip
    return out


def closing_summary(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rounds, how many closers read more than their opener, and the median ratio, for the
    closers read with the usual settle and those read past the flush.

    Example:
      >>> closing_summary([{"ratio": r, "past_flush": False} for r in (0.5, 2.0, 3.0)])[0]
      {'read': 'usual settle', 'rounds': 3, 'closer_more': 2, 'median_ratio': 2.0}
    """
    out = []
    for read, past in (("usual settle", False), ("past the flush", True)):
        group = [p["ratio"] for p in pairs if p["past_flush"] == past]
        if group:
            out.append({
                "read": read, "rounds": len(group), "closer_more": sum(r > 1 for r in group),
                "median_ratio": statistics.median(group),
            })  # fmt: skip
    return out


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By what ran before (and over all): windows, how many measured a loss that did not
    fall, and the quartiles of the quotient.

    Example:
      >>> rows = [{"after": AFTER[0], "quotient": q} for q in (-1.0, 0.5, 1.0, 2.0)]
      >>> summary(rows)[0]["quartiles"], summary(rows)[0]["not_falling"]
      ([-0.625, 0.75, 1.75], 1)
    """
    out = []
    for after in (*AFTER, "all"):
        group = [r["quotient"] for r in rows if after in ("all", r["after"])]
        out.append({
            "after": after, "windows": len(group), "not_falling": sum(q <= 0 for q in group),
            "quartiles": statistics.quantiles(group, n=4) if len(group) > 1 else None,
        })  # fmt: skip
    return out


def draw(rows: list[dict[str, Any]]) -> Callable[[Any], None]:
    """Each window's ratio against the full runs' ratio, by what ran before it."""

    def plot(ax: Any) -> None:
        for after, marker in zip(AFTER, "os^v", strict=True):
            pts = [(r["full_run_ratio"], r["window_ratio"]) for r in rows if r["after"] == after]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker, alpha=0.6, label=after)
        top = max([1.0, *(r["full_run_ratio"] for r in rows)])
        ax.plot([0, top], [0, top], "k--", linewidth=0.8, label="window = full runs")

    return plot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cells", type=pathlib.Path, default=pathlib.Path("benchmarks/results/e2e/cells")
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args()
    rows, pairs = [], []
    for folder in sorted(args.cells.glob("heldout-*/*")):
        steps = reached_steps(folder)
        for path in sorted(folder.glob("auto*-s*.json")):
            rows += cell_windows(path, steps)
            pairs += closing_over_opening(path)
    table, closing = summary(rows), closing_summary(pairs)
    args.out.mkdir(parents=True, exist_ok=True)
    print("| what ran before | lossy windows | loss not falling | quotient: quartiles |")
    print("|---|---|---|---|")
    for row in table:
        q = " / ".join(f"{v:.2f}" for v in row["quartiles"] or [])
        print(f"| {row['after']} | {row['windows']} | {row['not_falling']} | {q or '–'} |")
    for row in closing:
        print(
            f"closing safe window, {row['read']}: read more than the opening one in "
            f"{row['closer_more']} of {row['rounds']} rounds, median ratio "
            f"{row['median_ratio']:.2f}"
        )
    result = {"cells": str(args.cells), "summary": table, "closing": closing, "windows": rows}
    write_result_and_plot(
        args.out, "window-order", result,
        draw(rows), figsize=(6.5, 4.5), xlabel="full runs: safe steps / arm steps",
        ylabel="window: arm decrease / safe decrease", title="What a lossy window measures",
        legend_size=8,
    )  # fmt: skip


if __name__ == "__main__":
    main()
