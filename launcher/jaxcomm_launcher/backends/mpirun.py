"""``mpirun``: OpenMPI's mpirun starts the ranks from a hostfile.

Ranks take their rank and size from OMPI_COMM_WORLD_RANK/SIZE and rank 0's coordinator
address from JAXCOMM_COORDINATOR (exported with ``-x``). ``--tag-output`` prefixes every line
with ``[job,rank]<stdout>:``, which the supervisor turns back into per-rank logs. On GPUs
each rank takes its host's GPUs by ``OMPI_COMM_WORLD_LOCAL_RANK`` (``placement.gpu_slots``),
out of the GPUs visible on that host.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import shutil

from jaxcomm_launcher.backends._base import (
    BackendError,
    SupervisedBackend,
    base_env,
    gpu_env,
    shell_join,
    worker_command,
)
from jaxcomm_launcher.placement import gpu_rule, shared_gpu_notice
from jaxcomm_launcher.procs import Supervisor
from jaxcomm_launcher.recipe import TRANSPORT_SETTING, MpirunBackend

LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
"""Each rank's index on its host; on GPUs it picks the rank's GPUs (placement.py)."""

# OpenMPI 4: "[1,0]<stdout>:text"; OpenMPI 5 (PRRTE): "[1,0]<stdout>: text". A rank's chunk
# without a newline gets the next chunk, maybe another rank's, glued to it with its own tag.
_TAG = re.compile(r"\[\d+,(\d+)\]<std(?:out|err)>: ?")


def route_tagged_line(line: str) -> list[tuple[int | None, str]]:
    """Splits an mpirun ``--tag-output`` line into (rank, text) pieces, one per tag.

    Args:
        line: One line of mpirun's output.

    Returns:
        The pieces in order: each tagged piece with its rank, text before the first tag (or a
        line without tags, mpirun's own messages) with None. Empty pieces after a tag are
        dropped unless the line is only that tag.

    Example:
        >>> route_tagged_line("[1,3]<stdout>:hello")
        [(3, 'hello')]
        >>> route_tagged_line("[1,0]<stdout>:half[1,1]<stdout>:other")
        [(0, 'half'), (1, 'other')]
    """
    tags = list(_TAG.finditer(line))
    if not tags:
        return [(None, line)]
    pieces: list[tuple[int | None, str]] = []
    if tags[0].start() > 0:
        pieces.append((None, line[: tags[0].start()]))
    for i, tag in enumerate(tags):
        end = tags[i + 1].start() if i + 1 < len(tags) else len(line)
        text = line[tag.end() : end]
        if text or len(tags) == 1:
            pieces.append((int(tag.group(1)), text))
    return pieces


class MpirunBackendRunner(SupervisedBackend):
    """Runs each sweep entry as one ``mpirun`` under the supervisor.

    Args:
        recipe: The recipe (``backend.kind == "mpirun"``).
        run_dir: The run directory (the hostfile is written there).

    Example:
        >>> with MpirunBackendRunner(recipe, run_dir) as b:  # doctest: +SKIP
        ...     b.start(supervisor, spec_path)
    """

    kind = "mpirun"
    opts: MpirunBackend

    def _executable(self) -> str:
        exe = shutil.which(self.opts.mpirun)
        if exe is None:
            raise BackendError(
                f"the mpirun backend needs {self.opts.mpirun!r}, which is not on PATH: install "
                "OpenMPI (Debian/Ubuntu: apt-get install openmpi-bin) or set backend.mpirun"
            )
        return exe

    def hostfile(self, write: bool = True) -> pathlib.Path:
        """Returns the hostfile to use, writing one from ``backend.hosts`` if needed.

        Args:
            write: Write the generated hostfile (False for ``--dry-run``).

        Returns:
            Its path.
        """
        if self.opts.hostfile:
            return pathlib.Path(self.opts.hostfile)
        hosts = self.opts.hosts
        slots = self.opts.slots_per_host or math.ceil(self.recipe.world.processes / len(hosts))
        path = self.run_dir / "hostfile"
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(f"{h} slots={slots}\n" for h in hosts))
        return path

    def _coordinator(self, probe: bool = True) -> str:
        if self.opts.coordinator:
            return self.opts.coordinator
        first = self.opts.hosts[0]
        host = "127.0.0.1" if first in ("localhost", "127.0.0.1") else first
        # A port of this machine is held until the backend exits (rank 0's coordinator binds
        # it then); with remote hosts set backend.coordinator to a port free on the first host.
        return f"{host}:{self.hold_port() if probe and host == '127.0.0.1' else 29500}"

    def command(
        self, spec_path: pathlib.Path, coordinator: str, mpirun: str, write: bool = True
    ) -> list[str]:
        """Returns the mpirun command line for one run.

        Args:
            spec_path: The run's spec.json.
            coordinator: host:port of rank 0's jax.distributed coordinator.
            mpirun: The mpirun executable.
            write: Write the hostfile (False for ``--dry-run``).

        Returns:
            The argv list.
        """
        env_names = [
            "JAXCOMM_COORDINATOR",
            "PYTHONUNBUFFERED",
            "PYTHONPATH",
            *self.recipe.env,
            *gpu_env(self.recipe),
        ]
        cmd = [
            mpirun,
            "--hostfile",
            str(self.hostfile(write)),
            "-np",
            str(self.recipe.world.processes),
            # Ranks wait for each other inside collectives; yielding leaves the 2 cores to
            # whichever rank has work (docs/DESIGN.md §5).
            "--mca",
            "mpi_yield_when_idle",
            "1",
            "--tag-output",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")  # containers and CI runners are often root
        for name in dict.fromkeys(env_names):
            cmd += ["-x", name]
        cmd += list(self.opts.extra_args)
        return cmd + worker_command(spec_path)

    def start(self, supervisor: Supervisor, spec_path: pathlib.Path) -> None:
        """Starts mpirun for one run under `supervisor`.

        Args:
            supervisor: Receives the mpirun process; its output is routed per rank.
            spec_path: The run's spec.json.

        Returns:
            None.
        """
        mpirun = self._executable()
        coordinator = self._coordinator()
        env = base_env(self.recipe)
        env["JAXCOMM_COORDINATOR"] = coordinator
        env.setdefault("PYTHONPATH", "")
        # Both variables are needed by OpenMPI >= 4 to accept root without the flag's prompt.
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        supervisor.start(
            self.command(spec_path, coordinator, mpirun),
            env,
            rank=None,
            name="mpirun",
            router=route_tagged_line,
        )

    def describe(self, spec_path: pathlib.Path) -> list[str]:
        """Returns the mpirun line that ``start`` would run (for ``--dry-run``)."""
        coordinator = self._coordinator(probe=False)
        cmd = self.command(spec_path, coordinator, self.opts.mpirun, write=False)
        lines = [shell_join(cmd, {"JAXCOMM_COORDINATOR": coordinator, **gpu_env(self.recipe)})]
        w = self.recipe.world
        if w.platform == "gpu":
            lines.append(f"# {gpu_rule(w.devices_per_process, w.processes_per_gpu, LOCAL_RANK)}")
            shared = shared_gpu_notice(
                w.processes_per_gpu, gpu_env(self.recipe).get(TRANSPORT_SETTING, "")
            )
            if shared:
                lines.append(f"# {shared}")
        return lines
