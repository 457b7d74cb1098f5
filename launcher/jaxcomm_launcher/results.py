"""Run results (the launcher's side; the collectives' own counters are ``jaxcomm.metrics``):
read the ranks' JSON lines, write ``summary.json``, print a table, draw PNGs."""

from __future__ import annotations

import json
import math
import pathlib
import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table

from jaxcomm_launcher.placement import describe_cores


def read_run(run_dir: pathlib.Path) -> dict[str, Any]:
    """Returns ``run.json`` of a run directory (written by the launcher).

    Args:
        run_dir: The run directory.

    Returns:
        The parsed run description (recipe name, backend, variants with their status).

    Raises:
        FileNotFoundError: When `run_dir` is not a run directory.

    Example:
        >>> read_run(pathlib.Path("runs/digits-dense-20250101-000000"))  # doctest: +SKIP
    """
    path = run_dir / "run.json"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a jaxcomm run directory (no run.json)")
    return json.loads(path.read_text())


def read_records(variant_dir: pathlib.Path) -> dict[int, list[dict[str, Any]]]:
    """Returns each rank's metric records of one run, by rank.

    Args:
        variant_dir: Directory holding ``rank<R>.jsonl`` files.

    Returns:
        ``{rank: [record, ...]}``; a torn last line (a rank killed mid-write) is skipped.

    Example:
        >>> read_records(pathlib.Path("runs/x/dense"))[0][0]["step"]  # doctest: +SKIP
        0
    """
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(variant_dir.glob("rank*.jsonl")):
        try:
            rank = int(path.stem[4:])
        except ValueError:
            continue
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        out[rank] = records
    return out


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def _last(records: list[dict[str, Any]], key: str) -> Any:
    for r in reversed(records):
        if r.get(key) is not None:
            return r[key]
    return None


def summarize_variant(
    records: dict[int, list[dict[str, Any]]], warmup_steps: int = 2
) -> dict[str, Any]:
    """Reduces one run's records to the numbers of the summary table.

    Args:
        records: Output of :func:`read_records`.
        warmup_steps: Leading steps excluded from time medians (compilation).

    Returns:
        steps, final loss/accuracy/test accuracy (rank 0), median step and collective time,
        mean bytes sent per step per rank, compression ratio.

    Example:
        >>> summarize_variant({0: [{"step": 0, "loss": 1.0, "step_time_s": 0.1}]}, 0)["steps"]
        1
    """
    main = records.get(0) or next(iter(records.values()), [])
    timed = [r for r in main if r.get("step", 0) >= warmup_steps] or main
    sent = [r.get("bytes_sent") for recs in records.values() for r in recs]
    sent = [s for s in sent if s is not None]
    return {
        "ranks_reporting": len(records),
        "steps": (max(r["step"] for r in main) + 1) if main else 0,
        "final_loss": _last(main, "loss"),
        "final_accuracy": _last(main, "accuracy"),
        "final_test_accuracy": _last(main, "test_accuracy"),
        "median_step_time_s": _median([r.get("step_time_s") for r in timed]),
        "median_collective_time_s": _median([r.get("collective_time_s") for r in timed]),
        "mean_bytes_sent_per_step": (sum(sent) / len(sent)) if sent else None,
        "compression_ratio": _last(main, "compression_ratio"),
    }


def write_summary(run_dir: pathlib.Path) -> dict[str, Any]:
    """Writes ``summary.json`` of a run directory and returns it.

    Args:
        run_dir: The run directory.

    Returns:
        ``{"recipe": ..., "backend": ..., "variants": [{label, status, ...numbers}]}``.

    Example:
        >>> write_summary(pathlib.Path("runs/x"))["variants"][0]["status"]  # doctest: +SKIP
        'ok'
    """
    run = read_run(run_dir)
    warmup = int(run.get("warmup_steps", 2))
    variants = []
    for v in run.get("variants", []):
        entry = dict(v)
        entry.update(summarize_variant(read_records(run_dir / v["label"]), warmup))
        variants.append(entry)
    summary = {
        "recipe": run.get("recipe"),
        "backend": run.get("backend"),
        "world": run.get("world"),
        # cores per node and the oversubscription notice (placement.py; None: not placed)
        "placement": run.get("placement"),
        "oversubscribed": (run.get("placement") or {}).get("oversubscribed"),
        "variants": variants,
    }
    if "slurm" in run:  # job id, final state and nodes of a slurm run
        summary["slurm"] = run["slurm"]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def print_table(summary: dict[str, Any], console: Console) -> None:
    """Prints the summary as a Rich table, one row per run of the recipe.

    Args:
        summary: Output of :func:`write_summary`.
        console: Where to print.

    Returns:
        None.

    Example:
        >>> print_table(write_summary(run_dir), Console())  # doctest: +SKIP
    """
    world = summary.get("world") or {}
    title = (
        f"{summary.get('recipe')} · {summary.get('backend')} · "
        f"{world.get('processes', '?')} processes × {world.get('devices_per_process', '?')} "
        + ("GPUs" if world.get("platform") == "gpu" else "devices")
    )
    placement = summary.get("placement")
    if placement and placement.get("node_cpus"):
        title += " · cores " + describe_cores(placement["node_cpus"])
    if placement and placement.get("gpus"):
        title += " · GPUs " + " | ".join(placement["gpus"])
    if placement and placement.get("shared_gpus"):
        title += f" · {placement['shared_gpus']}"
    if summary.get("oversubscribed"):
        title += f" · [bold yellow]{summary['oversubscribed']}[/]"
    table = Table(title=title)
    for col in (
        "run",
        "status",
        "steps",
        "loss",
        "acc",
        "test acc",
        "step ms",
        "coll ms",
        "MB/step",
        "wall s",
    ):
        table.add_column(col, justify="left" if col in ("run", "status") else "right")
    for v in summary.get("variants", []):
        status = v.get("status", "?")
        style = "green" if status == "ok" else "red"
        mb = v.get("mean_bytes_sent_per_step")
        table.add_row(
            v["label"],
            f"[{style}]{status}[/]",
            str(v.get("steps", 0)),
            _fmt(v.get("final_loss"), ".4f"),
            _fmt(v.get("final_accuracy"), ".3f"),
            _fmt(v.get("final_test_accuracy"), ".3f"),
            _fmt(
                None if v.get("median_step_time_s") is None else v["median_step_time_s"] * 1e3,
                ".2f",
            ),
            _fmt(
                None
                if v.get("median_collective_time_s") is None
                else v["median_collective_time_s"] * 1e3,
                ".2f",
            ),
            _fmt(None if mb is None else mb / 1e6, ".3f"),
            _fmt(v.get("wall_s"), ".1f"),
        )
    console.print(table)


