"""The quantized allreduce that one-bit, threshold, adaptive and block quantization share.

C++: ffi/quantized_allreduce.cc (flat and hierarchical; CUDA in ffi/cuda/
quantized_allreduce.cc), kernels/quantized_slices.h. Dryden et al. (2016, §3.4): the vector is
cut into P slices at whole units (a quantizer's column, or one element); each rank quantizes
every slice and sends it to its owner (a pairwise reduce-scatter of ``used`` words); the owner
decodes the P contributions, sums and requantizes them; a ring allgather shares the sums.

A quantizer module describes its own words per slice (:class:`Schedule`) and gets its byte
ledger, time model and FFI attributes from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ._base import F32, Algorithm, ceil_div

WordsFn = Callable[[int, Any, int, str], int]
"""``(m, options, parts, stage) -> used words`` of one slice of ``m`` elements; stage
``"send"``: a rank's own contribution, ``"sum"``: the owner's requantized sum of ``parts``."""


def slice_range(n: int, parts: int, q: int, unit: int) -> tuple[int, int]:
    """Elements [begin, end) of slice ``q``: kernels/quantized_slices.cc ``SliceRange``.

    Whole units; the first ``units % parts`` slices get one unit more.

    Example:
      >>> [slice_range(100, 2, q, 32) for q in range(2)]
      [(0, 64), (64, 100)]
    """
    units = ceil_div(n, unit)

    def unit_begin(s: int) -> int:
        return s * (units // parts) + min(s, units % parts)

    return min(n, unit_begin(q) * unit), min(n, unit_begin(q + 1) * unit)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The quantized allreduce of one quantizer.

    Attributes:
      kind: the quantizer's name (``"onebit"``, ...): its entry in the C++ quantizer table
        (kernels/quantizer_table.h), its kernels' ``quantize.<kind>`` and ``decode.<kind>``.
      words: :data:`WordsFn`.
      unit: ``options -> elements`` a slice boundary must be a multiple of.
    """

    kind: str
    words: WordsFn
    unit: Callable[[Any], int]

    def slices(self, n: int, parts: int, options: Any) -> tuple[list[int], list[int], list[int]]:
        """(slice lengths, words sent per slice, words of the requantized sum per slice)."""
        unit = self.unit(options)
        lengths = [b - a for a, b in (slice_range(n, parts, q, unit) for q in range(parts))]
        send = [self.words(m, options, parts, "send") if m else 1 for m in lengths]
        summed = [self.words(m, options, parts, "sum") if m else 1 for m in lengths]
        return lengths, send, summed

    def bytes(self, n: int, parts: int, rank: int, options: Any) -> int:
        """Bytes rank ``rank`` sends in the quantized allreduce (ffi/quantized_allreduce.cc).

        Pairwise reduce-scatter (``used`` words of slice ``rank + k`` to its owner,
        k = 1..P-1), then a ring allgather of the requantized sums (slices ``rank - k``,
        k = 0..P-2).
        """
        if parts <= 1:
            return 0
        _, send, summed = self.slices(n, parts, options)
        words = sum(send[(rank + k) % parts] for k in range(1, parts))
        words += sum(summed[(rank - k) % parts] for k in range(parts - 1))
        return F32 * words

    def time(
        self, t: Any, n: int, parts: int, link: str, options: Any, pairwise_flows: int = 1
    ) -> None:
        """Adds the quantized allreduce of n floats over ``parts`` ranks to tally ``t``."""
        kind = self.kind
        if parts <= 1 or n == 0:
            t.kernel(f"quantize.{kind}", n)
            t.kernel(f"decode.{kind}", n)
            return
        lengths, send, summed = self.slices(n, parts, options)
        m = max(lengths)
        t.kernel(f"quantize.{kind}", n + m)  # every slice, then the owned sum
        t.kernel(f"decode.{kind}", parts * m + n)  # P contributions, then every sum
        t.kernel("sum", m + n)  # the requantization error into the residual; zeroing out
        t.send(link, parts - 1, (parts - 1) * max(send) * F32, pairwise_flows)
        t.send(link, parts - 1, (parts - 1) * max(summed) * F32)

    def algorithm(self, **fields: Any) -> Algorithm:
        """The registry record of this quantizer: the shared targets and models, named
        :attr:`kind` (also its metrics label, its ``jaxcomm.ops`` module and its C++ table
        entry), plus ``fields`` (spec, build, kernels, ...; a field given here replaces the
        shared one)."""

        def flat_bytes(n: int, world: Any, options: Any, rank: int) -> int:
            return self.bytes(n, world.ranks, rank, options)

        def flat_time(t: Any, n: int, world: Any, options: Any) -> None:
            # Ranks of one process that send across its boundary at once in the pairwise
            # exchange.
            flows = world.devices_per_process if world.processes > 1 else 1
            self.time(t, n, world.ranks, world.flat_link(), options, flows)

        def inter_bytes(m: int, parts: int, rank: int, world: Any, options: Any) -> int:
            return self.bytes(m, parts, rank, options)

        def inter_time(
            t: Any, m: int, parts: int, link: str, options: Any, contention: int
        ) -> None:
            self.time(t, m, parts, link, options, contention)

        shared: dict[str, Any] = {
            "name": self.kind,
            "ops": self.kind,  # jaxcomm/ops/<kind>.py
            "targets": {
                "flat": "jaxcomm_quantized_allreduce",
                "hierarchical": "jaxcomm_hierarchical_quantized",
            },
            "metric_labels": (self.kind,),
            "bytes_sent": flat_bytes,
            "time": flat_time,
            "inter_bytes": inter_bytes,
            "inter_time": inter_time,
            "residual": True,
            "quantizer": self.kind,
            "attributes": lambda spec, n: quantizer_attributes(spec, _kind_number(self.kind)),
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
