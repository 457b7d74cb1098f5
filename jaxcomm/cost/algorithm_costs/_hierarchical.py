"""The cost of the hierarchical (node, local) forms (:mod:`jaxcomm.algorithms._hierarchical`):
``hier_<name>`` and ``hier_<name>_leader``.

C++: ffi/quantized_allreduce.cc (HierarchicalAllreduce). Inside a node the sum is reduced
through shared memory, local rank l owning slice l; across nodes the base algorithm's own
allreduce runs (its cost's ``inter_bytes``/``inter_time``); the result is shared inside the
node. ``multi_leader``: every local rank reduces its slice across nodes; ``leader``: local
rank 0 reduces the whole vector and sends it to its node.
"""

from __future__ import annotations

from typing import Any

from ...algorithms import Algorithm
from ...algorithms._base import ceil_div
from ._base import F32, AlgorithmCost, even_size
from .dense import direct_ag_bytes, direct_rs_bytes


def variant(form: Algorithm, base: AlgorithmCost) -> AlgorithmCost:
    """The cost of hierarchical form ``form`` (its record's ``hierarchy`` names its base and
    scheme), from its base's cost ``base``."""
    assert form.hierarchy is not None and form.hierarchy[0] == base.name, form.name
    inter_bytes, inter_time = base.inter_bytes, base.inter_time
    assert inter_bytes is not None and inter_time is not None, base.name
    leader = form.hierarchy[1] == "leader"
    residual = form.residual

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
        t.kernel("sum", 2 * n if residual else n)
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

    return AlgorithmCost(form.name, bytes_sent, time, settings=base.settings)
