"""``threshold``: threshold quantization with error feedback (Strom 2015; Dryden et al. §3.2).

Kernels: kernels/threshold.cc (ops: jaxcomm/ops/threshold.py); the allreduce is the shared
quantized allreduce (:mod:`jaxcomm.algorithms._quantized`). Its bytes depend on the data: the
cost model assumes ``Options.threshold_fraction`` of the entries pass ``tau``.
"""

from __future__ import annotations

import dataclasses
import math

from .. import _checks
from ._base import Setting, fraction
from ._quantized import quantizer_algorithm

TAU = Setting(
    "tau",
    float,
    3.0,
    lambda v: v > 0.0,
    "> 0",
    "threshold of threshold quantization (only used to build the compressor).",
)
MAX_DENSITY = fraction(
    "max_density", 1.0, "capacity of threshold quantization (fraction of a slice).", zero=False
)


@dataclasses.dataclass(frozen=True)
class Threshold:
    """Threshold quantization with error feedback (Strom 2015; Dryden et al. §3.2).

    Entries with ``acc > tau`` are sent as ``+tau``, ``acc < -tau`` as ``-tau``; the rest stay in
    the residual. In ``compressed_allreduce`` each slice's owner requantizes the sum with the
    same strict test, as in the paper, so an entry that only one rank sent (a sum of exactly
    ``+-tau``) goes back to the owner's residual; over one rank nothing is ever sent.

    Args:
      tau: the threshold, > 0.
      max_density: at most ``ceil(max_density * n)`` entries are sent per call (fixed buffer
        size for XLA); the lowest indices win and the others stay in the residual.

    Example:
      >>> import jaxcomm
      >>> jaxcomm.Threshold(0.01, max_density=0.1).packed_words(1000)
      101
    """

    tau: float
    max_density: float = 1.0

    def __post_init__(self) -> None:
        tau = _checks.finite_float(self.tau, "tau")
        if tau <= 0.0:
            raise ValueError(f"tau must be > 0, got {tau}; e.g. Threshold(0.01)")
        max_density = _checks.finite_float(self.max_density, "max_density")
        if not 0.0 < max_density <= 1.0:
            raise ValueError(f"max_density must be in (0, 1], got {max_density}")
        object.__setattr__(self, "tau", tau)
        object.__setattr__(self, "max_density", max_density)

    def capacity(self, n: int) -> int:
        """Largest number of entries one call can send for ``n`` elements."""
        return min(n, max(1, math.ceil(self.max_density * n)))

    def packed_words(self, n: int) -> int:
        """Length of the packed uint32 buffer for ``n`` elements."""
        return 1 + self.capacity(n)


ALGORITHM = quantizer_algorithm(
    "threshold",
    summary="threshold quantization with error feedback (needs a tuned tau)",
    order=60,
    spec=Threshold,
    settings=(TAU, MAX_DENSITY),
)
