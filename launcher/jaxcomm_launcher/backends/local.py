"""``local``: N rank processes on this machine, joined by jax.distributed over loopback."""

from __future__ import annotations

import pathlib

from jaxcomm_launcher.backends._base import PerRankBackend, rank_env, worker_command
from jaxcomm_launcher.placement import Placement, local_placement


class LocalBackendRunner(PerRankBackend):
    """Starts ``world.processes`` workers with JAXCOMM_PROCESS_ID/NUM_PROCESSES/COORDINATOR.

    Each sweep entry's coordinator port is held (:meth:`BackendRunner.hold_port`) until the
    backend exits, so no other process can take it before rank 0's coordinator binds it.

    Args:
        recipe: The recipe.
        run_dir: The run directory.

    Example:
        >>> with LocalBackendRunner(recipe, run_dir) as b:  # doctest: +SKIP
        ...     b.start(supervisor, run_dir / "dense" / "spec.json")
    """

    kind = "local"

    def placement(self, *, dry_run: bool = False) -> Placement:
        """Returns the world as one node: its processes share the host's cores, unpinned (and
        on GPUs each rank's ``CUDA_VISIBLE_DEVICES``)."""
        return self.gpu_placement(local_placement(self.recipe.world.processes), dry_run=dry_run)

    def rank_launches(
        self, spec_path: pathlib.Path, *, dry_run: bool = False
    ) -> list[tuple[list[str], dict[str, str]]]:
        """Returns the worker command and rank variables of every rank (coordinator on loopback).

        Args:
            spec_path: The run's spec.json.
            dry_run: Show port 29500 instead of reserving a free one.
        """
        # A fresh port per sweep entry: the previous coordinator's socket may linger.
        coordinator = f"127.0.0.1:{29500 if dry_run else self.hold_port()}"
        n = self.recipe.world.processes
        devices = self.device_env(dry_run=dry_run)
        return [
            (worker_command(spec_path), {**rank_env(rank, n, coordinator), **devices[rank]})
            for rank in range(n)
        ]
