"""The byte ledger: exact bytes one rank sends in one call of each algorithm.

Each algorithm's schedule lives in its cost module (:mod:`jaxcomm.cost.algorithm_costs`),
following the C++ message by message (the ring's chunks, gTop-k's tree, the quantized allreduce's slices and
``used`` words); this module sums them per world and re-exports the schedule helpers the
tests, the probe and the benchmarks use. The counts equal what ``jaxcomm.metrics()`` reports
for the same call. Standard library only.
"""

from __future__ import annotations

from .. import algorithms
from . import algorithm_costs
from .algorithm_costs.dense import (
    dense_bytes,
    direct_bytes,
    doubling_bytes,
    oneshot_bytes,
    ring_bytes,
    small_allreduce_bytes,
)
from .algorithm_costs.gtopk import gtopk_sends
from .model import Options, World

__all__ = [
    "bytes_sent",
    "check_elements",
    "dense_bytes",
    "direct_bytes",
    "doubling_bytes",
    "gtopk_sends",
    "oneshot_bytes",
    "quantized_bytes",
    "ring_bytes",
    "small_allreduce_bytes",
]


def check_elements(n: int) -> None:
    """Raises ValueError unless ``n`` is an integer >= 0 (elements per rank)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n (elements) must be an integer >= 0, got {n!r}")


def quantized_bytes(kind: str, n: int, parts: int, rank: int, options: Options) -> int:
    """Bytes rank ``rank`` sends in the quantized allreduce (ffi/quantized_allreduce.cc).

    Pairwise reduce-scatter (``used`` words of slice ``rank + k`` to its owner, k = 1..P-1),
    then a ring allgather of the requantized sums (slices ``rank - k``, k = 0..P-2).

    Args:
      kind: a quantizer's name: ``"onebit"``, ``"threshold"`` or ``"adaptive"``.
      n: elements.
      parts: ranks.
      rank: group rank.
      options: compressor settings and data assumptions.

    Returns:
      Bytes sent.

    Example:
      >>> quantized_bytes("onebit", 2048, 2, 0, Options())
      280
    """
    inter_bytes = algorithm_costs.get(kind).inter_bytes
    if algorithms.get(kind).quantizer is None or inter_bytes is None:
        raise ValueError(
            f"{kind!r} is not a quantizer; known: {[q.name for q in algorithms.quantizers()]}"
        )
    return inter_bytes(n, parts, rank, None, options)


def bytes_sent(
    algorithm: str, n: int, world: World, options: Options | None = None, rank: int | None = None
) -> float:
    """Bytes one rank sends in one call of ``algorithm`` over all ranks of ``world``.

    Equal to ``jaxcomm.metrics()``'s ``bytes_sent`` for the same call (``psum``: the ring
    volume, which XLA does not report).

    Args:
      algorithm: a registered name (:func:`jaxcomm.algorithms.registered`: those of
        ``ALGORITHMS``, and ``hier_onebit``, ``hier_threshold`` and the ``_leader`` forms).
      n: float32 elements per rank.
      world: the ranks.
      options: compressor settings (default :class:`Options`).
      rank: a world rank (process-major); None: the mean over all ranks.

    Returns:
      Bytes (an integer value for one rank, the mean otherwise).

    Example:
      >>> bytes_sent("dense", 100_000, World(processes=4))
      600000.0
    """
    options = options or Options()
    record = algorithm_costs.get(algorithm)
    check_elements(n)
    if rank is None:
        return sum(bytes_sent(algorithm, n, world, options, r) for r in range(world.ranks)) / (
            world.ranks
        )
    if not 0 <= rank < world.ranks:
        raise ValueError(f"rank must be in [0, {world.ranks}), got {rank}")
    if n == 0 or world.ranks == 1:
        return 0.0
    return float(record.bytes_sent(n, world, options, rank))
