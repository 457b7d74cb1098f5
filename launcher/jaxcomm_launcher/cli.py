"""The ``jaxcomm`` command: ``launch``, ``probe``, ``plan``, ``recipes``, ``report``, ``cleanup``,
``--version``, and shell completion (``jaxcomm --install-completion``).

Exit codes (:data:`EXIT_CODES`, shown by ``--help``): 0 success, 1 run failed (a rank failed, a
backend is unusable), 2 invalid recipe or usage, 124 timeout, 130 interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import types
from collections.abc import Iterator
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

from jaxcomm_launcher import __version__
from jaxcomm_launcher.jobs.args import ProbeArgs
from jaxcomm_launcher.recipe import Recipe, RecipeError, load_recipe

EXIT_CODES = (
    "Exit codes: 0 success; 1 the run failed (a rank failed, a backend is unusable); "
    "2 invalid recipe or usage; 124 timeout; 130 interrupted."
)
"""What every command may return; the epilog of ``--help``."""

app = typer.Typer(
    name="jaxcomm",
    help="Launch jaxcomm recipes on this machine, an emulated cluster, mpirun or Slurm.",
    epilog=EXIT_CODES,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Without a terminal (CI logs, pipes) Rich would wrap tables at 80 columns.
_width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "120"))
console = Console(width=_width)
err_console = Console(stderr=True, width=_width)


def complete_recipe(incomplete: str) -> list[str]:
    """Shell completion of a recipe: bundled names and YAML files that start with `incomplete`.

    Example:
        >>> "digits-dense" in complete_recipe("digits-")
        True
    """
    names = sorted(p.stem for p in bundled_recipes_dir().glob("*.yaml"))
    base = pathlib.Path(incomplete)
    folder = base if incomplete.endswith("/") else base.parent
    try:
        files = sorted(
            str(folder / p.name) if str(folder) != "." else p.name
            for p in folder.iterdir()
            if p.suffix in (".yaml", ".yml") or p.is_dir()
        )
    except OSError:
        files = []
    return [c for c in [*names, *files] if c.startswith(incomplete)]


# The arguments and options several commands take, each declared once.
RecipeArg = Annotated[
    str,
    typer.Argument(
        help="Recipe YAML file, or the name of a bundled one.", autocompletion=complete_recipe
    ),
]
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a recipe field: --set world.processes=4 (repeatable)."),
]
ProfilePath = Annotated[
    pathlib.Path | None,
    typer.Option(
        "--profile",
        help="Profile JSON from `jaxcomm probe` for the plan (default: built-in).",
    ),
]
RunProfile = Annotated[
    pathlib.Path | None,
    typer.Option(
        "--profile",
        help="Profile JSON from `jaxcomm probe` the run uses: the jaxcomm.profile of every "
        "entry (what `auto` reads), and the --dry-run plan's.",
    ),
]
# launch, probe: the commands that run a recipe.
RunTimeout = Annotated[
    float | None, typer.Option("--timeout", help="Seconds for the whole run.", min=0.001)
]
Quiet = Annotated[
    bool, typer.Option("--quiet", "-q", help="Do not echo rank logs (files still get them).")
]


@contextlib.contextmanager
def _exit_on_launch_errors() -> Iterator[None]:
    """Turns a backend or launch failure into one error line and the CLI's exit code."""
    from jaxcomm_launcher.backends import BackendError
    from jaxcomm_launcher.runner import LaunchFailed

    try:
        yield
    except BackendError as exc:
        _print_error(exc)
        raise typer.Exit(1) from None
    except LaunchFailed as exc:
        _print_error(exc)
        raise typer.Exit(exc.exit_code) from None


def _print_error(exc: BaseException | str) -> None:
    """Prints ``error: <message>`` (red label, message verbatim: never read as markup)."""
    err_console.print(Text("error: ", style="bold red") + Text(str(exc)), soft_wrap=True)


