"""The hierarchical (node, local) form of every algorithm that has one: ``hier_<name>`` and
``hier_<name>_leader``.

C++: ffi/quantized_allreduce.cc (HierarchicalAllreduce). Inside a node (on CPU: a process, its
devices the local ranks) the sum is reduced through shared memory, local rank l owning slice
l; across nodes the algorithm's own allreduce runs (its ``inter_bytes``/``inter_time``); the
result is shared inside the node. ``multi_leader``: every local rank reduces its slice across
nodes; ``leader``: local rank 0 reduces the whole vector and sends it to its node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from ._base import F32, Algorithm, ceil_div, even_size
from .dense import direct_ag_bytes, direct_rs_bytes

SCHEMES = ("multi_leader", "leader")
"""``hierarchical_scheme`` values of ``jaxcomm.allreduce`` and ``jaxcomm.compressed_allreduce``;
the default first."""


def name_of(base: str, scheme: str = "multi_leader") -> str:
    """The registry name of ``base``'s hierarchical form under ``scheme``.

    Example:
      >>> name_of("adaptive", "leader")
      'hier_adaptive_leader'
    """
    return f"hier_{base}" + ("_leader" if scheme == "leader" else "")


def variant(base: Algorithm, scheme: str, order: int) -> Algorithm:
    """The record of ``base``'s hierarchical form under ``scheme`` (``base.hierarchical``)."""
    leader = scheme == "leader"
    inter_bytes, inter_time = base.inter_bytes, base.inter_time
    assert inter_bytes is not None and inter_time is not None

    def bytes_sent(n: int, world: Any, options: Any, rank: int) -> int:
        nodes, local = world.processes, world.devices_per_process
        node, l_rank = divmod(rank, local)

        def inter(m: int) -> int:
            return inter_bytes(m, nodes, node, world, options) if nodes > 1 else 0

        # A node's ranks share a process: its reduce-scatter and allgather are the
        # shared-memory ones, local rank l owning slice l.
        total = direct_rs_bytes(n, local, l_rank) + direct_ag_bytes(n, local, l_rank)
        if not leader or local == 1:
            total += inter(even_size(n, local, l_rank))
        elif l_rank == 0:
            total += inter(n) + (local - 1) * n * F32  # the sum, read by every rank
        return total

    def time(t: Any, n: int, world: Any, options: Any) -> None:
        nodes, local, link = world.processes, world.devices_per_process, world.inter_process
        # acc = x + r and zeroing the new residual, or the copy of x into the output.
        t.kernel("sum", 2 * n if base.residual else n)
        chunk = ceil_div(n, local)
        if local > 1:
            t.send("same_process", local - 1, (local - 1) * chunk * F32)
            t.kernel("sum", (local - 1) * chunk)
        if not leader or local == 1:
            # Every local rank runs its own inter-node allreduce through the process's link.
            inter_time(t, chunk, nodes, link, options, local)
            if local > 1:
                t.send("same_process", local - 1, (local - 1) * chunk * F32)
        else:
            t.send("same_process", local - 1, (local - 1) * chunk * F32)  # gather to leader
            inter_time(t, n, nodes, link, options, 1)
            t.send("same_process", local - 1, (local - 1) * n * F32)  # leader sends the sum

    label = "hierarchical_" + base.name + ("_leader" if leader else "")
    return dataclasses.replace(
        base,
        name=name_of(base.name, scheme),
        summary=f"{base.name} across nodes inside a hierarchical allreduce ({scheme})",
        order=order,
        targets={"flat": base.targets["hierarchical"]},
        cpu_only_targets=base.cpu_only_targets & {base.targets["hierarchical"]},
        metric_labels=(label,),
        bytes_sent=bytes_sent,
        time=time,
        inter_bytes=None,
        inter_time=None,
        hierarchical_planned=(),
        kernels=(),
        ops=None,
        auto_rank=None,
        auto_default=False,
        planned=scheme in base.hierarchical_planned,
        in_recipes=False,
        hierarchy=(base.name, scheme),
    )


def variants(bases: Iterable[Algorithm]) -> list[Algorithm]:
    """Every hierarchical form of ``bases``, ordered after them (by base, then scheme)."""
    bases = list(bases)
    top = max((b.order for b in bases), default=0)
    return [
        variant(b, scheme, top + 1 + len(SCHEMES) * b.order + s)
        for b in bases
        if b.hierarchical
        for s, scheme in enumerate(SCHEMES)
    ]
