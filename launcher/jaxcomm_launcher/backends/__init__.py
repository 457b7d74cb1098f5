"""Backends start the ranks of one run: ``local``, ``emulated``, ``mpirun`` (supervised here)
and ``slurm`` (an sbatch script, submitted and followed: see ``backends/slurm.py``).

A supervised backend (:class:`SupervisedBackend`) is a context manager (``with backend: ...``
sets up and always tears down what it creates, e.g. namespaces) with
``start(supervisor, spec_path)`` that starts the processes of one sweep entry and
``describe(spec_path)`` that returns the commands for ``--dry-run``. What the backends share
lives in ``backends/_base.py``.
"""

from __future__ import annotations

import pathlib

from jaxcomm_launcher.backends._base import (
    BackendError,
    BackendRunner,
    SupervisedBackend,
    base_env,
    reserve_port,
    shell_join,
    worker_command,
)
from jaxcomm_launcher.backends.emulated import EmulatedBackendRunner
from jaxcomm_launcher.backends.local import LocalBackendRunner
from jaxcomm_launcher.backends.mpirun import MpirunBackendRunner
from jaxcomm_launcher.backends.slurm import SlurmBackendRunner
from jaxcomm_launcher.recipe import Recipe

SUPERVISED: dict[str, type[SupervisedBackend]] = {
    "local": LocalBackendRunner,
    "emulated": EmulatedBackendRunner,
    "mpirun": MpirunBackendRunner,
}


def make_backend(recipe: Recipe, run_dir: pathlib.Path) -> SupervisedBackend:
    """Returns the supervised backend for ``recipe.backend.kind``.

    Args:
        recipe: The validated recipe (``local``, ``emulated`` or ``mpirun``).
        run_dir: The run directory.

    Returns:
        A :class:`SupervisedBackend`.

    Raises:
        BackendError: a ``slurm`` recipe (it is submitted, not supervised: use
            :class:`SlurmBackendRunner`).

    Example:
        >>> make_backend(Recipe(name="x", job="smoke"), pathlib.Path("/tmp/x")).kind
        'local'
    """
    kind = recipe.backend.kind
    if kind not in SUPERVISED:
        raise BackendError(
            f"backend {kind!r} is not supervised by the launcher; "
            f"{'use SlurmBackendRunner' if kind == 'slurm' else 'unknown backend'}"
        )
    return SUPERVISED[kind](recipe, run_dir)


__all__ = [
    "BackendError",
    "BackendRunner",
    "EmulatedBackendRunner",
    "LocalBackendRunner",
    "MpirunBackendRunner",
    "SlurmBackendRunner",
    "SupervisedBackend",
    "base_env",
    "make_backend",
    "reserve_port",
    "shell_join",
    "worker_command",
]