def bundled_recipes_dir() -> pathlib.Path:
    """Returns the directory of the recipes shipped with the package.

    Returns:
        ``jaxcomm_launcher/recipes`` inside the installed package.

    Example:
        >>> sorted(p.name for p in bundled_recipes_dir().glob("*.yaml"))[0]
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


@app.command(epilog=EXIT_CODES)
def launch(
    recipe: RecipeArg,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would run (the sbatch script for slurm).")
    ] = False,
    set_: Overrides = None,
    out: Annotated[
        pathlib.Path | None, typer.Option("--out", help="Run directory (default runs/NAME-TIME).")
    ] = None,
    timeout: RunTimeout = None,
    quiet: Quiet = False,
    detach: Annotated[
        bool,
        typer.Option("--detach", help="slurm: only submit the job (then: jaxcomm report RUN_DIR)."),
    ] = False,
    profile: RunProfile = None,
    max_restarts: Annotated[
        int | None,
        typer.Option(
            "--max-restarts",
            min=0,
            help="Relaunch the whole world up to N times after a rank fails, resuming from the "
            "newest checkpoint (the recipe's max_restarts; see train.checkpoint_every).",
        ),
    ] = None,
) -> None:
    """Run RECIPE: start its ranks, stream their logs, then write summary.json and plots.

    Example: jaxcomm launch recipes/digits-dense.yaml --set world.processes=4
    """
    from jaxcomm_launcher.backends import SlurmBackendRunner
    from jaxcomm_launcher.rundir import default_run_dir
    from jaxcomm_launcher.runner import run_recipe, run_slurm_recipe

    path = _resolve_recipe(recipe)
    try:
        overrides = list(set_ or [])
        if max_restarts is not None:
            overrides.append(f"max_restarts={max_restarts}")
        rec = load_recipe(path, overrides)
        if profile is not None:
            rec = with_profile(rec, profile)
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
    with _exit_on_launch_errors():
        if rec.backend.kind == "slurm":
            if dry_run:
                # The compute nodes read the run directory by its absolute path.
                script = SlurmBackendRunner(rec, run_dir.resolve()).render()
                typer.echo(script, nl=False)  # verbatim: no wrapping, no markup
                _echo_plan_comment(rec, profile)
                return
            run_slurm_recipe(rec, run_dir, console, timeout=timeout, quiet=quiet, detach=detach)
            return
        if dry_run:
            _echo_launch_table(rec, run_dir)
            _echo_plan_comment(rec, profile)
            return
        run_recipe(rec, run_dir, console, timeout=timeout, quiet=quiet)


def _echo_launch_table(rec: Recipe, run_dir: pathlib.Path) -> None:
    """``launch --dry-run`` of a supervised backend: the world, where its ranks run (cores,
    GPUs, shared GPUs), each entry's commands, restarts and faults."""
    from jaxcomm_launcher.backends import make_backend

    backend = make_backend(rec, run_dir)
    typer.echo(f"# recipe {rec.name}: {rec.backend.kind}, run dir {run_dir}")
    typer.echo(f"# world: {_world_words(rec)}")
    placement = backend.placement(dry_run=True)
    if placement is not None:
        typer.echo(f"# placement: {placement.describe()}")
    for settings in rec.variants():
        spec = run_dir / settings.display_label() / "spec.json"
        typer.echo(f"# {settings.display_label()}")
        for line in backend.describe(spec):
            typer.echo(line)
    if rec.max_restarts:
        typer.echo(f"# restarts: up to {rec.max_restarts}, from the newest checkpoint")
    for fault in rec.faults:
        when = f"at {fault.at_s:g} s" if fault.at_s is not None else f"at step {fault.at_step}"
        typer.echo(f"# fault {when}: {fault.describe()}")


def _world_words(recipe: Recipe) -> str:
    """``"4 processes × 1 GPU (2 per GPU)"``: the world of the launch table."""
    w = recipe.world
    unit = "GPU" if w.platform == "gpu" else "CPU device"
    text = f"{w.processes} processes × {w.devices_per_process} {unit}"
    text += "s" if w.devices_per_process != 1 else ""
    return text + (f" ({w.processes_per_gpu} per GPU)" if w.shares_gpus else "")


