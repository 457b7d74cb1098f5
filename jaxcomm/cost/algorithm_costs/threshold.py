"""The cost of ``threshold`` in the shared quantized allreduce (:mod:`._quantized`).

Its bytes depend on the data: the cost model assumes ``Options.threshold_fraction`` of the
entries pass ``tau``.
"""

from __future__ import annotations

import math
from typing import Any

from ...algorithms._base import fraction
from ._quantized import Schedule

THRESHOLD_FRACTION = fraction(
    "threshold_fraction",
    0.003,
    "expected fraction of entries with ``|x + r| > tau`` (threshold sends "
    "``min(capacity, ceil(fraction m))`` entries per slice of m elements, and as many for the "
    "requantized sum); an assumed prior, not a measurement: set it from the run's data.",
)
"""``cost.Options.threshold_fraction``: what threshold's byte count assumes of the data."""


def _words(m: int, options: Any, parts: int, stage: str) -> int:
    # min(capacity, ceil(fraction m)) entries, for a contribution and for the sum alike.
    capacity = min(m, max(1, math.ceil(options.max_density * m)))
    return 1 + min(capacity, math.ceil(options.threshold_fraction * m))


COST = Schedule("threshold", _words, unit=lambda options: 1).cost(
    settings=(THRESHOLD_FRACTION,),
    kernels=("quantize.threshold", "decode.threshold"),
    auto_rank=5,
    auto_default=False,  # its bytes hang on a user-tuned tau: auto picks it only when allowed
)
