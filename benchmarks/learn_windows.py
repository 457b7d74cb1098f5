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

It then sets the noise beside the full runs of the workload's cells in the grid (or
``--cells``), per link: the least expected cost of one round of windows and the pick it
makes (:func:`bound`), against what the targets allow. Where it exceeds that, a learner that
reads such a round and keeps its pick cannot meet the targets on that row: they are bounded
by this measurement.

Usage:
  python benchmarks/learn_windows.py --workload heldout-teacher --seeds 0 1 2
  python benchmarks/learn_windows.py --workload bytes-lm --arms dense onebit --seeds 0 1 2 \\
      --steps 210
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
from train_report import summarize  # noqa: E402

from docs import TARGET_OVER_DENSE16, TARGET_OVER_FASTEST  # noqa: E402

ARMS = ("dense", "blockquant", "adaptive", "topk_allgather", "gtopk", "onebit")
WINDOWS = (10, 20, 40, 80, 160)
SETTLE = learn.Learning().settle  # the learner's: a window's first steps left out
START = learn.Learning().warmup  # the learner's warm-up: the windows measured follow it
PROBE = 1024  # examples (bytes-lm: windows) of the probe
ALLOWANCE = TARGET_OVER_FASTEST - 1  # the targets: within 15 % of the fastest run
DENSE_ALLOWANCE = TARGET_OVER_DENSE16 - 1  # and within 10 % of the fastest dense 16-bit one
RECIPES = pathlib.Path(__file__).resolve().parent.parent / "recipes"
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def recipe_settings(name: str, config: type, arm: str, seed: int) -> Any:
    """``config`` of ``recipes/<name>.yaml`` (its ``train``, ``jaxcomm`` and ``args``, which
    win, as the launcher passes them) for ``arm`` and ``seed``: 16-bit dense wire, no sparse
    warm-up (the learner's arms have none), every step waited for."""
    recipe = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    fields = {**recipe.get("train", {}), **recipe.get("jaxcomm", {}), **recipe.get("args", {})}
    fields.update(algorithm=arm, seed=seed, grad_dtype="bfloat16", warmup=False, max_in_flight=0)
    return _loop.make_config(config, fields, name)


def digits_recipe(name: str) -> Callable[[str, int], tuple[Any, Any, Any, Callable, Callable]]:
    """A digits recipe's workload (``recipes/<name>.yaml``: the held-out ones, digits-small)."""

    def build(arm: str, seed: int) -> tuple[Any, Any, Any, Callable, Callable]:
        cfg = recipe_settings(name, digits.DigitsConfig, arm, seed)
        t = digits.build(cfg)
        params, state = t.init()
        x, y, _, _ = digits.load_split(cfg)
        rep = NamedSharding(t.mesh, P())
        xp, yp = jax.device_put(x[:PROBE], rep), jax.device_put(y[:PROBE], rep)
        probe = jax.jit(lambda p: t.loss(p, xp, yp)[0])
        return t.step, params, state, t.batch, probe

    return build


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


def recipes_of(job: str) -> list[str]:
    """The names of the recipes that run ``job``."""
    return sorted(p.stem for p in RECIPES.glob("*.yaml")
                  if yaml.safe_load(p.read_text()).get("job") == job)  # fmt: skip


WORKLOADS = {**{name: digits_recipe(name) for name in recipes_of("digits")}, "bytes-lm": lm}


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


def estimates(runs: dict[str, list[dict]]) -> dict[str, dict[int, list[dict]]]:
    """Per arm and window length, each seed's window estimates (:func:`window_estimates`):
    what :func:`noise_table` and :func:`paired_noise` both read."""
    return {arm: {w: [window_estimates(r, w) for r in seeds] for w in WINDOWS}
            for arm, seeds in runs.items()}  # fmt: skip