def with_profile(recipe: Recipe, profile: pathlib.Path) -> Recipe:
    """Returns `recipe` with every entry's ``jaxcomm.profile`` set to `profile` (``launch
    --profile``; it wins over a sweep entry's own).

    Args:
        recipe: The validated recipe.
        profile: A profile JSON from ``jaxcomm probe``.

    Returns:
        The new recipe; the path is absolute, as the ranks may run elsewhere.

    Raises:
        RecipeError: The file is not a profile (the message says why).

    Example:
        >>> with_profile(Recipe(name="x", job="digits"), pathlib.Path("p.json"))  # doctest: +SKIP
    """
    from jaxcomm import cost

    try:
        cost.Profile.load(profile)
    except (OSError, ValueError) as exc:
        raise RecipeError(f"--profile {profile}: {exc}") from None
    path = str(profile.resolve())
    data = recipe.model_dump(mode="json")
    data["jaxcomm"]["profile"] = path
    for entry in data["sweep"]:
        if entry.get("profile") is not None:
            entry["profile"] = path
    return Recipe.model_validate(data)


@app.command("recipes")
def list_recipes() -> None:
    """List the bundled recipes (use their name or path with `jaxcomm launch`)."""
    table = Table(title=f"bundled recipes ({bundled_recipes_dir()})")
    table.add_column("name")
    table.add_column("job")
    table.add_column("backend")
    table.add_column("processes", justify="right")
    table.add_column("platform")
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
            str((data.get("world") or {}).get("platform", "cpu")),
            str(data.get("description", "")).strip(),
        )
    console.print(table)


@app.command(epilog=EXIT_CODES)
def report(
    run_dir: Annotated[pathlib.Path, typer.Argument(help="A run directory made by `launch`.")],
) -> None:
    """Re-read RUN_DIR's metrics: rewrite summary.json, redraw the PNGs, print the table.

    For a slurm run (also a detached one) the entries' statuses are first read from the
    files the job wrote, and the job's state from Slurm.
    """
    from jaxcomm_launcher import results

    try:
        run = results.read_run(run_dir)
        if run.get("backend") == "slurm":
            from jaxcomm_launcher.backends.slurm import collect

            slurm = collect(run_dir).get("slurm", {})
            if slurm.get("state"):
                console.print(f"slurm job {slurm.get('job_id')}: {slurm['state']}", highlight=False)
        summary = results.write_summary(run_dir)
    except FileNotFoundError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    plots = results.draw_plots(run_dir)
    results.print_table(summary, console)
    for p in plots:
        console.print(f"plot: {p}", highlight=False, soft_wrap=True)


@app.command("cleanup", epilog=EXIT_CODES)
def cleanup_command(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only list what would be removed.")
    ] = False,
) -> None:
    """Remove what a killed launcher left behind: emulated-cluster namespaces, links, processes.

    Runs of a launcher that is still alive, and runs with a process inside, are never touched.
    Every emulated launch first removes the runs whose recorded launcher died.
    Example: sudo jaxcomm cleanup --dry-run
    """
    from jaxcomm_launcher import cleanup

    removed = cleanup.sweep(dry_run=dry_run, unowned=True)
    verb = "would remove" if dry_run else "removed"
    for line in removed:
        console.print(f"{verb} {line}", highlight=False, markup=False)
    if not removed:
        console.print("nothing to clean up", highlight=False)


# ---------------------------------------------------------------------------------------------
# probe and plan: the cost model (jaxcomm/cost/)


def _digits_parameters(model: str, hidden: int) -> int:
    # jaxcomm/examples/digits.py's models (tests/test_cost.py checks these against Flax):
    # MLP 64 -> hidden -> 10; CNN conv 3x3 1->16, conv 3x3 stride 2 16->hidden (8x8 -> 4x4),
    # dense 4*4*hidden -> 10.
    if model == "cnn":
        return (9 * 16 + 16) + (9 * 16 * hidden + hidden) + (16 * hidden * 10 + 10)
    return 64 * hidden + hidden + hidden * 10 + 10


