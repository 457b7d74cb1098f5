"""Time to target: train each workload with each gradient reduction until it reaches its target.

One command runs the end-to-end grid: workloads × networks × reductions × seeds. A *cell* is
one training run (``jaxcomm launch`` of the workload's recipe with one sweep entry) that stops
at the recipe's ``train.target`` (test accuracy, or validation bits per byte), at a time cap or
at its step cap, and records its metric against training wall clock, bytes and step time. Each
finished cell is written to ``--out/cells/<workload>/<network>/<label>-s<seed>.json`` and never
run again, so an interrupted grid resumes where it stopped (delete a cell's file to rerun it).

Networks (2 nodes by default, each pinned to a core of its own: ``backend.cpus_per_node``;
a world that needs more cores than the host has is marked oversubscribed):

- ``100mbit``, ``1gbit``: the emulated cluster (network namespaces, tbf-shaped links; root);
- ``host``: one machine, the processes talk through shared memory and loopback.

Reductions: ``psum`` and ``psum-bf16`` (XLA's ``lax.pmean`` in fp32 and bf16), ``dense`` and
``dense-bf16`` (jaxcomm's dense allreduce, fp32 and its 16-bit wire), ``gtopk`` and
``topk_allgather`` (with the gTop-k paper's warm-up), ``onebit``, ``adaptive``, and ``auto``
(jaxcomm's cost model picks per bucket, from a profile that ``jaxcomm probe`` measured on the
same world before: a cell of its own, ``cells/profiles/<network>.json``).

Before its first run, the grid measures each workload's compute step on one pinned core
(``cells/<workload>/compute.json``, ``compute-4x1.json`` for 4 nodes), and again before a run
when the last measurement is older than ``--compute-max-age`` hours: this machine's compute
step has drifted by half between runs of the grid, and a prediction is only as good as the
compute step it adds. With the profile, ``jaxcomm.cost.plan`` predicts every cell's step time
(compute + the reduction) from the compute step last measured before the cell ran, and the
report shows it beside the measured one.

The report (``--report`` alone redraws it from the cells) prints, per workload and network:
time to target, the speedup over the fastest dense 16-bit run (``psum-bf16`` or
``dense-bf16``), the best metric, bytes and seconds per step, the predicted step time, and
``auto``'s pick. It writes ``--out/e2e.json``, ``e2e-curves.png`` (metric against wall clock,
a panel per cell), ``e2e-pays.png`` (workload × network coloured by the best speedup, ``auto``'s
pick marked) and ``docs/e2e.md``. A run that stopped at its cap did not reach its target: its
time to target is reported as "> cap", and a speedup over a capped baseline as a lower bound;
nothing is extrapolated.

This file runs the grid; the workloads, reductions, networks and the cells' files are defined
in ``train_grid.py``, the predictions and steps factors in ``train_predict.py``, the report in
``train_report.py`` and its pictures in ``train_plots.py``.

Usage:
  python benchmarks/train.py                                     # the whole grid (hours)
  python benchmarks/train.py --workloads digits-small --networks host 1gbit
  python benchmarks/train.py --workloads lbann-mlp --networks 1gbit --algorithms psum-bf16 gtopk
  python benchmarks/train.py --report                            # tables and pictures only
  # DiLoCo over 2 sites of 2 devices against flat data-parallel, per-device DiLoCo and a
  # per-step compressor, in one world (oversubscribed on a host with fewer than 4 cores):
  python benchmarks/train.py --workloads bytes-lm --networks 100mbit --devices 2 \
      --algorithms dense-bf16 gtopk diloco-dense-bf16 diloco-gtopk diloco-sites-dense-bf16 \
      diloco-sites-gtopk diloco-sites-stream-gtopk
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import yaml
from _bench import jaxcomm_cli
from jaxcomm_launcher.recipe import apply_overrides, parse_set
from train_grid import (
    BASELINES_16BIT,
    DEFAULT_ALGORITHMS,
    DEFAULT_CAPS,
    DEFAULT_LABEL_CAPS,
    DEFAULT_OUT,
    NETWORKS,
    VARIANTS,
    WORKLOADS,
    backend,
    cell_path,
    cell_recipe,
    compute_path,
    network_dir,
    tuned,
    utc_epoch,
    utc_now,
    write_json,
)
from train_predict import measured_dense_steps, measured_steps_factor, predict_step
from train_report import report

from docs import TARGET_OVER_FASTEST


def launch(
    recipe: dict[str, Any], run_dir: pathlib.Path, timeout: float, prefix: tuple[str, ...] = ()
) -> int:
    """Runs `recipe` through ``jaxcomm launch`` (quiet) into `run_dir`; returns its exit code.

    `prefix` goes before the command (``taskset -c 0`` pins a local run to one core)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    path = run_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    command = [*prefix, *jaxcomm_cli("launch", str(path), "--out", str(run_dir / "run"), "-q")]
    command += ["--timeout", str(timeout)]
    done = subprocess.run(command, text=True, capture_output=True)
    (run_dir / "launch.log").write_text(done.stdout + done.stderr)
    return done.returncode


