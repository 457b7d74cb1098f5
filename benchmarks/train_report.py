"""The end-to-end grid's report, redrawn from its cells: each cell predicted again with this
commit's cost model, the seeds of each (workload, network, reduction) pooled into a row with
its speedup over the fastest dense 16-bit run, printed as tables and written to ``e2e.json``,
its two pictures (``train_plots.py``) and, for the default output folder, ``docs/e2e.md``
(through ``benchmarks/docs.py``, as every generated table)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
from typing import Any

from train_grid import (
    BASELINES_16BIT,
    DEFAULT_OUT,
    LEARNER,
    VARIANTS,
    WORKLOADS,
    auto_dropped_warmup,
    auto_pick,
    compute_at,
    compute_path,
    load_cells,
    network_dir,
    write_json,
)
from train_plots import draw_curves, draw_pays
from train_predict import predict_step

from docs import e2e_cells, e2e_columns
from docs import main as docs_main


def summarize(
    cells: list[dict[str, Any]], computes: dict[tuple[str, int, int], float] | None = None
) -> list[dict[str, Any]]:
    """One row per (workload, network, label): seeds pooled (median time to target, a seed
    that missed it counted as the slowest; spread), the speedup over the fastest dense 16-bit
    run of the same cell, and the bound on any speedup there (``computes``: each workload's
    measured compute step)."""
    computes = computes or {}
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for c in cells:
        net = network_dir(c["network"], c["nodes"], c.get("devices", 1))
        groups.setdefault((c["workload"], net, c["label"]), []).append(c)
    rows = [
        _summary_row(workload, net, label, runs) for (workload, net, label), runs in groups.items()
    ]
    by_cell: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_cell.setdefault((r["workload"], r["network"]), []).append(r)
    for cell_rows in by_cell.values():
        _add_speedups(cell_rows, computes)
    order = {k: i for i, k in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (r["workload"], r["network"], order.get(r["label"], 99)))
    return rows


def _summary_row(workload: str, net: str, label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The seeds of one (workload, network, label) pooled into a row of :func:`summarize`."""
    reached = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
    caps = [r["training_s"] for r in runs if r["time_to_target_s"] is None]
    first = runs[0]
    higher = first["higher_is_better"]
    bests = [r["best"] for r in runs if r["best"] is not None]
    # Each seed predicted with the compute step measured before it, against each seed's step.
    pred = _median([(r.get("predicted") or {}).get("step_s") for r in runs])
    step = _median([r["step_s"] for r in runs])
    return {
        "workload": workload,
        "network": net,
        "nodes": first["nodes"],
        "devices": first.get("devices", 1),
        "label": label,
        "seeds": sorted(r["seed"] for r in runs),
        "reached": len(reached),
        "time_to_target_s": _censored_median(reached, len(runs)),
        "time_to_target_spread_s": (min(reached), max(reached)) if reached else None,
        "capped_at_s": max(caps) if caps else None,
        "target": first["target"],
        "metric": first["metric"],
        "best": (max(bests) if higher else min(bests)) if bests else None,
        "step_s": step,
        "predicted_step_s": pred,
        "prediction_error": (pred - step) / step if pred and step else None,
        "bytes_sent_per_step": _median([r["bytes_sent_per_step"] for r in runs]),
        "steps": _median([r["steps"] for r in runs]),
        # Every seed's pick, where they differ ("a / b"): seeds decide apart.
        "auto_pick": " / ".join(dict.fromkeys(p for p in map(auto_pick, runs) if p)) or None,
        "oversubscribed": first.get("oversubscribed"),
        "held_out": WORKLOADS[workload].held_out if workload in WORKLOADS else False,
        "learner": WORKLOADS[workload].learner if workload in WORKLOADS else "",
        # What a learning auto read as the run's length (the recipe's, or a --set of it).
        "dense_steps": ((first.get("recipe") or {}).get("jaxcomm") or {}).get("dense_steps"),
        "measure_s": _median([r.get("auto_measure_s") for r in runs]),
        "compile_s": _median([r.get("auto_compile_s") for r in runs]),
        # The compute step its runs were predicted with.
        "compute_s": _median([(r.get("predicted") or {}).get("compute_s") for r in runs]),
    }


def _add_speedups(cell_rows: list[dict[str, Any]], computes: dict) -> None:
    """Adds to each row of one (workload, network) its speedup over the fastest dense 16-bit
    baseline and the bound a free reduction would reach there."""
    base = [r for r in cell_rows if r["label"] in BASELINES_16BIT]
    done = [r for r in base if r["time_to_target_s"] is not None]
    if done:
        b = min(done, key=lambda r: r["time_to_target_s"])
        base_t, lower = b["time_to_target_s"], False
    elif base:  # no 16-bit baseline reached the target: the longest cap bounds it
        b = max(base, key=lambda r: r["capped_at_s"] or 0)
        base_t, lower = b["capped_at_s"], True
    else:
        b, base_t, lower = None, None, False
    # The speedup a reduction that cost nothing and needed no more steps than the baseline
    # would get: the baseline's time over its steps of compute alone.
    first = cell_rows[0]
    latest = computes.get((first["workload"], first["nodes"], first.get("devices", 1)))
    compute = (b["compute_s"] if b is not None else None) or latest
    bound = (
        base_t / (b["steps"] * compute)
        if (b is not None and base_t and compute and b["steps"])
        else None
    )
    for r in cell_rows:
        r["compute_s"] = r["compute_s"] or latest
        r["no_communication_bound"] = bound
        r["bound_compute_s"] = compute if bound else None
        r["baseline"] = None if b is None else b["label"]
        t = r["time_to_target_s"]
        r["speedup"] = base_t / t if (base_t and t) else None
        r["speedup_is_lower_bound"] = lower and r["speedup"] is not None


