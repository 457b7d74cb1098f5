"""``algorithm="auto"`` under a density schedule: one :class:`Auto` per phase, and the phases
auto follows.

``jaxcomm.optax.allreduce_gradients`` asks this module, at trace time, which phases a step
compiles and which buckets stay out of the schedule's ``lax.switch``; the decisions are the
cost model's (:func:`warmup_pays`), the same on every rank. Standard library only: the caller
passes the facts it reads from JAX (axis size, process layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .. import algorithms
from .auto import Auto, warmup_pays

__all__ = ["at_density", "follow_schedule"]


def at_density(auto: Auto | str, density: float) -> Auto:
    """``auto`` (``"auto"``: the defaults) whose sparse candidates use ``density``.

    Each phase of a density schedule chooses per bucket with that phase's density (in a dense
    warm-up phase a sparse algorithm is expensive, and auto may pick another), so auto's
    sparse choices follow the same warm-up as explicit ones.

    Args:
      auto: ``"auto"`` or an :class:`Auto`.
      density: the phase's density.

    Returns:
      An :class:`Auto` with ``options.density == density``.

    Example:
      >>> at_density("auto", 0.25).options.density
      0.25
    """
    base = Auto() if isinstance(auto, str) else auto
    return dataclasses.replace(base, options=dataclasses.replace(base.options, density=density))


def follow_schedule(
    phases: Sequence[Any],
    starts: Sequence[int],
    bucket_sizes: Sequence[int],
    axis_size: int,
    processes: int,
    devices_per_process: int,
    hierarchical: bool,
    element_bytes: int,
) -> tuple[list[Any], list[int]]:
    """The phases auto follows, and the buckets that choose the same density-free algorithm
    in every one of them.

    The phases are the schedule, or its last phase from the first step when the cost model
    predicts the target sooner without the warm-up (:func:`warmup_pays`; static, the same on
    every rank). A bucket whose choice never changes can be reduced outside the schedule's
    ``lax.switch``: the switch's operands are copied in and out of its branches, so a gradient
    inside it costs even when every branch sends it alike (docs/e2e.md).

    Args:
      phases: each phase's ``"auto"`` or :class:`Auto` (the schedule's, as
        ``allreduce_gradients`` normalized it).
      starts: each phase's first step, increasing, the first 0.
      bucket_sizes: elements of each bucket of the step.
      axis_size, processes, devices_per_process, hierarchical, element_bytes: as
        :func:`jaxcomm.cost.resolve_auto` (``element_bytes``: the step's dense wire).

    Returns:
      ``(phases, fixed)``: the phases to compile (one, with ``steps_factor_no_warmup`` as its
      factors, when the warm-up does not pay) and the indices of the buckets outside the
      switch.

    Example:
      >>> phases = [at_density("auto", 0.25), at_density("auto", 0.01)]
      >>> follow_schedule(phases, [0, 10], [1000], 2, 2, 1, False, 4)[1]
      [0]
    """
    autos = [Auto() if isinstance(p, str) else p for p in phases]  # "auto": defaults
    auto = autos[-1]
    decision = warmup_pays(
        auto,
        list(bucket_sizes),
        [int(s) for s in starts],
        [a.options.density for a in autos],
        axis_size,
        processes,
        devices_per_process,
        hierarchical,
        element_bytes,
    )
    if not decision["warmup"]:
        # Without the warm-up the choices weigh the steps they need without it.
        return [dataclasses.replace(auto, steps_factor=auto.steps_factor_no_warmup)], []
    choices = decision["choices"]
    fixed = [
        b
        for b in range(len(bucket_sizes))
        if len({names[b] for names in choices}) == 1
        and not algorithms.get(choices[-1][b]).uses_density
    ]
    return list(phases), fixed
