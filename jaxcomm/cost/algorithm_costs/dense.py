"""The cost of ``dense``, jaxcomm's own allreduce (``jaxcomm.allreduce``), and its 16-bit wire.

The schedules of ffi/allreduce.h, by where the ranks are and by size: over a transport the
pipelined ring (large vectors) or recursive doubling (small ones); through shared memory (every
rank of the group on one host) the direct reduce-scatter + allgather or the one-shot read.
bfloat16 and float16 inputs travel as 16-bit words (ffi/allreduce_half.cc).
"""

from __future__ import annotations

import functools
from typing import Any

from ... import config
from ...algorithms._base import ceil_div
from ._base import F32, AlgorithmCost, even_size

SMALL_ALLREDUCE_SETTING = "JAXCOMM_SMALL_ALLREDUCE_BYTES"
"""The setting (declared in :data:`jaxcomm.config.SETTINGS`, read by ffi/allreduce.cc)."""


@functools.cache  # the C++ library reads the setting once per process, so reading it once fits
def small_allreduce_bytes() -> int:
    """The largest dense float32 allreduce (bytes) that takes the small-vector schedules.

    ``JAXCOMM_SMALL_ALLREDUCE_BYTES``, read through :func:`jaxcomm.config.get` exactly as the
    C++ library reads it (ffi/allreduce.h; its default is declared once, in
    :data:`jaxcomm.config.SETTINGS`): vectors up to this size run recursive doubling over a
    transport and the one-shot read through shared memory, larger ones the ring and the direct
    reduce-scatter + allgather. No library call: the cost model stays light.

    Returns:
      Bytes (0: the small-vector schedules are off).

    Example:
      >>> small_allreduce_bytes() >= 0
      True
    """
    return int(config.get(SMALL_ALLREDUCE_SETTING))


def ring_bytes(n: int, parts: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in jaxcomm's ring allreduce of ``n`` float32 over ``parts``.

    The reduce-scatter sends every chunk but ``rank + 1``, the allgather every chunk but
    ``rank + 2`` (ffi/allreduce.cc).

    Args:
      n: elements.
      parts: ranks in the ring.
      rank: this rank's index in the ring.

    Returns:
      Bytes sent.

    Example:
      >>> ring_bytes(10, 2, 0)
      40
    """
    if parts <= 1:
        return 0
    return F32 * (2 * n - even_size(n, parts, rank + 1) - even_size(n, parts, rank + 2))


def direct_rs_bytes(n: int, parts: int, rank: int, element_bytes: int = F32) -> int:
    """Bytes peers read from ``rank`` in the shared-memory reduce-scatter (DirectReduceScatter).

    The peers read every slice of this rank's input but its own (its notices go through shared
    memory, not a transport).

    Example:
      >>> direct_rs_bytes(10, 2, 0)
      20
    """
    if parts <= 1:
        return 0
    return element_bytes * (n - even_size(n, parts, rank))


def direct_ag_bytes(n: int, parts: int, rank: int, element_bytes: int = F32) -> int:
    """Bytes peers read from ``rank`` in the shared-memory allgather: its reduced slice each.

    Example:
      >>> direct_ag_bytes(10, 2, 0)
      20
    """
    if parts <= 1:
        return 0
    return (parts - 1) * element_bytes * even_size(n, parts, rank)


def direct_bytes(n: int, parts: int, rank: int, element_bytes: int = F32) -> int:
    """Bytes rank ``rank`` sends in jaxcomm's shared-memory allreduce of ``n`` elements.

    Ranks of one host read each other's memory (ffi/direct_allreduce.h): the bytes a rank
    "sends" are those its peers read from it (every slice of its input but its own, then its
    reduced slice to each peer). The same 2(P-1)/P·n as the ring for even slices, through
    memory instead of a link; the ranks' notices live in shared memory and send nothing.
    The metric labels ``dense_direct`` (float32) and ``dense_bf16_direct`` /
    ``dense_f16_direct`` (2-byte elements) count these bytes.

    Args:
      n: elements.
      parts: ranks in the group.
      rank: this rank's index in the group.
      element_bytes: bytes per element: 4 (float32) or 2 (bfloat16, float16).

    Returns:
      Bytes sent.

    Example:
      >>> direct_bytes(10, 2, 0)
      40
      >>> direct_bytes(10, 2, 0, element_bytes=2)
      20
    """
    if element_bytes not in (2, F32):
        raise ValueError(f"element_bytes must be 2 or 4, got {element_bytes}")
    return direct_rs_bytes(n, parts, rank, element_bytes) + direct_ag_bytes(
        n, parts, rank, element_bytes
    )


def _doubling_rounds(parts: int) -> tuple[int, int]:
    """(log2 of the largest power of two p2 <= parts, ranks that fold in pairs)."""
    p2 = 1 << (parts.bit_length() - 1)
    return p2.bit_length() - 1, 2 * (parts - p2)


def doubling_bytes(n: int, parts: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in jaxcomm's recursive-doubling allreduce of ``n`` float32.

    Every exchange sends the whole vector (ffi/allreduce.cc, DoublingAllreduce). When ``parts``
    is not a power of two, the first 2(P - p2) ranks pair up: the even one sends its vector
    once and receives the result, the odd one exchanges for both and sends the result back.

    Args:
      n: elements.
      parts: ranks in the group.
      rank: this rank's index in the group.

    Returns:
      Bytes sent.

    Example:
      >>> [doubling_bytes(10, 3, r) for r in range(3)]
      [40, 80, 40]
    """
    if parts <= 1:
        return 0
    rounds, paired = _doubling_rounds(parts)
    if rank < paired:
        return F32 * n * (1 if rank % 2 == 0 else rounds + 1)
    return F32 * n * rounds


