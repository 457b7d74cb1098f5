"""Time-to-accuracy: train a workload with every gradient reduction in the same run.

Runs ``recipes/<workload>.yaml`` (``lbann-mlp`` or ``bytes-lm``) through ``jaxcomm launch`` with
one variant per algorithm (``psum`` fp32 and bf16 are XLA's ``lax.pmean``; ``dense``,
``dense-bf16``, ``gtopk``, ``topk``, ``adaptive``, ``onebit`` go through
``jaxcomm.optax.allreduce_gradients``), locally or on the emulated cluster of DESIGN.md §5
(``--backend emulated --bandwidth 1gbit``: network namespaces with tbf-shaped links, root).
Every job records loss and test accuracy (lbann-mlp) or validation bits per byte (bytes-lm)
against training wall clock (from the end of the compiling first step, evaluations excluded),
its step time, the time inside jaxcomm's collectives and the bytes each rank sent.

The target is the final metric of the ``psum`` (fp32) run; each algorithm's time to target is
the training time of its first evaluation that reaches it. Prints a table, writes JSON and a
PNG (metric against wall clock per algorithm) to ``--out``.

Usage:
  python benchmarks/train.py --workload lbann-mlp --epochs 2
  python benchmarks/train.py --workload lbann-mlp --backend emulated --bandwidth 1gbit
  python benchmarks/train.py --workload bytes-lm --steps 200 --args width=128 layers=2
  python benchmarks/train.py --steps 4 --train hidden=256 --algorithms psum dense   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Any

import yaml
from _bench import (
    add_world_arguments,
    jaxcomm_cli,
    recipe_backend,
    setup_fields,
    write_result_and_plot,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
# label -> sweep entry of the recipes (the launcher's display label of each entry)
VARIANTS = {
    "psum": {"algorithm": "psum"},
    "psum-bf16": {"algorithm": "psum", "grad_dtype": "bfloat16"},
    "dense": {"algorithm": "dense"},
    "dense-bf16": {"algorithm": "dense", "grad_dtype": "bfloat16"},
    "gtopk": {"algorithm": "gtopk"},
    "topk_allgather": {"algorithm": "topk"},
    "adaptive": {"algorithm": "adaptive"},
    "onebit": {"algorithm": "onebit"},
    "threshold": {"algorithm": "threshold"},
}
# What each workload reports and which way is better.
METRICS = {
    "lbann-mlp": ("test_accuracy", "test accuracy", True),
    "bytes-lm": ("validation_bits_per_byte", "validation bits per byte", False),
}


def parse_value(text: str) -> object:
    return yaml.safe_load(text)


def write_recipe(args: argparse.Namespace, path: pathlib.Path) -> dict:
    recipe = yaml.safe_load((REPO / "recipes" / f"{args.workload}.yaml").read_text())
    recipe["name"] = f"{args.workload}-bench"
    density = args.density if args.density is not None else recipe["jaxcomm"]["density"]
    recipe["sweep"] = [
        {**VARIANTS[v], **({"density": density} if v in ("gtopk", "topk_allgather") else {})}
        for v in args.algorithms
    ]
    recipe["world"] = {"processes": args.processes, "devices_per_process": 1}
    if args.backend == "emulated":
        recipe["backend"] = recipe_backend(args)
    recipe.setdefault("args", {})
    if args.steps is not None:
        recipe["train"]["steps"] = args.steps
        recipe["args"].pop("epochs", None)
        if args.workload == "bytes-lm":
            recipe["args"]["steps"] = args.steps
    if args.epochs is not None:
        recipe["args"]["epochs"] = args.epochs
    if args.eval_every is not None:
        recipe["train"]["eval_every"] = args.eval_every
    for section, items in (("args", args.args), ("train", args.train)):
        for item in items:
            key, _, value = item.partition("=")
            recipe[section][key] = parse_value(value)
    recipe["timeout"] = args.timeout
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return recipe


def time_to_target(history: list[dict], key: str, target: float, higher: bool) -> float | None:
    for h in history:
        value = h[key]
        if value is not None and (value >= target if higher else value <= target):
            return h["seconds"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(METRICS), default="lbann-mlp")
    add_world_arguments(parser, devices=False)
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=[
            "psum",
            "psum-bf16",
            "dense",
            "dense-bf16",
            "gtopk",
            "topk_allgather",
            "adaptive",
            "onebit",
        ],
        choices=sorted(VARIANTS),
    )
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's steps")
    parser.add_argument("--epochs", type=int, default=None, help="lbann-mlp: epochs (20 = paper)")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--density", type=float, default=None, help="gtopk/topk density")
    parser.add_argument(
        "--args", nargs="*", default=[], help="extra job args, key=value (e.g. width=128)"
    )
    parser.add_argument(
        "--train", nargs="*", default=[], help="recipe train fields, key=value (e.g. hidden=512)"
    )
    parser.add_argument("--timeout", type=float, default=36000)
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    key, metric_name, higher = METRICS[args.workload]

    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"train-{args.workload}-{args.backend}"
    if args.backend == "emulated":
        tag += f"-{args.bandwidth}"
    # The run directory (ranks' logs and metrics) is kept next to the results.
    run_dir = args.out / f"{tag}-run"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    recipe_path = run_dir / "bench-recipe.yaml"
    recipe = write_recipe(args, recipe_path)
    command = jaxcomm_cli("launch", str(recipe_path), "--out", str(run_dir), "-q")
    start = time.monotonic()
    launched = subprocess.run(command, text=True)
    wall = time.monotonic() - start
    results = {}
    for path in sorted(run_dir.glob("*/*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "history" in data:
            results[data["label"]] = data
    if launched.returncode != 0:
        print(f"jaxcomm launch exited with {launched.returncode}; reporting the runs that finished")
    if "psum" not in results:
        sys.exit("the psum (fp32) run did not finish: no target to measure against")

    target = results["psum"][key]
    base = {
        name: time_to_target(results[name]["history"], key, target, higher)
        for name in ("psum", "psum-bf16")
        if name in results
    }
    rows = []
    for label in [v for v in VARIANTS if v in results]:
        r = results[label]
        reach = time_to_target(r["history"], key, target, higher)
        row = {
            "algorithm": label,
            "final": r[key],
            "time_to_target_s": reach,
            "step_s": r["step_seconds"],
            "comm_s": r["comm_seconds_per_step"],
            "bytes_sent_per_step": r["bytes_sent_per_step"],
            "steps": r["steps"],
            "parameters": r["parameters"],
        }
        for name, t in base.items():
            row[f"speedup_vs_{name}"] = (t / reach) if (t and reach) else None
        rows.append(row)

    print(
        f"\n{tag}: {args.processes} ranks, {results['psum']['parameters'] / 1e6:.1f}M parameters, "
        f"{results['psum']['steps']} steps; target = psum's final {metric_name} {target:.4f}"
    )
    print(
        f"{'algorithm':14s} {'final':>8s} {'to target':>10s} {'step s':>8s} {'comm s':>8s} "
        f"{'MB/step':>9s} {'vs psum':>8s} {'vs bf16':>8s}"
    )

    def fmt(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None and math.isfinite(v) else "-"

    for r in rows:
        print(
            f"{r['algorithm']:14s} {fmt(r['final'], '8.4f')} {fmt(r['time_to_target_s'], '10.1f')} "
            f"{fmt(r['step_s'], '8.3f')} {fmt(r['comm_s'], '8.3f')} "
            f"{r['bytes_sent_per_step'] / 1e6:9.3f} {fmt(r.get('speedup_vs_psum'), '7.2f')}x "
            f"{fmt(r.get('speedup_vs_psum-bf16'), '7.2f')}x"
        )
    summary = {
        "workload": args.workload,
        **setup_fields(args),
        "command": " ".join(sys.argv),
        "recipe": recipe,
        "metric": key,
        "target": target,
        "wall_s": wall,
        "rows": rows,
        "runs": results,
    }

    def draw(ax: Any) -> None:
        for label, r in results.items():
            pts = [(h["seconds"], h[key]) for h in r["history"] if h[key] is not None]
            ax.plot(*zip(*pts, strict=True), marker=".", label=label)
        ax.axhline(target, color="gray", linestyle=":", label="psum final")

    write_result_and_plot(
        args.out,
        tag,
        summary,
        draw,
        figsize=(7.5, 4.5),
        xlabel="training wall clock (s)",
        ylabel=metric_name,
        title=f"{tag}, {args.processes} ranks",
        legend_size=8,
    )


if __name__ == "__main__":
    main()
