"""The cost of ``blockquant`` in the shared quantized allreduce (:mod:`._quantized`): fixed
size, ``bits``-bit codes and one float32 scale per block."""

from __future__ import annotations

from typing import Any

from ...algorithms.blockquant import BlockQuant
from ._quantized import Schedule


def _words(m: int, options: Any, parts: int, stage: str) -> int:
    # Fixed size: the same for a contribution and for the requantized sum.
    return BlockQuant(bits=options.bits, block=options.block).packed_words(m)


COST = Schedule("blockquant", _words, unit=lambda options: options.block).cost(
    # `jaxcomm probe` measures both on a cluster.
    kernels=("quantize.blockquant", "decode.blockquant"),
    auto_rank=6,  # after the others on an exact tie of predicted time to target
    auto_default=True,
)