def oneshot_bytes(n: int, parts: int, rank: int) -> int:
    """Bytes rank ``rank`` "sends" in jaxcomm's one-shot shared-memory allreduce of ``n`` float32.

    Every peer reads all of this rank's input (ffi/direct_allreduce.h, DirectAllreduceOneShot).

    Args:
      n: elements.
      parts: ranks in the group.
      rank: this rank's index in the group (every rank sends as much).

    Returns:
      Bytes sent.

    Example:
      >>> oneshot_bytes(10, 3, 0)
      80
    """
    del rank
    return (parts - 1) * F32 * n if parts > 1 else 0


def dense_bytes(n: int, parts: int, rank: int, shared_memory: bool) -> int:
    """Bytes rank ``rank`` sends in ``jaxcomm.allreduce`` of ``n`` float32 over ``parts`` ranks.

    The schedule of ffi/allreduce.h: by where the ranks are (``shared_memory``: one host) and
    by size (:func:`small_allreduce_bytes`).

    Args:
      n: elements.
      parts: ranks in the group.
      rank: this rank's index in the group.
      shared_memory: whether every rank of the group reads the others' memory (one host).

    Returns:
      Bytes sent.

    Example:
      >>> dense_bytes(1 << 20, 2, 0, shared_memory=False) == ring_bytes(1 << 20, 2, 0)
      True
    """
    small = F32 * n <= small_allreduce_bytes()
    if shared_memory:
        return (oneshot_bytes if small else direct_bytes)(n, parts, rank)
    return (doubling_bytes if small else ring_bytes)(n, parts, rank)


def ring_path(n: int, parts: int) -> tuple[int, int]:
    """Latency steps and bytes on the critical path of jaxcomm's ring allreduce.

    2(P-1) steps (reduce-scatter, then allgather), each moving one chunk of ``ceil(n / P)``
    floats. A chunk travels in pipelined segments (ffi/allreduce.cc), which overlap, so the
    latency is counted once per step, not per segment.

    Args:
      n: elements.
      parts: ranks in the ring.

    Returns:
      ``(steps, bytes)`` one rank sends in sequence.

    Example:
      >>> ring_path(1 << 20, 4)
      (6, 6291456)
    """
    if parts <= 1 or n == 0:
        return 0, 0
    steps = 2 * (parts - 1)
    return steps, steps * ceil_div(n, parts) * F32


