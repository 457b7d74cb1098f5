"""What a run directory holds, shared by every backend (the launcher and the Slurm job).

``RUN_DIR/run.json`` (:func:`run_description`), one directory per sweep entry with its
``spec.json`` (:func:`spec`, read by ``jaxcomm_launcher.worker``), each rank's
``rank<R>.status.json`` (:func:`failed_rank`, :func:`status_error`) and ``rank<R>.jsonl``
(:func:`progress`).
"""

from __future__ import annotations

import datetime
import json
import pathlib
from typing import Any

from jaxcomm_launcher.procs import Outcome
from jaxcomm_launcher.recipe import JaxcommSettings, Recipe


def default_run_dir(recipe: Recipe, base: pathlib.Path | None = None) -> pathlib.Path:
    """Returns ``runs/<recipe name>-<timestamp>`` (under `base`, default the cwd).

    Args:
        recipe: The recipe.
        base: Parent directory.

    Returns:
        A path that does not exist yet.

    Example:
        >>> default_run_dir(Recipe(name="x", job="smoke")).parent.name
        'runs'
    """
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = (base or pathlib.Path.cwd()) / "runs"
    path = root / f"{recipe.name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = root / f"{recipe.name}-{stamp}-{n}"
    return path


def run_description(recipe: Recipe) -> dict[str, Any]:
    """Returns the skeleton of ``run.json`` (variants are appended as they run).

    Args:
        recipe: The recipe.

    Returns:
        recipe name, backend, world, job, warm-up steps, start time, empty variant list.

    Example:
        >>> run_description(Recipe(name="x", job="smoke"))["backend"]
        'local'
    """
    return {
        "recipe": recipe.name,
        "backend": recipe.backend.kind,
        "world": recipe.world.model_dump(),
        "job": recipe.job_target(),
        "warmup_steps": recipe.metrics.warmup_steps,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "variants": [],
    }


def spec(recipe: Recipe, settings: JaxcommSettings, variant_dir: pathlib.Path) -> dict[str, Any]:
    """Returns the ``spec.json`` of one sweep entry: what every rank of it reads.

    Args:
        recipe: The recipe.
        settings: The entry's jaxcomm settings.
        variant_dir: The entry's directory.

    Returns:
        ``{"recipe", "jaxcomm", "job", "variant", "run_dir"}``.

    Example:
        >>> spec(Recipe(name="x", job="smoke"), JaxcommSettings(), pathlib.Path("/r/dense"))["variant"]
        'dense'
    """
    return {
        "recipe": recipe.model_dump(mode="json"),
        "jaxcomm": settings.model_dump(mode="json"),
        "job": recipe.job_target(),
        "variant": settings.display_label(),
        "run_dir": str(variant_dir.resolve()),
    }


def first_error_rank(variant_dir: pathlib.Path) -> int | None:
    """The rank whose error status file is the oldest (None when no rank wrote an error).

    The rank that raised first wrote the oldest error status; ranks that merely lost their
    peer fail a moment later.

    Example:
        >>> import tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "rank1.status.json").write_text('{"rank": 1, "ok": false}')
        >>> first_error_rank(d), first_error_rank(d / "missing")
        (1, None)
    """
    errors = []
    for path in variant_dir.glob("rank*.status.json"):
        try:
            status = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not status.get("ok"):
            errors.append((path.stat().st_mtime, int(status["rank"])))
    return min(errors)[1] if errors else None


def failed_rank(outcome: Outcome, variant_dir: pathlib.Path) -> int | None:
    """The rank whose failure ended an entry (None when no rank can be named)."""
    # A rank killed by a signal writes nothing, then the supervisor's first-exit observation
    # stands; otherwise the oldest error status (:func:`first_error_rank`).
    if outcome.failed_rank is not None and (
        (outcome.returncode or 0) < 0
        or not (variant_dir / f"rank{outcome.failed_rank}.status.json").exists()
    ):
        return outcome.failed_rank
    rank = first_error_rank(variant_dir)
    return outcome.failed_rank if rank is None else rank


def status_error(variant_dir: pathlib.Path, rank: int | None) -> str | None:
    """The error that ``rank`` wrote to its status file, if any."""
    if rank is None:
        return None
    path = variant_dir / f"rank{rank}.status.json"
    try:
        return json.loads(path.read_text()).get("error")
    except (OSError, json.JSONDecodeError):
        return None


def progress(variant_dir: pathlib.Path) -> str:
    """``", step S, loss L"`` of rank 0's latest record ("" before it has one)."""
    # Show rank 0's latest step while the run goes on (cheap: reads the file's tail).
    path = variant_dir / "rank0.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
        last = json.loads(lines[-1]) if lines else None
    except (OSError, json.JSONDecodeError, IndexError):
        return ""
    if not last:
        return ""
    loss = last.get("loss")
    return f", step {last['step']}" + (f", loss {loss:.4f}" if isinstance(loss, float) else "")
