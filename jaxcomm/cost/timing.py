"""Timing calls on every device of every rank, for :mod:`jaxcomm.cost.measure` (``auto``'s
measurement at start) and :mod:`jaxcomm.cost.probe` (``jaxcomm probe``'s thorough one).

A call here is a jitted shard_map over a 1-D mesh of every device (:func:`per_device`); every
rank starts each timed call together behind a barrier (a tiny ``jaxcomm.allreduce``), and
:func:`agree` averages each time over the ranks so that every rank fits the same numbers.
:class:`Timer` keeps the least of a few samples of one call; :class:`Rounds` interleaves many
calls and keeps each one's median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["AXIS", "Rounds", "Timer", "agree", "barrier", "gather", "mesh", "per_device"]

AXIS = "jaxcomm_measure"
REPEATS = 5
LONG_CALL_S = 0.05  # a size whose call takes this long has measured the bandwidth


def mesh() -> Any:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.asarray(jax.devices()), (AXIS,))


def _placed(mesh: Any, rows: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.make_array_from_process_local_data(NamedSharding(mesh, P(AXIS)), rows)


def per_device(mesh: Any, fn: Callable[..., Any], *rows: Any, donate: bool = False) -> Callable:
    """A call of ``fn`` on every device at once (a jitted shard_map); ``donate``: the first
    operand is the previous call's output (in place)."""
    import jax
    from jax.sharding import PartitionSpec as P

    spec = P(AXIS)
    placed = [_placed(mesh, r) for r in rows]
    f = jax.jit(
        jax.shard_map(
            lambda *xs: jax.tree.map(lambda y: y[None], fn(*(x[0] for x in xs))),
            mesh=mesh,
            in_specs=(spec,) * len(placed),
            out_specs=spec,
            check_vma=False,
        ),
        donate_argnums=(0,) if donate else (),
    )

    def call() -> Any:
        out = f(*placed)
        if donate:
            placed[0] = out
        return out

    return call


def gather(values: Sequence[float]) -> list[float]:
    """Every rank's ``values``, concatenated in device order (a jaxcomm allreduce of a vector
    in which each rank fills its own slot)."""
    return _reduce_rows(values, every_rank=True)


def _reduce_rows(values: Sequence[float], every_rank: bool = False) -> list[float]:
    """``every_rank``: each rank's slot of a ranks × len(values) vector, summed (a gather);
    else the mean of ``values`` over every rank."""
    import jax
    import numpy as np

    import jaxcomm

    world_mesh = mesh()
    ranks, local, m = world_mesh.size, jax.local_device_count(), len(values)
    first = jax.process_index() * local  # a process's devices are contiguous in jax.devices()
    if every_rank:
        rows = np.zeros((local, ranks * m), np.float32)
        for d in range(local):
            rows[d, (first + d) * m : (first + d + 1) * m] = values
    else:
        rows = np.tile(np.asarray(values, np.float32), (local, 1))
    total = per_device(world_mesh, lambda v: jaxcomm.allreduce(v, AXIS), rows)()
    out = np.asarray(total.addressable_data(0)).reshape(-1).astype(np.float64)
    return [float(v) for v in (out if every_rank else out / ranks)]


def agree(times: Mapping[str, float]) -> dict[str, float]:
    """The mean of each named time over every rank (names in sorted order: the same vector
    everywhere), so every rank fits the same numbers."""
    names = sorted(times)
    return dict(zip(names, _reduce_rows([times[n] for n in names]), strict=True))


def barrier(mesh: Any) -> Callable[[], None]:
    """A call that returns once every rank of ``mesh`` has made it (a one-element
    ``jaxcomm.allreduce``), so that every rank starts the next timed call together; with one
    rank it does nothing."""
    import jax
    import numpy as np

    import jaxcomm

    if mesh.size == 1:
        return lambda: None
    ones = np.ones((mesh.local_mesh.size, 1), np.float32)
    reduce = per_device(mesh, lambda v: jaxcomm.allreduce(v, AXIS), ones)

    def wait() -> None:
        jax.block_until_ready(reduce())

    return wait


def _timed(fn: Callable[[], Any]) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


class Timer:
    """The least seconds of a call over :data:`REPEATS`, every rank starting it together: on a
    machine shared with other work, load only ever adds time, and a few samples' median
    still carries it."""

    def __init__(self, mesh: Any) -> None:
        self._barrier = barrier(mesh)
        self.ranks = mesh.size

    def __call__(self, fn: Callable[[], Any], repeats: int = REPEATS) -> float:
        _timed(fn)  # compile
        _timed(fn)  # connections, pages
        samples: list[float] = []
        for i in range(repeats):
            # Long calls vary little: stop after three, all ranks or none, on their mean (a
            # rank that stopped on its own clock left its peers in a collective it never ran).
            if i == 3 and self._agreed(min(samples)) >= LONG_CALL_S:
                break
            self._barrier()
            samples.append(_timed(fn))
        return min(samples)

    def _agreed(self, seconds: float) -> float:
        """`seconds` averaged over every rank (one allreduce that every rank runs)."""
        return agree({"t": seconds})["t"] if self.ranks > 1 else seconds


class Rounds:
    """Times named calls in interleaved rounds: every call once per round, ``repeats`` rounds,
    and keeps each call's median.

    On a machine shared with other work a burst of load then slows one sample of every call
    instead of all samples of one call, so the medians stay comparable with each other.
    """

    def __init__(self, mesh: Any, seed: int) -> None:
        import numpy as np

        self.mesh, self.local = mesh, mesh.local_mesh.size
        self.rng = np.random.default_rng(seed)
        self.calls: dict[str, Callable[[], Any]] = {}
        self._barrier = barrier(mesh)

    def normal(self, n: int) -> Any:
        """The next ``(local devices, n)`` standard normal float32 block of this rank."""
        import numpy as np

        return self.rng.standard_normal((self.local, n)).astype(np.float32)

    def per_device(self, fn: Callable, *rows: Any, donate: bool = False) -> Callable:
        """A call of ``fn`` on every local device at once (:func:`per_device`)."""
        return per_device(self.mesh, fn, *rows, donate=donate)

    def add(self, name: str, fn: Callable[[], Any]) -> None:
        _timed(fn)  # compile
        _timed(fn)  # a second warm-up: first calls set up connections, pages
        self.calls[name] = fn

    def run(self, repeats: int) -> dict[str, float]:
        samples: dict[str, list[float]] = {name: [] for name in self.calls}
        for _ in range(repeats):
            for name, fn in self.calls.items():
                self._barrier()
                samples[name].append(_timed(fn))
        return {name: statistics.median(ts) for name, ts in samples.items()}
