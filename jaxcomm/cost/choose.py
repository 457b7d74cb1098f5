"""Choosing an algorithm: predictions for every candidate, and the one with the least predicted
time to target (its seconds times the steps it needs relative to dense).

Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .. import algorithms
from ..algorithms import get as _record
from ..algorithms._hierarchical import name_of as hierarchical_name
from .model import (
    ALGORITHMS,
    AUTO_CHOICES,
    DEFAULT_ALLOWED,
    Options,
    Profile,
    World,
    steps_factor_of,
)
from .timemodel import predict

__all__ = ["choose", "plan"]


def plan(
    sizes: Sequence[int],
    world: World,
    profile: Profile | None = None,
    options: Options | None = None,
    algorithms: Iterable[str] = ALGORITHMS,
    allowed: Iterable[str] | None = None,
    overlap: bool = False,
    hidden_seconds: float = 0.0,
    steps_factor: Mapping[str, float] | None = None,
    compute_seconds: float = 0.0,
) -> dict[str, Any]:
    """Predictions for every algorithm and size, and the pick (what ``jaxcomm plan`` prints).

    The pick, like ``auto``'s, has the least predicted time to target: seconds times the
    steps the algorithm needs relative to dense (``steps_factor``).

    Args:
      sizes: gradient sizes in elements per rank; the pick is made for the sum of one call
        per size (a step that reduces each of them once, e.g. one call per bucket).
      world: the ranks.
      profile: alpha/beta/gamma (default :data:`DEFAULT_PROFILE`).
      options: compressor settings.
      algorithms: algorithms to predict (default: all of :data:`ALGORITHMS`).
      allowed: algorithms the pick may be (default: all predicted ones but the leaf-shaped
        ``powersgd``, whose row models each size as one near-square matrix, a bound for the
        shapes it would really see, not a bucket it could reduce).
      overlap: see :func:`predict`.
      hidden_seconds: see :func:`predict` (per call).
      steps_factor: steps relative to dense (default :data:`DEFAULT_STEPS_FACTOR`).
      compute_seconds: the rest of the step (forward, backward, optimizer), paid again by
        every extra step.

    Returns:
      ``{"pick": {"algorithm", "elements", "bytes_sent_per_rank", "seconds", "steps_factor"},
      "predictions": [{"algorithm", "elements", "processes", "devices_per_process",
      "bytes_sent_per_rank", "seconds"}, ...]}``.

    Raises:
      ValueError: no sizes, or ``allowed`` shares no algorithm with ``algorithms``.

    Example:
      >>> plan([1 << 20], World(processes=2))["pick"]["algorithm"] in ALGORITHMS
      True
    """
    sizes = [int(s) for s in sizes]
    if not sizes:
        raise ValueError("plan needs at least one gradient size")
    algorithms = list(algorithms)
    if allowed is None:
        allowed = [a for a in algorithms if _record(a).leafwise is None]
    candidates = [a for a in algorithms if a in set(allowed)]
    if not candidates:
        raise ValueError(f"allowed={allowed!r} names none of the algorithms {algorithms}")
    predictions = []
    totals: dict[str, list[float]] = {}
    for n in sizes:
        for a in algorithms:
            p = predict(a, n, world, profile, options, overlap, hidden_seconds)
            keys = ("algorithm", "elements", "processes", "devices_per_process")
            row = {k: getattr(p, k) for k in keys}
            row.update(bytes_sent_per_rank=p.bytes_sent_per_rank, seconds=p.seconds)
            predictions.append(row)
            acc = totals.setdefault(a, [0.0, 0.0])
            acc[0] += p.seconds
            acc[1] += p.bytes_sent_per_rank
    best = min(
        candidates,
        key=lambda a: (
            (totals[a][0] + compute_seconds) * steps_factor_of(a, steps_factor),
            candidates.index(a),
        ),
    )
    pick = {
        "algorithm": best,
        "elements": sum(sizes),
        "bytes_sent_per_rank": totals[best][1],
        "seconds": totals[best][0],
        "steps_factor": steps_factor_of(best, steps_factor),
    }
    return {"pick": pick, "predictions": predictions}


def choose(
    n: int,
    world: World,
    allowed: Iterable[str] = DEFAULT_ALLOWED,
    profile: Profile | None = None,
    options: Options | None = None,
    hierarchical: bool = False,
    steps_factor: Mapping[str, float] | None = None,
    compute_seconds: float = 0.0,
) -> str:
    """The algorithm among ``allowed`` with the least predicted time to target for one call on
    ``n`` elements: its seconds times the steps it needs relative to dense.

    Args:
      n: elements per rank.
      world: the ranks.
      allowed: names from :data:`AUTO_CHOICES`.
      profile: default :data:`DEFAULT_PROFILE`.
      options: compressor settings.
      hierarchical: the call is hierarchical (node, local): only dense and the quantizers
        have hierarchical forms, so the sparse names are skipped.
      steps_factor: steps relative to dense (default :data:`DEFAULT_STEPS_FACTOR`).
      compute_seconds: the rest of the step this call belongs to (its share of forward,
        backward and the optimizer): every extra step pays it again, so a compressor whose
        call saves less than that is not worth its extra steps.

    Returns:
      A name from ``allowed``; ties go to the earlier one.

    Raises:
      ValueError: nothing in ``allowed`` is usable.

    Example:
      >>> choose(25_000_000, World(4, 1, "across_hosts"), ("dense", "gtopk"))
      'gtopk'
      >>> choose(4810, World(2, 1, "across_hosts"))  # a small gradient: not worth the steps
      'dense'
    """
    for name in allowed:
        if name not in AUTO_CHOICES:
            raise ValueError(f"unknown auto choice {name!r}; allowed: {AUTO_CHOICES}")
    allowed = [a for a in allowed if not hierarchical or algorithms.get(a).hierarchical]
    if not allowed:
        raise ValueError("no allowed algorithm has a hierarchical form; allow 'dense'")
    best, best_time = None, math.inf
    for name in allowed:
        model = hierarchical_name(name) if hierarchical else name
        seconds = predict(model, n, world, profile, options).seconds
        seconds = (seconds + compute_seconds) * steps_factor_of(name, steps_factor)
        if seconds < best_time:
            best, best_time = name, seconds
    return best
