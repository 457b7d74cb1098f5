"""FFI attributes shared by several collectives (C++ in ffi/quantized_allreduce.cc).

- :func:`quantizer_attributes`: the quantizer of the quantized allreduce, flat or hierarchical
  (``jaxcomm.compressed_allreduce`` with ``OneBit``, ``Threshold`` or ``Adaptive``);
- :func:`hierarchical_attributes`: the (node, local) axes and scheme of *both* hierarchical
  allreduces, the dense one (``jaxcomm.allreduce(..., hierarchical=True)``) and the quantized
  one.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxcomm import _jax_compat
from jaxcomm.collectives import _mesh
from jaxcomm.compressors import Adaptive, OneBit, Threshold

Quantizer = OneBit | Threshold | Adaptive
QUANTIZERS = (OneBit, Threshold, Adaptive)


class QuantizerKind(enum.IntEnum):
    """The ``kind`` attribute: kernels/quantized_slices.h ``enum class QuantizerKind``."""

    ONEBIT = 0  # kOneBit
    THRESHOLD = 1  # kThreshold
    ADAPTIVE = 2  # kAdaptive


# Multi-leader (every local rank allreduces 1/L of the vector across nodes) measured faster
# than a single leader per node (benchmarks/allreduce.py, 4 nodes x 2 local devices), so it is
# the default; "leader" keeps the IBM slides' single-leader scheme for comparison.
HIERARCHICAL_SCHEMES = {"multi_leader": 0, "leader": 1}


def quantizer_attributes(c: Quantizer) -> dict[str, Any]:
    """The ``quantizer`` FFI attribute of quantizer `c`.

    One dictionary, decoded once into the handlers' ``QuantizerAttrs`` (ffi/quantized_common.h),
    as kernels/quantized_slices.h ``QuantizerSpec`` holds it.

    Args:
      c: a ``OneBit``, ``Threshold`` or ``Adaptive`` compressor.

    Returns:
      ``{"quantizer": ...}``, to pass as keyword attributes of the FFI call.

    Example:
      >>> from jaxcomm.compressors import OneBit
      >>> sorted(quantizer_attributes(OneBit(column_size=64))["quantizer"])[:3]
      ['column_size', 'kind', 'max_density']
    """
    kind, column_size, sample_size = QuantizerKind.ONEBIT, 1024, 0
    proportion, tau, max_density = 1.0, 1.0, 1.0
    if isinstance(c, Threshold):
        kind, tau, max_density = QuantizerKind.THRESHOLD, c.tau, c.max_density
    else:
        column_size, sample_size = c.column_size, c.sample_size
        if isinstance(c, Adaptive):
            kind, proportion = QuantizerKind.ADAPTIVE, c.proportion
    return {
        "quantizer": _jax_compat.dict_attribute(
            kind=np.int64(kind),
            column_size=np.int64(column_size),
            sample_size=np.int64(sample_size),
            proportion=np.float64(proportion),
            tau=np.float32(tau),
            max_density=np.float64(max_density),
        )
    }


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
