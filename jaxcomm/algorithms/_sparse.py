"""``TopK``: the top-k compressor, and :class:`Density`, the density and ``k`` it shares with the
sparse allreduces (``TopKAllgather``, ``GTopK``)."""

from __future__ import annotations

import dataclasses
import math

from .. import _checks


@dataclasses.dataclass(frozen=True)
class Density:
    """What the top-k specs share: a density in (0, 1] and ``k = max(1, ceil(density * n))``.

    Example:
      >>> Density(0.01).k(1000)
      10
    """

    density: float

    def __post_init__(self) -> None:
        density = _checks.finite_float(self.density, "density")
        if not 0.0 < density <= 1.0:
            raise ValueError(
                f"density must be in (0, 1], got {density}; e.g. {type(self).__name__}(0.001)"
            )
        object.__setattr__(self, "density", density)

    def k(self, n: int) -> int:
        """Number of entries selected out of ``n`` (per rank, or of the global result)."""
        return min(n, max(1, math.ceil(self.density * n)))


@dataclasses.dataclass(frozen=True)
class TopK(Density):
    """Sparse top-k by magnitude with error feedback (Strom/Aji & Heafield; Shi et al.).

    Args:
      density: fraction of elements sent, in (0, 1]; ``k = max(1, ceil(density * n))``.

    Example:
      >>> import jaxcomm
      >>> jaxcomm.TopK(0.001).k(25_000_000)
      25000
    """

    def packed_words(self, n: int) -> int:
        """Length of the packed uint32 buffer for ``n`` elements."""
        return 1 + 2 * self.k(n)


def k_attribute(spec: Density, n: int) -> dict:
    """The ``k`` FFI attribute of the sparse collectives (bound in ffi/collective_handler.h)."""
    import numpy as np  # the JAX side only

    return {"k": np.int64(spec.k(n))}
