"""``onebit``: one-bit quantization with error feedback (Seide et al.; Dryden et al. §3.1).

Kernels: kernels/onebit.cc (ops: jaxcomm/ops/onebit.py); the allreduce is the shared
quantized allreduce (:mod:`jaxcomm.algorithms._quantized`).
"""

from __future__ import annotations

import dataclasses

from .. import _checks
from ._base import Setting, ceil_div
from ._quantized import quantizer_algorithm

COLUMN_SIZE = Setting(
    "column_size",
    int,
    1024,
    lambda v: v >= 32 and v % 32 == 0,
    "a positive multiple of 32",
    "column length of one-bit and adaptive quantization.",
)
"""``cost.Options.column_size``: :class:`OneBit`'s columns (whole uint32 words of bits);
adaptive quantization reads it too."""


@dataclasses.dataclass(frozen=True)
class OneBit:
    """One-bit quantization with error feedback (Seide et al.; Dryden et al. §3.1).

    Each column of ``column_size`` consecutive elements is encoded as one bit per element plus
    the means of its non-negative and of its negative values.

    Args:
      column_size: elements per column, a positive multiple of 32.
      sample_size: 0 computes exact column means; a positive value estimates each mean from
        that many sampled entries per column (fewer operations, error feedback absorbs the bias).

    Example:
      >>> import jaxcomm
      >>> jaxcomm.OneBit().packed_words(1024)
      35
    """

    column_size: int = 1024
    sample_size: int = 0

    def __post_init__(self) -> None:
        column_size = _checks.positive_int(self.column_size, "column_size", low=32)
        if column_size % 32:
            raise ValueError(f"column_size must be a multiple of 32, got {column_size}")
        _checks.positive_int(self.sample_size, "sample_size", low=0)

    def num_columns(self, n: int) -> int:
        """Number of columns that ``n`` elements form."""
        return ceil_div(n, self.column_size)

    def packed_words(self, n: int) -> int:
        """Length of the packed uint32 buffer for ``n`` elements."""
        return 1 + 2 * self.num_columns(n) + ceil_div(n, 32)


ALGORITHM = quantizer_algorithm(
    "onebit",
    summary="one-bit quantization with error feedback, quantized allreduce",
    order=50,
    spec=OneBit,
    settings=(COLUMN_SIZE,),
)
