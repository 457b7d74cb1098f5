"""What a learning ``auto``'s arm costs a step beside the same reduction run alone.

Runs ``benchmarks/arm_step_job.py`` on 2 faithful emulated nodes (one core each): a digits
model (by default heldout-fivemom's 5x640 MLP) trained with one compressor three ways in
turns (``alone``: its own step; ``arm``: the learner's program of that arm over the shared
state; ``switched``: one ``lax.switch`` program over every arm), ``--rounds`` rounds of
``--steps`` steps each, after ``--steps`` of ``alone`` before the learning auto is built
(``first``: as in a cell of its own). Prints the median milliseconds a step of each way and its ratio to
``alone``, and writes ``benchmarks/results/arm-step-<tag>.json`` and a PNG of every round.

Usage (root, for the emulated links):
  python benchmarks/arm_step.py --bandwidth 100mbit --arm topk_allgather
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import run_recipe, setup_fields, write_job_recipe, write_result_and_plot  # noqa: E402
from arm_step_job import WAYS  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent / "results"


def write_recipe(args: argparse.Namespace, path: pathlib.Path) -> None:
    job = {"arm": args.arm, "rounds": args.rounds, "steps": args.steps}
    write_job_recipe(args, path, "arm_step", job, target="arm_step_job:run")


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's records as each way's seconds per round, median, ratio to ``alone`` and the
    algorithms its collectives ran.

    Example:
      >>> time = lambda way, s: {"kind": "time", "way": way, "step_s": s}
      >>> records = [time("alone", 0.010), time("arm", 0.011), time("switched", 0.012),
      ...            {"kind": "sent", "way": "arm", "algorithms": ["topk_allgather"]}]
      >>> [(r["way"], round(r["over_alone"], 2), r["sent"]) for r in summarize(records)["rows"]]
      [('alone', 1.0, []), ('arm', 1.1, ['topk_allgather']), ('switched', 1.2, [])]
    """
    times = [r for r in records if r.get("kind") == "time"]
    sent = {r["way"]: r["algorithms"] for r in records if r.get("kind") == "sent"}
    rows = []
    for way in WAYS:
        seconds = [r["step_s"] for r in times if r["way"] == way]
        if seconds:  # (results from before the way ``first``: none)
            rows.append({"way": way, "step_s": seconds, "median_s": statistics.median(seconds),
                         "sent": sent.get(way, [])})  # fmt: skip
    alone = next(r["median_s"] for r in rows if r["way"] == "alone")
    for row in rows:
        row["over_alone"] = row["median_s"] / alone
    return {"rows": rows}


def table(result: dict[str, Any]) -> str:
    """The Markdown table of :func:`summarize`'s rows."""
    lines = ["| way | collectives | ms a step (median) | over alone |", "|---|---|---|---|"]
    for r in result["rows"]:
        ms = r["median_s"] * 1e3
        lines.append(f"| {r['way']} | {', '.join(r['sent'])} | {ms:.2f} | {r['over_alone']:.3f}× |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="100mbit", help="emulated link rate (tc tbf)")
    parser.add_argument("--arm", default="topk_allgather")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    args.backend, args.processes, args.devices_per_process, args.cpus_per_node = (
        "emulated", 2, 1, 1)  # fmt: skip
    records, wall = run_recipe(lambda path: write_recipe(args, path))
    result = {**setup_fields(args), "cpus_per_node": 1, "arm": args.arm, "rounds": args.rounds,
              "steps": args.steps, "wall_s": wall, **summarize(records)}  # fmt: skip
    print(table(result))
    args.out.mkdir(parents=True, exist_ok=True)

    def draw(ax: Any) -> None:
        for r in result["rows"]:
            ax.plot([s * 1e3 for s in r["step_s"]], marker="o", label=r["way"])
        ax.set_xticks(range(args.rounds))

    write_result_and_plot(args.out, f"arm-step-{args.bandwidth}-{args.arm}", result, draw,
                          figsize=(7, 4.5), xlabel="round", ylabel="ms a step",
                          title=f"{args.arm}: alone, as an arm, switched ({args.bandwidth})")  # fmt: skip


if __name__ == "__main__":
    main()