def _censored_median(reached: list[float], runs: int) -> float | None:
    """The median time to target over ``runs`` seeds, ``reached`` of which reached it: a seed
    that missed counts as slower than every seed that reached it (it stopped at its cap), so
    the median exists while fewer than half missed, and is None otherwise.

    Example:
      >>> _censored_median([1.0, 2.0, 3.0], 4), _censored_median([1.0, 2.0], 4)
      (2.5, None)
    """
    middle = statistics.median(sorted(reached) + [math.inf] * (runs - len(reached)))
    return middle if math.isfinite(middle) else None


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report as text for the terminal (docs/e2e.md gets the same through docs.py)."""
    widths = [34, 30, 18, 8, 6, 8, 16, 9]
    lines: list[str] = []
    for title, cell_rows in e2e_cells(rows):
        lines += ["", title, ""]
        for r in cell_rows:
            cols = e2e_columns(r)
            lines.append(
                " ".join(
                    c.rjust(w) if i else c.ljust(w)
                    for i, (c, w) in enumerate(zip(cols, widths, strict=True))
                )
            )
    return lines


def _profiles_by_source(out: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every profile of the grid by its ``source`` (the probe's run): the current ones
    (``cells/profiles/<network>.json``) and the earlier ones that cells' auto runs read
    (``cells/profiles/read/``); a current one wins."""
    profiles = out / "cells" / "profiles"
    paths = sorted((profiles / "read").glob("*.json")) + sorted(profiles.glob("*.json"))
    return {json.loads(path.read_text()).get("source"): path for path in paths}


def repredict(args: argparse.Namespace, cells: list[dict[str, Any]]) -> None:
    """Predicts every cell's step time again with this commit's cost model (each cell keeps
    the prediction made before it ran as ``predicted_before_run``).

    An auto cell is predicted with the profile its run read (its decisions name the probe),
    so that the prediction is of the choices it made: a profile probed later may choose
    otherwise (lbann-mlp at 1 Gbit/s: BlockQuant with the current profile, TopK-allgather
    with the one the run read), and the step it would then predict is not the run's."""
    sources = _profiles_by_source(args.out)
    for c in cells:
        devices = c.get("devices", 1)
        compute = compute_path(args.out, c["workload"], c["nodes"], devices)
        net = network_dir(c["network"], c["nodes"], devices)
        profile = args.out / "cells" / "profiles" / f"{net}.json"
        read = [d["profile"] for d in c.get("auto_choices") or [] if "profile" in d]
        if read and read[0] in sources:
            profile = sources[read[0]]
        compute_s = compute_at(compute, c.get("started_at"))
        if compute_s is None:
            continue
        c.setdefault("predicted_before_run", c.get("predicted"))
        recipe = c["recipe"]
        if auto_dropped_warmup(c):  # predict the run auto made: no warm-up, its factors
            entry = dict(recipe["sweep"][0])
            entry["steps_factor"] = entry.get("steps_factor_no_warmup", entry.get("steps_factor"))
            recipe = {
                **recipe,
                "sweep": [entry],
                "args": {**recipe.get("args", {}), "warmup": False},
            }
        c["predicted"] = predict_step(
            c["workload"],
            recipe,
            c["label"],
            c["network"],
            c["nodes"],
            compute_s,
            profile if profile.exists() else None,
            c["steps"],
            devices,
        )


def report(args: argparse.Namespace) -> None:
    cells = load_cells(args.out)
    if not cells:
        print(f"no cells in {args.out}/cells yet")
        return
    repredict(args, cells)
    computes = {}
    for c in cells:
        key = (c["workload"], c["nodes"], c.get("devices", 1))
        path = compute_path(args.out, *key)
        if path.exists():
            computes[key] = json.loads(path.read_text())["step_s"]
    rows = summarize(cells, computes)
    for line in table_lines(rows):
        print(line)
    write_json(args.out / "e2e.json", {"rows": rows, "cells": len(cells), "learner": LEARNER})
    draw_curves(cells, args.out / "e2e-curves.png")
    draw_pays(rows, args.out / "e2e-pays.png")
    if args.out.resolve() == DEFAULT_OUT.resolve():
        # docs/e2e.md's table comes from e2e.json through benchmarks/docs.py, as every table does.
        docs_main([])