def gradient_sizes(recipe: Recipe, elements: list[int] | None = None) -> tuple[list[int], str]:
    """The gradient sizes a recipe reduces per step, in float32 elements per rank.

    Args:
        recipe: The recipe.
        elements: Explicit sizes (``--elements``), which win.

    Returns:
        ``(sizes, where they came from)``: the allreduce job's ``args.sizes`` (one call per
        size), or the digits model's parameter count (one bucket).

    Raises:
        RecipeError: The job's gradient size is unknown (a custom job without ``--elements``).

    Example:
        >>> gradient_sizes(Recipe(name="x", job="digits"))
        ([4810], 'digits mlp parameters (hidden 64)')
    """
    if elements:
        return [int(e) for e in elements], "--elements"
    if recipe.job == "allreduce":
        if "sizes" in recipe.args:
            return [int(s) for s in recipe.args["sizes"]], "args.sizes"
        from jaxcomm_launcher.jobs.args import ALLREDUCE_SIZES

        return list(ALLREDUCE_SIZES), "the allreduce job's default sizes"
    if recipe.job == "digits":
        model = str(recipe.args.get("model", "mlp"))
        hidden = int(recipe.args.get("hidden", recipe.train.hidden))
        return [_digits_parameters(model, hidden)], f"digits {model} parameters (hidden {hidden})"
    raise RecipeError(
        f"the gradient size of job {recipe.job!r} is unknown: pass --elements N (float32 "
        "elements per rank, repeatable)"
    )


def _inter_process(recipe: Recipe) -> str:
    kind = recipe.backend.kind
    if kind == "emulated":
        return "across_hosts"
    if kind == "mpirun" and len(set(recipe.backend.hosts)) > 1:
        return "across_hosts"
    if kind == "slurm" and recipe.backend.nodes > 1:
        return "across_hosts"
    return "same_host"


def _options(cost: types.ModuleType, recipe: Recipe) -> Any:
    # The allreduce job reads every algorithm setting from args (each missing one keeps its
    # declared default); the training jobs read density from the jaxcomm settings.
    if recipe.job == "allreduce":
        return cost.Options.from_args(recipe.args)
    return cost.Options.from_args(recipe.args, density=recipe.jaxcomm.density)


def recipe_plan(
    recipe: Recipe,
    profile_path: pathlib.Path | None = None,
    elements: list[int] | None = None,
    allowed: list[str] | None = None,
    overlap_seconds: float | None = None,
) -> tuple[dict[str, Any], str, Any]:
    """Predicts every algorithm for a recipe's world and gradient (``jaxcomm plan``).

    Args:
        recipe: The recipe.
        profile_path: A profile from ``jaxcomm probe`` (None: the built-in default).
        elements: Explicit gradient sizes.
        allowed: Algorithms the pick may be (None: all but the leaf-shaped powersgd, see
            jaxcomm.cost.plan).
        overlap_seconds: Overlap on: communication hides behind this much compute per call
            (None: overlap off).

    Returns:
        ``(plan, where the sizes came from, profile)``; ``plan`` is ``jaxcomm.cost.plan``'s
        ``{"pick": ..., "predictions": [...]}``.

    Raises:
        RecipeError: Unknown gradient size, unreadable profile or unknown algorithm names.

    Example:
        >>> plan, _, _ = recipe_plan(Recipe(name="x", job="digits"))
        >>> plan["pick"]["algorithm"]  # doctest: +SKIP
        'dense'
    """
    from jaxcomm import cost

    sizes, source = gradient_sizes(recipe, elements)
    try:
        profile = cost.Profile.load(profile_path) if profile_path else cost.DEFAULT_PROFILE
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    if allowed is None and recipe.world.shares_gpus:
        # XLA's psum cannot run where ranks share a GPU: the pick is one of auto's choices.
        allowed = list(cost.AUTO_CHOICES)
    if allowed:
        unknown = sorted(set(allowed) - set(cost.ALGORITHMS))
        if unknown:
            raise RecipeError(f"--allowed: unknown {unknown}; known: {', '.join(cost.ALGORITHMS)}")
    world = cost.World(
        recipe.world.processes, recipe.world.devices_per_process, _inter_process(recipe)
    )
    try:
        result = cost.plan(
            sizes,
            world,
            profile,
            _options(cost, recipe),
            allowed=allowed,
            overlap=overlap_seconds is not None,
            hidden_seconds=overlap_seconds or 0.0,
        )
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    return result, source, profile


