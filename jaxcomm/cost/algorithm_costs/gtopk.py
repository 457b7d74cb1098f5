"""The cost of ``gtopk``, the gTop-k sparse allreduce (Shi et al. 2019): O(k log P) bytes.

The schedule of ffi/gtopk_schedule.h: a tree of sparse top-k merges to rank 0, and the
broadcast down the same tree.
"""

from __future__ import annotations

from typing import Any

from ._base import F32, AlgorithmCost


def schedule(rank: int, parts: int) -> list[tuple[str, int]]:
    """(op, tag) of rank's steps in ffi/gtopk_schedule.h: "send", "merge" (receive + merge)
    or "recv".

    Fold the ranks above the largest power of two p2, a binomial tree of merges to rank 0, the
    broadcast down the same tree, the unfold.

    Example:
      >>> schedule(1, 2)
      [('send', 1), ('recv', 2)]
    """
    steps: list[tuple[str, int]] = []
    p2 = 1
    while p2 * 2 <= parts:
        p2 *= 2
    extra = parts - p2
    tag = 0
    if rank >= p2:
        steps.append(("send", tag))
    elif rank < extra:
        steps.append(("merge", tag))
    tag += 1
    sent_up = rank >= p2
    d = 1
    while d < p2:
        if not sent_up:
            if rank % (2 * d) == d:
                steps.append(("send", tag))
                sent_up = True
            elif rank % (2 * d) == 0:
                steps.append(("merge", tag))
        d *= 2
        tag += 1
    d = p2 // 2
    while d >= 1:
        if rank < p2:
            if rank % (2 * d) == 0:
                steps.append(("send", tag))
            elif rank % (2 * d) == d:
                steps.append(("recv", tag))
        d //= 2
        tag += 1
    if rank < extra:
        steps.append(("send", tag))
    elif rank >= p2:
        steps.append(("recv", tag))
    return steps


def gtopk_sends(rank: int, parts: int) -> int:
    """Number of sparse sets rank ``rank`` sends in gTop-k over ``parts`` ranks.

    Args:
      rank: group rank.
      parts: group size.

    Returns:
      Messages of ``2k`` words this rank sends (:func:`schedule`).

    Example:
      >>> [gtopk_sends(r, 4) for r in range(4)]
      [2, 1, 2, 1]
    """
    return sum(1 for op, _ in schedule(rank, parts) if op == "send")


def _bytes(n: int, world: Any, options: Any, rank: int) -> int:
    return gtopk_sends(rank, world.ranks) * 2 * options.k(n) * F32


def _time(t: Any, n: int, world: Any, options: Any) -> None:
    p, k = world.ranks, options.k(n)
    t.kernel("topk", n)
    t.kernel("topk.entry", k)
    t.kernel("sum", n)  # memset of the dense result
    # Rank 0 is on the critical path: fold, tree merges, broadcast sends, unfold.
    steps = schedule(0, p)
    depth = len(steps)
    merges = sum(1 for op, _ in steps if op == "merge")
    t.kernel("merge", merges * 2 * k)
    t.kernel("sum", k)
    if p > 1:
        t.send(world.flat_link(), depth, depth * 2 * k * F32)


COST = AlgorithmCost(
    name="gtopk",
    bytes_sent=_bytes,
    time=_time,
    kernels=("merge",),  # gTop-k's sparse merge, per input entry
    auto_rank=1,
    auto_default=True,
)
