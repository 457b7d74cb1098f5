"""What a job sees inside each rank: :class:`JobContext` and its :class:`MetricsLogger`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import Any, TextIO

from jaxcomm_launcher.recipe import JaxcommSettings, Recipe, Train


def _jsonable(value: Any) -> Any:
    # NumPy/JAX scalars and non-finite floats must not break a JSON line.
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends one JSON object per call to ``rank<R>.jsonl`` in the run directory.

    Every line carries ``rank``, ``variant`` and wall-clock ``time`` besides the job's fields;
    lines are flushed at once so a rank that crashes still leaves its metrics behind.

    Args:
        path: The JSON-lines file (created, or appended to).
        rank: This process's rank.
        variant: Label of the jaxcomm setting being run.
        log_every: Only every N-th step is written (step 0 and the last call always are
            when ``force=True``).

    Example:
        >>> m = MetricsLogger(pathlib.Path("/tmp/r0.jsonl"), rank=0, variant="dense")
        >>> m.log(step=0, loss=2.3, step_time_s=0.01)
        >>> m.close()
    """

    def __init__(self, path: pathlib.Path, rank: int, variant: str, log_every: int = 1) -> None:
        self.path = path
        self.rank = rank
        self.variant = variant
        self.log_every = max(1, log_every)
        self._file: TextIO | None = open(path, "a", buffering=1)
        self._progress_fd: int | None = None

    def progress(self, steps: int) -> None:
        """Records that `steps` training steps have been dispatched, in ``rank<R>.progress``.

        One ``pwrite`` of a fixed-width number per call (no JSON, no flush of the metrics): the
        launcher reads it to fire ``at_step`` faults and to count the steps a restart lost.

        Args:
            steps: Steps dispatched so far (the next step's index).

        Returns:
            None.

        Example:
            >>> ctx.metrics.progress(41)  # doctest: +SKIP
        """
        if self._progress_fd is None:
            self._progress_fd = os.open(
                progress_path(self.path.parent, self.rank), os.O_WRONLY | os.O_CREAT, 0o644
            )
        os.pwrite(self._progress_fd, f"{int(steps):>12d}\n".encode(), 0)

    def log(self, step: int, force: bool = False, **fields: Any) -> None:
        """Writes one record for `step`.

        Args:
            step: The training step (or measurement index).
            force: Write even when `step` is not a multiple of ``log_every``.
            **fields: Metrics such as loss, accuracy, step_time_s, bytes_sent,
                bytes_received, collective_time_s, compression_ratio.

        Returns:
            None.

        Example:
            >>> ctx.metrics.log(step=3, loss=0.4, accuracy=0.9)  # doctest: +SKIP
        """
        if self._file is None:
            raise RuntimeError("MetricsLogger is closed")
        if not force and step % self.log_every:
            return
        record = {
            "step": int(step),
            "rank": self.rank,
            "variant": self.variant,
            "time": time.time(),
        }
        record.update({k: _jsonable(v) for k, v in fields.items()})
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Closes the file; further :meth:`log` calls raise."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._progress_fd is not None:
            os.close(self._progress_fd)
            self._progress_fd = None


def progress_path(run_dir: pathlib.Path, rank: int) -> pathlib.Path:
    """Returns the file where :meth:`MetricsLogger.progress` keeps `rank`'s step count."""
    return run_dir / f"rank{rank}.progress"


def read_progress(run_dir: pathlib.Path, rank: int) -> int | None:
    """Returns the steps `rank` has dispatched (its ``rank<R>.progress``), None before any.

    Args:
        run_dir: The run's directory (one sweep entry).
        rank: The rank.

    Returns:
        The count, or None when the rank has not reported one.

    Example:
        >>> read_progress(pathlib.Path("/nonexistent"), 0) is None
        True
    """
    try:
        text = progress_path(run_dir, rank).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@dataclasses.dataclass
class JobContext:
    """Everything a job function receives, once per rank.

    Attributes:
        rank: This process's index in ``[0, world_size)``.
        world_size: Number of processes.
        devices_per_process: Devices each process was given (CPU devices, or GPUs on
            ``world.platform: gpu``).
        run_dir: Directory of this run (one per sweep entry); write artifacts here.
        metrics: Per-rank JSON-lines logger.
        recipe: The validated recipe.
        jaxcomm: The jaxcomm settings of this run (the sweep entry, if any).
        train: Shortcut for ``recipe.train``.
        args: Shortcut for ``recipe.args`` (free-form job arguments).
        variant: Label of this run in tables and plots.

    Example:
        >>> def my_job(ctx: JobContext) -> None:  # a recipe's `job: mymod:my_job`
        ...     ctx.print(f"hello from {ctx.rank}/{ctx.world_size}")
        ...     ctx.metrics.log(step=0, loss=1.0)
    """

    rank: int
    world_size: int
    devices_per_process: int
    run_dir: pathlib.Path
    metrics: MetricsLogger
    recipe: Recipe
    jaxcomm: JaxcommSettings
    variant: str

    @property
    def train(self) -> Train:
        """The recipe's training settings."""
        return self.recipe.train

    @property
    def args(self) -> dict[str, Any]:
        """The recipe's free-form job arguments."""
        return self.recipe.args

    @property
    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    def print(self, *parts: object) -> None:
        """Prints a line to this rank's log (the launcher adds the rank prefix)."""
        print(*parts, flush=True)
        sys.stdout.flush()
