"""The cost of ``psum``, XLA's own allreduce (``lax.psum``): a black box to the cost model.

Its bytes are the ring's volume (XLA does not report its bytes); its time is its measured line
(``cost.Profile.psum``), never faster than a ring over the same links.
"""

from __future__ import annotations

from typing import Any

from ._base import AlgorithmCost
from .dense import ring_bytes, ring_path


def _bytes(n: int, world: Any, options: Any, rank: int) -> int:
    return ring_bytes(n, world.ranks, rank)


def _time(t: Any, n: int, world: Any, options: Any) -> None:
    p = world.ranks
    if p <= 1:
        return
    # The fitted line alone would let a profile taken over loopback plan a network faster
    # than its links allow; the ring's wire time bounds it from below.
    messages, nbytes = ring_path(n, p)
    wire = t.profile.links[world.flat_link()].seconds(messages, nbytes)
    fitted = t.profile.psum.seconds(1, ring_bytes(n, p, 0))
    t.comm += max(fitted, wire)
    t.messages += messages


COST = AlgorithmCost(name="psum", bytes_sent=_bytes, time=_time)
