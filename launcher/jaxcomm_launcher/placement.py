"""Which cores each node of a world runs on, and whether the world oversubscribes the host.

A real cluster gives every node cores of its own. An emulated cluster on one machine only
measures the algorithms, not the host, when each emulated node gets its own cores too: the
``emulated`` backend pins node ``i`` to cores ``[i*c, (i+1)*c)`` of the launcher's cores with
``taskset`` (``backend.cpus_per_node``, default: the cores split evenly). A world that needs
more cores than the host has wraps round and is *oversubscribed*: the launcher says so in its
table and in ``summary.json``, and the benchmarks mark such rows.

On ``world.platform: gpu`` each rank also gets GPUs of its node: local rank ``l`` takes the
node's visible GPUs ``[(l // k) * d, (l // k) * d + d)`` for ``d = devices_per_process`` and
``k = processes_per_gpu`` (:func:`gpu_slots`), as ``CUDA_VISIBLE_DEVICES``. The local and
emulated backends set it for each rank; under mpirun and Slurm the rank sets it itself from
its local rank (``jaxcomm_launcher.worker``), out of what the scheduler made visible.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any


def host_cpus() -> list[int]:
    """Returns the cores this process may run on (its affinity, not the machine's count).

    Returns:
        Sorted core ids.

    Example:
        >>> len(host_cpus()) >= 1
        True
    """
    return sorted(os.sched_getaffinity(0))


def describe_cores(node_cpus: Sequence[Sequence[int]]) -> str:
    """Returns each node's cores, nodes apart by ``" | "`` (a placement's ``node_cpus``, or
    their JSON in ``summary.json``).

    Example:
        >>> describe_cores([[0, 1], [2, 3]])
        '0,1 | 2,3'
    """
    return " | ".join(",".join(map(str, cores)) for cores in node_cpus)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a world's processes run.

    Attributes:
        nodes: Emulated or real nodes of the world (a local world is one node).
        processes: Processes (ranks) of the world.
        host_cpus: Cores of the host the world shares.
        node_cpus: The cores each node is pinned to, or None when nothing is pinned.
        oversubscribed: None, or the notice, e.g. ``"oversubscribed: 4 nodes on 2 cores"``.
    """

    nodes: int
    processes: int
    host_cpus: tuple[int, ...]
    node_cpus: tuple[tuple[int, ...], ...] | None
    oversubscribed: str | None
    gpus: tuple[str, ...] | None = None
    shared_gpus: str | None = None

    def with_gpus(self, gpus: Sequence[str], shared: str | None) -> Placement:
        """Returns this placement with each rank's ``CUDA_VISIBLE_DEVICES`` and the notice of
        ranks sharing a GPU (:func:`shared_gpu_notice`)."""
        return dataclasses.replace(self, gpus=tuple(gpus), shared_gpus=shared)

    def to_json(self) -> dict[str, Any]:
        """Returns the placement as the JSON of ``run.json`` and ``summary.json``."""
        return {
            "nodes": self.nodes,
            "processes": self.processes,
            "host_cpus": list(self.host_cpus),
            "node_cpus": None if self.node_cpus is None else [list(c) for c in self.node_cpus],
            "oversubscribed": self.oversubscribed,
            "gpus": None if self.gpus is None else list(self.gpus),
            "shared_gpus": self.shared_gpus,
        }

    def describe(self) -> str:
        """Returns one line for tables, e.g. ``"2 nodes × 1 core (cores 0 | 1)"``.

        Example:
            >>> emulated_placement(2, 1, cpus=[0, 1]).describe()
            '2 nodes × 1 core (0 | 1)'
        """
        if self.node_cpus is None:
            text = f"{self.processes} processes on {len(self.host_cpus)} cores, unpinned"
        else:
            per = len(self.node_cpus[0]) if self.node_cpus else 0
            cores = describe_cores(self.node_cpus)
            text = f"{self.nodes} nodes × {per} core{'s' if per != 1 else ''} ({cores})"
        if self.gpus is not None:
            text += f"; GPUs {' | '.join(self.gpus)}"
        if self.shared_gpus:
            text += f"; {self.shared_gpus}"
        return f"{text}; {self.oversubscribed}" if self.oversubscribed else text


def _notice(count: int, what: str, cores: int) -> str:
    plural = {"node": "nodes", "process": "processes"}[what] if count != 1 else what
    return f"oversubscribed: {count} {plural} on {cores} cores"


