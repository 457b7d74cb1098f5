"""``psum``: XLA's own allreduce (``lax.psum``; Gloo on CPU, NCCL on GPU), the baseline.

jaxcomm does not run it, so it has no spec, no FFI target and no metrics; the cost model
treats it as a black box: its measured line (``cost.Profile.psum``), never faster than a ring
over the same links.
"""

from __future__ import annotations

from typing import Any

from ._base import Algorithm
from .dense import ring_bytes, ring_path


def _bytes(n: int, world: Any, options: Any, rank: int) -> int:
    return ring_bytes(n, world.ranks, rank)  # the ring volume (XLA does not report its bytes)


def _time(t: Any, n: int, world: Any, options: Any) -> None:
    p = world.ranks
    if p <= 1:
        return
    # XLA's collectives are a black box: their measured line, but never faster than the links
    # allow a ring to be (a profile from loopback planning a network).
    messages, nbytes = ring_path(n, p)
    wire = t.profile.links[world.flat_link()].seconds(messages, nbytes)
    fitted = t.profile.psum.seconds(1, ring_bytes(n, p, 0))
    t.comm += max(fitted, wire)
    t.messages += messages


ALGORITHM = Algorithm(
    name="psum",
    summary="XLA's lax.psum, the baseline",
    order=0,
    build=lambda options: None,
    bytes_sent=_bytes,
    time=_time,
)
