"""What every backend shares: errors, the base classes, the rank command line and environment.

The backends (``local``, ``emulated``, ``mpirun``, ``slurm``) import this module, never the
``backends`` package itself, so the package can import them all (no cycle).
"""

from __future__ import annotations

import abc
import os
import pathlib
import shlex
import socket
import sys
from typing import Any

from jaxcomm_launcher.placement import (
    Placement,
    assign_gpus,
    gpus_needed,
    shared_gpu_notice,
    visible_gpus,
)
from jaxcomm_launcher.procs import Supervisor
from jaxcomm_launcher.recipe import PREALLOCATE_SETTING, TRANSPORT_SETTING, Recipe


class BackendError(RuntimeError):
    """A backend cannot run here (missing tool, not root, ...); the message says what to do."""


class BackendRunner:
    """What every backend shares: its recipe, run directory, the coordinator ports it holds
    for its ranks, and a context manager that releases them. Backends that create something
    (``emulated``) override both halves.

    Args:
        recipe: The validated recipe, whose ``backend.kind`` is this runner's ``kind``.
        run_dir: The run directory.
    """

    kind: str  # the recipe's ``backend.kind`` this runner runs
    opts: Any  # the recipe's backend options (each backend names their class)

    attempt: int = 0
    """Which launch of the current sweep entry this is (0: the first; the runner counts the
    restarts). Backends with a fixed coordinator port add it, so a relaunch never meets the
    previous attempt's socket."""

    def __init__(self, recipe: Recipe, run_dir: pathlib.Path) -> None:
        if recipe.backend.kind != self.kind:
            raise BackendError(
                f"{type(self).__name__} runs backend {self.kind!r}, the recipe's is "
                f"{recipe.backend.kind!r}"
            )
        self.recipe = recipe
        self.opts = recipe.backend
        self.run_dir = run_dir
        self._held_ports: list[socket.socket] = []

    def __enter__(self) -> BackendRunner:
        return self

    def placement(self, *, dry_run: bool = False) -> Placement | None:
        """Returns which cores (and GPUs) the ranks run on, or None where the launcher does
        not place them (mpirun, slurm: the scheduler does, and each rank takes its GPUs by
        its local rank). `dry_run`: only describing, the host need not have the GPUs."""
        return None

    def __exit__(self, *exc_info: object) -> None:
        for sock in self._held_ports:
            sock.close()
        self._held_ports.clear()

    def hold_port(self, host: str = "127.0.0.1") -> int:
        """Reserves a port on `host` (:func:`reserve_port`) until the backend exits.

        Args:
            host: The address the coordinator will bind.

        Returns:
            The port number.
        """
        self._held_ports.append(reserve_port(host))
        return int(self._held_ports[-1].getsockname()[1])


class SupervisedBackend(BackendRunner, abc.ABC):
    """A backend whose ranks this process starts and supervises (local, emulated, mpirun).

    ``with backend: ...`` sets up and always tears down what it creates (e.g. namespaces).
    """

    @abc.abstractmethod
    def start(self, supervisor: Supervisor, spec_path: pathlib.Path) -> None:
        """Starts the ranks of one sweep entry under ``supervisor``."""

    @abc.abstractmethod
    def describe(self, spec_path: pathlib.Path) -> list[str]:
        """The commands :meth:`start` would run, for ``--dry-run``."""


class PerRankBackend(SupervisedBackend):
    """A supervised backend that starts every rank as its own process (local, emulated).

    Subclasses say what each rank runs (:meth:`rank_launches`); starting them under the
    supervisor with :func:`base_env` plus the rank's own variables, and the ``--dry-run``
    lines, are the same for all of them and live here.
    """

    @abc.abstractmethod
    def rank_launches(
        self, spec_path: pathlib.Path, *, dry_run: bool = False
    ) -> list[tuple[list[str], dict[str, str]]]:
        """Returns ``(argv, the rank's own environment variables)`` for every rank, in order.

        Args:
            spec_path: The run's spec.json.
            dry_run: Only describing (``--dry-run``): probe or create nothing.
        """

    def device_env(self, *, dry_run: bool = False) -> list[dict[str, str]]:
        """Returns each rank's device variables: its ``CUDA_VISIBLE_DEVICES`` and, where ranks
        share a GPU, :func:`gpu_env` (empty dicts on CPU)."""
        gpus = self.rank_gpus(dry_run=dry_run)
        if gpus is None:
            return [{} for _ in range(self.recipe.world.processes)]
        shared = gpu_env(self.recipe)
        return [{"CUDA_VISIBLE_DEVICES": g, **shared} for g in gpus]

    def rank_gpus(self, *, dry_run: bool = False) -> list[str] | None:
        """Returns each rank's ``CUDA_VISIBLE_DEVICES`` (None on ``world.platform: cpu``).

        The ranks share this one host, so rank ``r`` is local rank ``r`` (:func:`gpu_slots`).

        Args:
            dry_run: Only describing: a host without GPUs shows GPUs 0, 1, ... it would need.

        Raises:
            BackendError: The host has fewer GPUs than the world needs.
        """
        w = self.recipe.world
        if w.platform != "gpu":
            return None
        visible = visible_gpus()
        if dry_run and not visible:
            need = gpus_needed(w.processes, w.devices_per_process, w.processes_per_gpu)
            visible = [str(i) for i in range(need)]
        try:
            return assign_gpus(visible, w.processes, w.devices_per_process, w.processes_per_gpu)
        except ValueError as exc:
            raise BackendError(str(exc)) from None

    def gpu_placement(self, placement: Placement, *, dry_run: bool = False) -> Placement:
        """Returns `placement` with each rank's GPUs and the shared-GPU notice (GPU worlds)."""
        gpus = self.rank_gpus(dry_run=dry_run)
        if gpus is None:
            return placement
        transport = gpu_env(self.recipe).get(TRANSPORT_SETTING, "")
        return placement.with_gpus(
            gpus, shared_gpu_notice(self.recipe.world.processes_per_gpu, transport)
        )

    def start(self, supervisor: Supervisor, spec_path: pathlib.Path) -> None:
        """Starts every rank of one run under `supervisor`.

        Args:
            supervisor: Receives the processes.
            spec_path: The run's spec.json.

        Returns:
            None.
        """
        env = base_env(self.recipe)
        for rank, (cmd, extra) in enumerate(self.rank_launches(spec_path)):
            supervisor.start(cmd, {**env, **extra}, rank=rank)

    def describe(self, spec_path: pathlib.Path) -> list[str]:
        """Returns the shell lines that :meth:`start` would run (for ``--dry-run``)."""
        return [
            shell_join(cmd, extra) + " &"
            for cmd, extra in self.rank_launches(spec_path, dry_run=True)
        ]


