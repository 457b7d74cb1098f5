"""``topk_allgather``: every rank's local top-k, allgathered and summed, O(kP) bytes.

C++: ffi/topk_allgather.cc (CPU), ffi/cuda/compress.cc (CUDA).
"""

from __future__ import annotations

import dataclasses

from ._sparse import Density, sparse_algorithm


@dataclasses.dataclass(frozen=True)
class TopKAllgather(Density):
    """Sparse allreduce baseline: local top-k, allgather of (index, value), sum — O(kP).

    Args:
      density: fraction of elements each rank contributes, in (0, 1].

    Example:
      >>> import jaxcomm
      >>> jaxcomm.TopKAllgather(0.001).k(1_000_000)
      1000
    """


ALGORITHM = sparse_algorithm(
    "topk_allgather",
    TopKAllgather,
    "jaxcomm_topk_allgather",
    summary="local top-k of every rank, allgathered and summed, O(kP) bytes",
    order=20,
)