def read_result(run_dir: pathlib.Path, workload: str) -> dict[str, Any] | None:
    paths = sorted((run_dir / "run").glob(f"*/{WORKLOADS[workload].result_glob}"))
    return json.loads(paths[0].read_text()) if paths else None


def measure_compute(args: argparse.Namespace, workload: str) -> float | None:
    """The workload's step on one pinned core with nothing to reduce (one rank): what each
    node computes per step. Cached in ``train_grid.compute_path``, and measured again when the
    cached one is older than ``args.compute_max_age`` hours (the older ones move to its
    ``history``, for ``train_grid.compute_at``)."""
    path = compute_path(args.out, workload, args.nodes, args.devices)
    cached = json.loads(path.read_text()) if path.exists() else None
    if cached is not None:
        stamp = cached.get("measured_at")
        age_h = (time.time() - utc_epoch(stamp)) / 3600 if stamp else math.inf
        if args.dry_run or age_h <= args.compute_max_age:
            return cached["step_s"]
    if args.dry_run:
        return None
    # One local process: the links' settings (--set backend.*) are not its.
    training = [(k, v) for k, v in args.set if k[0] != "backend"]
    # A node of several devices: its devices average their gradients (psum), as a site does.
    recipe = cell_recipe(workload, "host", 1, "psum", 0, None, None, training, devices=args.devices)
    recipe["name"] = f"{workload}-compute"
    recipe["train"]["steps"] = args.compute_steps
    recipe["train"].pop("target", None)
    recipe.setdefault("args", {}).pop("epochs", None)
    recipe["train"]["eval_every"] = args.compute_steps
    # The batch one node computes in the grid's world: the global batch over its nodes.
    recipe["train"]["batch_size"] = max(1, recipe["train"]["batch_size"] // args.nodes)
    if "batch_size" in recipe.get("args", {}):
        recipe["args"]["batch_size"] = max(1, recipe["args"]["batch_size"] // args.nodes)
    # One node pinned to a core per device, as an emulated node is.
    run_dir = args.work / f"{workload}-compute"
    cores = ",".join(str(c) for c in range(args.devices))
    prefix = ("taskset", "-c", cores) if shutil.which("taskset") else ()
    code = launch(recipe, run_dir, args.timeout, prefix)
    result = read_result(run_dir, workload)
    if code != 0 or result is None:
        print(f"  compute calibration of {workload} failed (exit {code}); see {run_dir}")
        return None
    data = {
        "step_s": result["step_seconds"],
        "steps": result["steps"],
        "pinned": bool(prefix),
        "batch_size": recipe["train"]["batch_size"],
        "measured_at": utc_now(),
    }
    if cached is not None:
        older = {k: v for k, v in cached.items() if k != "history"}
        data["history"] = [older, *cached.get("history", [])]
    write_json(path, data)
    return data["step_s"]


def measure_profile(args: argparse.Namespace, network: str) -> pathlib.Path | None:
    """``jaxcomm probe`` on the network's world (what ``auto`` and the predictions read)."""
    path = (
        args.out / "cells" / "profiles" / f"{network_dir(network, args.nodes, args.devices)}.json"
    )
    if path.exists() or args.dry_run:
        return path if path.exists() else None
    recipe = {
        "name": f"probe-{network}",
        "job": "probe",
        "world": {"processes": args.nodes, "devices_per_process": args.devices},
        "backend": backend(network, args.nodes, args.devices),
        "metrics": {"plots": False},
    }
    # The probe measures the cells' links: the --set overrides of the backend apply to it too
    # (e.g. backend.burst), the training ones do not.
    recipe = apply_overrides(recipe, [(k, v) for k, v in args.set if k[0] == "backend"])
    work = args.work / f"probe-{network}"
    work.mkdir(parents=True, exist_ok=True)
    recipe_path = work / "probe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        jaxcomm_cli("probe", str(recipe_path), "--out", str(path.with_suffix(".tmp"))),
        text=True,
        capture_output=True,
    )
    (work / "probe.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not path.with_suffix(".tmp").exists():
        print(f"  probe of {network} failed (exit {done.returncode}); see {work}/probe.log")
        return None
    os.replace(path.with_suffix(".tmp"), path)
    return path


def cap_of(args: argparse.Namespace, label: str, network: str) -> float:
    return args.label_caps.get((label, network), args.caps[network])


def auto_factors(
    args: argparse.Namespace, workload: str, label: str, seed: int
) -> tuple[dict | None, dict[str, Any]]:
    """An auto cell's measured steps factors (None: none measured) and what it decides the
    warm-up from (empty: it follows the schedule)."""
    if not tuned(workload, label, args.untuned):
        return None, {}
    half = VARIANTS[label].get("grad_dtype") == "bfloat16"
    warmup = VARIANTS[label].get("args", {}).get("warmup", True)
    world = (args.out, workload, args.nodes, seed, half)
    factors = measured_steps_factor(*world, warmup, args.devices) or None
    dense_steps = measured_dense_steps(*world, args.devices)
    without = measured_steps_factor(*world, False, args.devices)
    if warmup and dense_steps and set(without) - {"dense"}:
        # auto decides the warm-up from what was measured: its seconds per step against
        # the steps dropping it costs (jaxcomm.cost.warmup_pays).
        return factors, {"dense_steps": dense_steps, "steps_factor_no_warmup": without}
    return factors, {}


def cell_of(
    args: argparse.Namespace,
    result: dict[str, Any],
    summary: dict[str, Any],
    keys: dict[str, Any],
    recipe: dict[str, Any],
) -> dict[str, Any]:
    """The cell's record: ``keys`` (workload, network, nodes, label, seed, time_cap_s,
    predicted, wall_s, started_at) and what the run reported."""
    workload = keys["workload"]
    metric = WORKLOADS[workload].metric
    higher = WORKLOADS[workload].higher_is_better
    values = [h[metric] for h in result["history"] if h[metric] is not None]
    return {
        "workload": workload,
        "network": keys["network"],
        "nodes": keys["nodes"],
        "devices": args.devices,
        "label": keys["label"],
        "seed": keys["seed"],
        "metric": metric,
        "higher_is_better": higher,
        "target": result.get("target"),
        "time_cap_s": keys["time_cap_s"],
        "stopped": result.get("stopped"),
        "time_to_target_s": result.get("time_to_target_s"),
        "training_s": result["seconds"],
        "steps": result["steps"],
        "best": (max(values) if higher else min(values)) if values else None,
        "final": result[metric],
        "step_s": result["step_seconds"],
        "comm_s": result.get("comm_seconds_per_step"),
        "bytes_sent_per_step": result["bytes_sent_per_step"],
        "dense_bytes_per_step": result.get("dense_bytes_per_step"),
        "parameters": result["parameters"],
        "predicted": keys["predicted"],
        "auto_choices": result.get("auto_choices"),
        # A learning auto's trial windows and decisions (jaxcomm.cost.learn).
        "auto_learned": (result.get("auto") or {}).get("learned"),
        # Seconds auto spent measuring its world before deciding (no profile given).
        "auto_measure_s": _measure_seconds(result),
        # Seconds it spent compiling its arms' programs after the first step (untimed, as
        # every run's first compilation).
        "auto_compile_s": _compile_seconds(result),
        "placement": summary.get("placement"),
        "oversubscribed": summary.get("oversubscribed"),
        "wall_s": keys["wall_s"],
        "started_at": keys["started_at"],
        "history": result["history"],
        "recipe": recipe,
        "command": " ".join(sys.argv),
    }


def _measure_seconds(result: dict[str, Any]) -> float | None:
    """The seconds auto spent measuring its world (``jaxcomm.metrics()["auto"]``) and timing
    its arms' steps (a learning auto's ``"timed"`` event), if it did."""
    auto = result.get("auto") or {}
    measured = auto.get("measured") or {}
    timing = [e["seconds"] for e in auto.get("learned") or [] if e["event"] == "timed"]
    return sum(measured.get("seconds") or []) + sum(timing) or None


def _compile_seconds(result: dict[str, Any]) -> float | None:
    """The seconds a learning auto spent compiling its arms' programs, if it did."""
    learned = (result.get("auto") or {}).get("learned") or []
    return sum(e["seconds"] for e in learned if e["event"] == "compiled") or None


def run_cell(
    args: argparse.Namespace,
    workload: str,
    network: str,
    label: str,
    seed: int,
    profile: pathlib.Path | None,
    compute: Callable[[], float | None],
) -> dict[str, Any] | None:
    """Runs one cell, or reads it if it ran before. `compute` gives the workload's compute
    step, measured (again) only when a cell is about to run."""
    path = cell_path(args.out, workload, network, args.nodes, label, seed, args.devices)
    if path.exists():
        return json.loads(path.read_text())
    compute_s = compute()
    cap = cap_of(args, label, network)
    factors, warmup_choice = auto_factors(args, workload, label, seed)
    recipe = cell_recipe(
        workload,
        network,
        args.nodes,
        label,
        seed,
        cap,
        profile,
        args.set,
        compute_s,
        factors,
        args.devices,
        args.untuned,
    )
    recipe["sweep"][0].update(warmup_choice)
    prediction = predict_step(
        workload, recipe, label, network, args.nodes, compute_s, profile, None, args.devices
    )
    if args.dry_run:
        print(f"  would run {path.relative_to(args.out)} (cap {cap:.0f} s)")
        if factors:
            print(f"    steps factors measured on {workload}: {factors}")
        if warmup_choice:
            print(f"    auto decides the warm-up from: {warmup_choice}")
        return None
    run_dir = args.work / f"{workload}-{network}-{label}-s{seed}"
    started_at = utc_now()
    t0 = time.monotonic()
    code = launch(recipe, run_dir, timeout=cap * 3 + 600)
    wall = time.monotonic() - t0
    result = read_result(run_dir, workload)
    summary_path = run_dir / "run" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if code != 0 or result is None:
        log = (run_dir / "launch.log").read_text()[-2000:]
        print(f"  {label}: launch failed (exit {code}); cell not written. Log tail:\n{log}")
        return None
    keys = {
        "workload": workload, "network": network, "nodes": args.nodes, "label": label,
        "seed": seed, "time_cap_s": cap, "predicted": prediction, "wall_s": wall,
        "started_at": started_at,
    }  # fmt: skip
    cell = cell_of(args, result, summary, keys, recipe)
    write_json(path, cell)
    return cell


def fmt_cell(cell: dict[str, Any]) -> str:
    reach = cell["time_to_target_s"]
    pred = (cell.get("predicted") or {}).get("step_s")
    return (
        f"  {cell['label']:15s} {cell['stopped']:8s} steps {cell['steps']:5d}  "
        f"to target {'> cap' if reach is None else f'{reach:8.1f} s'}  "
        f"best {cell['best']:.4f}  step {cell['step_s']:.3f} s"
        + (f" (predicted {pred:.3f})" if pred else "")
        + f"  {cell['bytes_sent_per_step'] / 1e6:.2f} MB/step"
    )


def run_grid(args: argparse.Namespace) -> None:
    for workload in args.workloads:
        # Measured (or re-measured, when stale) before the first cell that runs, not before
        # a resumed grid whose cells are all done.
        compute = functools.cache(functools.partial(measure_compute, args, workload))
        for network in args.networks:
            # The profile of this world: auto reads it, and every cell's prediction uses it.
            profile = measure_profile(args, network)
            print(f"{workload} · {network_dir(network, args.nodes, args.devices)}")
            cells = {}
            for label in args.algorithms:
                for seed in args.seeds:
                    cell = run_cell(args, workload, network, label, seed, profile, compute)
                    if cell is not None:
                        cells[label] = cell
                        print(fmt_cell(cell), flush=True)
            if args.winner_seeds and network in args.winner_networks:
                for label in winners(cells):
                    for seed in args.winner_seeds:
                        cell = run_cell(args, workload, network, label, seed, profile, compute)
                        if cell is not None:
                            print(fmt_cell(cell), flush=True)


def winners(cells: dict[str, dict[str, Any]]) -> list[str]:
    """The runs of one (workload, network) that get more seeds: the fastest dense 16-bit run,
    and every jaxcomm run within the targets' tolerance (``TARGET_OVER_FASTEST``) of the
    fastest one. A near-tie left on its first seed would let one lucky seed stand as the
    fastest reduction that ``auto`` is judged against.

    Example:
      >>> cell = lambda label, t: {"label": label, "time_to_target_s": t, "step_s": 0.1}
      >>> winners({"dense-bf16": cell("dense-bf16", 9.0), "gtopk": cell("gtopk", 1.0),
      ...          "topk_allgather": cell("topk_allgather", 1.1), "onebit": cell("onebit", 2.0)})
      ['dense-bf16', 'gtopk', 'topk_allgather']
    """

    def key(c: dict[str, Any]) -> tuple[float, float]:
        t = c["time_to_target_s"]
        return (0 if t is not None else 1, t if t is not None else c["step_s"])

    base = [cells[b] for b in BASELINES_16BIT if b in cells]
    jc = sorted((c for label, c in cells.items() if label not in ("psum", "psum-bf16")), key=key)
    out = [min(base, key=key)["label"]] if base else []
    fastest = jc[0]["time_to_target_s"] if jc else None
    near = [c for c in jc if fastest is not None and c["time_to_target_s"] is not None
            and c["time_to_target_s"] <= TARGET_OVER_FASTEST * fastest]  # fmt: skip
    for c in near or jc[:1]:
        if c["label"] not in out:
            out.append(c["label"])
    return out


def parse_caps(items: list[str]) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """``NET=SECONDS`` and ``LABEL@NET=SECONDS`` items over the defaults.

    Example:
      >>> parse_caps(["1gbit=60", "psum@host=30"])[1][("psum", "host")]
      30.0
    """
    caps, label_caps = dict(DEFAULT_CAPS), dict(DEFAULT_LABEL_CAPS)
    for item in items:
        key, _, value = item.partition("=")
        if "@" in key:
            label, net = key.split("@")
            label_caps[(label, net)] = float(value)
        else:
            caps[key] = float(value)
    return caps, label_caps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--networks", nargs="+", choices=list(NETWORKS), default=list(NETWORKS))
    parser.add_argument(
        "--algorithms", nargs="+", choices=list(VARIANTS), default=DEFAULT_ALGORITHMS
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument(
        "--winner-seeds",
        nargs="*",
        type=int,
        default=[1, 2],
        help="more seeds for the fastest 16-bit baseline and the fastest jaxcomm run",
    )
    parser.add_argument("--winner-networks", nargs="*", default=["1gbit"])
    parser.add_argument("--nodes", type=int, default=2, help="nodes (processes)")
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="devices per node, a core each (2 nodes x 2 devices: the DiLoCo-over-sites "
        "cells; more cores than the host has are marked oversubscribed)",
    )
    parser.add_argument(
        "--cap",
        nargs="*",
        default=[],
        help="time caps: NET=SECONDS or LABEL@NET=SECONDS (defaults: "
        + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_CAPS.items())
        + ")",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        help="recipe fields for every cell, dotted.key=value (e.g. train.steps=100)",
    )
    parser.add_argument(
        "--untuned",
        action="store_true",
        help="give auto cells nothing measured beforehand (no profile, compute step or steps "
        "factors), as a held-out workload's: a new user's auto on a grid workload",
    )
    parser.add_argument("--compute-steps", type=int, default=20)
    max_age = "hours after which a workload's compute step is measured again before a run"
    parser.add_argument("--compute-max-age", type=float, default=3.0, help=max_age)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=pathlib.Path, default=None, help="run directories")
    parser.add_argument("--report", action="store_true", help="only redraw the report")
    parser.add_argument("--dry-run", action="store_true", help="list the cells that would run")
    args = parser.parse_args()
    args.caps, args.label_caps = parse_caps(args.cap)
    args.set = parse_set(args.set)  # the launcher's own --set: dotted.key=YAML value
    args.work = args.work or pathlib.Path(tempfile.gettempdir()) / "jaxcomm-e2e"
    if not args.report:
        run_grid(args)
    report(args)


if __name__ == "__main__":
    main()
