"""``local``: N rank processes on this machine, joined by jax.distributed over loopback."""

from __future__ import annotations

import pathlib

from jaxcomm_launcher.backends._base import (
    SupervisedBackend,
    base_env,
    free_port,
    shell_join,
    worker_command,
)
from jaxcomm_launcher.procs import Supervisor


class LocalBackendRunner(SupervisedBackend):
    """Starts ``world.processes`` workers with JAXCOMM_PROCESS_ID/NUM_PROCESSES/COORDINATOR.

    Args:
        recipe: The recipe.
        run_dir: The run directory.

    Example:
        >>> with LocalBackendRunner(recipe, run_dir) as b:  # doctest: +SKIP
        ...     b.start(supervisor, run_dir / "dense" / "spec.json")
    """

    kind = "local"

    def _rank_envs(self, port: int) -> list[dict[str, str]]:
        n = self.recipe.world.processes
        return [
            {
                "JAXCOMM_PROCESS_ID": str(rank),
                "JAXCOMM_NUM_PROCESSES": str(n),
                "JAXCOMM_COORDINATOR": f"127.0.0.1:{port}",
            }
            for rank in range(n)
        ]

    def start(self, supervisor: Supervisor, spec_path: pathlib.Path) -> None:
        """Starts every rank of one run under `supervisor`.

        Args:
            supervisor: Receives the processes.
            spec_path: The run's spec.json.

        Returns:
            None.
        """
        env = base_env(self.recipe)
        # A fresh port per sweep entry: the previous coordinator's socket may linger.
        for rank, extra in enumerate(self._rank_envs(free_port())):
            supervisor.start(worker_command(spec_path), {**env, **extra}, rank=rank)

    def describe(self, spec_path: pathlib.Path) -> list[str]:
        """Returns the shell lines that ``start`` would run (for ``--dry-run``)."""
        return [
            shell_join(worker_command(spec_path), extra) + " &" for extra in self._rank_envs(29500)
        ]
