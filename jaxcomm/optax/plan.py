"""The bucket plan of :func:`jaxcomm.optax.allreduce_gradients`: which leaves are fused into
one collective, in which order, and which algorithm each phase of a density schedule uses.

Everything here is static (decided at trace time from shapes and arguments, the same on every
rank); the reduction itself is :mod:`jaxcomm.optax.reduce`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxcomm import cost

AxisName = str | tuple[str, ...]
DEFAULT_BUCKET_SIZE = 1 << 24  # elements (64 MiB of float32; docs/benchmarks.md)

# The paper's warm-up densities, one per epoch (Shi et al. 2019, §5).
GTOPK_WARMUP = (0.25, 0.0725, 0.015, 0.004)

Schedule = Mapping[int, float] | Sequence[tuple[int, float]]

F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What one :func:`allreduce_gradients` reduces, and how: its arguments, checked (see its
    docstring), and each phase of its density schedule."""

    axis_name: AxisName
    algorithm: Any
    hierarchical: bool
    mean: bool
    starts: np.ndarray  # each phase's first step
    phases: list[Any]  # each phase's algorithm
    bucket_size: int
    first_bucket_size: int | None
    overlap: bool
    dense_dtype: Any

    @property
    def extra(self) -> dict[str, Any]:
        """Keywords of every collective call."""
        return {"hierarchical": True} if self.hierarchical else {}

    def dense_wire_of(self, leaves: list[Any]) -> Any:
        """The dtype dense buckets travel in: ``dense_dtype``, else the gradients' common
        dtype (an all-bf16 tree uses the 16-bit wire of jaxcomm.allreduce, and "auto" weighs
        that wire against the compressors). Compressed buckets travel in float32, the dtype of
        the residuals; the hierarchical allreduce under a compressor or auto has no 16-bit
        wire."""
        if self.dense_dtype is not None:
            return jnp.dtype(self.dense_dtype)
        algorithm = self.algorithm
        keeps_dtype = algorithm is None or (is_auto(algorithm) and not self.hierarchical)
        return jnp.dtype(jnp.result_type(*leaves)) if keeps_dtype and leaves else F32


def make_plan(
    axis_name: AxisName, algorithm: Any, hierarchical: bool, mean: bool,
    density_schedule: Schedule | None, bucket_size: int, first_bucket_size: int | None,
    overlap: bool, dense_dtype: Any,
) -> Plan:  # fmt: skip
    """The :class:`Plan` of ``allreduce_gradients``'s arguments (a bucketed algorithm).

    Raises:
      ValueError: a bad bucket size, density schedule or dense dtype, naming the argument.
    """
    if int(bucket_size) < 1:
        raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
    if first_bucket_size is not None and int(first_bucket_size) < 1:
        raise ValueError(f"first_bucket_size must be >= 1 element or None, got {first_bucket_size}")
    starts, phases = phases_of(density_schedule, algorithm)
    _check_dense_dtype(dense_dtype, algorithm, hierarchical)
    return Plan(
        axis_name, algorithm, hierarchical, mean, starts, phases, int(bucket_size),
        first_bucket_size, overlap, dense_dtype,
    )  # fmt: skip


