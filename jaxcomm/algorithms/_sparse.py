"""``TopK``: the top-k compressor, and :class:`Density`, the density and ``k`` it shares with the
sparse allreduces (``TopKAllgather``, ``GTopK``), whose registry records
:func:`sparse_algorithm` fills in, with the cost-model setting they read, :data:`DENSITY`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .. import _checks
from ._base import Algorithm, fraction

DENSITY = fraction(
    "density", 0.001, "ρ of TopK-allgather and gTop-k (``k = max(1, ceil(ρ n))``).", zero=False
)
"""``cost.Options.density``, the one setting of the sparse allreduces."""


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


def sparse_algorithm(name: str, spec: type[Density], target: str, **fields: Any) -> Algorithm:
    """The registry record of a sparse allreduce: what the top-k allreduces share, plus ``fields``.

    Its spec is built from the cost model's density (:data:`DENSITY`, its one setting), its one
    FFI attribute is
    ``k``, it keeps an error-feedback residual and follows the warm-up density schedules;
    ``name`` is also its metrics label.

    Args:
      name: its name (:attr:`Algorithm.name`).
      spec: its :class:`Density` subclass.
      target: its flat XLA FFI target, as registered.
      **fields: the rest of the record (summary, order, ...).

    Returns:
      The :class:`Algorithm`.

    Example:
      >>> record = sparse_algorithm("t", TopK, "jaxcomm_t", summary="", order=0)
      >>> record.build(type("Options", (), {"density": 0.5})())
      TopK(density=0.5)
    """
    return Algorithm(
        name=name,
        spec=spec,
        targets={"flat": target},
        metric_labels=(name,),
        attributes=k_attribute,
        residual=True,
        uses_density=True,
        settings=(DENSITY,),
        **fields,
    )
