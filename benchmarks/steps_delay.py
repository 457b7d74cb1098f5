"""Whether a compressor's extra steps are a factor or a delay, from the grid's full runs.

The learner's prior says a compressor needs a fixed multiple of dense's steps to reach the same
accuracy (:class:`jaxcomm.cost.learn.Learning`'s ``prior_steps``). Error feedback suggests
another shape: what a compressor holds back reaches the model some steps late, so it would need
about as many steps more than dense on a short run as on a long one, a delay, and a factor
that falls as the run grows. This script fits both shapes to every reduction's steps to target
in the end-to-end grid's cells (``benchmarks/results/e2e/cells``: each workload's median over
its seeds, both links pooled), on the workloads the prior's replay reads, and scores them on
those it leaves out (``steps_prior.JUDGED``): the factor ``F`` predicts ``F × N`` steps where
dense takes ``N``, the delay ``D`` predicts ``N + D``.

Usage:
  python benchmarks/steps_delay.py
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

from jaxcomm.cost.arms import is_safe

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import write_result_and_plot  # noqa: E402
from prior_pick import ARMS  # noqa: E402
from steps_prior import JUDGED, MET  # noqa: E402

COMPRESSORS = tuple(a for a in ARMS if not is_safe(a))
"""A learning auto's arms that are not safe (:func:`~jaxcomm.cost.arms.is_safe`): those the
prior weighs."""
POOLED = "all"
""":func:`score`'s row of every compressor at once, as the learner's one prior."""


def medians(cells: pathlib.Path) -> dict[str, dict[str, float]]:
    """Each workload's median steps to target per reduction over the seeds that reached it, on
    two emulated nodes at either link (the steps do not depend on the link)."""
    steps: dict[str, dict[str, list[int]]] = {}
    for path in cells.glob("*/*-2x1/*-s*.json"):
        cell = json.loads(path.read_text())
        if cell["label"].startswith("auto") or cell["time_to_target_s"] is None:
            continue
        steps.setdefault(cell["workload"], {}).setdefault(cell["label"], []).append(cell["steps"])
    return {w: {a: statistics.median(s) for a, s in by.items()} for w, by in steps.items()}


def pairs(steps: dict[str, dict[str, float]]) -> Iterator[dict[str, Any]]:
    """Each (workload, compressor) with dense's steps ``n`` (the 16-bit run's, else fp32's) and
    the compressor's."""
    for workload, by in sorted(steps.items()):
        n = by.get("dense-bf16", by.get("dense"))
        for arm in COMPRESSORS:
            if n is not None and arm in by:
                yield {"workload": workload, "arm": arm, "dense_steps": n, "steps": by[arm],
                       "judged": workload in JUDGED}  # fmt: skip


def fit(entries: list[dict[str, Any]]) -> tuple[float, float]:
    """The factor (geometric median of steps over dense's) and the delay (median steps beyond
    dense's) of ``entries``."""
    factor = math.exp(statistics.median(math.log(e["steps"] / e["dense_steps"]) for e in entries))
    delay = statistics.median(e["steps"] - e["dense_steps"] for e in entries)
    return factor, delay


def errors(entries: list[dict[str, Any]], predict: Callable[[float], float]) -> dict[str, Any]:
    """How far ``predict(dense steps)`` lands from each entry's steps: the median of the
    absolute log ratio, and how many land within ``MET``."""
    logs = [abs(math.log(max(predict(e["dense_steps"]), 1.0) / e["steps"])) for e in entries]
    return {"median_log_error": statistics.median(logs),
            "within": sum(x <= math.log(MET) for x in logs), "of": len(logs)}  # fmt: skip


def score(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per compressor and for all of them as one prior: both shapes fitted on the entries the
    replay reads, each scored on those it reads and on those it leaves out."""
    out = []
    for arms in [*([a] for a in COMPRESSORS), list(COMPRESSORS)]:
        read = [e for e in entries if e["arm"] in arms and not e["judged"]]
        left = [e for e in entries if e["arm"] in arms and e["judged"]]
        if not read or not left:
            continue
        factor, delay = fit(read)
        out.append({
            "arms": arms[0] if len(arms) == 1 else POOLED, "factor": factor, "delay": delay,
            "factor_read": errors(read, lambda n, f=factor: f * n),
            "delay_read": errors(read, lambda n, d=delay: n + d),
            "factor_left_out": errors(left, lambda n, f=factor: f * n),
            "delay_left_out": errors(left, lambda n, d=delay: n + d),
        })  # fmt: skip
    return out


def pooled(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of :func:`score`'s ``summary`` that fits every compressor at once."""
    return next(r for r in summary if r["arms"] == POOLED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args()
    entries = list(pairs(medians(args.results / "e2e" / "cells")))
    rows = score(entries)
    if not rows:
        sys.exit("no compressor has runs both read by the fit and left out of it")
    print("| arms | factor | delay | left out: factor's error, within | delay's error, within |")
    print("|---|---|---|---|---|")
    for r in rows:
        f, d = r["factor_left_out"], r["delay_left_out"]
        print(f"| {r['arms']} | {r['factor']:.2f}x | {r['delay']:.0f} steps | "
              f"{f['median_log_error']:.2f}, {f['within']}/{f['of']} | "
              f"{d['median_log_error']:.2f}, {d['within']}/{d['of']} |")  # fmt: skip
    result = {"met": MET, "judged": list(JUDGED), "summary": rows, "entries": entries}
    write_result_and_plot(
        args.results, "steps-delay", result, draw(entries, pooled(rows)), figsize=(7, 4.5),
        xlabel="dense steps to target", ylabel="compressor's steps / dense's",
        title="Extra steps: a factor or a delay (grid's full runs)", log=True,
    )  # fmt: skip


def draw(entries: list[dict[str, Any]], pooled: dict[str, Any]) -> Callable[[Any], None]:
    """Each (workload, compressor): its steps over dense's against dense's, and both shapes
    fitted to every compressor at once."""

    def plot(ax: Any) -> None:
        for judged, marker in ((False, "o"), (True, "s")):
            pts = [(e["dense_steps"], e["steps"] / e["dense_steps"])
                   for e in entries if e["judged"] == judged]  # fmt: skip
            name = "left out of the fit" if judged else "read by the fit"
            ax.plot(*zip(*pts, strict=True), marker, label=name, alpha=0.6)
        ns = sorted(e["dense_steps"] for e in entries)
        ax.plot(ns, [pooled["factor"]] * len(ns), "k--", label=f"factor {pooled['factor']:.2f}")
        ax.plot(ns, [1 + pooled["delay"] / n for n in ns], "k-",
                label=f"delay {pooled['delay']:.0f} steps")  # fmt: skip

    return plot


if __name__ == "__main__":
    main()
