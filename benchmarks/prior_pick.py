"""How the learner's pick on the prior alone fares, given each reduction's measured step.

A learning ``auto`` times every arm's step at start and lets the prior decide until a round of
trial windows is cheap beside the run (:class:`jaxcomm.cost.learn.Learner`'s ``timed``). This
script asks what that pick is worth on every row of the end-to-end grid
(``benchmarks/results/e2e/e2e.json``): the learner is given each reduction's seconds a step
from its own full runs as the timed seconds, and its pick is scored by that reduction's time
to target over the fastest reduction's (within ``MET``: the target met). Beside it, on the
held-out rows, what ``auto`` reached as it ran (each row's learner). The learner is also
given the row's dense steps (its recipe's ``dense_steps``, else the 16-bit dense run's steps
to target), which make its prior a delay over the run
(:meth:`jaxcomm.cost.learn.Learning.for_run`). A pick that runs from the first step is what a
learner that never explores would reach; the learner's warm-up and its rounds on a long run
are left out.

Usage:
  python benchmarks/prior_pick.py
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from jaxcomm.cost.learn import Learner, Learning

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import write_result_and_plot  # noqa: E402
from steps_prior import JUDGED, MET, label  # noqa: E402

ARMS = ("dense", "blockquant", "topk_allgather", "gtopk", "onebit", "adaptive")
"""A learning auto's arms (its dense one sends the 16-bit wire: ``dense-bf16``'s runs)."""


def cells(rows: list[dict[str, Any]]) -> Iterator[tuple[str, str, dict[str, dict[str, Any]]]]:
    """Each (workload, link) of two emulated nodes a core each, its rows by label."""
    by: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["network"].endswith("-2x1") and not r["network"].startswith("host"):
            by.setdefault((r["workload"], r["network"]), {})[r["label"]] = r
    for (workload, link), labels in sorted(by.items()):
        if "dense-bf16" in labels:
            yield workload, link, labels


def seconds(row: dict[str, Any] | None) -> float:
    """A row's time to target (infinite where it missed)."""
    t = None if row is None else row["time_to_target_s"]
    return math.inf if t is None else t


def prior_pick(labels: dict[str, dict[str, Any]], learning: Learning) -> str:
    """The learner's decision at start, its arms timed at each reduction's measured step."""
    arms = [a for a in ARMS if label(a) in labels]
    timed = {a: labels[label(a)]["step_s"] for a in arms}
    return Learner(arms, learning, 0, timed=timed).chosen


def judge(rows: list[dict[str, Any]], learning: Learning) -> list[dict[str, Any]]:
    """One entry per row: the prior's pick and its ratio to the fastest reduction; on a
    held-out row, auto's own (``auto-bf16``) too."""
    out = []
    for workload, link, labels in cells(rows):
        fastest = min(seconds(labels.get(label(a))) for a in ARMS)
        pick = prior_pick(labels, learning)
        # The recipe's dense_steps where it gives them (what its auto read), else dense's own.
        dense_steps = labels["dense-bf16"].get("dense_steps") or labels["dense-bf16"]["steps"]
        given = prior_pick(labels, learning.for_run(dense_steps and round(dense_steps)))
        auto = labels.get("auto-bf16")
        held_out = bool(labels["dense-bf16"]["held_out"])
        out.append({
            "workload": workload, "link": link, "held_out": held_out,
            "judged": workload in JUDGED, "pick": label(pick),
            "pick_over_fastest": seconds(labels[label(pick)]) / fastest,
            "dense_steps": dense_steps, "pick_given_steps": label(given),
            "given_steps_over_fastest": seconds(labels[label(given)]) / fastest,
            "auto_over_fastest": seconds(auto) / fastest if held_out and auto else None,
            "learner": auto.get("learner") if auto else None,
        })  # fmt: skip
    return out


def tally(entries: list[dict[str, Any]], key: str) -> dict[str, int]:
    """How many of ``entries`` have a ``key`` ratio, and how many of those are within MET."""
    ratios = [e[key] for e in entries if e[key] is not None]
    return {"rows": len(ratios), "met": sum(r <= MET for r in ratios)}


def shown(counted: dict[str, int]) -> str:
    """A :func:`tally` as the table shows it ("-" where no row had the ratio).

    Example:
      >>> shown({"rows": 4, "met": 3}), shown({"rows": 0, "met": 0})
      ('3 of 4', '-')
    """
    return f"{counted['met']} of {counted['rows']}" if counted["rows"] else "-"


def subsets(entries: list[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The rows summarized: the grid's own, the held-out ones the prior's replay reads, those
    it leaves out (the latest learners' judges), and every held-out row."""
    yield "grid", [e for e in entries if not e["held_out"]]
    yield (
        "held-out, read by the prior's replay",
        [e for e in entries if e["held_out"] and not e["judged"]],
    )
    yield "held-out, left out of it", [e for e in entries if e["judged"]]
    yield "held-out, all", [e for e in entries if e["held_out"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args()
    rows = json.loads((args.results / "e2e" / "e2e.json").read_text())["rows"]
    entries = judge(rows, Learning())
    summary = [
        {"rows_of": name, "prior": tally(part, "pick_over_fastest"),
         "given_steps": tally(part, "given_steps_over_fastest"),
         "auto": tally(part, "auto_over_fastest")}
        for name, part in subsets(entries)
    ]  # fmt: skip
    print(f"| rows | prior's pick within {MET}x | given dense's steps | auto as it ran |")
    print("|---|---|---|---|")
    for s in summary:
        met = [shown(s[key]) for key in ("prior", "given_steps", "auto")]
        print(f"| {s['rows_of']} | {' | '.join(met)} |")
    result = {"met": MET, "learning": Learning().__dict__, "summary": summary, "rows": entries}
    write_result_and_plot(
        args.results, "prior-pick", json.loads(json.dumps(result, default=str)), draw(entries),
        figsize=(7, 4.5), xlabel="auto as it ran / fastest", ylabel="prior's pick / fastest",
        title="Held-out rows: the prior's pick on measured steps against auto", log=True,
    )  # fmt: skip


def draw(entries: list[dict[str, Any]]) -> Callable[[Any], None]:
    """Each held-out row: auto's ratio against the prior's pick's, the targets as lines."""

    def plot(ax: Any) -> None:
        held = [e for e in entries if e["auto_over_fastest"] is not None]
        for judged, marker in ((False, "o"), (True, "s")):
            pts = [(min(e["auto_over_fastest"], 10.0), min(e["pick_over_fastest"], 10.0))
                   for e in held if e["judged"] == judged]  # fmt: skip
            if pts:
                name = "left out of the prior's replay" if judged else "read by the prior's replay"
                ax.plot(*zip(*pts, strict=True), marker, label=name, alpha=0.7)
        ax.axhline(MET, color="k", linestyle="--", linewidth=0.8)
        ax.axvline(MET, color="k", linestyle="--", linewidth=0.8)

    return plot


if __name__ == "__main__":
    main()
