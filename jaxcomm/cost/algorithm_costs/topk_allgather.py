"""The cost of ``topk_allgather``: every rank's local top-k, allgathered and summed, O(kP)
bytes (ffi/topk_allgather.cc)."""

from __future__ import annotations

from typing import Any

from ._base import F32, AlgorithmCost


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


COST = AlgorithmCost(
    name="topk_allgather", bytes_sent=_bytes, time=_time, auto_rank=2, auto_default=True
)