def noise_table(per_seed: dict[str, dict[int, list[dict]]]) -> list[dict[str, Any]]:
    """Per arm, window length and measure: the mean decrease per step and its noise (the
    scatter across seeds of the same window, pooled over the windows), from
    :func:`estimates`."""
    rows = []
    for arm, by_window in per_seed.items():
        for w, seeds in by_window.items():
            for measure in ("batch", "probe"):
                columns = list(zip(*(e[measure] for e in seeds), strict=True))
                spread = [statistics.variance(c) for c in columns if len(c) > 1]
                mean = statistics.fmean(v for c in columns for v in c)
                noise = math.sqrt(statistics.fmean(spread)) if spread else float("nan")
                rows.append({"arm": arm, "window": w, "measure": measure, "windows": len(columns),
                             "decrease_per_step": mean, "noise": noise})  # fmt: skip
    return rows


def paired_noise(
    per_seed: dict[str, dict[int, list[dict]]], truth: dict[str, float]
) -> list[dict[str, Any]]:
    """Per pair of arms, window length and measure: the relative error of the ratio of their
    decreases, read from the same seed's windows (same initialization and batches, so what
    is common to both cancels), each relative to its arm's decrease over the span
    (:func:`span_decrease`), scattered across seeds and pooled over the windows. Windows of a
    run are read at different steps on other batches: their error is at least this."""
    out = []
    arms = list(per_seed)
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            ta, tb = (max(truth[x], 1e-12) for x in (a, b))
            for w in WINDOWS:
                for measure in ("batch", "probe"):
                    columns = zip(*(
                        [y / tb - x / ta for x, y in zip(sa[measure], sb[measure], strict=True)]
                        for sa, sb in zip(per_seed[a][w], per_seed[b][w], strict=True)
                    ), strict=True)  # fmt: skip
                    spread = [statistics.variance(c) for c in columns if len(c) > 1]
                    error = math.sqrt(statistics.fmean(spread)) if spread else float("nan")
                    out.append({"arms": [a, b], "window": w, "measure": measure,
                                "relative_error": error})  # fmt: skip
    return out


def read_cells(directory: pathlib.Path) -> tuple[dict[str, dict[str, float]], float]:
    """Each reduction's full runs in a cell directory, seeds pooled as the report pools them
    (:func:`train_report.summarize`): seconds per step, steps and time to target (infinite
    where it missed) and the run's seconds (to target, or to its cap). The dense arm is the
    16-bit run, as auto-bf16's is. Then the fastest dense 16-bit run's time to target (psum
    or dense; infinite where none reached it), for the target against it."""
    runs = [json.loads(path.read_text()) for path in directory.glob("*-s*.json")]
    rows = {r["label"]: r for r in summarize([c for c in runs if c["label"] != "auto-bf16"])}
    cells = {}
    for label, r in rows.items():
        arm = "dense" if label == "dense-bf16" else label
        if arm in ARMS and label != "dense":
            missed = r["time_to_target_s"] is None
            cells[arm] = {"step_s": r["step_s"], "steps": None if missed else r["steps"],
                          "time_to_target_s": math.inf if missed else r["time_to_target_s"],
                          "run_s": r["capped_at_s"] if missed else r["time_to_target_s"]}  # fmt: skip
    dense16 = [rows[k]["time_to_target_s"] for k in ("psum-bf16", "dense-bf16") if k in rows]
    return cells, min((t for t in dense16 if t), default=math.inf)


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