def rank_env(rank: int, processes: int, coordinator: str) -> dict[str, str]:
    """Returns the variables that tell a rank who it is (read by ``jaxcomm_launcher.worker``).

    Args:
        rank: The rank (``jax.distributed`` process id).
        processes: Ranks in the run.
        coordinator: ``host:port`` of rank 0's ``jax.distributed`` coordinator.

    Returns:
        ``JAXCOMM_PROCESS_ID``, ``JAXCOMM_NUM_PROCESSES`` and ``JAXCOMM_COORDINATOR``.

    Example:
        >>> rank_env(1, 2, "127.0.0.1:29500")["JAXCOMM_PROCESS_ID"]
        '1'
    """
    return {
        "JAXCOMM_PROCESS_ID": str(rank),
        "JAXCOMM_NUM_PROCESSES": str(processes),
        "JAXCOMM_COORDINATOR": coordinator,
    }


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """Returns a socket bound to a port the OS chose on `host`; the port stays reserved until
    the socket is closed.

    The socket sets ``SO_REUSEPORT`` and never listens: a server that sets it too (gRPC does, so
    the ``jax.distributed`` coordinator does) binds the same port while it is held, and nothing
    else can, and the OS hands it to no other ``bind(0)`` or outgoing connection. Close it once
    the ranks are done.

    Args:
        host: Address to bind.

    Returns:
        The bound socket; ``sock.getsockname()[1]`` is the port.

    Example:
        >>> with reserve_port() as sock:
        ...     port = sock.getsockname()[1]
        ...     other = socket.socket()
        ...     try:
        ...         other.bind(("127.0.0.1", port))
        ...     except OSError:
        ...         print("held")
        ...     finally:
        ...         other.close()
        held
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock


def worker_command(spec_path: pathlib.Path, python: str | None = None) -> list[str]:
    """Returns the command line that runs one rank.

    ``-P`` (Python >= 3.11) keeps the working directory off ``sys.path``: launched from a
    source checkout, ranks must import the installed ``jaxcomm`` (with its compiled library),
    not the source tree.

    Args:
        spec_path: The run's spec.json.
        python: Interpreter; defaults to the launcher's own.

    Returns:
        The argv list.

    Example:
        >>> worker_command(pathlib.Path("/r/spec.json"), "python3")[-2:]
        ['--spec', '/r/spec.json']
    """
    python = python or sys.executable
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    return [python, *flags, "-m", "jaxcomm_launcher.worker", "--spec", str(spec_path)]


def base_env(recipe: Recipe) -> dict[str, str]:
    """Returns the environment shared by all ranks: this one, plus the recipe's additions.

    Args:
        recipe: The recipe (its ``env`` and ``pythonpath``).

    Returns:
        A new environment mapping.

    Example:
        >>> "PYTHONUNBUFFERED" in base_env(Recipe(name="x", job="smoke"))
        True
    """
    env = dict(os.environ)
    env.update(recipe.env)
    env.update(gpu_env(recipe))
    env["PYTHONUNBUFFERED"] = "1"  # logs must stream line by line, not at exit
    if recipe.pythonpath:
        parts = [*recipe.pythonpath]
        if env.get("PYTHONPATH"):
            parts.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(parts)
    # Every rank is one process with its own CPU devices; a leftover XLA device-count flag
    # from the user's shell would fight jax_num_cpu_devices.
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        env["XLA_FLAGS"] = " ".join(
            f for f in flags.split() if "xla_force_host_platform_device_count" not in f
        )
    return env


def gpu_env(recipe: Recipe) -> dict[str, str]:
    """Returns what every rank of a world whose ranks share GPUs must have (else nothing).

    Ranks sharing a GPU take the UCX transport (NCCL refuses two ranks on one GPU; the
    recipe may say ``auto``, which picks UCX there) and allocate GPU memory as they need it
    instead of taking most of the GPU at start.

    Args:
        recipe: The recipe (its ``world`` and ``env``).

    Returns:
        ``JAXCOMM_TRANSPORT`` and ``XLA_PYTHON_CLIENT_PREALLOCATE``, or ``{}``.

    Example:
        >>> gpu_env(Recipe(name="x", job="smoke", world={"platform": "gpu",
        ...                                              "processes_per_gpu": 2}))
        {'JAXCOMM_TRANSPORT': 'ucx', 'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'}
    """
    if not recipe.world.shares_gpus:
        return {}
    return {
        TRANSPORT_SETTING: recipe.env.get(TRANSPORT_SETTING) or "ucx",
        PREALLOCATE_SETTING: "false",
    }


def shell_join(cmd: list[str], env: dict[str, Any] | None = None) -> str:
    """Returns `cmd` as one shell line, with `env` assignments in front."""
    prefix = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(cmd)
