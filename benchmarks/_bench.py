"""What the benchmark scripts share: the options and launcher backend they run their recipe on, the recipe
of a one-job benchmark, the launcher's command line, matplotlib when it is installed, and the
JSON and PNG they write.

The scripts run as ``python benchmarks/<name>.py``, so this folder is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import yaml


def add_world_arguments(
    parser: argparse.ArgumentParser, *, processes: bool = True, devices: bool = True
) -> None:
    """Adds the options that say where a benchmark's ranks run: ``--backend`` (``local`` or
    ``emulated``), ``--bandwidth`` (the emulated links' tbf rate) and, unless turned off,
    ``--processes`` (default 4) and ``--devices-per-process`` (default 1).

    Example:
      >>> parser = argparse.ArgumentParser()
      >>> add_world_arguments(parser)
      >>> parser.parse_args([]).backend
      'local'
    """
    parser.add_argument("--backend", choices=["local", "emulated"], default="local")
    parser.add_argument("--bandwidth", default="1gbit", help="emulated link rate (tc tbf)")
    if processes:
        parser.add_argument("--processes", type=int, default=4)
    if devices:
        parser.add_argument(
            "--devices-per-process", type=int, default=1, help="local ranks per node (process)"
        )


def add_repeats_argument(parser: argparse.ArgumentParser, default: int, minimum: int = 5) -> None:
    """Adds ``--repeats`` (timed samples a median is taken of), refusing fewer than ``minimum``:
    medians of fewer runs are noise.

    Example:
      >>> parser = argparse.ArgumentParser()
      >>> add_repeats_argument(parser, 7)
      >>> parser.parse_args([]).repeats, parser.parse_args(["--repeats", "5"]).repeats
      (7, 5)
    """

    def repeats(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be >= {minimum} (medians of fewer runs are noise), got {value}"
            )
        return value

    parser.add_argument(
        "--repeats", type=repeats, default=default, help=f"timed samples (>= {minimum})"
    )


def recipe_backend(args: argparse.Namespace) -> dict | str:
    """The recipe ``backend`` for ``--backend local`` or ``--backend emulated``.

    The emulated cluster (docs/DESIGN.md §5, root needed) gets ``--bandwidth`` links with a
    128 KiB tbf burst (smaller bursts make the CPU the bottleneck), an IPC namespace per node and
    UCX over TCP, so that ranks on different "nodes" cannot use shared memory; with
    ``args.cpus_per_node``, each node pinned to that many cores of its own.

    Args:
      args: the script's arguments, with ``backend`` and (emulated) ``bandwidth``.

    Returns:
      ``"local"`` or the emulated backend's mapping.

    Example:
      >>> recipe_backend(argparse.Namespace(backend="local"))
      'local'
    """
    if args.backend != "emulated":
        return "local"
    backend = {
        "kind": "emulated",
        "bandwidth": args.bandwidth,
        "burst": "128kb",
        "ipc_isolation": True,
        "ucx_tls": "tcp",
    }
    if getattr(args, "cpus_per_node", None):  # faithful nodes: each pinned to its own cores
        backend["cpus_per_node"] = args.cpus_per_node
    return backend


def jaxcomm_cli(*argv: str) -> list[str]:
    """The command line of ``jaxcomm ARGV...`` with this interpreter.

    ``python -m jaxcomm_launcher`` instead of the ``jaxcomm`` script: the script lives in the
    venv's ``bin``, which need not be on ``PATH`` when the venv's python runs a benchmark.

    Args:
      *argv: the CLI's arguments, e.g. ``"launch", "recipe.yaml"``.

    Returns:
      The argv list for ``subprocess.run``.

    Example:
      >>> jaxcomm_cli("launch", "r.yaml")[1:]
      ['-P', '-m', 'jaxcomm_launcher', 'launch', 'r.yaml']
    """
    # -P, as the launcher's ranks run: ``-m`` would put the working directory first on
    # sys.path, and a benchmark run from a checkout would validate recipes against the
    # checkout's jaxcomm registry instead of the installed package its ranks import.
    return [sys.executable, "-P", "-m", "jaxcomm_launcher", *argv]


def write_job_recipe(
    args: argparse.Namespace,
    path: pathlib.Path,
    job: str,
    job_args: dict[str, Any],
    env: dict[str, str] | None = None,
    target: str | None = None,
) -> None:
    """Writes the recipe of ``benchmarks/<job>.py``: job `job` with `job_args` on the backend,
    world and timeout the script's arguments ask for.

    Args:
      args: the script's arguments (``backend``, ``bandwidth``, ``processes``,
        ``devices_per_process``, ``timeout``).
      path: where the YAML goes.
      job: the benchmark's name, and the launcher job unless `target` is given (``allreduce``).
      job_args: the job's ``args``.
      env: extra environment variables of the ranks (the recipe's ``env``).
      target: a job of this folder as ``module:function`` (``overlap_job:run``): the recipe
        runs it, with this folder on the ranks' ``pythonpath``.

    Example:
      >>> import tempfile
      >>> a = argparse.Namespace(backend="local", processes=2, devices_per_process=1, timeout=60)
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "r.yaml"
      >>> write_job_recipe(a, p, "allreduce", {"repeats": 1})
      >>> yaml.safe_load(p.read_text())["name"]
      'allreduce-bench-local'
    """
    recipe = {
        "name": f"{job}-bench-{args.backend}",
        "description": f"benchmarks/{job}.py",
        "job": target or job,
        "world": {"processes": args.processes, "devices_per_process": args.devices_per_process},
        "backend": recipe_backend(args),
        "args": job_args,
        "timeout": args.timeout,
    }
    if env:
        recipe["env"] = env
    if target:
        recipe["pythonpath"] = [str(pathlib.Path(__file__).resolve().parent)]
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed), or None, after saying so,
    when matplotlib is not installed (the script then writes its JSON only).

    Example:
      >>> plt = pyplot()  # doctest: +SKIP
    """
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing: no PNG")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(
    fig: Any,
    ax: Any,
    path: pathlib.Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    legend_size: float | None = None,
    log: bool = False,
) -> pathlib.Path:
    """Labels ``ax`` (log-log when ``log``), adds its grid and legend, saves ``fig`` at 120 dpi.

    Args:
      fig, ax: the figure and its single axes.
      path: the PNG to write.
      xlabel, ylabel, title: the axes' labels and title.
      legend_size: legend font size (None: matplotlib's default).
      log: both axes logarithmic.

    Returns:
      ``path``.

    Example:
      >>> save_plot(fig, ax, out / "x.png", xlabel="n", ylabel="ms", title="t")  # doctest: +SKIP
    """
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def launch_records(recipe: pathlib.Path, run_dir: pathlib.Path) -> list[dict]:
    """Runs ``jaxcomm launch <recipe> --out <run_dir> -q`` (the script exits if it fails) and
    returns rank 0's metric records, every variant's in order.

    Example:
      >>> records = launch_records(pathlib.Path("r.yaml"), pathlib.Path("run"))  # doctest: +SKIP
    """
    launched = subprocess.run(
        jaxcomm_cli("launch", str(recipe), "--out", str(run_dir), "-q"), text=True
    )
    if launched.returncode != 0:
        sys.exit(f"jaxcomm launch failed with exit code {launched.returncode}")
    return [
        json.loads(line)
        for path in sorted(run_dir.rglob("rank0.jsonl"))
        for line in path.read_text().splitlines()
    ]


