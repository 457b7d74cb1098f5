"""The thorough measurement of a world: what ``jaxcomm probe`` writes as a profile.

:mod:`jaxcomm.cost.measure` measures what ``auto`` needs at start, quickly (the call, ``sum``,
one link, the candidates' collectives). :func:`probe_world` measures everything the model
reads, with more sizes and repeats, using that module's collectives and fits:

* links: ``jaxcomm.allreduce`` over all ranks at each of ``sizes`` and a latency test, fitted
  by :func:`~jaxcomm.cost.measure.fit_link`. This measures the slowest link class of the
  world: between processes (``same_host``, or ``across_hosts`` when the processes are on
  different hosts or emulated ones), or between the devices of one process when there is a
  single process. With several processes of several devices, a ring over each process's
  devices alone measures ``same_process`` too. Classes a world cannot measure keep the
  built-in default (``measured`` lists the others).
* psum: ``lax.psum`` at the same sizes and over a tree of :data:`PSUM_TREE_LEAVES` leaves,
  fitted to ``alpha * operands + beta * ring bytes`` (:func:`fit_psum`). XLA:CPU runs the one
  all-reduce that ``lax.psum`` of a tree emits as one collective per operand, each paying its
  latency, so alpha is the cost of an operand.
* call: a jitted shard_mapped step that adds 1 to one element (dispatch and synchronization).
* gamma: each local kernel through ``jaxcomm.ops`` on ``kernel_elements`` elements per device
  (:mod:`jaxcomm.cost.kernels`), then rescaled to what it costs inside its collective by
  :func:`~jaxcomm.cost.measure.calibrate_gamma` (gTop-k, gTop-k at the warm-up's density, and
  each quantized allreduce).

Every call runs on every rank at once, in interleaved rounds (:class:`Rounds`), the median of
``repeats`` is kept, and the medians are averaged over the ranks before anything is fitted,
so every rank returns the same profile.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import measure
from .kernels import TOPK_DENSITY, WIDE_DENSITY, Kernels, add_kernels, fit_gamma
from .model import Options, World

__all__ = ["Rounds", "fit_psum", "inter_process_link", "probe_world"]

LATENCY_ELEMENTS = measure.LATENCY_ELEMENTS
# lax.psum of a tree: this many leaves of PSUM_TREE_ELEMENTS each (a model's gradient tree,
# e.g. bytes-lm's 70 leaves), to measure what each operand of its all-reduce costs.
PSUM_TREE_LEAVES, PSUM_TREE_ELEMENTS = 64, 1 << 12
LOCAL = ("proc", "local")


class Rounds:
    """Times named calls in interleaved rounds: every call once per round, ``repeats`` rounds.

    On a machine shared with other work a burst of load then slows one sample of every call
    instead of all samples of one call, so the medians stay comparable with each other.
    """

    def __init__(self, mesh: Any, seed: int) -> None:
        import jax
        import numpy as np

        import jaxcomm

        self.mesh, self.local = mesh, mesh.local_mesh.size
        self.rng = np.random.default_rng(seed)
        self.calls: dict[str, Callable[[], Any]] = {}
        ones = np.ones((self.local, 1), np.float32)
        self._barrier = measure._per_device(
            mesh, lambda v: jaxcomm.allreduce(v, measure.AXIS), ones
        )
        self._ranks = mesh.size
        self._block = jax.block_until_ready

    def normal(self, n: int) -> Any:
        """The next ``(local devices, n)`` standard normal float32 block of this rank."""
        import numpy as np

        return self.rng.standard_normal((self.local, n)).astype(np.float32)

    def per_device(self, fn: Callable, *rows: Any, donate: bool = False) -> Callable:
        """A call of ``fn`` on every local device at once (:mod:`jaxcomm.cost.measure`'s)."""
        return measure._per_device(self.mesh, fn, *rows, donate=donate)

    def add(self, name: str, fn: Callable[[], Any]) -> None:
        self._block(fn())  # compile
        self._block(fn())  # a second warm-up: first calls set up connections, pages
        self.calls[name] = fn

    def run(self, repeats: int) -> dict[str, float]:
        samples: dict[str, list[float]] = {name: [] for name in self.calls}
        for _ in range(repeats):
            for name, fn in self.calls.items():
                if self._ranks > 1:
                    self._block(self._barrier())  # every rank starts the call together
                t0 = time.perf_counter()
                self._block(fn())
                samples[name].append(time.perf_counter() - t0)
        return {name: statistics.median(ts) for name, ts in samples.items()}


def inter_process_link() -> str:
    """``across_hosts`` when the processes sit on different (or emulated) hosts: the hosts
    of :func:`~jaxcomm.cost.measure.world_key` (a collective on the first call)."""
    return "same_host" if len(set(measure.world_key()[-1])) == 1 else "across_hosts"


def _add_links(rounds: Rounds, sizes: Sequence[int], inter: str) -> dict[str, int]:
    """Adds jaxcomm's ring over all ranks, and within each process when there are several of
    each, and lax.psum over all ranks; returns each ring's link class and size."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    rings: dict[str, int] = {}  # link class -> ring size

    def add_ring(mesh: Any, axis: str, spec: Any, parts: int, name: str) -> None:
        rings[name] = parts
        for n in [LATENCY_ELEMENTS, *sizes]:
            placed = jax.make_array_from_process_local_data(
                NamedSharding(mesh, spec), rounds.normal(n)
            )
            f = jax.jit(
                jax.shard_map(
                    lambda v, a=axis: jaxcomm.allreduce(v[0], a)[None],
                    mesh=mesh, in_specs=spec, out_specs=spec,
                )
            )  # fmt: skip
            rounds.add(f"ring.{name}.{n}", lambda f=f, placed=placed: f(placed))

    ranks, local = rounds.mesh.size, rounds.local
    if ranks > 1:
        name = "same_process" if jax.process_count() == 1 else inter
        add_ring(rounds.mesh, measure.AXIS, P(measure.AXIS), ranks, name)
        for n in sizes:
            rounds.add(f"psum.{n}", rounds.per_device(lambda v: lax.psum(v, measure.AXIS),
                                                      rounds.normal(n)))  # fmt: skip
        leaves = [rounds.normal(PSUM_TREE_ELEMENTS) for _ in range(PSUM_TREE_LEAVES)]
        tree = rounds.per_device(lambda *vs: lax.psum(list(vs), measure.AXIS), *leaves)
        rounds.add("psum.tree", tree)
    if jax.process_count() > 1 and local > 1:
        proc_mesh = Mesh(np.asarray(jax.devices()).reshape(jax.process_count(), local), LOCAL)
        add_ring(proc_mesh, "local", P(LOCAL), local, "same_process")
    return rings


def _add_calibrations(
    rounds: Rounds, kernels: Kernels, n: int
) -> dict[str, tuple[tuple[str, ...], Options]]:
    """Adds the compressed collectives at ``n`` elements, to calibrate gamma inside them;
    returns, per calibration, the gamma entries it rescales and the options it ran with."""
    import numpy as np

    import jaxcomm

    from .. import algorithms

    # "gtopk.wide": gTop-k at the warm-up's first density, where the selected entries and
    # their merge, not the scan, take the time; calibrated after "gtopk" (dicts keep order).
    options = kernels.options
    wide = dataclasses.replace(options, density=WIDE_DENSITY)
    calibrations = {
        "gtopk": (algorithms.build("gtopk", options), ("topk",), options),
        "gtopk.wide": (algorithms.build("gtopk", wide), ("topk.entry", "merge"), wide),
        **{
            kind: (q, (f"quantize.{kind}", f"decode.{kind}"), options)
            for kind, q in kernels.quantizers.items()
        },
    }
    x, zeros = rounds.normal(n), np.zeros((rounds.local, n), np.float32)
    for calibration, (compressor, _, _) in calibrations.items():

        def reduce(v: Any, r: Any, c: Any = compressor) -> tuple:
            return jaxcomm.compressed_allreduce(v, r, measure.AXIS, c)

        rounds.add(f"calibration.{calibration}", rounds.per_device(reduce, x, zeros))
    return {c: (names, opts) for c, (_, names, opts) in calibrations.items()}


def _fit_links(
    t: Mapping[str, float], rings: Mapping[str, int], sizes: Sequence[int], gamma_sum: float
) -> dict[str, dict[str, float]]:
    """Each ring's link (:func:`~jaxcomm.cost.measure.fit_link`)."""
    links: dict[str, dict[str, float]] = {}
    for name, parts in rings.items():
        link = measure.fit_link(
            t[f"ring.{name}.{LATENCY_ELEMENTS}"],
            {n: t[f"ring.{name}.{n}"] for n in sizes},
            parts, name, t["call"], gamma_sum,
        )  # fmt: skip
        links[name] = dataclasses.asdict(link)
    return links


def fit_psum(t: Mapping[str, float], sizes: Sequence[int], ranks: int) -> dict[str, float]:
    """lax.psum's line: alpha per operand, beta per ring byte, beyond the call overhead.

    Args:
      t: the medians: ``call``, ``psum.<n>`` for each of ``sizes`` and ``psum.tree``.
      sizes: the single arrays' elements per rank.
      ranks: ranks of the all-reduce.

    Returns:
      ``{"alpha": ..., "beta": ...}``, the profile's ``psum``.

    Example:
      >>> t = {"call": 0.0, "psum.1024": 1e-4, "psum.1048576": 1e-2, "psum.tree": 7e-3}
      >>> sorted(fit_psum(t, [1024, 1048576], 2))
      ['alpha', 'beta']
    """
    from .ledger import ring_bytes
    from .timemodel import fit_line

    call = t["call"]
    # [operands, ring bytes]: the single arrays and the tree (one all-reduce of its leaves).
    tree_bytes = PSUM_TREE_LEAVES * ring_bytes(PSUM_TREE_ELEMENTS, ranks, 0)
    rows = [[1.0, ring_bytes(n, ranks, 0)] for n in sizes]
    rows.append([float(PSUM_TREE_LEAVES), tree_bytes])
    ys = [max(0.0, t[f"psum.{n}"] - call) for n in sizes]
    ys.append(max(0.0, t["psum.tree"] - call))
    a, b = fit_line(rows, ys)
    return {"alpha": a, "beta": b}


def probe_world(sizes: Sequence[int], kernel_elements: int, repeats: int) -> dict[str, Any]:
    """Measures links, psum, the call and every kernel on this world. Every process must call
    it at the same point of its program; every rank returns the same numbers.

    Args:
      sizes: the ring and psum sizes, elements per rank.
      kernel_elements: elements per device of each kernel timing and calibration.
      repeats: timed calls per measurement (the median is kept).

    Returns:
      The profile's JSON (``jaxcomm.cost.Profile.from_json`` reads it; no ``source``) with
      ``hardware`` and ``samples`` (the medians and the calibrations' scales).

    Example:
      >>> data = probe_world([4096, 65536], 1 << 16, 3)  # doctest: +SKIP
      >>> Profile.from_json({**data, "source": "here"}).save("profile.json")  # doctest: +SKIP
    """
    import jax

    mesh = measure._mesh()
    inter = inter_process_link()
    rounds = Rounds(mesh, 1000 + jax.process_index())
    kernels = add_kernels(rounds, kernel_elements)
    rings = _add_links(rounds, sizes, inter)
    calibrations = _add_calibrations(rounds, kernels, kernel_elements)
    t = measure._agree(rounds.run(repeats))
    gamma = fit_gamma(t, kernel_elements, kernels)
    links = _fit_links(t, rings, sizes, gamma["sum"])
    measured = ["call", *(f"gamma.{name}" for name in gamma), *(f"links.{n}" for n in links)]
    data: dict[str, Any] = {"version": 1, "inter_process": inter, "links": links}
    data["call"] = t["call"]
    if mesh.size > 1:
        data["psum"] = fit_psum(t, sizes, mesh.size)
        measured.append("psum")
    # Calibrate gamma inside the collectives: a kernel inside a collective does not run as it
    # does alone (other buffers, the handler's threads, memory shared with the transport).
    world = World(jax.process_count(), rounds.local, inter)
    times = {c: t[f"calibration.{c}"] for c in calibrations}
    scales = measure.calibrate_gamma(gamma, calibrations, times, data, world, kernel_elements)
    samples = {"kernel_elements": kernel_elements, "medians": t, "calibration_scales": scales}
    return {**data, "gamma": gamma, "measured": measured, "hardware": measure.hardware(),
            "samples": samples}  # fmt: skip
