"""``topk_allgather``: every rank's local top-k, allgathered and summed, O(kP) bytes.

C++: ffi/topk_allgather.cc (CPU), ffi/cuda/compress.cc (CUDA).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._base import F32
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


def _bytes(n: int, world: Any, options: Any, rank: int) -> int:
    return (world.ranks - 1) * 2 * options.k(n) * F32


def _time(t: Any, n: int, world: Any, options: Any) -> None:
    p, k = world.ranks, options.k(n)
    t.kernel("topk", n)
    t.kernel("topk.entry", k)
    t.kernel("sum", n)  # memset of the dense result
    t.kernel("sum", p * k)  # scatter-add of every rank's set
    if p > 1:
        t.send(world.flat_link(), p - 1, (p - 1) * 2 * k * F32)


ALGORITHM = sparse_algorithm(
    "topk_allgather",
    TopKAllgather,
    "jaxcomm_topk_allgather",
    summary="local top-k of every rank, allgathered and summed, O(kP) bytes",
    order=20,
    bytes_sent=_bytes,
    time=_time,
    auto_rank=2,
    auto_default=True,
)