def emulated_placement(
    nodes: int, cpus_per_node: int | None, *, pin: bool = True, cpus: list[int] | None = None
) -> Placement:
    """Returns the cores of each emulated node (one rank per node).

    Args:
        nodes: Nodes of the world.
        cpus_per_node: Cores per node; None splits the host's cores evenly (at least 1).
        pin: False leaves every node unpinned (then only the oversubscription is reported).
        cpus: The host's cores (default: :func:`host_cpus`).

    Returns:
        The :class:`Placement`; node ``i`` gets the next ``cpus_per_node`` cores, wrapping
        round when the world needs more cores than the host has.

    Raises:
        ValueError: `nodes` or `cpus_per_node` below 1.

    Example:
        >>> emulated_placement(4, 1, cpus=[0, 1]).oversubscribed
        'oversubscribed: 4 nodes on 2 cores'
        >>> emulated_placement(2, None, cpus=[0, 1]).node_cpus
        ((0,), (1,))
    """
    cpus = list(cpus if cpus is not None else host_cpus())
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    per = cpus_per_node if cpus_per_node is not None else max(1, len(cpus) // nodes)
    if per < 1:
        raise ValueError(f"backend.cpus_per_node must be >= 1, got {per}")
    oversubscribed = _notice(nodes, "node", len(cpus)) if nodes * per > len(cpus) else None
    node_cpus = None
    if pin:
        node_cpus = tuple(
            tuple(sorted({cpus[(i * per + j) % len(cpus)] for j in range(per)}))
            for i in range(nodes)
        )
    return Placement(nodes, nodes, tuple(cpus), node_cpus, oversubscribed)


def local_placement(processes: int, cpus: list[int] | None = None) -> Placement:
    """Returns the placement of `processes` unpinned processes on this one host.

    Args:
        processes: Processes of the world.
        cpus: The host's cores (default: :func:`host_cpus`).

    Returns:
        One node, unpinned; oversubscribed when there are more processes than cores.

    Example:
        >>> local_placement(2, cpus=[0, 1]).oversubscribed is None
        True
    """
    cpus = list(cpus if cpus is not None else host_cpus())
    over = _notice(processes, "process", len(cpus)) if processes > len(cpus) else None
    return Placement(1, processes, tuple(cpus), None, over)


def gpu_slots(
    local_ranks: int, devices_per_process: int, processes_per_gpu: int
) -> list[tuple[int, ...]]:
    """Returns which of its node's visible GPUs each local rank takes (indices, in order).

    Args:
        local_ranks: Ranks on the node.
        devices_per_process: GPUs each rank owns.
        processes_per_gpu: Ranks that share each GPU (then ``devices_per_process`` is 1).

    Returns:
        One tuple of GPU indices per local rank.

    Example:
        >>> gpu_slots(4, 1, 2)
        [(0,), (0,), (1,), (1,)]
        >>> gpu_slots(2, 2, 1)
        [(0, 1), (2, 3)]
    """
    d, k = devices_per_process, processes_per_gpu
    return [tuple(range((r // k) * d, (r // k) * d + d)) for r in range(local_ranks)]


def gpus_needed(local_ranks: int, devices_per_process: int, processes_per_gpu: int) -> int:
    """Returns the GPUs a node with `local_ranks` ranks needs (:func:`gpu_slots`).

    Example:
        >>> gpus_needed(4, 1, 4), gpus_needed(3, 1, 2), gpus_needed(2, 2, 1)
        (1, 2, 4)
    """
    return -(-local_ranks // processes_per_gpu) * devices_per_process


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """Returns the GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them.

    Args:
        environ: The environment (default ``os.environ``).

    Returns:
        The entries of ``CUDA_VISIBLE_DEVICES`` when it is set (indices or UUIDs; empty: no
        GPU), else the index of every ``/dev/nvidiaN`` of the machine.

    Example:
        >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})
        ['2', '3']
    """
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    found = [
        p.name[6:]
        for p in pathlib.Path("/dev").glob("nvidia*")
        if re.fullmatch(r"nvidia\d+", p.name)
    ]
    return sorted(found, key=int)


def assign_gpus(
    visible: Sequence[str], local_ranks: int, devices_per_process: int, processes_per_gpu: int
) -> list[str]:
    """Returns each local rank's ``CUDA_VISIBLE_DEVICES`` value out of the node's `visible` GPUs.

    Args:
        visible: The node's GPUs (:func:`visible_gpus`).
        local_ranks: Ranks on the node.
        devices_per_process: GPUs each rank owns.
        processes_per_gpu: Ranks that share each GPU.

    Returns:
        One comma-separated value per local rank.

    Raises:
        ValueError: The node has fewer GPUs than its ranks need; the message names the
            recipe keys that decide it.

    Example:
        >>> assign_gpus(["0"], 2, 1, 2)
        ['0', '0']
    """
    need = gpus_needed(local_ranks, devices_per_process, processes_per_gpu)
    if len(visible) < need:
        shown = ",".join(visible) if visible else "none"
        raise ValueError(
            f"{local_ranks} ranks with world.devices_per_process={devices_per_process} and "
            f"world.processes_per_gpu={processes_per_gpu} need {need} GPUs per node; this node "
            f"shows {len(visible)} (CUDA_VISIBLE_DEVICES / /dev/nvidia*: {shown}). Let ranks "
            "share a GPU with world.processes_per_gpu, or use world.platform: cpu"
        )
    slots = gpu_slots(local_ranks, devices_per_process, processes_per_gpu)
    return [",".join(visible[i] for i in slot) for slot in slots]


def shared_gpu_notice(processes_per_gpu: int, transport: str) -> str | None:
    """The launch table's line for ranks sharing a GPU (None when every rank has its own).

    Example:
        >>> shared_gpu_notice(4, "ucx")
        'shared GPUs: 4 ranks per GPU over transport ucx, no preallocation'
    """
    if processes_per_gpu <= 1:
        return None
    return (
        f"shared GPUs: {processes_per_gpu} ranks per GPU over transport {transport}, "
        "no preallocation"
    )


def gpu_rule(devices_per_process: int, processes_per_gpu: int, local_rank: str) -> str:
    """One line saying how a rank picks its GPUs from its local rank (mpirun, Slurm).

    Args:
        devices_per_process: GPUs each rank owns.
        processes_per_gpu: Ranks that share each GPU.
        local_rank: The variable the rank reads its local rank from.

    Returns:
        The line, e.g. for the ``--dry-run`` output.

    Example:
        >>> print(gpu_rule(1, 2, "SLURM_LOCALID"))
        GPUs: local rank L (SLURM_LOCALID) takes its node's visible GPU L // 2
    """
    d, k = devices_per_process, processes_per_gpu
    if d == 1:
        pick = "GPU L" if k == 1 else f"GPU L // {k}"
    else:
        pick = f"GPUs L*{d} .. L*{d}+{d - 1}"
    return f"GPUs: local rank L ({local_rank}) takes its node's visible {pick}"
