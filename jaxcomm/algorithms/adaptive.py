"""``adaptive``: adaptive quantization with error feedback (Dryden et al. 2016, §3.3).

Kernels: kernels/adaptive.cc (ops: jaxcomm/ops/adaptive.py); the allreduce is the shared
quantized allreduce (:mod:`jaxcomm.algorithms._quantized`). Its bytes depend on the data: the
cost model assumes balanced signs and ``Options.selection_overlap`` between the ranks' picks.
"""

from __future__ import annotations

import dataclasses
import math

from .. import _checks
from ._base import Setting, ceil_div
from ._quantized import quantizer_algorithm
from .onebit import COLUMN_SIZE

PROPORTION = Setting(
    "proportion", float, 64.0, lambda v: v >= 1.0, ">= 1", "π of adaptive quantization."
)
"""``cost.Options.proportion``: :attr:`Adaptive.proportion`."""


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Adaptive quantization with error feedback (Dryden et al. 2016, §3.3).

    Per column, the ``min(k+, ceil((k+ + k0) / proportion))`` largest positive and
    ``min(k-, ceil((k- + k0) / proportion))`` most negative values are sent (k+/k-/k0: the
    column's positive/negative/zero counts), each decoded to the mean of the values of its
    sign that were sent. Zeros are never sent, but they count: the paper takes k as the
    number of *non-negative* values (§3.3), mirrored here for the negative sign. On a dense
    gradient this is ``ceil(k± / proportion)``; on the sparse sum that the quantized
    allreduce requantizes (§3.4) it keeps about 1/π of the column instead of 1/π of the
    sum's few nonzeros, which is what keeps the owners' residuals bounded.

    Args:
      proportion: π >= 1; about 1/π of each sign's values are sent per column.
      column_size: elements per column.
      sample_size: 0 selects exactly; a positive value estimates each column's thresholds
        from that many sampled entries (the paper's fast variant).

    Example:
      >>> import jaxcomm
      >>> jaxcomm.Adaptive(proportion=64).capacity(1024)
      34
    """

    proportion: float = 64.0
    column_size: int = 1024
    sample_size: int = 0

    def __post_init__(self) -> None:
        proportion = _checks.finite_float(self.proportion, "proportion")
        if proportion < 1.0:
            raise ValueError(f"proportion must be >= 1, got {proportion}; e.g. Adaptive(64)")
        object.__setattr__(self, "proportion", proportion)
        _checks.positive_int(self.column_size, "column_size", low=1)
        _checks.positive_int(self.sample_size, "sample_size", low=0)

    def num_columns(self, n: int) -> int:
        """Number of columns that ``n`` elements form."""
        return ceil_div(n, self.column_size)

    def column_capacity(self, length: int) -> int:
        """Largest number of entries sent from one column of ``length`` elements."""
        return min(length, 2 * math.ceil(length / self.proportion) + 2)

    def capacity(self, n: int) -> int:
        """Largest number of entries one call can send for ``n`` elements."""
        full, tail = divmod(n, self.column_size)
        return full * self.column_capacity(self.column_size) + (
            self.column_capacity(tail) if tail else 0
        )

    def packed_words(self, n: int) -> int:
        """Length of the packed uint32 buffer for ``n`` elements."""
        return 1 + 2 * self.num_columns(n) + self.capacity(n)


ALGORITHM = quantizer_algorithm(
    "adaptive",
    summary="adaptive quantization with error feedback, quantized allreduce",
    order=40,
    spec=Adaptive,
    settings=(PROPORTION, COLUMN_SIZE),
    hierarchical_planned=("multi_leader",),
)
