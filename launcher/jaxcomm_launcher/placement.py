"""Which cores each node of a world runs on, and whether the world oversubscribes the host.

A real cluster gives every node cores of its own. An emulated cluster on one machine only
measures the algorithms, not the host, when each emulated node gets its own cores too: the
``emulated`` backend pins node ``i`` to cores ``[i*c, (i+1)*c)`` of the launcher's cores with
``taskset`` (``backend.cpus_per_node``, default: the cores split evenly). A world that needs
more cores than the host has wraps round and is *oversubscribed*: the launcher says so in its
table and in ``summary.json``, and the benchmarks mark such rows.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
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

    def to_json(self) -> dict[str, Any]:
        """Returns the placement as the JSON of ``run.json`` and ``summary.json``."""
        return {
            "nodes": self.nodes,
            "processes": self.processes,
            "host_cpus": list(self.host_cpus),
            "node_cpus": None if self.node_cpus is None else [list(c) for c in self.node_cpus],
            "oversubscribed": self.oversubscribed,
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
