"""Runs a recipe end to end: run directory, one supervised launch per sweep entry, results."""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import time
from collections.abc import Iterable, Iterator, Mapping
from types import FrameType
from typing import Any

from rich.console import Console

from jaxcomm_launcher import faults, results, rundir
from jaxcomm_launcher.backends import BackendError, make_backend
from jaxcomm_launcher.backends.slurm import SlurmBackendRunner, collect
from jaxcomm_launcher.procs import Interrupted, Outcome, Supervisor
from jaxcomm_launcher.recipe import Recipe


class LaunchFailed(Exception):
    """The run did not succeed; ``exit_code`` is what the CLI should return."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Inside the block SIGTERM raises :class:`Interrupted` (so the ranks are stopped and the
    run is saved, as for Ctrl-C); the previous handler comes back on leaving it."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted()

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. embedded use): Ctrl-C handling only
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def run_recipe(
    recipe: Recipe,
    run_dir: pathlib.Path,
    console: Console,
    timeout: float | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Runs every jaxcomm setting of `recipe` and writes summary, table and plots.

    Args:
        recipe: The validated recipe (backend local, emulated or mpirun; slurm recipes go
            through :func:`run_slurm_recipe`).
        run_dir: Output directory (created).
        console: For logs, warnings and the table.
        timeout: Seconds for the whole run (overrides ``recipe.timeout``).
        quiet: Do not echo rank logs (they are still written to files).

    Returns:
        The summary (also in ``run_dir/summary.json``).

    Raises:
        LaunchFailed: A rank failed, the run timed out or was interrupted; the message names
            the rank and shows its last log lines.

    Example:
        >>> run_recipe(load_recipe("recipes/digits-dense.yaml"), pathlib.Path("runs/a"), Console())  # doctest: +SKIP
    """
    timeout = timeout if timeout is not None else recipe.timeout
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.json").write_text(json.dumps(recipe.model_dump(mode="json"), indent=2))
    run = rundir.run_description(recipe)

    def save_run() -> None:
        (run_dir / "run.json").write_text(json.dumps(run, indent=2) + "\n")

    variants = recipe.variants()
    deadline = None if timeout is None else time.monotonic() + timeout
    failure: LaunchFailed | None = None
    try:
        with _sigterm_interrupts(), make_backend(recipe, run_dir) as backend:
            placement = backend.placement()
            run["placement"] = None if placement is None else placement.to_json()
            if placement is not None and (placement.oversubscribed or placement.gpus):
                console.print(f"[yellow]{placement.describe()}[/]")
            for settings in variants:
                label = settings.display_label()
                entry: dict[str, Any] = {"label": label, "jaxcomm": settings.model_dump()}
                run["variants"].append(entry)
                variant_dir = run_dir / label
                variant_dir.mkdir(exist_ok=True)
                spec_path = variant_dir / "spec.json"
                spec_path.write_text(
                    json.dumps(rundir.spec(recipe, settings, variant_dir), indent=2)
                )
                console.rule(
                    f"[bold]{recipe.name}[/] · {label} · {recipe.backend.kind} · "
                    f"{recipe.world.processes} processes"
                )
                t0 = time.monotonic()
                outcome, tails = _run_entry(
                    recipe, backend, spec_path, variant_dir, label, entry, console, quiet, deadline
                )
                entry["wall_s"] = round(time.monotonic() - t0, 2)
                if outcome.ok:
                    entry["status"] = "ok"
                    save_run()
                    continue
                failure = _failure(outcome, variant_dir, label, tails)
                entry.update(
                    status=outcome.reason,
                    reason=str(failure).splitlines()[0],
                    failed_rank=rundir.failed_rank(outcome, variant_dir),
                )
                save_run()
                break
    except Interrupted:
        failure = LaunchFailed("interrupted (SIGTERM): every rank was stopped", exit_code=130)
    finally:
        save_run()
    return _finish(recipe, run_dir, console, failure)


