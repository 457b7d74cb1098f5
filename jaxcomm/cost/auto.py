"""``algorithm="auto"`` at trace time: each bucket's algorithm, chosen by the cost model, and
the log of the choices.

Standard library only, except :func:`auto_algorithm`, which runs while JAX traces a step and
asks JAX for the reduced axes' sizes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from .. import algorithms
from ..algorithms._hierarchical import name_of as hierarchical_name
from . import measure
from .choose import choose
from .model import (
    AUTO_CHOICES,
    DEFAULT_ALLOWED,
    DEFAULT_PROFILE,
    Options,
    Profile,
    World,
    steps_factor_of,
)
from .timemodel import predict

__all__ = [
    "Auto",
    "auto_algorithm",
    "auto_decisions",
    "resolve_auto",
    "warmup_pays",
]

_log = logging.getLogger("jaxcomm.cost")


@dataclasses.dataclass(frozen=True)
class Auto:
    """``algorithm`` of ``jaxcomm.optax.allreduce_gradients`` that picks per bucket.

    At trace time each bucket's algorithm is the one :func:`choose` predicts fastest for its
    static size and the static world: the same on every rank (a pure function of shapes, the
    mesh and the profile, which every rank must read from the same file).

    Args:
      allowed: names from :data:`AUTO_CHOICES` the choice may be (the convergence cost you
        accept); default :data:`DEFAULT_ALLOWED`.
      profile: a :class:`Profile`, a path to ``jaxcomm probe``'s JSON, or None: the run
        measures its own world before it decides (:mod:`jaxcomm.cost.measure`; until then,
        and where nothing could be measured, :data:`DEFAULT_PROFILE`).
      options: compressor settings of the candidates (density, proportion, tau, ...).
      steps_factor: steps each algorithm needs to reach dense's accuracy, relative to dense
        (default :data:`~jaxcomm.cost.DEFAULT_STEPS_FACTOR`); the pick minimizes
        ``factor × seconds``, the predicted time to target.
      compute_seconds: seconds of one training step besides the gradient reduction (forward,
        backward, optimizer), e.g. measured on one rank. Each bucket gets its share by size,
        and an algorithm's extra steps pay it again: with a small gradient the reduction is
        a sliver of the step and dense wins. None: 0 (only the reductions are weighed).
      dense_steps: steps dense training needs to reach the target. With
        ``steps_factor_no_warmup`` it lets auto decide a density schedule's warm-up
        (:func:`warmup_pays`): the warm-up's dense-ish first phases cost seconds per step, and
        dropping it costs steps. None: a schedule is always followed. A learning auto reads
        it as the run's length (:meth:`jaxcomm.cost.learn.Learning.for_run`).
      steps_factor_no_warmup: like ``steps_factor``, for training without the warm-up (the
        sparse choices at their final density from the first step).

    Example:
      >>> auto = Auto(allowed=("dense", "gtopk"), options=Options(density=0.01))
      >>> auto.allowed
      ('dense', 'gtopk')
    """

    allowed: tuple[str, ...] = DEFAULT_ALLOWED
    profile: Profile | str | None = None
    options: Options = dataclasses.field(default_factory=Options)
    steps_factor: Mapping[str, float] | None = None
    compute_seconds: float | None = None
    dense_steps: int | None = None
    steps_factor_no_warmup: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        allowed = (self.allowed,) if isinstance(self.allowed, str) else tuple(self.allowed)
        bad = [a for a in allowed if a not in AUTO_CHOICES]
        if bad or not allowed:
            raise ValueError(
                f"Auto.allowed must be a non-empty subset of {AUTO_CHOICES}, got {self.allowed!r}"
            )
        object.__setattr__(self, "allowed", allowed)
        for name in allowed:
            steps_factor_of(name, self.steps_factor)  # ValueError for a bad factor
            steps_factor_of(name, self.steps_factor_no_warmup)
        if self.dense_steps is not None and not (
            isinstance(self.dense_steps, int) and self.dense_steps >= 1
        ):
            raise ValueError(
                f"Auto.dense_steps must be an int >= 1 or None, got {self.dense_steps!r}"
            )
        if self.compute_seconds is not None and not (
            math.isfinite(self.compute_seconds) and self.compute_seconds >= 0
        ):
            raise ValueError(
                f"Auto.compute_seconds must be finite and >= 0, got {self.compute_seconds!r}"
            )
        if isinstance(self.profile, (str, pathlib.Path)):
            object.__setattr__(self, "profile", Profile.load(self.profile))

    def resolved_profile(self) -> Profile:
        """The profile in use: the one given, else the one measured for this world
        (:func:`jaxcomm.cost.measure.measure_world`), else :data:`DEFAULT_PROFILE`."""
        if isinstance(self.profile, Profile):
            return self.profile
        return measure.active() or DEFAULT_PROFILE


_decisions: list[dict[str, Any]] = []


def resolve_auto(
    auto: Auto | str,
    n: int,
    axis_size: int,
    processes: int,
    devices_per_process: int,
    hierarchical: bool = False,
    share: float = 1.0,
    element_bytes: int = 4,
) -> Any:
    """The algorithm ``allreduce_gradients`` uses for one bucket when ``algorithm="auto"``.

    Args:
      auto: ``"auto"`` (default :class:`Auto`) or an :class:`Auto`.
      n: the bucket's elements.
      axis_size: ranks reduced over (the product of the reduced mesh axes).
      processes: ``jax.process_count()``.
      devices_per_process: ``jax.local_device_count()``.
      hierarchical: the reduction is hierarchical over (node, local).
      share: the bucket's fraction of the step's gradient (its share of
        ``Auto.compute_seconds``).
      element_bytes: bytes per element of the bucket: 2 for bf16/f16 gradients, which dense
        sends on its 16-bit wire (half the bytes; the compressors quantize from float32).

    Returns:
      None for the dense allreduce, else a jaxcomm algorithm (``GTopK``, ...).

    Example:
      >>> resolve_auto(Auto(allowed=("dense",)), 1000, 2, 2, 1) is None
      True
      >>> resolve_auto(Auto(allowed=("gtopk",)), 1000, 2, 2, 1)
      GTopK(density=0.001)
    """
    if isinstance(auto, str):
        if auto != "auto":
            raise ValueError(f"algorithm string must be 'auto', got {auto!r}")
        auto = Auto()
    profile = auto.resolved_profile()
    world = _world(profile, axis_size, processes, devices_per_process)
    compute = (auto.compute_seconds or 0.0) * share
    options = dataclasses.replace(auto.options, element_bytes=element_bytes)
    name = choose(
        n, world, auto.allowed, profile, options, hierarchical, auto.steps_factor, compute
    )
    chosen = algorithms.build(name, auto.options)  # the spec, from the registry
    decision = {
        "elements": n,
        "processes": world.processes,
        "devices_per_process": world.devices_per_process,
        "choice": name,
        "element_bytes": element_bytes,
        "allowed": list(auto.allowed),
        "profile": profile.source,
        # The link numbers the choice read (measured ones when the world was measured).
        "link": {
            "class": world.flat_link(),
            **dataclasses.asdict(profile.links[world.flat_link()]),
        },
    }
    _decisions.append(decision)
    _log.info("jaxcomm auto: %d elements over %d ranks -> %s", n, axis_size, name)
    return chosen


def _world(profile: Profile, axis_size: int, processes: int, devices_per_process: int) -> World:
    # The reduced axis may span fewer ranks than the world (e.g. one axis of a 2-D mesh):
    # keep the world's devices per process where they divide it.
    local = math.gcd(axis_size, devices_per_process)
    nodes = max(1, axis_size // local)
    world = World(min(nodes, processes) if processes > 1 else 1, local, profile.inter_process)
    if world.ranks != axis_size:  # a world the model cannot split: treat it as flat
        world = World(axis_size, 1, profile.inter_process if processes > 1 else "same_host")
    return world


def warmup_pays(
    auto: Auto,
    buckets: Sequence[int],
    starts: Sequence[int],
    densities: Sequence[float],
    axis_size: int,
    processes: int,
    devices_per_process: int,
    hierarchical: bool = False,
    element_bytes: int = 4,
) -> dict[str, Any]:
    """Whether auto follows a density schedule's warm-up or sends at the final density from
    the first step: the one with the lesser predicted time to target; and each phase's
    choice per bucket.

    Each phase's step is its buckets' predicted reductions (each bucket's choice at that
    phase's density, as :func:`resolve_auto` makes it) plus ``compute_seconds``. A run needs
    ``dense_steps`` times the largest steps factor of its choices: ``steps_factor`` over
    every phase with the warm-up, ``steps_factor_no_warmup`` without. With the warm-up the
    run pays each phase's step for the steps it spends there. Without both ``dense_steps``
    and ``steps_factor_no_warmup`` the schedule is followed (nothing measured says otherwise).

    Args:
      auto: the :class:`Auto` (its profile, options, factors and compute).
      buckets: elements of each bucket of the step.
      starts: the schedule's start steps, increasing, the first 0.
      densities: each phase's density; the last is the density without the warm-up.
      axis_size, processes, devices_per_process, hierarchical, element_bytes: as
        :func:`resolve_auto`.

    Returns:
      ``{"warmup": bool, "with_s", "without_s", "choices"}``: the decision, the predicted
      seconds to target of each (None when not predicted), and each phase's choice per
      bucket with the warm-up (a list per phase, a name per bucket), which
      ``allreduce_gradients`` reads to keep a bucket whose choice never changes out of the
      schedule's ``lax.switch``.

    Example:
      >>> auto = Auto(allowed=("dense", "gtopk"), compute_seconds=0.01, dense_steps=100,
      ...             steps_factor={"gtopk": 1.0}, steps_factor_no_warmup={"gtopk": 1.0})
      >>> warmup_pays(auto, [25_000_000], [0, 50], [0.25, 0.001], 2, 2, 1)["warmup"]
      False
      >>> decision = warmup_pays(Auto(allowed=("dense",)), [1000, 10], [0, 50], [0.25, 0.001],
      ...                        2, 2, 1)  # nothing measured: the schedule is followed
      >>> decision["warmup"], decision["with_s"], decision["choices"]
      (True, None, [['dense', 'dense'], ['dense', 'dense']])
    """
    if len(starts) != len(densities) or not starts or starts[0] != 0:
        raise ValueError(f"starts must begin at 0 and pair with densities, got {starts}")
    profile = auto.resolved_profile()
    world = _world(profile, axis_size, processes, devices_per_process)

    def phase(
        density: float, factors: Mapping[str, float] | None
    ) -> tuple[list[str], float, float]:
        """(each bucket's choice, seconds per step, the largest steps factor of the choices)
        at ``density``."""
        options = dataclasses.replace(auto.options, density=density, element_bytes=element_bytes)
        names = _choices(auto, buckets, world, profile, options, hierarchical, factors)
        seconds, factor = auto.compute_seconds or 0.0, 1.0
        for n, name in zip(buckets, names, strict=True):
            model = hierarchical_name(name) if hierarchical else name
            seconds += predict(model, n, world, profile, options).seconds
            factor = max(factor, steps_factor_of(name, factors))
        return names, seconds, factor

    steps = [phase(d, auto.steps_factor) for d in densities]
    choices = [names for names, _, _ in steps]
    if auto.dense_steps is None or auto.steps_factor_no_warmup is None:
        return {"warmup": True, "with_s": None, "without_s": None, "choices": choices}
    # A warm-up run mixes its phases' choices: it needs the steps of the slowest to converge
    # (lbann-mlp: adaptive in the dense-ish phases, 146 steps, though gTop-k after the same
    # warm-up alone needed 86).
    run = auto.dense_steps * max(factor for *_, factor in steps)
    with_s = 0.0
    for i, (_, seconds, _) in enumerate(steps):
        end = starts[i + 1] if i + 1 < len(starts) else math.inf
        with_s += max(0.0, min(end, run) - starts[i]) * seconds
    _, seconds, factor = phase(densities[-1], auto.steps_factor_no_warmup)
    without_s = auto.dense_steps * factor * seconds
    decision = {"warmup": with_s <= without_s, "with_s": with_s, "without_s": without_s}
    _decisions.append({"warmup_decision": decision, "buckets": list(buckets)})
    return {**decision, "choices": choices}


def _choices(
    auto: Auto,
    buckets: Sequence[int],
    world: World,
    profile: Profile,
    options: Options,
    hierarchical: bool,
    factors: Mapping[str, float] | None,
) -> list[str]:
    """Each bucket's pick as :func:`resolve_auto` makes it: :func:`choose` with the bucket's
    share of the step's compute, which every extra step pays again."""
    total = max(1, sum(buckets))
    compute = auto.compute_seconds or 0.0
    return [
        choose(n, world, auto.allowed, profile, options, hierarchical, factors, compute * n / total)
        for n in buckets
    ]


def auto_decisions() -> list[dict[str, Any]]:
    """The choices ``algorithm="auto"`` made in this process, in trace order.

    Returns:
      One dict per resolved bucket: ``elements``, ``processes``, ``devices_per_process``,
      ``choice``, ``element_bytes``, ``allowed``, ``profile``.

    Example:
      >>> from jaxcomm import cost
      >>> isinstance(cost.auto_decisions(), list)
      True
    """
    return list(_decisions)


def auto_algorithm(
    algorithm: Any,
    n: int,
    axis_name: str | Sequence[str],
    hierarchical: bool = False,
    share: float = 1.0,
    element_bytes: int = 4,
) -> Any:
    """Resolves ``algorithm="auto"`` for one bucket inside a traced, shard_mapped step.

    ``jaxcomm.optax.allreduce_gradients`` calls this for every bucket: any other algorithm
    comes back unchanged; ``"auto"`` or an :class:`Auto` becomes :func:`resolve_auto`'s choice
    for the bucket's static size, the reduced axes' static size and the process layout
    (``jax.process_count()``, ``jax.local_device_count()``), so every rank chooses the same.

    Args:
      algorithm: what the user passed as ``algorithm``.
      n: the bucket's elements.
      axis_name: the reduced mesh axis or axes (inside ``jax.shard_map``).
      hierarchical: the reduction is hierarchical.
      share: the bucket's fraction of the step's gradient (see :func:`resolve_auto`).
      element_bytes: bytes per element of the bucket (see :func:`resolve_auto`).

    Returns:
      None (dense ring allreduce) or a jaxcomm algorithm (``GTopK``, ...).

    Example:
      >>> auto_algorithm(None, 1000, "dp") is None
      True
    """
    if not (isinstance(algorithm, Auto) or isinstance(algorithm, str)):
        return algorithm
    # Called while tracing a step, so JAX is loaded already; importing it here keeps the
    # rest of jaxcomm.cost free of it.
    import jax
    from jax import lax

    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    axis_size = math.prod(lax.axis_size(a) for a in names)
    return resolve_auto(
        algorithm,
        n,
        axis_size,
        jax.process_count(),
        jax.local_device_count(),
        hierarchical,
        share,
        element_bytes,
    )
