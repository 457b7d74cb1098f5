"""What a trial window of the learning ``auto`` can tell, and what it costs.

The learner (:mod:`jaxcomm.cost.learn`) compares reductions by how fast the training loss falls
in short windows of the run. This script measures, on a workload, each reduction's loss
decrease per step in windows of ``w`` steps and its noise, for two measures of the decrease:

- ``batch``: the least-squares slope of the steps' own batch losses (what the learner reads),
  its first steps left out as the learner does (:func:`jaxcomm.cost.learn.window_rate`);
- ``probe``: the difference of the loss of a fixed set of training examples (the probe) at the
  window's two ends, a forward pass per window end.

Every reduction runs alone from the same initialization for ``--steps`` steps, one process of
2 devices, for each seed. A window's noise is the scatter of its estimate across the seeds
(same reduction, same steps, other initialization and batches): a trend that changes between
windows does not count as noise.

With ``--cells`` (a held-out cell's directory of ``benchmarks/train.py``), it then sets the
noise beside the cell's full runs: the fastest reduction and the runner-up, the margin of
decrease per step by which a window must rank them (their seconds per step), the window
length at which each measure resolves it (two standard errors of the ratio of decreases), and
what one round of such windows costs against 15 % of the fastest run: each other reduction's
window is run instead of the fastest, its excess seconds are its seconds per step less what
the fastest needs for the same progress (the full runs' steps to target).

Usage:
  python benchmarks/learn_windows.py --workload teacher --seeds 0 1 2 \\
      --cells benchmarks/results/e2e/cells/heldout-teacher/100mbit-2x1
  python benchmarks/learn_windows.py --workload bytes-lm --arms dense onebit --seeds 0 1 2 \\
      --steps 170
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomm.cost import learn  # noqa: E402
from jaxcomm.examples import _loop, bytes_lm, digits  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench import write_result_and_plot  # noqa: E402

ARMS = ("dense", "blockquant", "adaptive", "topk_allgather", "gtopk", "onebit")
WINDOWS = (10, 20, 40)
SETTLE = learn.Learning().settle  # the learner's: a window's first steps left out
START = learn.Learning().warmup  # the learner's warm-up: the windows measured follow it
PROBE = 1024  # examples (bytes-lm: windows) of the probe
ALLOWANCE = 0.15  # the target: within 15 % of the fastest
RECIPES = pathlib.Path(__file__).resolve().parent.parent / "recipes"


def recipe_settings(name: str, config: type, arm: str, seed: int) -> Any:
    """``config`` of ``recipes/<name>.yaml`` (its ``train``, ``jaxcomm`` and ``args``, which
    win, as the launcher passes them) for ``arm`` and ``seed``: 16-bit dense wire, no sparse
    warm-up (the learner's arms have none), every step waited for."""
    recipe = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    fields = {**recipe.get("train", {}), **recipe.get("jaxcomm", {}), **recipe.get("args", {})}
    fields.update(algorithm=arm, seed=seed, grad_dtype="bfloat16", warmup=False, max_in_flight=0)
    return _loop.make_config(config, fields, name)


def teacher(arm: str, seed: int) -> tuple[Any, Any, Any, Callable, Callable]:
    """The held-out teacher workload (recipes/heldout-teacher.yaml)."""
    cfg = recipe_settings("heldout-teacher", digits.DigitsConfig, arm, seed)
    t = digits.build(cfg)
    params, state = t.init()
    x, y, _, _ = digits.load_split(cfg)
    rep = NamedSharding(t.mesh, P())
    xp, yp = jax.device_put(x[:PROBE], rep), jax.device_put(y[:PROBE], rep)
    probe = jax.jit(lambda p: t.loss(p, xp, yp)[0])
    return t.step, params, state, t.batch, probe


def lm(arm: str, seed: int) -> tuple[Any, Any, Any, Callable, Callable]:
    """The grid's byte LM (recipes/bytes-lm.yaml)."""
    cfg = recipe_settings("bytes-lm", bytes_lm.BytesLMConfig, arm, seed)
    t = bytes_lm.build(cfg)
    params, state = t.init()
    train_bytes, _ = t.corpus
    span = cfg.seq_len + 1
    starts = np.random.default_rng(12345).integers(0, len(train_bytes) - span, PROBE // 8)
    probe_windows = jax.device_put(
        bytes_lm._windows(train_bytes, starts, span), NamedSharding(t.mesh, P())
    )
    probe = jax.jit(lambda p: t.loss(p, probe_windows)[0])
    return t.step, params, state, t.batch, probe


WORKLOADS = {"teacher": teacher, "bytes-lm": lm}


def trajectory(workload: str, arm: str, seed: int, steps: int) -> dict[str, list[float]]:
    """``arm`` alone for ``steps`` steps: every step's batch loss, the probe's loss every 10
    steps (the windows' ends)."""
    step, params, state, batch, probe = WORKLOADS[workload](arm, seed)
    losses, probes = [], {}
    for i in range(steps):
        if i % 10 == 0:
            probes[i] = float(probe(params))
        params, state, loss, _ = step(params, state, *batch(i))
        losses.append(float(loss))
    probes[steps] = float(probe(params))
    return {"batch": losses, "probe": [probes[i] for i in sorted(probes)]}


def window_estimates(run: dict[str, list[float]], w: int) -> dict[str, list[float]]:
    """Each window's decrease per step from ``START`` on, by both measures."""
    steps = len(run["batch"])
    firsts = range(START, steps - w + 1, w)
    return {
        "batch": [learn.window_rate(run["batch"][s : s + w], 1.0, SETTLE)[0] for s in firsts],
        "probe": [(run["probe"][s // 10] - run["probe"][(s + w) // 10]) / w for s in firsts],
    }


def noise_table(runs: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Per arm, window length and measure: the mean decrease per step and its noise (the
    scatter across seeds of the same window, pooled over the windows)."""
    rows = []
    for arm, seeds in runs.items():
        for w in WINDOWS:
            per_seed = [window_estimates(r, w) for r in seeds]
            for measure in ("batch", "probe"):
                columns = list(zip(*(e[measure] for e in per_seed), strict=True))
                spread = [statistics.variance(c) for c in columns if len(c) > 1]
                mean = statistics.fmean(v for c in columns for v in c)
                noise = math.sqrt(statistics.fmean(spread)) if spread else float("nan")
                rows.append({"arm": arm, "window": w, "measure": measure, "windows": len(columns),
                             "decrease_per_step": mean, "noise": noise})  # fmt: skip
    return rows


def read_cells(directory: pathlib.Path) -> dict[str, dict[str, float]]:
    """Seed 0's full run of each reduction in a cell directory: seconds per step and steps."""
    cells = {}
    for path in sorted(directory.glob("*-s0.json")):
        c = json.loads(path.read_text())
        arm = c["label"].split("-")[0]  # dense-bf16 runs the dense arm
        if c.get("stopped") == "target" and arm in ARMS:
            cells[arm] = {"step_s": c["step_s"], "steps": c["steps"],
                          "time_to_target_s": c["time_to_target_s"]}  # fmt: skip
    return cells


def against_reference(rows: list[dict[str, Any]], reference: str) -> None:
    """Adds to each row how many standard errors one window's decrease lies below the
    ``reference`` arm's (same window length and measure): below 2, one window cannot tell
    the two apart."""
    ref = {(r["window"], r["measure"]): r for r in rows if r["arm"] == reference}
    for r in rows:
        other = ref.get((r["window"], r["measure"]))
        if other is None or r["arm"] == reference:
            continue
        error = math.hypot(r["noise"], other["noise"])
        gap = other["decrease_per_step"] - r["decrease_per_step"]
        r["below_reference_se"] = gap / error if error > 0 else float("nan")


def span_decrease(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each arm's decrease per step over the whole span: the probe's windows telescope, so their
    mean is the same at every window length, and the least noisy estimate of all."""
    return {r["arm"]: r["decrease_per_step"] for r in rows if r["measure"] == "probe"}


def bound(rows: list[dict[str, Any]], cells: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Whether a window ranks the fastest full run above the runner-up (the ratio of their
    decreases within the log of their times' ratio, two standard errors), and what one round
    of windows costs against ``ALLOWANCE`` of the fastest run."""
    ranked = sorted(cells, key=lambda a: cells[a]["time_to_target_s"])
    fastest, runner = ranked[0], ranked[1]
    best = cells[fastest]
    margin = math.log(cells[runner]["time_to_target_s"] / best["time_to_target_s"])
    # The guard needs one safe arm: dense is left out where block int8 ran (the cheaper).
    others = [a for a in ranked[1:] if not (a == "dense" and "blockquant" in cells)]
    excess = {
        a: cells[a]["step_s"] - best["step_s"] * best["steps"] / cells[a]["steps"] for a in others
    }
    per_step = sum(excess.values())
    allowance = ALLOWANCE * best["time_to_target_s"]
    truth = span_decrease(rows)
    out: dict[str, Any] = {
        "fastest": fastest, "runner_up": runner, "margin_log": margin, "excess_s": excess,
        "round_excess_s_per_window_step": per_step, "allowance_s": allowance,
        "affordable_window": allowance / per_step, "span_decrease_per_step": truth,
        "round_cost_s": {w: w * per_step for w in WINDOWS}, "measures": {},
    }  # fmt: skip
    for measure in ("batch", "probe"):
        noise = {(r["arm"], r["window"]): r["noise"] for r in rows if r["measure"] == measure}
        rel = {
            w: math.hypot(*(noise[(a, w)] / max(truth[a], 1e-12) for a in (fastest, runner)))
            for w in WINDOWS
        }
        resolving = [w for w in WINDOWS if 2 * rel[w] <= margin]
        out["measures"][measure] = {"relative_error": rel, "window": min(resolving, default=None)}
    return out


def print_tables(rows: list[dict[str, Any]], reference: str, result: dict[str, Any] | None) -> None:
    print(f"\n| arm | window | measure | windows | decrease per step | noise | "
          f"below {reference} (SE) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        below = r.get("below_reference_se")
        print(f"| {r['arm']} | {r['window']} | {r['measure']} | {r['windows']} | "
              f"{r['decrease_per_step']:.4f} | {r['noise']:.4f} | "
              f"{'' if below is None else f'{below:.1f}'} |")  # fmt: skip
    if result is None:
        return
    costs = ", ".join(f"{w} steps {c:.1f} s" for w, c in result["round_cost_s"].items())
    print(f"\nfastest {result['fastest']}, runner-up {result['runner_up']}: a window must rank "
          f"them within log {result['margin_log']:.3f} (two standard errors); one round of "
          f"windows costs {costs}; the allowance is {result['allowance_s']:.2f} s (windows of "
          f"{result['affordable_window']:.1f} steps)")  # fmt: skip
    for measure, m in result["measures"].items():
        errs = ", ".join(f"w={w}: {e:.2f}" for w, e in m["relative_error"].items())
        w = m["window"]
        print(f"  {measure}: relative error of the ratio {errs}; "
              + ("no measured window resolves it" if w is None else f"{w} steps resolve it"))  # fmt: skip


def draw(rows: list[dict[str, Any]]) -> Callable[[Any], None]:
    """A window's noise over the arm's decrease per step (:func:`span_decrease`) against the
    window, per arm and measure."""
    truth = span_decrease(rows)

    def plot(ax: Any) -> None:
        for arm in dict.fromkeys(r["arm"] for r in rows):
            for measure, style in (("batch", "-o"), ("probe", "--s")):
                pts = [(r["window"], r["noise"] / max(truth[arm], 1e-12))
                       for r in rows if (r["arm"], r["measure"]) == (arm, measure)]  # fmt: skip
                ax.plot(*zip(*pts, strict=True), style, label=f"{arm} ({measure})")

    return plot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="teacher")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=START + 4 * max(WINDOWS))
    parser.add_argument("--cells", type=pathlib.Path, help="a cell directory of train.py")
    parser.add_argument(
        "--reuse", type=pathlib.Path, help="an earlier result JSON: its noise, not new runs"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args()
    if args.steps % 10 or args.steps < START + max(WINDOWS):
        parser.error(f"--steps must be a multiple of 10 and at least {START + max(WINDOWS)}")
    if len(args.seeds) < 2:
        parser.error("--seeds: at least 2 (the noise is the scatter across seeds)")
    if args.reuse:  # the noise of an earlier run, analysed again
        rows = json.loads(args.reuse.read_text())["noise"]
    else:
        runs = {
            arm: [trajectory(args.workload, arm, s, args.steps) for s in args.seeds]
            for arm in args.arms
        }
        rows = noise_table(runs)
        against_reference(rows, args.arms[0])
    result = bound(rows, read_cells(args.cells)) if args.cells else None
    print_tables(rows, rows[0]["arm"], result)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"workload": args.workload, "seeds": args.seeds, "steps": args.steps,
              "start": START, "settle": SETTLE, "probe_examples": PROBE, "devices": 2,
              "cells": str(args.cells) if args.cells else None, "noise": rows, "bound": result}  # fmt: skip
    write_result_and_plot(
        args.out, f"learn-windows-{args.workload}", record, draw(rows), figsize=(7.5, 4.5),
        xlabel="window (steps)", ylabel="noise / decrease per step",
        title=f"{args.workload}: a window's relative error", legend_size=7, log=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
