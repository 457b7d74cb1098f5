"""The ``hierarchy`` FFI attribute of both hierarchical allreduces (C++ in
ffi/quantized_allreduce.cc): the dense one (``jaxcomm.allreduce(..., hierarchical=True)``) and
the quantized one (``jaxcomm.compressed_allreduce`` with a quantizer and ``hierarchical=True``).

Each algorithm's own attributes (``k`` of the sparse ones, ``quantizer`` of the quantizers)
come from its module in :mod:`jaxcomm.algorithms` (``Algorithm.attributes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcomm import _jax_compat
from jaxcomm.algorithms._hierarchical import SCHEMES
from jaxcomm.collectives import _mesh

# Multi-leader (every local rank allreduces 1/L of the vector across nodes) measured faster
# than a single leader per node (benchmarks/allreduce.py, 4 nodes x 2 local devices), so it is
# the default; "leader" keeps the IBM slides' single-leader scheme for comparison.
HIERARCHICAL_SCHEMES = SCHEMES


def hierarchical_attributes(
    axis_name: str | Sequence[str], scheme: str, api: str
) -> dict[str, Any]:
    """Checks a hierarchical call's axes and returns its ``hierarchy`` FFI attribute.

    Args:
      axis_name: ``(node_axis, local_axis)``: the inter-node axis first, the intra-node one second.
      scheme: ``"multi_leader"`` or ``"leader"``.
      api: public function name, for errors.

    Returns:
      ``{"hierarchy": ...}``: one dictionary (``HierarchyAttrs`` in ffi/collective_handler.h) of
      ``node_axis``, ``local_axis`` (indices among the manual mesh axes) and ``leaders``.

    Raises:
      ValueError: not exactly two distinct axes of the enclosing mesh, or an unknown scheme.
    """
    if isinstance(axis_name, str) or len(tuple(axis_name)) != 2:
        raise ValueError(
            f"{api}: hierarchical=True needs axis_name=(node_axis, local_axis), two mesh axes "
            f"(e.g. ('node', 'local')); got axis_name={axis_name!r}"
        )
    if scheme not in HIERARCHICAL_SCHEMES:
        raise ValueError(
            f"{api}: hierarchical_scheme must be one of {sorted(HIERARCHICAL_SCHEMES)}, got {scheme!r}"
        )
    node, local = tuple(axis_name)
    layout = _mesh.resolve(axis_name, api)  # raises ValueError for unknown axes
    names = layout.axis_names
    leaders = 1 if scheme == "leader" else max(2, layout.axis_sizes[names.index(local)])
    return {
        "hierarchy": _jax_compat.dict_attribute(
            node_axis=np.int64(names.index(node)),
            local_axis=np.int64(names.index(local)),
            leaders=np.int64(leaders),
        )
    }
