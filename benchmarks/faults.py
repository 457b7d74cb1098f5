"""The fault table: each fault kind against a digits run on the emulated cluster, restarts on.

For every kind (link_down, loss, delay, bandwidth, straggler, kill, partition) the script
launches the same 2-node digits run (``jaxcomm launch``, backend emulated, ``max_restarts``,
``train.checkpoint_every``) with that one fault, and a fault-free run first, then reads each
run's ``summary.json``, ``timeline.jsonl`` and result file. It prints and writes (JSON, PNG):

- the fault and the outcome: ridden out (no restart), restarted (k restarts), failed, or
  refused (the kernel lacks what the kind needs: loss and delay without netem);
- seconds to detect: from the fault's application to the launcher seeing a rank fail;
- seconds to recover: after a failure, from its detection to the relaunched world stepping
  past its checkpoint; for a ridden-out fault, from the fault's end to the next step;
- the steps lost to restarts;
- whether the final test accuracy matches the fault-free run (and whether the final
  parameters are bit-identical).

Needs root (network namespaces). Times are wall clock on whatever machine runs it: on a
shared, loaded machine they include that load (docs/faults.md says which).

  sudo python benchmarks/faults.py                       # every kind
  sudo python benchmarks/faults.py --kinds kill link_down
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml
from _bench import jaxcomm_cli, pyplot, write_result

from docs import fault_table

KINDS = ("link_down", "loss", "delay", "bandwidth", "straggler", "kill", "partition")


def fault_of(kind: str, at_step: int, seconds: float, timeout_s: float) -> dict[str, Any]:
    """The ``faults:`` entry of one kind, on node 1 (partition: node 1 alone on one side).

    A partition lasts three collective timeouts, so it is a long one: the ranks fail and the
    relaunched world meets once it heals.

    Example:
      >>> fault_of("kill", 100, 5, 5)
      {'kind': 'kill', 'at_step': 100, 'node': 1}
    """
    entry: dict[str, Any] = {"kind": kind, "at_step": at_step}
    if kind == "partition":
        return {**entry, "groups": [[0], [1]], "seconds": 3 * timeout_s}
    entry["node"] = 1
    if kind == "kill":
        return entry
    entry["seconds"] = seconds
    extra = {
        "loss": {"percent": 1},
        "delay": {"delay_ms": 20, "jitter_ms": 5},
        "bandwidth": {"bandwidth": "10mbit"},
        "straggler": {"cpu": 0.25},
    }
    return {**entry, **extra.get(kind, {})}


def recipe_of(args: argparse.Namespace, fault: dict[str, Any] | None) -> dict[str, Any]:
    """The recipe of one run: 2 emulated nodes, digits, dense, restarts and checkpoints on."""
    return {
        "name": f"faults-{fault['kind'] if fault else 'none'}",
        "job": "digits",
        "world": {"processes": 2, "devices_per_process": 1},
        "backend": {"kind": "emulated", "bandwidth": args.bandwidth},
        "jaxcomm": {"algorithm": args.algorithm},
        "train": {
            "steps": args.steps,
            "batch_size": 64,
            "eval_every": args.steps // 4,
            "checkpoint_every": args.checkpoint_every,
        },
        "metrics": {"plots": False},
        "env": {"JAXCOMM_TIMEOUT_S": str(args.timeout_s)},
        "max_restarts": args.max_restarts,
        "faults": [fault] if fault else [],
        "timeout": args.run_timeout,
    }


def run_one(args: argparse.Namespace, fault: dict[str, Any] | None, tmp: pathlib.Path) -> dict:
    """Launches one run and returns what the table needs from its run directory."""
    name = fault["kind"] if fault else "none"
    recipe = tmp / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(recipe_of(args, fault)))
    run_dir = tmp / f"run-{name}"
    started = time.monotonic()
    done = subprocess.run(
        jaxcomm_cli("launch", str(recipe), "--out", str(run_dir), "-q"),
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - started
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    out: dict[str, Any] = {"exit_code": done.returncode, "wall_s": round(wall, 2)}
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():  # refused before anything ran (e.g. no netem)
        out["refused"] = errors[0].removeprefix("error: ") if errors else done.stderr[-500:]
        return out
    (variant,) = json.loads(summary_path.read_text())["variants"]
    vdir = run_dir / variant["label"]
    results = list(vdir.glob("digits-*.json"))
    result = json.loads(results[0].read_text()) if results else {}
    out.update(
        status=variant.get("status"),
        reason=variant.get("reason"),
        restarts=variant.get("restarts", []),
        steps=variant.get("steps"),
        test_accuracy=result.get("test_accuracy"),
        params_sha256=result.get("params_sha256"),
        timeline=[json.loads(x) for x in (vdir / "timeline.jsonl").read_text().splitlines()],
    )
    return out


def _first(events: list[dict], name: str, after: float = -1.0) -> dict | None:
    return next((e for e in events if e["event"] == name and e["t"] >= after), None)


def row_of(kind: str, fault: dict[str, Any], run: dict[str, Any], base: dict[str, Any]) -> dict:
    """One row of the table from a run (and the fault-free run)."""
    row: dict[str, Any] = {"kind": kind, "fault": None, "wall_s": run["wall_s"]}
    if "refused" in run:
        return {**row, "outcome": "refused", "detail": run["refused"]}
    events = run["timeline"]
    applied = _first(events, "fault_applied")
    row["fault"] = applied["what"] if applied else None
    failed = _first(events, "attempt_failed", applied["t"] if applied else -1.0)
    restarts = run["restarts"]
    if run["status"] != "ok":
        row["outcome"] = "failed"
        row["detail"] = run.get("reason")
    elif restarts:
        row["outcome"] = f"restarted ({len(restarts)})"
    else:
        row["outcome"] = "ridden out"
    if applied is None:
        row["outcome"] += ", fault not applied"
    if applied and failed:
        row["detect_s"] = round(failed["t"] - applied["t"], 2)
        again = _first(events, "stepping_again", failed["t"])
        if again and restarts:
            row["recover_s"] = round(again["t"] - failed["t"], 2)
    elif applied:
        reverted = _first(events, "fault_reverted", applied["t"])
        if reverted and reverted.get("reason") == "the run ended":
            row["outcome"] += " (the run ended during it)"
        again = _first(events, "stepping_again", reverted["t"]) if reverted else None
        if again:
            row["recover_s"] = round(again["t"] - reverted["t"], 2)
    row["steps_lost"] = sum(r["steps_lost"] for r in restarts)
    row["causes"] = [r["cause"] for r in restarts]
    row["test_accuracy"] = run.get("test_accuracy")
    row["accuracy_matches"] = (
        run.get("test_accuracy") is not None and run["test_accuracy"] == base["test_accuracy"]
    )
    digest = run.get("params_sha256")
    row["bit_identical"] = digest is not None and digest == base.get("params_sha256")
    return row


def print_table(result: dict[str, Any], file: str) -> None:
    """Prints the table as docs/faults.md shows it (``benchmarks/docs.py``'s formatter)."""
    print("\n" + fault_table(result, file))


def draw(rows: list[dict[str, Any]], path: pathlib.Path, title: str) -> None:
    """Bars of seconds to detect and to recover per fault."""
    plt = pyplot()
    if plt is None:
        return
    shown = [r for r in rows if r["outcome"] != "refused"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(shown))
    ax.bar([x - 0.2 for x in xs], [r.get("detect_s") or 0 for r in shown], 0.4, label="detect")
    ax.bar([x + 0.2 for x in xs], [r.get("recover_s") or 0 for r in shown], 0.4, label="recover")
    ax.set_xticks(list(xs), [f"{r['kind']}\n{r['outcome']}" for r in shown], fontsize=7)
    ax.set(ylabel="seconds", title=title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--algorithm", default="dense")
    parser.add_argument("--bandwidth", default="1gbit", help="emulated link rate (tc tbf)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument(
        "--at-step", type=int, default=125, help="when each fault fires (rank 0's steps)"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="how long faults last")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="JAXCOMM_TIMEOUT_S")
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("--run-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--tag", default="faults-emulated")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        base = run_one(args, None, tmp)
        if base.get("status") != "ok":
            sys.exit(f"the fault-free run failed: {base.get('reason') or base.get('refused')}")
        print(f"fault-free: test accuracy {base['test_accuracy']:.4f}", flush=True)
        for kind in args.kinds:
            fault = fault_of(kind, args.at_step, args.seconds, args.timeout_s)
            row = row_of(kind, fault, run_one(args, fault, tmp), base)
            print(f"{kind}: {row['outcome']}", flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "setup": {k: v for k, v in vars(args).items() if k not in ("out", "kinds", "tag")},
        "command": "python benchmarks/faults.py " + " ".join(sys.argv[1:]),
        "fault_free": {k: base[k] for k in ("test_accuracy", "params_sha256", "wall_s")},
        "rows": rows,
    }
    print_table(result, f"{args.tag}.json")
    path = write_result(args.out, args.tag, result)
    draw(rows, args.out / f"{args.tag}.png", "faults on 2 emulated nodes (digits, dense)")
    print(f"\nwrote {path} and {args.out / (args.tag + '.png')}")


if __name__ == "__main__":
    main()
