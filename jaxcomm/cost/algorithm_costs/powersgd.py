"""The cost of ``powersgd`` (:mod:`jaxcomm.algorithms.powersgd`): three dense allreduces per
compressed step (every leaf's P, every leaf's Q, the leaves sent dense) and the thin products.

The cost model's interface is one call on ``n`` elements, which knows no shape: it models the
``n`` elements as one near-square matrix (:func:`matrix_of`), the shape whose factors are
smallest for its size. :func:`tree_bytes` counts the exact bytes of a model's leaf shapes, as
``jaxcomm.metrics()`` reports them (tests/test_powersgd.py checks both).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ...algorithms.powersgd import ALGORITHM, PowerSGD
from . import dense
from ._base import AlgorithmCost


def matrix_of(n: int) -> tuple[int, int]:
    """The near-square matrix the cost model assumes for ``n`` elements: ``(rows, columns)``
    with ``rows = floor(sqrt(n))`` and ``columns = ceil(n / rows)``.

    Example:
      >>> matrix_of(1000)
      (31, 33)
    """
    rows = max(1, math.isqrt(n))
    return rows, -(-n // rows)


def tree_sizes(shapes: Sequence[Sequence[int]], spec: PowerSGD) -> tuple[int, int, int]:
    """Elements of the three allreduces of one compressed step over leaves of ``shapes``.

    Args:
      shapes: the gradient leaves' shapes.
      spec: the PowerSGD settings.

    Returns:
      ``(p, q, dense)``: elements of the P allreduce, of the Q allreduce and of the dense one.

    Example:
      >>> tree_sizes([(64, 4096), (4096,), (4096, 10)], PowerSGD(rank=4))
      (16640, 16424, 4096)
    """
    p = q = dense = 0
    for shape in shapes:
        plan = spec.plan(shape)
        if plan is None:
            dense += math.prod(shape)
        else:
            rows, columns, r = plan
            p, q = p + rows * r, q + columns * r
    return p, q, dense


def _calls(sizes: tuple[int, int, int], options: Any) -> list[tuple[int, Any]]:
    """``(elements, options)`` of the three dense allreduces of a compressed step: P and Q in
    float32, the dense leaves on the gradient's own wire (``options.element_bytes``)."""
    p, q, dense = sizes
    f32 = dataclasses.replace(options, element_bytes=4)
    return [(m, o) for m, o in ((dense, options), (p, f32), (q, f32)) if m]


def _charge_leaf(t: Any, rows: int, columns: int, r: int) -> None:
    # M = g + error, M - P Qᵀ, and the output: three passes over the leaf.
    t.kernel("sum", 3 * rows * columns)
    # P = M Q, Q = Mᵀ P and P Qᵀ: rows × columns × r multiply-adds each, plus the two
    # Gram-Schmidt passes (about 2 (rows + columns) r² multiply-adds).
    t.kernel("matmul", 3 * rows * columns * r + 2 * (rows + columns) * r * r)


def tree_bytes(shapes: Sequence[Sequence[int]], world: Any, options: Any, world_rank: int) -> int:
    """Bytes world rank ``world_rank`` sends in one compressed step over leaves of ``shapes``.

    Three dense allreduces (float32 P and Q; the dense leaves on their own wire, 16-bit for
    16-bit gradients: ``options.element_bytes``), each with the schedule ``jaxcomm.allreduce``
    picks for its size (the ``dense`` cost's byte ledger). The cost record's ``tree_bytes``.

    Args:
      shapes: the gradient leaves' shapes.
      world: a ``jaxcomm.cost.World`` (a flat group over all its ranks).
      options: a ``jaxcomm.cost.Options`` (rank, min_compression_rate, element_bytes).
      world_rank: the rank.

    Returns:
      Bytes sent.

    Example:
      >>> from jaxcomm import cost
      >>> tree_bytes([(64, 4096)], cost.World(2, 1, "across_hosts"), cost.Options(rank=4), 0)
      66560
    """
    if world.ranks == 1:
        return 0
    sizes = tree_sizes(shapes, ALGORITHM.build(options))
    return sum(dense.COST.bytes_sent(m, world, o, world_rank) for m, o in _calls(sizes, options))


def tree_time(t: Any, shapes: Sequence[Sequence[int]], world: Any, options: Any) -> None:
    """Adds one compressed step over leaves of ``shapes`` to the cost model's tally: each
    compressed leaf's passes and thin products, then the dense, P and Q allreduces (one call
    each, in sequence: Q depends on P, each with the profile's per-call overhead). The
    cost record's ``tree_time``.

    Args:
      t: a ``jaxcomm.cost.Tally``.
      shapes: the gradient leaves' shapes.
      world: a ``jaxcomm.cost.World``.
      options: a ``jaxcomm.cost.Options``.

    Example:
      >>> from jaxcomm import cost
      >>> t = cost.Tally(cost.DEFAULT_PROFILE)
      >>> tree_time(t, [(64, 4096), (4096,)], cost.World(2), cost.Options())
      >>> t.compute > 0 and t.comm > 0
      True
    """
    calls = _tree_time(t, shapes, world, options)
    t.compute += t.profile.call * calls


def _tree_time(t: Any, shapes: Sequence[Sequence[int]], world: Any, options: Any) -> int:
    spec = ALGORITHM.build(options)
    for shape in shapes:
        plan = spec.plan(shape)
        if plan is not None:
            _charge_leaf(t, *plan)
    calls = _calls(tree_sizes(shapes, spec), options)
    for m, o in calls:
        dense.COST.time(t, m, world, o)
    return len(calls)


def _bytes(n: int, world: Any, options: Any, rank: int) -> int:
    # One call of n elements: a near-square matrix (matrix_of), or dense when it does not gain.
    return tree_bytes([matrix_of(n)], world, options, rank)


def _time(t: Any, n: int, world: Any, options: Any) -> None:
    # cost.predict charges one call's overhead itself.
    _tree_time(t, [matrix_of(n)], world, options)


# matmul: per multiply-add of the thin products (`jaxcomm probe` measures it as gamma.matmul).
COST = AlgorithmCost(
    "powersgd", _bytes, _time, tree_bytes=tree_bytes, tree_time=tree_time, kernels=("matmul",)
)
