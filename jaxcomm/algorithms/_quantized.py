"""The quantized allreduce that one-bit, threshold, adaptive and block quantization share.

C++: ffi/quantized_allreduce.cc (flat and hierarchical; CUDA in ffi/cuda/
quantized_allreduce.cc), kernels/quantized_slices.h. Dryden et al. (2016, §3.4): the vector is
cut into P slices at whole units (a quantizer's column, or one element); each rank quantizes
every slice and sends it to its owner; the owner decodes the P contributions, sums and
requantizes them; a ring allgather shares the sums.

A quantizer module gets its registry record's targets and FFI attributes from here
(:func:`quantizer_algorithm`); its cost is :mod:`jaxcomm.cost.algorithm_costs._quantized`'s.
"""

from __future__ import annotations

from typing import Any

from ._base import Algorithm


def quantizer_algorithm(kind: str, **fields: Any) -> Algorithm:
    """The registry record of quantizer ``kind``: the shared targets, named ``kind`` (also its
    metrics label, its ``jaxcomm.ops`` module and its C++ quantizer table entry), plus
    ``fields`` (spec, build, settings, ...; a field given here replaces the shared one).

    Args:
      kind: the quantizer's name (``"onebit"``, ...): its entry in the C++ quantizer table
        (kernels/quantizer_table.h).
      **fields: the rest of the record.

    Returns:
      The :class:`Algorithm`.
    """
    shared: dict[str, Any] = {
        "name": kind,
        "ops": kind,  # jaxcomm/ops/<kind>.py
        "targets": {
            "flat": "jaxcomm_quantized_allreduce",
            "hierarchical": "jaxcomm_hierarchical_quantized",
        },
        "metric_labels": (kind,),
        "residual": True,
        "quantizer": kind,
        "attributes": lambda spec, n: quantizer_attributes(spec, _kind_number(kind)),
    }
    # A quantizer may bring its own targets (BlockQuant's take a step operand).
    return Algorithm(**{**shared, **fields})


def _kind_number(name: str) -> int:
    from .._ffi import quantizer_kind  # the JAX side only, as the attributes are

    return quantizer_kind(name)


def quantizer_attributes(spec: Any, kind: int) -> dict[str, Any]:
    """The ``quantizer`` FFI attribute of a quantizer spec (``OneBit``, ``Threshold``, ...).

    One dictionary, decoded once into the handlers' ``QuantizerAttrs``
    (ffi/quantized_common.h), as kernels/quantized_slices.h ``QuantizerSpec`` holds it. A spec
    gives the fields it has (``column_size``, ``sample_size``, ``proportion``, ``tau``,
    ``max_density``; ``bits``, ``block`` (as the column size), ``rounding``,
    ``error_feedback`` and ``seed`` of ``BlockQuant``); the others take the neutral values the
    kernels ignore.

    Args:
      spec: the quantizer.
      kind: its kind number in the C++ quantizer table (``jaxcomm._ffi.quantizer_kind``).

    Returns:
      ``{"quantizer": ...}``, to pass as keyword attributes of the FFI call.

    Example:
      >>> from jaxcomm.algorithms.onebit import OneBit
      >>> sorted(quantizer_attributes(OneBit(column_size=64), 0)["quantizer"])[:3]
      ['bits', 'column_size', 'error_feedback']
    """
    import numpy as np  # the JAX side only

    from .. import _jax_compat

    return {
        "quantizer": _jax_compat.dict_attribute(
            kind=np.int64(kind),
            column_size=np.int64(getattr(spec, "column_size", getattr(spec, "block", 1024))),
            sample_size=np.int64(getattr(spec, "sample_size", 0)),
            proportion=np.float64(getattr(spec, "proportion", 1.0)),
            tau=np.float32(getattr(spec, "tau", 1.0)),
            max_density=np.float64(getattr(spec, "max_density", 1.0)),
            bits=np.int64(getattr(spec, "bits", 8)),
            stochastic=np.bool_(getattr(spec, "rounding", "nearest") == "stochastic"),
            error_feedback=np.bool_(getattr(spec, "error_feedback", True)),
            seed=np.int64(getattr(spec, "seed", 0)),
        )
    }
