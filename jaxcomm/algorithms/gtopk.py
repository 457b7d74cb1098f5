"""``gtopk``: gTop-k sparse allreduce (Shi et al. 2019), a tree of sparse ⊤ merges, O(k log P).

C++: ffi/gtopk.cc (CPU), ffi/cuda/gtopk.cc (CUDA), the schedule in ffi/gtopk_schedule.h.
"""

from __future__ import annotations

import dataclasses

from ._sparse import Density, sparse_algorithm


@dataclasses.dataclass(frozen=True)
class GTopK(Density):
    """gTop-k sparse allreduce (Shi et al. 2019): a tree of ⊤ merges, O(k log P).

    The result holds the k entries of largest magnitude of the (tree-merged) sum; local values
    that did not make it stay in the residuals, so nothing is lost.

    Args:
      density: fraction of elements selected, in (0, 1].

    Example:
      >>> import jaxcomm
      >>> jaxcomm.GTopK(0.01).k(1000)
      10
    """


ALGORITHM = sparse_algorithm(
    "gtopk",
    GTopK,
    "jaxcomm_gtopk",
    summary="gTop-k sparse allreduce: a tree of top-k merges, O(k log P) bytes",
    order=30,
)
