"""The ``jaxcomm`` command: ``launch``, ``recipes``, ``report``, ``cleanup``, ``--version``.

Exit codes: 0 success, 1 run failed (a rank failed, a backend is unusable), 2 invalid recipe
or usage, 124 timeout, 130 interrupted.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

from jaxcomm_launcher import __version__
from jaxcomm_launcher.recipe import RecipeError, load_recipe

app = typer.Typer(
    name="jaxcomm",
    help="Launch jaxcomm recipes on this machine, an emulated cluster, mpirun or Slurm.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Without a terminal (CI logs, pipes) Rich would wrap tables at 80 columns.
_width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "120"))
console = Console(width=_width)
err_console = Console(stderr=True, width=_width)


def _print_error(exc: BaseException | str) -> None:
    """Prints ``error: <message>`` (red label, message verbatim: never read as markup)."""
    err_console.print(Text("error: ", style="bold red") + Text(str(exc)), soft_wrap=True)


def bundled_recipes_dir() -> pathlib.Path:
    """Returns the directory of the recipes shipped with the package.

    Returns:
        ``jaxcomm_launcher/recipes`` inside the installed package.

    Example:
        >>> sorted(p.name for p in bundled_recipes_dir().glob("*.yaml"))[0]  # doctest: +SKIP
        'allreduce-sweep.yaml'
    """
    installed = pathlib.Path(__file__).with_name("recipes")
    if installed.is_dir():
        return installed
    # Running from a source checkout (PYTHONPATH=launcher): the repository's recipes/.
    return pathlib.Path(__file__).resolve().parents[2] / "recipes"


def _resolve_recipe(recipe: str) -> pathlib.Path:
    # A path wins; a bare name (digits-dense or digits-dense.yaml) finds a bundled recipe.
    path = pathlib.Path(recipe)
    if path.exists():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else path.name + ".yaml"
    bundled = bundled_recipes_dir() / name
    return bundled if bundled.exists() else path


def _version(value: bool) -> None:
    if value:
        console.print(f"jaxcomm {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """jaxcomm: communication-efficient collectives for data-parallel JAX training."""


@app.command()
def launch(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML file, or the name of a bundled one.")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would run (the sbatch script for slurm).")
    ] = False,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override a recipe field: --set world.processes=4 (repeatable)."
        ),
    ] = None,
    out: Annotated[
        pathlib.Path | None, typer.Option("--out", help="Run directory (default runs/NAME-TIME).")
    ] = None,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Seconds for the whole run.", min=0.001)
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Do not echo rank logs (files still get them).")
    ] = False,
    detach: Annotated[
        bool,
        typer.Option("--detach", help="slurm: only submit the job (then: jaxcomm report RUN_DIR)."),
    ] = False,
) -> None:
    """Run RECIPE: start its ranks, stream their logs, then write summary.json and plots.

    Example: jaxcomm launch recipes/digits-dense.yaml --set world.processes=4
    """
    from jaxcomm_launcher.backends import BackendError, make_backend
    from jaxcomm_launcher.runner import (
        LaunchFailed,
        default_run_dir,
        run_recipe,
        run_slurm_recipe,
    )

    path = _resolve_recipe(recipe)
    try:
        rec = load_recipe(path, set_ or [])
    except RecipeError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    run_dir = out or default_run_dir(rec)
    if detach and rec.backend.kind != "slurm":
        _print_error(
            f"--detach needs backend slurm (this recipe: {rec.backend.kind}); "
            "add --set backend.kind=slurm"
        )
        raise typer.Exit(2)
    try:
        if rec.backend.kind == "slurm":
            if dry_run:
                # The compute nodes read the run directory by its absolute path.
                backend = make_backend(rec, run_dir.resolve())
                typer.echo(backend.render(), nl=False)  # verbatim: no wrapping, no markup
                return
            run_slurm_recipe(rec, run_dir, console, timeout=timeout, quiet=quiet, detach=detach)
            return
        if dry_run:
            backend = make_backend(rec, run_dir)
            typer.echo(f"# recipe {rec.name}: {rec.backend.kind}, run dir {run_dir}")
            for settings in rec.variants():
                spec = run_dir / settings.display_label() / "spec.json"
                typer.echo(f"# {settings.display_label()}")
                for line in backend.describe(spec):
                    typer.echo(line)
            return
        run_recipe(rec, run_dir, console, timeout=timeout, quiet=quiet)
    except BackendError as exc:
        _print_error(exc)
        raise typer.Exit(1) from None
    except LaunchFailed as exc:
        _print_error(exc)
        raise typer.Exit(exc.exit_code) from None


@app.command("recipes")
def list_recipes() -> None:
    """List the bundled recipes (use their name or path with `jaxcomm launch`)."""
    table = Table(title=f"bundled recipes ({bundled_recipes_dir()})")
    table.add_column("name")
    table.add_column("job")
    table.add_column("backend")
    table.add_column("processes", justify="right")
    table.add_column("description")
    for path in sorted(bundled_recipes_dir().glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        backend = data.get("backend", "local")
        kind = backend.get("kind", "local") if isinstance(backend, dict) else backend
        table.add_row(
            path.stem,
            str(data.get("job", "?")),
            str(kind),
            str((data.get("world") or {}).get("processes", 2)),
            str(data.get("description", "")).strip(),
        )
    console.print(table)


@app.command()
def report(
    run_dir: Annotated[pathlib.Path, typer.Argument(help="A run directory made by `launch`.")],
) -> None:
    """Re-read RUN_DIR's metrics: rewrite summary.json, redraw the PNGs, print the table.

    For a slurm run (also a detached one) the entries' statuses are first read from the
    files the job wrote, and the job's state from Slurm.
    """
    from jaxcomm_launcher import metrics

    try:
        run = metrics.read_run(run_dir)
        if run.get("backend") == "slurm":
            from jaxcomm_launcher.backends.slurm import collect

            slurm = collect(run_dir).get("slurm", {})
            if slurm.get("state"):
                console.print(f"slurm job {slurm.get('job_id')}: {slurm['state']}", highlight=False)
        summary = metrics.write_summary(run_dir)
    except FileNotFoundError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    plots = metrics.draw_plots(run_dir)
    metrics.print_table(summary, console)
    for p in plots:
        console.print(f"plot: {p}", highlight=False, soft_wrap=True)


@app.command("cleanup")
def cleanup_command(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only list what would be removed.")
    ] = False,
) -> None:
    """Remove what a killed launcher left behind: emulated-cluster namespaces, links, processes.

    Runs of a launcher that is still alive are never touched. Every emulated launch also does
    this first. Example: sudo jaxcomm cleanup --dry-run
    """
    from jaxcomm_launcher import cleanup

    removed = cleanup.sweep(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for line in removed:
        console.print(f"{verb} {line}", highlight=False, markup=False)
    if not removed:
        console.print("nothing to clean up", highlight=False)


if __name__ == "__main__":
    app()
