"""``local``: N rank processes on this machine, joined by jax.distributed over loopback."""

from __future__ import annotations

import pathlib
import socket

from jaxcomm_launcher.backends._base import PerRankBackend, rank_env, reserve_port, worker_command
from jaxcomm_launcher.recipe import Recipe


class LocalBackendRunner(PerRankBackend):
    """Starts ``world.processes`` workers with JAXCOMM_PROCESS_ID/NUM_PROCESSES/COORDINATOR.

    Each sweep entry's coordinator port is reserved (:func:`reserve_port`) from when its ranks
    are described until the backend exits, so no other process can take it in between.

    Args:
        recipe: The recipe.
        run_dir: The run directory.

    Example:
        >>> with LocalBackendRunner(recipe, run_dir) as b:  # doctest: +SKIP
        ...     b.start(supervisor, run_dir / "dense" / "spec.json")
    """

    kind = "local"

    def __init__(self, recipe: Recipe, run_dir: pathlib.Path) -> None:
        super().__init__(recipe, run_dir)
        self._ports: list[socket.socket] = []

    def __exit__(self, *exc_info: object) -> None:
        for sock in self._ports:
            sock.close()
        self._ports.clear()

    def rank_launches(
        self, spec_path: pathlib.Path, *, dry_run: bool = False
    ) -> list[tuple[list[str], dict[str, str]]]:
        """Returns the worker command and rank variables of every rank (coordinator on loopback).

        Args:
            spec_path: The run's spec.json.
            dry_run: Show port 29500 instead of reserving a free one.
        """
        # A fresh port per sweep entry: the previous coordinator's socket may linger.
        if dry_run:
            port = 29500
        else:
            self._ports.append(reserve_port())
            port = self._ports[-1].getsockname()[1]
        coordinator = f"127.0.0.1:{port}"
        n = self.recipe.world.processes
        return [(worker_command(spec_path), rank_env(rank, n, coordinator)) for rank in range(n)]