def bound(
    rows: list[dict[str, Any]],
    cells: dict[str, dict[str, float]],
    dense16: float,
    paired: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """What windows cost at least, in expectation, to pick well enough for the targets: to
    land within ``ALLOWANCE`` of the fastest full run and ``DENSE_ALLOWANCE`` of the fastest
    dense 16-bit one (``dense16`` seconds), set against what those allow.

    The model is one round of windows, then the pick kept to the target. Each rival (an arm
    whose full run is slower than the fastest's by more than the allowance) runs a window of
    some length: it costs the rival's excess seconds per step (its seconds less what the
    fastest needs for the same progress, from the full runs' steps to target; a run that
    missed made none), and with the chance that the window ranks the rival above the fastest
    (the ratio of their decreases off by more than the log of their times' ratio, at the
    window's relative error) the run is the rival's, its time beyond the fastest's. Each
    rival's least expected cost is taken over every window length (between two measured
    lengths: the shorter's steps and the longer's error, so it is a floor), and the rivals'
    are summed. A safe rival (its steps are dense's) whose seconds per step exceed the
    fastest's times the prior's 95th percentile of steps is ruled out by its seconds alone,
    as the learner does. Windows of the fastest arm cost nothing, and the noise is the
    pair's on the same seed's windows (:func:`paired_noise`), less than a run's interleaved
    windows have: the bound favours the learner."""
    truth = span_decrease(rows)  # the arms measured: only they are ranked
    ranked = sorted((a for a in cells if a in truth), key=lambda a: cells[a]["time_to_target_s"])
    fastest = ranked[0]
    best = cells[fastest]
    allowance = min(ALLOWANCE * best["time_to_target_s"],
                    (1 + DENSE_ALLOWANCE) * dense16 - best["time_to_target_s"])  # fmt: skip
    learning = learn.Learning()
    rivals = {}
    for arm in ranked[1:]:
        c = cells[arm]
        if c["time_to_target_s"] <= (1 + ALLOWANCE) * best["time_to_target_s"]:
            continue  # a pick within the allowance needs no ruling out
        if learn.is_safe(arm) and learning.outpaced(c["step_s"], best["step_s"]):
            continue  # too dear a step for any compressor's steps
        progress = best["steps"] / c["steps"] if c["steps"] else 0.0
        rival = {  # a run that missed: at least its cap
            "margin_log": math.log(c["run_s"] / best["time_to_target_s"]),
            "excess_s_per_step": max(0.0, c["step_s"] - best["step_s"] * progress),
            # a pick of the rival, kept to the target (a miss: to the run's cap)
            "wrong_pick_s": c["run_s"] - best["time_to_target_s"],
        }
        rival["measures"] = _least_cost(rival, _relative_errors(rows, truth, fastest, arm, paired))
        rivals[arm] = rival
    out: dict[str, Any] = {"fastest": fastest, "allowance_s": allowance, "rivals": rivals,
                           "span_decrease_per_step": truth, "measures": {}}  # fmt: skip
    for measure in ("batch", "probe"):
        cost = sum(r["measures"][measure]["least_cost_s"] for r in rivals.values())
        out["measures"][measure] = {"least_cost_s": cost, "bounded": cost > allowance}
    out["bounded"] = all(m["bounded"] for m in out["measures"].values())
    return out


def _relative_errors(rows: list[dict[str, Any]], truth: dict[str, float], fastest: str,
                     rival: str, paired: list[dict[str, Any]] | None) -> dict[str, dict[int, float]]:  # fmt: skip
    """Per measure and window length, the relative error of the ratio of ``rival``'s decrease
    to ``fastest``'s: the pair's own (:func:`paired_noise`), or without it their two errors
    combined."""
    pair = {(r["window"], r["measure"]): r["relative_error"]
            for r in paired or [] if set(r["arms"]) == {fastest, rival}}  # fmt: skip
    out = {}
    for measure in ("batch", "probe"):
        noise = {(r["arm"], r["window"]): r["noise"] for r in rows if r["measure"] == measure}
        out[measure] = {
            w: pair.get((w, measure))
            or math.hypot(*(noise[(a, w)] / max(truth[a], 1e-12) for a in (fastest, rival)))
            for w in WINDOWS
        }
    return out


def _least_cost(rival: dict[str, Any], errors: dict[str, dict[int, float]]) -> dict[str, Any]:
    """Per measure, a rival's least expected cost over window lengths (:func:`bound`), from
    the shortest measured on (a slope needs its steps): a window of ``w`` steps between
    measured lengths ``lo <= w <= hi`` costs at least ``lo`` steps' excess and errs at least
    as ``hi``'s (the errors fitted non-increasing in the length, :func:`non_increasing`: a
    longer window errs less, and 3 seeds' estimates need not); beyond the longest, its steps
    alone cost more."""
    excess, margin, wrong = (rival[k] for k in ("excess_s_per_step", "margin_log", "wrong_pick_s"))
    out = {}
    for measure, rel in errors.items():
        least = dict(zip(WINDOWS, non_increasing([rel[w] for w in WINDOWS]), strict=True))
        options = {
            (lo, hi): lo * excess + wrong * 0.5 * math.erfc(margin / (least[hi] * math.sqrt(2)))
            for lo, hi in zip(WINDOWS, WINDOWS[1:], strict=False)
        }
        options[(max(WINDOWS), None)] = max(WINDOWS) * excess
        (lo, hi), cost = min(options.items(), key=lambda kv: kv[1])
        out[measure] = {"relative_error": rel, "least_cost_s": cost, "window": [lo, hi]}
    return out


def non_increasing(values: list[float]) -> list[float]:
    """The least-squares non-increasing fit to ``values`` (pooling adjacent violators).

    Example:
      >>> non_increasing([4.0, 1.0, 2.0, 0.5])
      [4.0, 1.5, 1.5, 0.5]
    """
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def print_tables(rows: list[dict[str, Any]], reference: str, bounds: dict[str, Any]) -> None:
    print(f"\n| arm | window | measure | windows | decrease per step | noise | "
          f"below {reference} (SE) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        below = r.get("below_reference_se")
        print(f"| {r['arm']} | {r['window']} | {r['measure']} | {r['windows']} | "
              f"{r['decrease_per_step']:.4f} | {r['noise']:.4f} | "
              f"{'' if below is None else f'{below:.1f}'} |")  # fmt: skip
    for cells, b in bounds.items():
        print(f"\n{cells}: fastest {b['fastest']}, allowance {b['allowance_s']:.2f} s")
        for arm, r in b["rivals"].items():
            costs = ", ".join(f"{m}: {v['least_cost_s']:.2f} s ({v['window']})"
                              for m, v in r["measures"].items())  # fmt: skip
            print(
                f"  rival {arm}: {math.exp(r['margin_log']):.2f}x slower, "
                f"{r['excess_s_per_step'] * 1e3:.1f} ms excess a step; least cost {costs}"
            )
        for measure, m in b["measures"].items():
            print(f"  {measure}: least cost {m['least_cost_s']:.2f} s; bounded: {m['bounded']}")


def cell_directories(workload: str, results: pathlib.Path) -> list[pathlib.Path]:
    """The grid's cell directories of ``workload`` (one per link) under ``results``."""
    return sorted(p for p in (results / "e2e" / "cells" / workload).glob("*") if p.is_dir())


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
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="heldout-teacher")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=START + 2 * max(WINDOWS))
    parser.add_argument("--cells", type=pathlib.Path, nargs="*",
                        help="cell directories of train.py (default: the workload's in the grid)")  # fmt: skip
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
        earlier = json.loads(args.reuse.read_text())
        rows, paired = earlier["noise"], earlier.get("paired")
    else:
        runs = {
            arm: [trajectory(args.workload, arm, s, args.steps) for s in args.seeds]
            for arm in args.arms
        }
        per_seed = estimates(runs)
        rows = noise_table(per_seed)
        against_reference(rows, args.arms[0])
        paired = paired_noise(per_seed, span_decrease(rows))
    cells = cell_directories(args.workload, RESULTS) if args.cells is None else args.cells
    bounds = {c.name: bound(rows, *read_cells(c), paired) for c in cells}
    print_tables(rows, rows[0]["arm"], bounds)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"workload": args.workload, "seeds": args.seeds, "steps": args.steps,
              "start": START, "settle": SETTLE, "probe_examples": PROBE, "devices": 2,
              "noise": rows, "paired": paired, "bounds": bounds}  # fmt: skip
    write_result_and_plot(
        args.out, f"learn-windows-{args.workload}", record, draw(rows), figsize=(7.5, 4.5),
        xlabel="window (steps)", ylabel="noise / decrease per step",
        title=f"{args.workload}: a window's relative error", legend_size=7, log=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