def dense_path(n: int, parts: int, shared_memory: bool) -> tuple[int, int, int]:
    """The critical path of ``jaxcomm.allreduce``'s schedule (ffi/allreduce.h) of n float32.

    Over a transport: recursive doubling (small vectors) or the pipelined ring. Through shared
    memory: the one-shot (small) or the direct reduce-scatter + allgather, whose "messages"
    are notice rounds and whose bytes are what a rank reads from its peers.

    Args:
      n: elements.
      parts: ranks in the group.
      shared_memory: whether the ranks read each other's memory (one host).

    Returns:
      ``(messages, bytes, summed)``: latency steps and bytes one rank moves in sequence, and
      the elements its reductions add (beyond the first copy of x into the output).

    Example:
      >>> dense_path(1 << 20, 4, shared_memory=False)
      (6, 6291456, 786432)
    """
    if parts <= 1 or n == 0:
        return 0, 0, 0
    if F32 * n <= small_allreduce_bytes():
        if shared_memory:
            return 2, (parts - 1) * n * F32, (parts - 1) * n
        rounds, paired = _doubling_rounds(parts)
        steps = rounds + (2 if paired else 0)
        return steps, steps * n * F32, (rounds + (1 if paired else 0)) * n
    chunk = ceil_div(n, parts)
    if shared_memory:
        return 3, 2 * (parts - 1) * chunk * F32, (parts - 1) * chunk
    steps, nbytes = ring_path(n, parts)
    return steps, nbytes, (parts - 1) * chunk


def half_path(n: int, parts: int, shared_memory: bool) -> tuple[int, int, int]:
    """The critical path of the 16-bit wire (ffi/allreduce_half.cc) for n bf16/f16 elements.

    A pairwise reduce-scatter of 16-bit chunks to their owners, float32 sums, a ring allgather
    of the rounded chunks: 2(P - 1) messages over a transport (three notice rounds through
    shared memory), each of one chunk of ``ceil(n / P)`` 2-byte words, whatever the size
    (it has no small-vector schedule).

    Args:
      n: elements.
      parts: ranks in the group.
      shared_memory: whether the ranks read each other's memory (one host).

    Returns:
      ``(messages, bytes, summed)`` as :func:`dense_path`.

    Example:
      >>> half_path(1 << 20, 4, shared_memory=False)
      (6, 3145728, 786432)
    """
    if parts <= 1 or n == 0:
        return 0, 0, 0
    chunk = ceil_div(n, parts)
    messages = 3 if shared_memory else 2 * (parts - 1)
    return messages, 2 * (parts - 1) * chunk * 2, (parts - 1) * chunk


def dense_time(
    t: Any, n: int, parts: int, link: str, options: Any = None, contention: int = 1
) -> None:
    """Adds ``jaxcomm.allreduce``'s schedule of n elements over ``link``: :func:`dense_path`,
    or :func:`half_path` for 16-bit elements (``options.element_bytes == 2``)."""
    shared_memory = link != "across_hosts"
    half = options is not None and options.element_bytes == 2
    messages, nbytes, summed = (half_path if half else dense_path)(n, parts, shared_memory)
    if messages == 0:
        return
    t.send(link, messages, nbytes, contention)
    t.kernel("sum", summed)
    if link == "same_host" and (half or F32 * n > small_allreduce_bytes()):
        t.kernel("sum", n)  # staging: x into this rank's shared area


def _bytes(n: int, world: Any, options: Any, rank: int) -> int:
    if options.element_bytes == 2:  # the 16-bit wire: pairwise reduce-scatter, ring allgather
        return direct_bytes(n, world.ranks, rank, element_bytes=2) if world.ranks > 1 else 0
    return dense_bytes(n, world.ranks, rank, shared_memory=world.flat_link() != "across_hosts")


def _time(t: Any, n: int, world: Any, options: Any) -> None:
    t.kernel("sum", n)  # x into the output: a copy, or the first pass of the reduction
    dense_time(t, n, world.ranks, world.flat_link(), options)


def _inter_bytes(m: int, parts: int, rank: int, world: Any, options: Any) -> int:
    return dense_bytes(m, parts, rank, shared_memory=world.inter_process == "same_host")


COST = AlgorithmCost(
    "dense", _bytes, _time, _inter_bytes, dense_time, auto_rank=0, auto_default=True
)