def run_recipe(write: Callable[[pathlib.Path], None]) -> tuple[list[dict], float]:
    """Writes a recipe with ``write(path)`` into a temporary directory, launches it there
    (:func:`launch_records`) and returns rank 0's records and the wall time in seconds.

    Example:
      >>> records, wall = run_recipe(lambda path: write_recipe(args, path))  # doctest: +SKIP
    """
    with tempfile.TemporaryDirectory() as tmp:
        recipe = pathlib.Path(tmp) / "recipe.yaml"
        write(recipe)
        start = time.monotonic()
        records = launch_records(recipe, pathlib.Path(tmp) / "run")
        return records, time.monotonic() - start


def setup_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The result file's description of where a benchmark ran: backend, link rate (emulated
    only) and processes.

    Example:
      >>> setup_fields(argparse.Namespace(backend="local", bandwidth="1gbit", processes=4))
      {'backend': 'local', 'bandwidth': None, 'processes': 4}
    """
    return {
        "backend": args.backend,
        "bandwidth": args.bandwidth if args.backend == "emulated" else None,
        "processes": args.processes,
    }


def setup_tag(name: str, args: argparse.Namespace) -> str:
    """The start of a result file's name: the benchmark, its backend and, emulated only, the
    link rate (the setup that ``setup_fields`` describes inside the file).

    Example:
      >>> setup_tag("allreduce", argparse.Namespace(backend="emulated", bandwidth="1gbit"))
      'allreduce-emulated-1gbit'
      >>> setup_tag("allreduce", argparse.Namespace(backend="local", bandwidth="1gbit"))
      'allreduce-local'
    """
    return f"{name}-{args.backend}" + (f"-{args.bandwidth}" if args.backend == "emulated" else "")


def write_result(out: pathlib.Path, tag: str, result: dict[str, Any]) -> pathlib.Path:
    """Writes `result` as ``<out>/<tag>.json`` (indented) and returns the path."""
    path = out / f"{tag}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def write_result_and_plot(
    out: pathlib.Path,
    tag: str,
    result: dict[str, Any],
    draw: Callable[[Any], None],
    *,
    figsize: tuple[float, float],
    **labels: Any,
) -> None:
    """Writes a benchmark's outputs and says which: ``<out>/<tag>.json`` (:func:`write_result`)
    and, when matplotlib is installed, the single-axes figure ``<out>/<tag>.png`` whose data
    ``draw(ax)`` adds (:func:`save_plot` labels and saves it).

    Args:
      out, tag, result: as for :func:`write_result`.
      draw: adds the data (with legend labels) to the axes.
      figsize: the figure's size in inches.
      **labels: :func:`save_plot`'s keywords (``xlabel``, ``ylabel``, ``title``,
        ``legend_size``, ``log``).

    Example:
      >>> write_result_and_plot(out, "t", {"rows": []}, lambda ax: ax.plot([1], label="a"),
      ...                       figsize=(7, 4.5), xlabel="n", ylabel="ms", title="t")  # doctest: +SKIP
    """
    json_path = write_result(out, tag, result)
    plt = pyplot()
    if plt is None:
        print(f"\nwrote {json_path}")
        return
    fig, ax = plt.subplots(figsize=figsize)
    draw(ax)
    png = save_plot(fig, ax, out / f"{tag}.png", **labels)
    print(f"\nwrote {json_path} and {png}")


def write_time_per_allreduce(
    out: pathlib.Path,
    tag: str,
    result: dict[str, Any],
    curves: dict[str, list[dict[str, Any]]],
    *,
    figsize: tuple[float, float],
    title: str,
) -> None:
    """:func:`write_result_and_plot` of a time-per-allreduce figure over message sizes (log
    axes): one curve per label, each row's median time in ms at its element count.

    Args:
      out, tag, result: as for :func:`write_result`.
      curves: label -> that curve's rows (``elements``, ``median_s``) in size order; a label
        without rows draws nothing.
      figsize: the figure's size in inches.
      title: the figure's title.

    Example:
      >>> rows = [{"elements": 1024, "median_s": 0.002}]
      >>> write_time_per_allreduce(out, "t", {"rows": rows}, {"psum": rows},
      ...                          figsize=(7, 4.5), title="t")  # doctest: +SKIP
    """

    def draw(ax: Any) -> None:
        for label, rows in curves.items():
            if rows:
                ms = [r["median_s"] * 1e3 for r in rows]
                ax.plot([r["elements"] for r in rows], ms, marker="o", label=label)

    write_result_and_plot(
        out,
        tag,
        result,
        draw,
        figsize=figsize,
        title=title,
        xlabel="float32 elements per rank",
        ylabel="median time per allreduce (ms)",
        log=True,
    )