def _plan_lines(recipe: Recipe, result: dict[str, Any], source: str, profile: Any) -> list[str]:
    w = recipe.world
    lines = [
        f"plan for {recipe.name}: {w.processes} processes x {w.devices_per_process} devices "
        f"({_inter_process(recipe)} between processes); gradient: {source}",
        f"profile: {profile.source}",
        f"{'algorithm':18s} {'elements':>11s} {'bytes sent/rank':>16s} {'predicted':>12s}",
    ]
    for row in result["predictions"]:
        lines.append(
            f"{row['algorithm']:18s} {row['elements']:>11d} {row['bytes_sent_per_rank']:>16.0f} "
            f"{row['seconds'] * 1e3:>9.3f} ms"
        )
    pick = result["pick"]
    lines.append(
        f"pick: {pick['algorithm']} ({pick['seconds'] * 1e3:.3f} ms and "
        f"{pick['bytes_sent_per_rank']:.0f} bytes per rank for {pick['elements']} elements)"
    )
    return lines


def _echo_plan_comment(recipe: Recipe, profile: pathlib.Path | None) -> None:
    # --dry-run: the same plan as `jaxcomm plan`, as comment lines after what would run.
    try:
        result, source, prof = recipe_plan(recipe, profile)
    except RecipeError as exc:
        typer.echo(f"# plan: {exc}")
        return
    for line in _plan_lines(recipe, result, source, prof):
        typer.echo(f"# {line}")


@app.command(epilog=EXIT_CODES)
def plan(
    recipe: RecipeArg,
    profile: ProfilePath = None,
    json_: Annotated[
        bool, typer.Option("--json", help="Print {pick, predictions} as JSON.")
    ] = False,
    set_: Overrides = None,
    elements: Annotated[
        list[int] | None,
        typer.Option("--elements", help="Gradient size in float32 elements (repeatable).", min=1),
    ] = None,
    allowed: Annotated[
        str | None,
        typer.Option("--allowed", help="Comma-separated algorithms the pick may be."),
    ] = None,
    overlap_ms: Annotated[
        float | None,
        typer.Option(
            "--overlap-ms",
            help="Overlap on: communication hides behind this much backward compute per call.",
            min=0.0,
        ),
    ] = None,
) -> None:
    """Predict each algorithm's bytes and seconds per step for RECIPE, and pick the fastest.

    Example: jaxcomm probe recipes/emulated-1gbit.yaml --out p.json; jaxcomm plan
    recipes/emulated-1gbit.yaml --profile p.json
    """
    try:
        rec = load_recipe(_resolve_recipe(recipe), set_ or [], light=True)
        names = [a.strip() for a in allowed.split(",") if a.strip()] if allowed else None
        hidden = None if overlap_ms is None else overlap_ms / 1e3
        result, source, prof = recipe_plan(rec, profile, elements, names, hidden)
    except RecipeError as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    if json_:
        keys = ("algorithm", "elements", "processes", "devices_per_process")
        out = {
            "pick": result["pick"],
            "predictions": [
                {
                    **{k: r[k] for k in keys},
                    "bytes_sent_per_rank": r["bytes_sent_per_rank"],
                    "seconds": r["seconds"],
                }
                for r in result["predictions"]
            ],
        }
        typer.echo(json.dumps(out, indent=2))
        return
    for line in _plan_lines(rec, result, source, prof):
        typer.echo(line)


def _probe_recipe(rec: Recipe, args: dict[str, Any]) -> Recipe:
    """`rec`'s world and backend running the probe job with `args` (``jaxcomm probe``)."""
    data = rec.model_dump(mode="json")
    data.update(
        name=f"{rec.name}-probe",
        job="probe",
        sweep=[],
        jaxcomm={"label": "probe"},
        args=args,
        metrics={**data["metrics"], "plots": False},
    )
    return Recipe.model_validate(data)


