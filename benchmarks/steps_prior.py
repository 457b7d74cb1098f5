"""How well the learning ``auto``'s decisions choose, replayed on the windows its runs recorded.

Every auto cell of the end-to-end grid (``benchmarks/results/e2e*/cells``) recorded its trial
windows and decisions (``auto_learned``). This script takes each exploration's windows (those
since the decision before) and asks which arm a decision rule picks from them
(:func:`jaxcomm.cost.learn.measure`, :func:`~jaxcomm.cost.learn.best_arm`), under each
setting of the steps' prior (``Learning.prior_steps``, ``prior_spread``, ``noise``). A pick is
scored by its own full runs: that reduction's median time to target in the same workload and
link, over the fastest reduction's. ``recorded`` is what the learner that ran chose. The
rule is replayed without the margin of a re-check, whose windows it leaves as they ran.

The held-out pairs that judged the learner's latest change or test it (``JUDGED``) are left
out. The prior's settings were fitted before heldout-convsmall and heldout-fourmid, which
judged them, had run; their rows, and those of each pair after it, joined once it had judged.

Usage:
  python benchmarks/steps_prior.py
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

from jaxcomm.cost.learn import Learning, best_arm, is_safe, measure

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import write_result_and_plot  # noqa: E402
from train_report import summarize  # noqa: E402

from docs import TARGET_OVER_FASTEST  # noqa: E402

JUDGED = (
    "heldout-convlowmom",
    "heldout-himom",
    "heldout-digitsdeep",
    "heldout-convwide",
    "heldout-digitsadam",
    "heldout-convdigits",
    "heldout-teachermom",
    "heldout-convadamdigits",
    "heldout-teacherbatch",
    "heldout-convteacher",
    "heldout-convbigbatch",
    "heldout-wideshallow",
    "heldout-convadamwd",
    "heldout-midplain",
    "heldout-fourwide",
    "heldout-fivemom",
    "heldout-convdigitsmom",
    "heldout-sixlong",
    "heldout-convmidmom",
    "heldout-fouradam",
    "heldout-convadambatch",
    "heldout-threelong",
    "heldout-twoadamlong",
    "heldout-threeadamwd",
    "heldout-convlong",
)
"""Never read here: the held-out workloads that judged the learner's latest changes."""
MET = TARGET_OVER_FASTEST  # a pick within this of the fastest reduction meets the target
PRIORS = (1.5, 2.0, 2.5, 3.0, 4.0)
NOISES = (0.01, 1.0, 2.0, 4.0, 8.0, 1000.0)  # 0.01: windows at face value; 1000: prior alone


def times_to_target(cells: pathlib.Path) -> dict[str, float]:
    """Each reduction's median time to target over its seeds in one cell directory of the
    grid, as the report's tables have it (:func:`train_report.summarize`: a seed that missed
    counts as the slowest); infinite where half its seeds missed."""
    runs = [json.loads(path.read_text()) for path in cells.glob("*-s*.json")]
    rows = summarize([c for c in runs if not c.get("label", "auto").startswith("auto")])
    return {r["label"]: math.inf if r["time_to_target_s"] is None else r["time_to_target_s"]
            for r in rows}  # fmt: skip


def explorations(learned: list[dict[str, Any]]) -> Iterator[tuple[int, list, dict]]:
    """Each exploration of one run: (its index, its windows, the decision that closed it),
    for those that tried more than one arm."""
    windows: list[dict[str, Any]] = []
    index = 0
    for event in learned:
        if event["event"] == "window" and "loss_decrease_se" in event:
            windows.append(event)
        elif event["event"] == "decision" and windows:
            if len({w["arm"] for w in windows}) > 1:
                yield index, windows, event
            windows, index = [], index + 1


def replayed(results: pathlib.Path) -> Iterator[dict[str, Any]]:
    """Every exploration of every auto-bf16 cell under ``results``, with its full runs' times
    (read from ``results/e2e/cells``, where each workload's baselines are)."""
    for path in sorted(results.glob("e2e*/cells/*/*/auto-bf16-s*.json")):
        workload, link = path.parent.parent.name, path.parent.name
        if workload in JUDGED:
            continue
        times = times_to_target(results / "e2e" / "cells" / workload / link)
        learned = json.loads(path.read_text()).get("auto_learned") or []
        before, so_far = None, []
        for index, windows, decision in explorations(learned):
            so_far = so_far + windows
            yield {"cell": str(path.relative_to(results)), "exploration": index,
                   "windows": windows, "recorded": decision["choice"], "times": times,
                   "before": before, "so_far": so_far, "step": decision["step"]}  # fmt: skip
            before = windows


def label(arm: str) -> str:
    """The grid's label of a learner's arm (its dense arm is the 16-bit baseline's wire)."""
    return "dense-bf16" if arm == "dense" else arm


def ratio(arm: str, times: dict[str, float]) -> float:
    """The arm's full-run time to target over the fastest reduction's (fp32 dense and psum
    left out: auto-bf16 sends 16-bit)."""
    fastest = min(t for name, t in times.items() if name not in ("dense", "psum", "psum-bf16"))
    return times.get(label(arm), math.nan) / fastest


def pick(windows: list[dict[str, Any]], learning: Learning) -> str:
    """The arm a decision under ``learning``'s prior takes from ``windows``."""
    names = list(dict.fromkeys(w["arm"] for w in windows))
    return best_arm(measure(windows, names, learning))


