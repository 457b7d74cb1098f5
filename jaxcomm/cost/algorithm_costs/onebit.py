"""The cost of ``onebit`` in the shared quantized allreduce (:mod:`._quantized`): a bit per
element and two means per column, for a contribution and for the requantized sum alike."""

from __future__ import annotations

from typing import Any

from ...algorithms.onebit import OneBit
from ._quantized import Schedule


def _words(m: int, options: Any, parts: int, stage: str) -> int:
    # The same for a contribution and for the requantized sum: a bit per element.
    return OneBit(options.column_size).packed_words(m)


COST = Schedule("onebit", _words, unit=lambda options: options.column_size).cost(
    kernels=("quantize.onebit", "decode.onebit"),
    auto_rank=4,
    auto_default=True,
)