class _Panel(NamedTuple):
    """One panel of a per-step figure of :func:`draw_plots`: a line per run of a sweep."""

    points: Callable[[list[dict[str, Any]]], tuple[list[int], list[float]]]  # records -> xs, ys
    ylabel: str
    title: str
    marker: str | None = None  # Axes.plot's marker (None: a line only)


def draw_plots(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """Draws the run's PNGs (one line per run of a sweep) and returns their paths.

    ``loss.png`` (loss and accuracy vs step, when the job logs them), ``step_time.png``
    (step time and bytes sent per step) and ``allreduce.png`` (bandwidth vs message size, for
    the allreduce benchmark).

    Args:
        run_dir: The run directory.

    Returns:
        The written files.

    Example:
        >>> [p.name for p in draw_plots(pathlib.Path("runs/x"))]  # doctest: +SKIP
        ['loss.png', 'step_time.png']
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters and CI
    import matplotlib.pyplot as plt

    run = read_run(run_dir)
    series = {}
    for v in run.get("variants", []):
        records = read_records(run_dir / v["label"])
        main = records.get(0) or next(iter(records.values()), [])
        if main:
            series[v["label"]] = main
    written: list[pathlib.Path] = []
    if not series:
        return written
    title = run.get("recipe", "")

    def column(
        recs: list[dict[str, Any]], key: str, scale: float = 1.0
    ) -> tuple[list[int], list[float]]:
        pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] * scale for p in pts]

    def accuracy(recs: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
        xs, ys = column(recs, "test_accuracy")
        return (xs, ys) if xs else column(recs, "accuracy")

    def per_step_pair(name: str, left: _Panel, right: _Panel) -> None:
        """Saves a figure of two per-step panels (the left one log-scale), a line per run."""
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, panel in zip(axes, (left, right), strict=True):
            for label, recs in series.items():
                ax.plot(*panel.points(recs), marker=panel.marker, label=label)
            ax.set(xlabel="step", ylabel=panel.ylabel, title=panel.title)
            ax.grid(alpha=0.3)
            ax.legend()
        axes[0].set_yscale("log")
        written.append(_save(fig, run_dir / name))

    if any(column(r, "loss")[0] for r in series.values()):
        per_step_pair(
            "loss.png",
            _Panel(lambda recs: column(recs, "loss"), "training loss", f"{title}: loss"),
            _Panel(accuracy, "accuracy", "test accuracy (rank 0)", marker="."),
        )
    per_step_pair(
        "step_time.png",
        _Panel(
            lambda recs: column(recs, "step_time_s", 1e3),
            "step time (ms)",
            f"{title}: step time (rank 0)",
        ),
        _Panel(
            lambda recs: column(recs, "bytes_sent", 1e-6),
            "MB sent per step",
            "bytes sent per step (rank 0)",
        ),
    )

    if any(column(r, "size_bytes")[0] for r in series.values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, recs in series.items():
            by_size: dict[int, list[float]] = {}
            for r in recs:
                if r.get("size_bytes") and r.get("algbw_gbps") is not None:
                    by_size.setdefault(r["size_bytes"], []).append(r["algbw_gbps"])
            sizes = sorted(by_size)
            ax.plot(sizes, [statistics.median(by_size[s]) for s in sizes], marker="o", label=label)
        ax.set(
            xlabel="message size (bytes)",
            ylabel="algorithm bandwidth (Gbit/s)",
            title=f"{title}: allreduce",
        )
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, run_dir / "allreduce.png"))
    return written


def _save(fig: Any, path: pathlib.Path) -> pathlib.Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