def unbracketed(windows: list[dict[str, Any]], learning: Learning) -> list[dict[str, Any]]:
    """The windows without the round's closing safe window where the learner leaves it out
    (:meth:`jaxcomm.cost.learn.Learning.outpaced` by the cheapest compressor,
    :meth:`jaxcomm.cost.learn.Learner._leave_out_outpaced`)."""
    last = windows[-1]
    lossy = [w["seconds_per_step"] for w in windows if not is_safe(w["arm"])]
    if len(windows) < 3 or not is_safe(last["arm"]) or not lossy:
        return windows
    dear = learning.outpaced(last["seconds_per_step"], min(lossy))
    return windows[:-1] if dear else windows


def score(rows: list[dict[str, Any]], choose: Callable[[dict[str, Any]], str]) -> dict:
    """How the picks of ``choose`` fare: within ``MET`` of the fastest, and their mean ratio
    (each capped at 5: a pick that never reaches the target is counted as 5x)."""
    ratios = [r for r in (ratio(choose(row), row["times"]) for row in rows) if not math.isnan(r)]
    return {
        "decisions": len(ratios),
        "met": sum(r <= MET for r in ratios),
        "mean_ratio": statistics.fmean(min(r, 5.0) for r in ratios),
        "worst": max(ratios),
    }


def rules(
    delay: float | None = None,
) -> Iterator[tuple[str, Callable[[dict[str, Any]], str], Learning | None]]:
    """The rules replayed (name, pick, prior): the recorded choice; at a re-check, keeping
    the pick the learner's prior made on the exploration before; reading every exploration's
    windows of the run so far, not the last one's alone (a long run's rounds add up); where
    ``delay`` is given (``benchmarks/steps_delay.py``'s fit), a prior that falls as the run
    goes on, as a delay of that many steps would over a run as long again as the steps so
    far; then each prior."""
    yield "recorded", lambda r: r["recorded"], None
    yield "keep the decision", lambda r: pick(r["before"] or r["windows"], Learning()), None
    yield "every round's windows so far", lambda r: pick(r["so_far"], Learning()), None
    if delay is not None:
        yield (
            f"prior 1 + {delay:.0f} / steps so far, at most the learner's",
            lambda r: pick(r["windows"], _delayed(delay, r["step"])),
            None,
        )
    yield (
        "no closing safe window that could not win",
        lambda r: pick(unbracketed(r["windows"], Learning()), Learning()),
        None,
    )
    for prior, noise in itertools.product(PRIORS, NOISES):
        learning = Learning(prior_steps=prior, noise=noise)
        yield (
            f"prior {prior}, noise {noise}",
            lambda r, ln=learning: pick(r["windows"], ln),
            learning,
        )


def _delayed(delay: float, step: int) -> Learning:
    """The learner's settings with the prior's steps those of a delay of ``delay`` steps over
    a run as long again as ``step`` (no more than the learner's prior,
    :meth:`~jaxcomm.cost.learn.Learning.for_run`)."""
    return Learning(prior_delay=delay).for_run(max(step, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args()
    rows = list(replayed(args.results))
    fitted = args.results / "steps-delay.json"
    delay = None
    if fitted.exists():  # every compressor at once (steps_delay imports this module)
        from steps_delay import pooled

        delay = pooled(json.loads(fitted.read_text())["summary"])["delay"]
    table = []
    for name, choose, learning in rules(delay):
        for which, subset in (("first", [r for r in rows if r["exploration"] == 0]),
                              ("re-check", [r for r in rows if r["exploration"] > 0])):  # fmt: skip
            if name == "keep the decision" and which == "first":
                continue  # nothing decided before
            entry = {"rule": name, "decisions_of": which, **score(subset, choose)}
            if learning is not None:
                entry["learning"] = dataclasses.asdict(learning)
            table.append(entry)
    print("| rule | decisions | picks within 1.15x | mean ratio | worst |")
    print("|---|---|---|---|---|")
    for e in table:
        print(f"| {e['rule']} ({e['decisions_of']}) | {e['decisions']} | {e['met']} | "
              f"{e['mean_ratio']:.2f} | {e['worst']:.2f} |")  # fmt: skip
    result = {"judged_left_out": list(JUDGED), "met": MET, "summary": table,
              "learner": dataclasses.asdict(Learning()),
              "cells": sorted({r["cell"] for r in rows})}  # fmt: skip
    write_result_and_plot(
        args.results, "steps-prior", json.loads(json.dumps(result, default=str)),
        draw(table), figsize=(7, 4.5), xlabel="noise (windows' errors times)",
        ylabel="first decisions within 1.15x of the fastest", title="Steps prior, replayed",
        legend_size=8,
    )  # fmt: skip


def draw(table: list[dict[str, Any]]) -> Callable[[Any], None]:
    """First decisions met against the noise, one line per prior, the recorded as a level."""

    def plot(ax: Any) -> None:
        first = [e for e in table if e["decisions_of"] == "first"]
        for prior in PRIORS:
            pts = [(e["learning"]["noise"], e["met"] / e["decisions"])
                   for e in first if e.get("learning", {}).get("prior_steps") == prior]  # fmt: skip
            ax.plot(*zip(*pts, strict=True), "o-", label=f"prior {prior}")
        recorded = next(e for e in first if e["rule"] == "recorded")
        ax.axhline(recorded["met"] / recorded["decisions"], color="k", linestyle="--",
                   label="recorded")  # fmt: skip
        ax.set_xscale("log")

    return plot


if __name__ == "__main__":
    main()