def _run_entry(
    recipe: Recipe,
    backend: Any,
    spec_path: pathlib.Path,
    variant_dir: pathlib.Path,
    label: str,
    entry: dict[str, Any],
    console: Console,
    quiet: bool,
    deadline: float | None,
) -> tuple[Outcome, Mapping[int | None, Iterable[str]]]:
    """Runs one sweep entry: its attempts (a failed one is relaunched, the whole world, up
    to ``recipe.max_restarts`` times) under the recipe's faults; records restarts and faults
    in `entry` (run.json, then summary.json) and every event in ``timeline.jsonl``."""
    timeline = faults.Timeline(variant_dir / "timeline.jsonl")
    injector = (
        faults.FaultInjector(recipe, backend, variant_dir, timeline) if recipe.faults else None
    )
    restarts = _prepare_entry(recipe, entry, console, injector)
    attempt = 0
    try:
        if injector is not None:
            try:
                injector.prepare()
            except faults.FaultError as exc:
                raise BackendError(str(exc)) from None
        while True:
            outcome, sup = _attempt(
                backend,
                injector,
                spec_path,
                variant_dir,
                label,
                console,
                quiet,
                deadline,
                timeline,
                attempt,
            )
            if outcome.ok:
                timeline.event("attempt_ok", attempt=attempt)
                return outcome, sup.tails
            rank = rundir.failed_rank(outcome, variant_dir)
            error = rundir.status_error(variant_dir, rank)
            cause = f"rank {rank}: {error}" if error else outcome.detail
            timeline.event(
                "attempt_failed",
                at=outcome.detected_at,
                attempt=attempt,
                reason=outcome.reason,
                failed_rank=rank,
                cause=cause,
            )
            if outcome.reason != "failed" or attempt >= recipe.max_restarts:
                return outcome, sup.tails
            record = _restart(recipe, variant_dir, timeline, outcome, attempt, rank, cause)
            restarts.append(record)
            if injector is not None:
                injector.watch_resume(record["resumed_from"])
            console.print(
                f"[bold yellow]restart {attempt + 1}/{recipe.max_restarts}[/]: {cause}; "
                f"every rank was stopped, relaunching from step {record['resumed_from']} "
                f"({record['steps_lost']} steps lost)",
                highlight=False,
            )
            attempt += 1
    finally:
        if injector is not None:
            injector.close()


def _prepare_entry(
    recipe: Recipe,
    entry: dict[str, Any],
    console: Console,
    injector: faults.FaultInjector | None,
) -> list[dict[str, Any]]:
    """Gives `entry` its ``restarts`` (when restarts are allowed) and ``faults`` lists, warns
    when restarts would start from step 0, and returns the restarts list to fill."""
    restarts: list[dict[str, Any]] = []
    if recipe.max_restarts:
        entry["restarts"] = restarts
        if not recipe.train.checkpoint_every:
            console.print(
                "[yellow]warning[/]: max_restarts is set but train.checkpoint_every is 0: "
                "a restarted run starts again from step 0",
                highlight=False,
            )
    if recipe.faults:
        entry["faults"] = injector.applied if injector else []
    return restarts


def _attempt(
    backend: Any,
    injector: faults.FaultInjector | None,
    spec_path: pathlib.Path,
    variant_dir: pathlib.Path,
    label: str,
    console: Console,
    quiet: bool,
    deadline: float | None,
    timeline: faults.Timeline,
    attempt: int,
) -> tuple[Outcome, Supervisor]:
    """Starts the ranks of one attempt under a new supervisor and waits for them, showing the
    entry's progress; returns how the attempt ended and its (closed) supervisor."""
    sup = Supervisor(console, variant_dir, quiet=quiet)
    backend.attempt = attempt  # emulated: a coordinator port per attempt
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    timeline.event("attempt_start", attempt=attempt)
    try:
        backend.start(sup, spec_path)
        if injector is not None:
            injector.attach(sup)
        status_line = console.status(f"{label}: running")
        with status_line:
            outcome = sup.wait(
                remaining,
                on_tick=lambda s: status_line.update(
                    f"{label}: running {s:.0f} s{rundir.progress(variant_dir)}"
                ),
            )
    finally:
        if injector is not None:
            injector.detach()
        sup.close()
    return outcome, sup


def _restart(
    recipe: Recipe,
    variant_dir: pathlib.Path,
    timeline: faults.Timeline,
    outcome: Outcome,
    attempt: int,
    rank: int | None,
    cause: str,
) -> dict[str, Any]:
    """Records the restart after failed attempt `attempt` (``restarts.jsonl``, the timeline)
    and returns its record: the step it resumes from and the steps lost."""
    ckpt_dir = pathlib.Path(str(recipe.args.get("checkpoint_dir") or variant_dir / "checkpoints"))
    record = faults.record_restart(
        variant_dir,
        attempt + 1,
        recipe.world.processes,
        cause,
        ckpt_dir,
        failed_rank=rank,
        t=round((outcome.detected_at or time.monotonic()) - timeline.t0, 3),
    )
    timeline.event("restart", **record)
    return record


def _finish(
    recipe: Recipe, run_dir: pathlib.Path, console: Console, failure: LaunchFailed | None
) -> dict[str, Any]:
    # Every backend ends the same way: summary.json, plots, the table, then the verdict.
    summary = results.write_summary(run_dir)
    if recipe.metrics.plots:
        results.draw_plots(run_dir)
    results.print_table(summary, console)
    if failure is not None:
        raise failure
    console.print(f"[bold green]done[/]: results in {run_dir}")
    return summary


