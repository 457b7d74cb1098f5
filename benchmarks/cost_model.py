"""Cost model validation: predicted (jaxcomm.cost, probed profile) against measured allreduce time.

For each world (processes x devices per process) this script, in one run:

1. probes the world (``jaxcomm probe``: alpha/beta per link class, gamma per kernel, psum),
2. measures every algorithm at every size with the ``allreduce`` launcher job (the same job as
   ``benchmarks/allreduce.py``: median of ``--repeats`` calls on rank 0, bytes from
   ``jaxcomm.metrics()``),
3. predicts each point with :func:`jaxcomm.cost.predict` from the probed profile,

then prints a table (predicted vs measured ms, error %, predicted vs measured bytes), the
median and worst |error|, how often ``auto`` (:func:`jaxcomm.cost.choose` over the default
allowed set) lands within 10 % of the best measured algorithm of that set (its pick's measured
time, and the job's own ``auto`` run with the probed profile), and writes JSON and a PNG
(predicted against measured, one point per case).

Usage:
  python benchmarks/cost_model.py                                   # local, 2x1 4x1 2x2
  python benchmarks/cost_model.py --backend emulated --bandwidth 1gbit --worlds 4x1
  python benchmarks/cost_model.py --worlds 2x1 --sizes 1000000 --algorithms dense gtopk

Run it from the repository root with jaxcomm importable (``python -m pip install .``); the
launcher is started as ``python -m jaxcomm_launcher.cli`` with this interpreter.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml
from _bench import (
    add_repeats_argument,
    add_world_arguments,
    jaxcomm_cli,
    recipe_backend,
    write_result,
    write_result_and_plot,
)
from jaxcomm_launcher.jobs.allreduce import ALL_ALGORITHMS

from jaxcomm import algorithms, cost

# The registry's default listing (jaxcomm/algorithms/), flat and hierarchical; the allreduce job
# times flat vectors, so not the leaf-shaped algorithms (PowerSGD).
FLAT = [a for a in ALL_ALGORITHMS if algorithms.get(a).hierarchy is None]
HIER = [a for a in algorithms.planned() if algorithms.get(a).hierarchy is not None]
MULTI_LEADER = [a for a in HIER if algorithms.get(a).hierarchy[1] == "multi_leader"]


def _recipe(
    args: argparse.Namespace, processes: int, devices: int, algorithms: list, profile: pathlib.Path
) -> dict:
    backend = recipe_backend(args)
    return {
        "name": f"cost-model-{args.backend}-{processes}x{devices}",
        "description": "benchmarks/cost_model.py",
        "job": "allreduce",
        "world": {"processes": processes, "devices_per_process": devices},
        "backend": backend,
        "args": {
            "sizes": args.sizes,
            "repeats": args.repeats,
            "density": args.density,
            "algorithms": algorithms,
            "tau": args.tau,
            "proportion": args.proportion,
            # `auto` in the job: the probed profile, among the measured default choices.
            "profile": str(profile),
            "allowed": [a for a in cost.DEFAULT_ALLOWED if a in algorithms],
        },
        "metrics": {"plots": False},
        "timeout": args.timeout,
    }


def _cli(*argv: str) -> None:
    done = subprocess.run(jaxcomm_cli(*argv), text=True)
    if done.returncode != 0:
        sys.exit(f"jaxcomm {argv[0]} failed with exit code {done.returncode}")


def _probe_and_run(
    args: argparse.Namespace, processes: int, devices: int, tmp: pathlib.Path
) -> tuple[dict[tuple[str, int], list[dict]], pathlib.Path]:
    """Probes one world and runs its recipe; returns its records by (algorithm, elements) and
    the probed profile's path."""
    algorithms = [a for a in args.algorithms if devices > 1 or a not in HIER]
    recipe_path = tmp / f"{processes}x{devices}.yaml"
    profile_path = tmp / f"{processes}x{devices}-profile.json"
    recipe_path.write_text(
        yaml.safe_dump(_recipe(args, processes, devices, algorithms, profile_path), sort_keys=False)
    )
    _cli(
        "probe",
        str(recipe_path),
        "--out",
        str(profile_path),
        "--run-dir",
        str(tmp / f"probe-{processes}x{devices}"),
        "--repeats",
        str(args.repeats),
        "-q",
    )
    run_dir = tmp / f"run-{processes}x{devices}"
    _cli("launch", str(recipe_path), "--out", str(run_dir), "-q")
    records = [
        json.loads(line)
        for path in sorted(run_dir.rglob("rank0.jsonl"))
        for line in path.read_text().splitlines()
    ]
    grouped: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for r in records:
        if "algorithm" in r:
            grouped[(r["algorithm"], r["size_bytes"] // 4)].append(r)
    return grouped, profile_path


def _mark_auto_picks(
    rows: list[dict], world: Any, profile: Any, options: Any, auto_measured: dict[int, float]
) -> None:
    """Marks, per size, the row of the model's pick among the allowed algorithms, with how it
    compares with the best measured one (and the job's own ``auto`` run)."""
    for n in sorted({r["elements"] for r in rows}):
        here = {r["algorithm"]: r for r in rows if r["elements"] == n}
        allowed = [a for a in cost.DEFAULT_ALLOWED if a in here]
        if not allowed:
            continue
        pick = cost.choose(n, world, allowed, profile, options)
        best = min(here[a]["measured_s"] for a in allowed)
        for r in rows:
            if r["elements"] == n and r["algorithm"] == pick:
                r["auto_pick"] = True
                r["auto_vs_best"] = r["measured_s"] / best
                if n in auto_measured:  # the job's own `auto` run, with its own choice
                    r["auto_run_vs_best"] = auto_measured[n] / best


def measure_world(
    args: argparse.Namespace, processes: int, devices: int, tmp: pathlib.Path, profiles: dict
) -> list[dict]:
    """Probes, measures and predicts one world; returns one row per (algorithm, size)."""
    grouped, profile_path = _probe_and_run(args, processes, devices, tmp)
    profile = cost.Profile.load(profile_path)
    inter = "across_hosts" if args.backend == "emulated" else "same_host"
    world = cost.World(processes, devices, inter)
    options = cost.Options(
        density=args.density,
        proportion=args.proportion,
        tau=args.tau,
        threshold_fraction=args.threshold_fraction,
    )
    profiles[f"{processes}x{devices}"] = profile.to_json()
    rows = []
    auto_measured = {
        n: statistics.median(r["step_time_s"] for r in recs)
        for (a, n), recs in grouped.items()
        if a == "auto"
    }
    for (algorithm, n), recs in sorted(grouped.items()):
        if algorithm == "auto":
            continue  # measured end to end below, against the best allowed algorithm
        measured = statistics.median(r["step_time_s"] for r in recs)
        p = cost.predict(algorithm, n, world, profile, options)
        rows.append(
            {
                "backend": args.backend
                + (f"-{args.bandwidth}" if args.backend == "emulated" else ""),
                "processes": processes,
                "devices_per_process": devices,
                "algorithm": algorithm,
                "elements": n,
                "measured_s": measured,
                "predicted_s": p.seconds,
                "predicted_compute_s": p.compute_seconds,
                "predicted_communication_s": p.communication_seconds,
                "error": (p.seconds - measured) / measured,
                "measured_bytes": statistics.median(r["bytes_sent"] for r in recs),
                # The job logs process 0's mean over its devices (world ranks 0..D-1).
                "predicted_bytes": statistics.mean(
                    cost.bytes_sent(algorithm, n, world, options, r) for r in range(devices)
                ),
            }
        )
    _mark_auto_picks(rows, world, profile, options, auto_measured)
    return rows


def extrapolate(profile_path: pathlib.Path | None, n: int, density: float) -> dict[str, Any]:
    """The model's predictions for large clusters (no measurement), printed as a markdown table
    and returned for the JSON (``docs/cost-model.md`` is generated from it).

    Worlds of P ranks, flat (P processes x 1) and hierarchical (P/8 nodes x 8 local ranks), at
    10, 100 and 400 Gbit/s between processes (alpha 10 us), with the local kernels (gamma)
    and same-process links of the given profile (default: the built-in one).
    """
    base = cost.Profile.load(profile_path) if profile_path else cost.DEFAULT_PROFILE
    options = cost.Options(density=density)
    alpha = 10e-6
    shown = [a for a in FLAT if a in cost.DEFAULT_ALLOWED]
    columns = shown + MULTI_LEADER
    print(f"| network | P | layout | {' | '.join(columns)} | pick |")
    print("|---" * (len(columns) + 4) + "|")
    rows = []
    for gbit in (10, 100, 400):
        link = cost.Link(alpha=alpha, beta=8 / (gbit * 1e9))
        profile = cost.Profile(
            links={**base.links, "across_hosts": link},
            gamma=base.gamma,
            psum=link,
            call=base.call,
            inter_process="across_hosts",
        )
        for p in (8, 64, 256, 1024):
            layouts = [("flat", cost.World(p, 1, "across_hosts"))]
            if p > 8:  # 8 ranks at 8 per node is one process: no network
                layouts.append(("8 per node", cost.World(p // 8, 8, "across_hosts")))
            for layout, world in layouts:
                algos = shown + (MULTI_LEADER if layout != "flat" else [])
                times = {a: cost.predict(a, n, world, profile, options).seconds for a in algos}
                cells = [f"{times[a] * 1e3:.0f}" if a in times else "" for a in columns]
                pick = min(times, key=times.get)
                print(f"| {gbit} Gbit/s | {p} | {layout} | {' | '.join(cells)} | {pick} |")
                rows.append(
                    {"gbit": gbit, "ranks": p, "layout": layout, "seconds": times, "pick": pick}
                )
    return {
        "elements": n,
        "density": density,
        "alpha_s": alpha,
        "profile": str(profile_path) if profile_path else "the built-in profile",
        "algorithms": columns,
        "rows": rows,
    }


def parse_args() -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--extrapolate",
        action="store_true",
        help="only print the model's table for P up to 1024 at 10/100/400 Gbit/s (ms, 25M floats)",
    )
    parser.add_argument("--profile", type=pathlib.Path, help="profile for --extrapolate")
    add_world_arguments(parser, processes=False, devices=False)
    parser.add_argument("--worlds", nargs="+", default=["2x1", "4x1", "2x2"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000])
    add_repeats_argument(parser, 5)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument(
        "--threshold-fraction",
        type=float,
        default=0.0027,
        help="fraction of N(0,1) entries above tau (2(1 - Phi(3)) for tau = 3)",
    )
    parser.add_argument("--proportion", type=float, default=64.0)
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=[*FLAT, *HIER, "auto"],
        choices=[*ALL_ALGORITHMS, "auto"],
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args()
    return args, parser


def parse_worlds(parser: argparse.ArgumentParser, specs: list[str]) -> list[tuple[int, int]]:
    """(processes, devices) of each ``PxD`` of ``--worlds``."""
    worlds = []
    for w in specs:
        try:
            p, d = (int(v) for v in w.lower().split("x"))
        except ValueError:
            parser.error(f"--worlds: {w!r} is not PROCESSESxDEVICES, e.g. 4x1")
        worlds.append((p, d))
    return worlds


def print_rows(rows: list[dict]) -> None:
    header = (
        f"{'world':8s} {'algorithm':17s} {'elements':>9s} {'measured':>10s} {'predicted':>10s} "
        f"{'error':>7s} {'bytes meas.':>12s} {'bytes pred.':>12s}  auto"
    )
    print(header)
    for r in rows:
        auto = f"pick ({r['auto_vs_best']:.2f}x best)" if r.get("auto_pick") else ""
        if "auto_run_vs_best" in r:
            auto += f"; auto run {r['auto_run_vs_best']:.2f}x best"
        print(
            f"{r['processes']}x{r['devices_per_process']:<6d} {r['algorithm']:17s} "
            f"{r['elements']:>9d} {r['measured_s'] * 1e3:>7.2f} ms {r['predicted_s'] * 1e3:>7.2f} ms "
            f"{r['error'] * 100:>6.1f}% {r['measured_bytes']:>12.0f} {r['predicted_bytes']:>12.0f}  {auto}"
        )


def summarize(rows: list[dict], wall: float) -> dict[str, Any]:
    """The model's error and auto's picks over every row; printed in one line."""
    errors = [abs(r["error"]) for r in rows]
    picks = [r["auto_vs_best"] for r in rows if r.get("auto_pick")]
    runs = [r["auto_run_vs_best"] for r in rows if "auto_run_vs_best" in r]
    bytes_exact = sum(
        1 for r in rows if r["algorithm"] != "psum" and r["measured_bytes"] == r["predicted_bytes"]
    )
    summary = {
        "cases": len(rows),
        "median_abs_error": statistics.median(errors) if errors else None,
        "worst_abs_error": max(errors) if errors else None,
        "auto_within_10pct": sum(1 for x in picks if x <= 1.10),
        "auto_cases": len(picks),
        "auto_run_within_10pct": sum(1 for x in runs if x <= 1.10),
        "auto_run_cases": len(runs),
        "bytes_exact": bytes_exact,
        "bytes_cases": sum(1 for r in rows if r["algorithm"] != "psum"),
        "wall_s": wall,
    }
    print(
        f"median |error| {summary['median_abs_error'] * 100:.1f} %, worst "
        f"{summary['worst_abs_error'] * 100:.1f} % over {len(rows)} cases; auto within 10 % of "
        f"the best allowed in {summary['auto_within_10pct']}/{summary['auto_cases']} (its own "
        f"run: {summary['auto_run_within_10pct']}/{summary['auto_run_cases']}); bytes "
        f"exact in {bytes_exact}/{summary['bytes_cases']} (wall {wall:.0f} s)"
    )
    return summary


def draw_scatter(ax: Any, rows: list[dict]) -> None:
    """Predicted against measured seconds per call, one colour per algorithm, ±20 % dotted."""
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        pts = [r for r in rows if r["algorithm"] == algorithm]
        ax.scatter(
            [r["measured_s"] * 1e3 for r in pts],
            [r["predicted_s"] * 1e3 for r in pts],
            label=algorithm,
            s=22,
        )
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 0.8
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.plot([lo, hi], [lo * 1.2, hi * 1.2], "k:", lw=0.6)
    ax.plot([lo, hi], [lo / 1.2, hi / 1.2], "k:", lw=0.6)


def main() -> None:
    args, parser = parse_args()
    if args.extrapolate:
        result = extrapolate(args.profile, 25_000_000, args.density)
        args.out.mkdir(parents=True, exist_ok=True)
        path = write_result(args.out, "cost-model-extrapolation", result)
        print(f"\nwrote {path}")
        return
    worlds = parse_worlds(parser, args.worlds)
    start = time.monotonic()
    rows: list[dict] = []
    profiles: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p, d in worlds:
            rows += measure_world(args, p, d, pathlib.Path(tmp), profiles)
    wall = time.monotonic() - start
    print_rows(rows)
    summary = summarize(rows, wall)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = (
        "cost-model-" + args.backend + (f"-{args.bandwidth}" if args.backend == "emulated" else "")
    )
    result = {
        "args": vars(args) | {"out": str(args.out)},
        "summary": summary,
        "profiles": profiles,
        "rows": rows,
    }
    write_result_and_plot(
        args.out,
        tag,
        result,
        lambda ax: draw_scatter(ax, rows),
        figsize=(6.5, 6),
        xlabel="measured ms per call",
        ylabel="predicted ms per call",
        title=f"jaxcomm.cost, {tag} (dotted: ±20 %)",
        legend_size=7,
        log=True,
    )


if __name__ == "__main__":
    main()