def _check_dense_dtype(dense_dtype: Any, algorithm: Any, hierarchical: bool) -> None:
    if dense_dtype is None:
        return
    if jnp.dtype(dense_dtype) not in (F32, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(
            f"dense_dtype must be float32, bfloat16, float16 or None, got {dense_dtype}"
        )
    if hierarchical and algorithm is not None and jnp.dtype(dense_dtype) != F32:
        raise ValueError(
            f"dense_dtype={jnp.dtype(dense_dtype).name}: the hierarchical allreduce has no "
            "16-bit wire here; pass dense_dtype=None or jnp.float32"
        )


def gtopk_warmup_schedule(
    steps_per_epoch: int, density: float, warmup: Sequence[float] = GTOPK_WARMUP
) -> dict[int, float]:
    """The gTop-k paper's warm-up: one density per epoch, then ``density`` for good.

    Densities of the warm-up that are not above ``density`` are dropped.

    Args:
      steps_per_epoch: optimizer steps per epoch.
      density: the density after the warm-up.
      warmup: densities of the first epochs (default 0.25, 0.0725, 0.015, 0.004).

    Returns:
      A ``{start step: density}`` mapping for ``density_schedule``.

    Example:
      >>> gtopk_warmup_schedule(10, 0.01)
      {0: 0.25, 10: 0.0725, 20: 0.015, 30: 0.01}
    """
    phases = [d for d in warmup if d > density] + [density]
    return {i * int(steps_per_epoch): float(d) for i, d in enumerate(phases)}


def is_auto(algorithm: Any) -> bool:
    """Whether ``algorithm`` asks the cost model to choose per bucket (``"auto"``, ``Auto``)."""
    return isinstance(algorithm, (str, cost.Auto))


def cores() -> int:
    """Cores this process may run on (its affinity: 1 on a node pinned to one core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _buckets(
    sizes: Sequence[int], bucket_size: int, first_bucket_size: int | None = None
) -> list[list[int]]:
    """Groups leaf indices, last leaf first, so that each group holds <= bucket_size elements.

    Leaves keep tree order inside a bucket (a model that fits one bucket is concatenated as
    before); the buckets come last leaf first. Reverse tree order approximates the order
    backward produces the gradients (last layer first), so the first bucket is ready, and on
    the wire, while backward still runs. The first bucket holds at most ``first_bucket_size``
    (default: ``bucket_size``) elements: a small one goes on the wire sooner.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes))):
        n = sizes[i]
        if n == 0:
            continue
        cap = bucket_size if groups or first_bucket_size is None else first_bucket_size
        if current and filled + n > cap:
            groups.append(sorted(current))
            current, filled = [], 0
        current.append(i)
        filled += n
    if current:
        groups.append(sorted(current))
    return groups


def _normalize_schedule(schedule: Schedule, algorithm: Any) -> tuple[np.ndarray, list[Any]]:
    """Returns (start steps, algorithm per phase) of a density schedule.

    ``auto`` takes the schedule too: each phase chooses per bucket with that phase's density
    for its sparse candidates (:func:`jaxcomm.cost.at_density`).
    """
    if is_auto(algorithm):

        def at(density: float) -> Any:
            return cost.at_density(algorithm, density)
    elif hasattr(algorithm, "density") and dataclasses.is_dataclass(algorithm):

        def at(density: float) -> Any:
            return dataclasses.replace(algorithm, density=density)
    else:
        raise ValueError(
            f"density_schedule needs an algorithm with a density (GTopK, TopKAllgather) or "
            f"'auto', got {algorithm!r}"
        )
    items = sorted(dict(schedule).items() if isinstance(schedule, Mapping) else schedule)
    if not items:
        raise ValueError("density_schedule is empty; pass None for a constant density")
    starts = [int(s) for s, _ in items]
    if len(set(starts)) != len(starts) or starts[0] < 0:
        raise ValueError(f"density_schedule steps must be distinct and >= 0, got {starts}")
    phases = [at(float(d)) for _, d in items]
    if starts[0] > 0:  # before the first scheduled step the algorithm's own density applies
        starts.insert(0, 0)
        phases.insert(0, algorithm)
    return np.asarray(starts, np.int32), phases


def phases_of(schedule: Schedule | None, algorithm: Any) -> tuple[np.ndarray, list[Any]]:
    """(start steps, algorithm per phase): one phase from step 0 without a schedule.

    Raises:
      ValueError: a schedule for the dense allreduce, or a bad schedule.
    """
    if schedule is None:
        return np.zeros(1, np.int32), [algorithm]
    if algorithm is None:
        raise ValueError("density_schedule needs an algorithm; the dense allreduce has no density")
    return _normalize_schedule(schedule, algorithm)
