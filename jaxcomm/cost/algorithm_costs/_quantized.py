"""The cost of the quantized allreduce that one-bit, threshold, adaptive and block
quantization share (ffi/quantized_allreduce.cc, kernels/quantized_slices.h).

Dryden et al. (2016, §3.4): the vector is cut into P slices at whole units (a quantizer's
column, or one element); each rank quantizes every slice and sends it to its owner (a pairwise
reduce-scatter of ``used`` words); the owner decodes the P contributions, sums and requantizes
them; a ring allgather shares the sums. A quantizer's cost module describes its own words per
slice (:class:`Schedule`) and gets its byte ledger and time model from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ...algorithms._base import ceil_div
from ._base import F32, AlgorithmCost

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

    def cost(self, **fields: Any) -> AlgorithmCost:
        """The cost record of this quantizer, named :attr:`kind`: the shared byte ledger and
        time model (flat and inside a hierarchical allreduce), plus ``fields`` (kernels,
        auto_rank, ...)."""

        def flat_bytes(n: int, world: Any, options: Any, rank: int) -> int:
            return self.bytes(n, world.ranks, rank, options)

        def flat_time(t: Any, n: int, world: Any, options: Any) -> None:
            # Ranks of one process that send across its boundary at once in the pairwise
            # exchange.
            flows = world.devices_per_process if world.processes > 1 else 1
            self.time(t, n, world.ranks, world.flat_link(), options, flows)

        def inter_bytes(m: int, parts: int, rank: int, world: Any, options: Any) -> int:
            return self.bytes(m, parts, rank, options)

        return AlgorithmCost(
            name=self.kind,
            bytes_sent=flat_bytes,
            time=flat_time,
            inter_bytes=inter_bytes,
            inter_time=self.time,
            **fields,
        )
