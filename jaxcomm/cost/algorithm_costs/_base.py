"""The record every algorithm's cost module fills in (its byte ledger, time model, local kernels
and place among ``algorithm="auto"``'s candidates), and the arithmetic their schedules share.

Standard library only. The functions receive the cost model's ``World``, ``Options`` and time
tally as arguments rather than importing them, so this package loads before
:mod:`jaxcomm.cost.model`, which reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ...algorithms import Setting

F32 = 4
"""Bytes per float32 value or uint32 word."""


def even_begin(n: int, parts: int, chunk: int) -> int:
    """First element of chunk ``chunk`` when ``n`` elements split into ``parts`` near-even chunks.

    ffi/quantized_common.h ``EvenBegin`` and ffi/allreduce.cc ``ChunkBegin``: the first
    ``n % parts`` chunks hold one element more.

    Example:
      >>> [even_begin(10, 3, c) for c in range(4)]
      [0, 4, 7, 10]
    """
    return chunk * (n // parts) + min(chunk, n % parts)


def even_size(n: int, parts: int, chunk: int) -> int:
    """Elements of chunk ``chunk % parts`` of :func:`even_begin`'s split.

    Example:
      >>> even_size(10, 3, 0), even_size(10, 3, 4)
      (4, 3)
    """
    chunk %= parts
    return even_begin(n, parts, chunk + 1) - even_begin(n, parts, chunk)


BytesFn = Callable[[int, Any, Any, int], int]
"""``(n, world, options, rank) -> bytes`` that world rank ``rank`` sends (n > 0, P > 1)."""

TimeFn = Callable[[Any, int, Any, Any], None]
"""``(tally, n, world, options)``: adds one call's critical path to the cost model's tally."""

TreeBytesFn = Callable[[Any, Any, Any, int], int]
"""``(shapes, world, options, rank) -> bytes`` that world rank ``rank`` sends in one step of a
leaf-shaped algorithm over gradient leaves of ``shapes``."""

TreeTimeFn = Callable[[Any, Any, Any, Any], None]
"""``(tally, shapes, world, options)``: adds one step of a leaf-shaped algorithm over leaves of
``shapes`` to the cost model's tally."""

InterBytesFn = Callable[[int, int, int, Any, Any], int]
"""``(m, parts, rank, world, options) -> bytes`` of the inter-node step of a hierarchical call."""

InterTimeFn = Callable[[Any, int, int, str, Any, int], None]
"""``(tally, m, parts, link, options, contention)``: the inter-node step's critical path."""


@dataclasses.dataclass(frozen=True)
class AlgorithmCost:
    """What the cost model knows of one algorithm of :mod:`jaxcomm.algorithms`.

    Attributes:
      name: the algorithm's registry name (one cost record per name).
      bytes_sent: its byte ledger (:data:`BytesFn`), following the C++ schedule message by
        message.
      time: its time model (:data:`TimeFn`).
      inter_bytes: the inter-node step when it runs inside a hierarchical allreduce (None
        where the algorithm has no hierarchical form).
      inter_time: likewise for the time model.
      tree_bytes: a leaf-shaped algorithm's byte ledger of one step over a gradient's leaf
        shapes (:data:`TreeBytesFn`; ``bytes_sent`` and ``time`` then model one call of n
        elements as one leaf of some shape).
      tree_time: likewise for the time model (:data:`TreeTimeFn`).
      kernels: the names of its own local kernels; their seconds per element are the gamma of
        ``cost.Profile``, measured data in jaxcomm/cost/default_profile.json.
      auto_rank: its place among ``algorithm="auto"``'s candidates (None: never chosen).
      auto_default: ``auto`` may choose it unless told otherwise.
      settings: the ``cost.Options`` fields only its cost model reads, what it assumes of the
        data (``threshold_fraction``), as :class:`~jaxcomm.algorithms.Setting` declarations;
        those that configure the spec are the algorithm's own (``Algorithm.settings``).
    """

    name: str
    bytes_sent: BytesFn
    time: TimeFn
    inter_bytes: InterBytesFn | None = None
    inter_time: InterTimeFn | None = None
    tree_bytes: TreeBytesFn | None = None
    tree_time: TreeTimeFn | None = None
    kernels: tuple[str, ...] = ()
    auto_rank: int | None = None
    auto_default: bool = False
    settings: tuple[Setting, ...] = ()