def run_slurm_recipe(
    recipe: Recipe,
    run_dir: pathlib.Path,
    console: Console,
    timeout: float | None = None,
    quiet: bool = False,
    detach: bool = False,
) -> dict[str, Any] | None:
    """Submits a slurm recipe, follows the job, then writes summary, table and plots.

    Args:
        recipe: The validated recipe (``backend.kind == "slurm"``).
        run_dir: Output directory, on a filesystem the compute nodes share (created).
        console: For the job state, rank logs, warnings and the table.
        timeout: Seconds after submission before the job is cancelled (overrides
            ``recipe.timeout``; queue time counts).
        quiet: Do not echo rank logs (srun still writes them to ``rank<R>.log``).
        detach: Only submit; ``jaxcomm report RUN_DIR`` reads the results later.

    Returns:
        The summary (also in ``run_dir/summary.json``), None when detached.

    Raises:
        LaunchFailed: A step failed (the message names the rank and its node), the job
            failed, timed out (it was cancelled) or the launcher was interrupted (ditto).
        BackendError: ``sbatch`` is missing or refused the job.

    Example:
        >>> run_slurm_recipe(load_recipe("recipes/digits-dense.yaml", ["backend.kind=slurm"]),
        ...                  pathlib.Path("runs/s"), Console())  # doctest: +SKIP
    """
    timeout = timeout if timeout is not None else recipe.timeout
    backend = SlurmBackendRunner(recipe, run_dir.resolve())
    job_id = backend.submit(console)
    if detach:
        console.print(
            f"detached: follow it with squeue -j {job_id}; results: jaxcomm report {run_dir}",
            highlight=False,
        )
        return None
    with _sigterm_interrupts():
        outcome, state = backend.follow(job_id, console, timeout=timeout, quiet=quiet)
    run = collect(
        run_dir, state, cancelled=None if outcome.reason in ("ok", "failed") else outcome.reason
    )
    failure = None
    if outcome.reason == "interrupted":
        failure = LaunchFailed(
            f"interrupted: slurm job {job_id} was cancelled (scancel)", exit_code=130
        )
    elif outcome.reason == "timeout":
        failure = LaunchFailed(
            f"{outcome.detail}: slurm job {job_id} was cancelled (scancel)", exit_code=124
        )
    else:
        failed = [v for v in run["variants"] if v.get("status") == "failed"]
        if failed:
            v = failed[0]
            vdir = run_dir / v["label"]
            rank = v.get("failed_rank")
            failure = _failure(
                Outcome(False, "failed", rank, detail=v["detail"]),
                vdir,
                v["label"],
                {rank: _file_tail(vdir / f"rank{rank}.log"), None: _file_tail(vdir / "srun.log")},
                node=v.get("failed_node"),
            )
        elif outcome.ok and any(v.get("status") != "ok" for v in run["variants"]):
            # The job ended well, yet an entry has no record of its step (it never started).
            missing = [
                f"{v['label']} ({v.get('status')})"
                for v in run["variants"]
                if v.get("status") != "ok"
            ]
            failure = LaunchFailed(
                f"slurm job {job_id} completed, but not every entry ran: {', '.join(missing)}",
                exit_code=1,
            )
        elif not outcome.ok:
            tail = "\n".join("    " + t for t in _file_tail(run_dir / f"slurm-{job_id}.out"))
            failure = LaunchFailed(
                f"{outcome.detail} (exit {state.exit_code if state else '?'})"
                + (f"; last lines of {run_dir}/slurm-{job_id}.out:\n{tail}" if tail else ""),
                exit_code=1,
            )
    return _finish(recipe, run_dir, console, failure)


def _file_tail(path: pathlib.Path, n: int = 40) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _failure(
    outcome: Outcome,
    variant_dir: pathlib.Path,
    label: str,
    tails: Mapping[int | None, Iterable[str]],
    node: str | None = None,
) -> LaunchFailed:
    if outcome.reason == "interrupted":
        return LaunchFailed(f"{label}: interrupted; every rank was stopped", exit_code=130)
    if outcome.reason == "timeout":
        return LaunchFailed(f"{label}: {outcome.detail}; every rank was stopped", exit_code=124)
    rank = rundir.failed_rank(outcome, variant_dir)
    error = rundir.status_error(variant_dir, rank)
    who = f"rank {rank}" if rank is not None else "a rank"
    where = f" on node {node}" if node else ""
    how = outcome.detail if rank == outcome.failed_rank else f"it raised first; {outcome.detail}"
    lines = [f"{label}: {who}{where} failed ({how}); the other ranks were stopped."]
    if error:
        lines.append(f"  error: {error}")
    tail = list(tails.get(rank, [])) or list(tails.get(None, []))
    if tail:
        log = variant_dir / f"rank{rank}.log" if rank is not None else variant_dir
        lines.append(f"  last lines of {who} (full log: {log}):")
        lines.extend("    " + t for t in tail[-15:])
    return LaunchFailed("\n".join(lines), exit_code=1)