_PROBE = ProbeArgs().model_dump()  # the defaults `jaxcomm probe --help` shows


@app.command(epilog=EXIT_CODES)
def probe(
    recipe: RecipeArg,
    out: Annotated[
        pathlib.Path, typer.Option("--out", help="Where to write the profile JSON.")
    ] = pathlib.Path("profile.json"),
    set_: Overrides = None,
    # The measurement's settings default to the probe job's (jobs/args.py, ProbeArgs).
    repeats: Annotated[
        int | None,
        typer.Option(
            "--repeats", help=f"Timed calls per point (default {_PROBE['repeats']}).", min=1
        ),
    ] = None,
    sizes: Annotated[
        list[int] | None,
        typer.Option(
            "--sizes",
            min=1,
            help="Ring/psum sizes in elements (repeatable) "
            f"(default {' '.join(map(str, _PROBE['sizes']))}).",
        ),
    ] = None,
    kernel_elements: Annotated[
        int | None,
        typer.Option(
            "--kernel-elements",
            min=64,
            help=f"Elements per kernel timing (default {_PROBE['kernel_elements']}).",
        ),
    ] = None,
    run_dir: Annotated[
        pathlib.Path | None, typer.Option("--run-dir", help="Run directory (default runs/...).")
    ] = None,
    timeout: RunTimeout = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would run.")] = False,
    quiet: Quiet = False,
) -> None:
    """Measure the cost model (alpha, beta per link class, gamma per kernel) on RECIPE's world.

    Runs the library's measurement (jaxcomm.cost.probe_world) as the `probe` job with the
    recipe's world and backend (local, emulated, mpirun; slurm submits it, and the job writes
    --out when it runs) and writes the profile that `jaxcomm plan --profile` and
    `algorithm="auto"` read.

    Example: jaxcomm probe recipes/digits-dense.yaml --out profile.json
    """
    from jaxcomm_launcher.backends import SlurmBackendRunner, make_backend
    from jaxcomm_launcher.rundir import default_run_dir
    from jaxcomm_launcher.runner import run_recipe

    out = out.resolve()
    # The ranks write the new profile beside the old one, which it replaces only once the
    # probe succeeded (a Slurm job's probe replaces it itself, atomically, when it has run).
    fresh = out.with_name(f".{out.name}.{os.getpid()}.new")
    try:
        rec = load_recipe(_resolve_recipe(recipe), set_ or [])
        given = {"repeats": repeats, "kernel_elements": kernel_elements, "sizes": sizes or None}
        args: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        args["out"] = str(out if rec.backend.kind == "slurm" else fresh)
        probe_recipe = _probe_recipe(rec, args)
    except (RecipeError, ValueError) as exc:
        _print_error(exc)
        raise typer.Exit(2) from None
    target = run_dir or default_run_dir(probe_recipe)
    with _exit_on_launch_errors():
        if probe_recipe.backend.kind == "slurm":
            slurm = SlurmBackendRunner(probe_recipe, target)
            if dry_run:
                typer.echo(slurm.render(), nl=False)
                return
            slurm.submit(console)
            console.print(f"the probe job writes {out} when it has run", highlight=False)
            return
        if dry_run:
            backend = make_backend(probe_recipe, target)
            typer.echo(f"# probe of {rec.name}: {probe_recipe.backend.kind}, run dir {target}")
            for line in backend.describe(target / "probe" / "spec.json"):
                typer.echo(line)
            return
        try:
            run_recipe(probe_recipe, target, console, timeout=timeout, quiet=quiet)
            if not fresh.exists():
                _print_error(f"the probe ran but wrote no profile; {out} is unchanged")
                raise typer.Exit(1)
            os.replace(fresh, out)
        finally:
            fresh.unlink(missing_ok=True)
    console.print(f"profile: {out}", highlight=False, soft_wrap=True)


if __name__ == "__main__":
    app()
