"""The hierarchical (node, local) form of every algorithm that has one: ``hier_<name>`` and
``hier_<name>_leader``.

C++: ffi/quantized_allreduce.cc (HierarchicalAllreduce). Inside a node (on CPU: a process, its
devices the local ranks) the sum is reduced through shared memory, local rank l owning slice
l; across nodes the algorithm's own allreduce runs; the result is shared inside the node.
``multi_leader``: every local rank reduces its slice across nodes; ``leader``: local rank 0
reduces the whole vector and sends it to its node. Their cost is
:mod:`jaxcomm.cost.algorithm_costs._hierarchical`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from ._base import Algorithm

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
    assert base.hierarchical, base.name
    leader = scheme == "leader"
    label = "hierarchical_" + base.name + ("_leader" if leader else "")
    return dataclasses.replace(
        base,
        name=name_of(base.name, scheme),
        summary=f"{base.name} across nodes inside a hierarchical allreduce ({scheme})",
        order=order,
        targets={"flat": base.targets["hierarchical"]},
        cpu_only_targets=base.cpu_only_targets & {base.targets["hierarchical"]},
        metric_labels=(label,),
        hierarchical_planned=(),
        ops=None,
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
