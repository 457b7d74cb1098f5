"""The thorough measurement of a world: what ``jaxcomm probe`` writes as a profile.

:mod:`jaxcomm.cost.measure` measures what ``auto`` needs at start, quickly (the call, ``sum``,
one link, the candidates' collectives). :func:`probe_world` measures everything the model
reads, with more sizes and repeats, on the same collectives (:mod:`jaxcomm.cost.timing`) and
fits (:mod:`jaxcomm.cost.fit`):

* links: ``jaxcomm.allreduce`` over all ranks at each of ``sizes`` and a latency test, fitted
  by :func:`~jaxcomm.cost.fit.fit_link`. This measures the slowest link class of the
  world: between processes (``same_host``, or ``across_hosts`` when the processes are on
  different hosts or emulated ones), or between the devices of one process when there is a
  single process. With several processes of several devices, a ring over each process's
  devices alone measures ``same_process`` too. Classes a world cannot measure keep the
  built-in default (``measured`` lists the others).
* psum: ``lax.psum`` at the same sizes and over a tree of
  :data:`~jaxcomm.cost.fit.PSUM_TREE_LEAVES` leaves, fitted to ``alpha * operands + beta *
  ring bytes`` (:func:`~jaxcomm.cost.fit.fit_psum`). XLA:CPU runs the one all-reduce that
  ``lax.psum`` of a tree emits as one collective per operand, each paying its latency, so
  alpha is the cost of an operand.
* call: a jitted shard_mapped step that adds 1 to one element (dispatch and synchronization).
* gamma: each local kernel through ``jaxcomm.ops`` on ``kernel_elements`` elements per device
  (:mod:`jaxcomm.cost.kernels`), then rescaled to what it costs inside its collective by
  :func:`~jaxcomm.cost.fit.calibrate_gamma` (gTop-k, gTop-k at the warm-up's density, and
  each quantized allreduce).

Every call runs on every rank at once, in interleaved rounds
(:class:`~jaxcomm.cost.timing.Rounds`), the median of ``repeats`` is kept, and the medians are
averaged over the ranks before anything is fitted, so every rank returns the same profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from . import measure
from .fit import (
    LATENCY_ELEMENTS,
    PSUM_TREE_ELEMENTS,
    PSUM_TREE_LEAVES,
    calibrate_gamma,
    fit_link,
    fit_psum,
)
from .kernels import WIDE_DENSITY, Kernels, add_kernels, fit_gamma
from .model import Options, World
from .timing import AXIS, Rounds, agree, mesh

__all__ = ["inter_process_link", "probe_world"]

LOCAL = ("proc", "local")


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
        add_ring(rounds.mesh, AXIS, P(AXIS), ranks, name)
        for n in sizes:
            rounds.add(f"psum.{n}", rounds.per_device(lambda v: lax.psum(v, AXIS),
                                                      rounds.normal(n)))  # fmt: skip
        leaves = [rounds.normal(PSUM_TREE_ELEMENTS) for _ in range(PSUM_TREE_LEAVES)]
        tree = rounds.per_device(lambda *vs: lax.psum(list(vs), AXIS), *leaves)
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
            return jaxcomm.compressed_allreduce(v, r, AXIS, c)

        rounds.add(f"calibration.{calibration}", rounds.per_device(reduce, x, zeros))
    return {c: (names, opts) for c, (_, names, opts) in calibrations.items()}


def _fit_links(
    t: Mapping[str, float], rings: Mapping[str, int], sizes: Sequence[int], gamma_sum: float
) -> dict[str, dict[str, float]]:
    """Each ring's link (:func:`~jaxcomm.cost.fit.fit_link`)."""
    links: dict[str, dict[str, float]] = {}
    for name, parts in rings.items():
        link = fit_link(
            t[f"ring.{name}.{LATENCY_ELEMENTS}"],
            {n: t[f"ring.{name}.{n}"] for n in sizes},
            parts, name, t["call"], gamma_sum,
        )  # fmt: skip
        links[name] = dataclasses.asdict(link)
    return links


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
      >>> profile = jaxcomm.cost.Profile.from_json({**data, "source": "here"})  # doctest: +SKIP
    """
    import jax

    world_mesh = mesh()
    inter = inter_process_link()
    rounds = Rounds(world_mesh, 1000 + jax.process_index())
    kernels = add_kernels(rounds, kernel_elements)
    rings = _add_links(rounds, sizes, inter)
    calibrations = _add_calibrations(rounds, kernels, kernel_elements)
    t = agree(rounds.run(repeats))
    gamma = fit_gamma(t, kernel_elements, kernels)
    links = _fit_links(t, rings, sizes, gamma["sum"])
    measured = ["call", *(f"gamma.{name}" for name in gamma), *(f"links.{n}" for n in links)]
    data: dict[str, Any] = {"version": 1, "inter_process": inter, "links": links}
    data["call"] = t["call"]
    if world_mesh.size > 1:
        data["psum"] = fit_psum(t, sizes, world_mesh.size)
        measured.append("psum")
    # Calibrate gamma inside the collectives: a kernel inside a collective does not run as it
    # does alone (other buffers, the handler's threads, memory shared with the transport).
    world = World(jax.process_count(), rounds.local, inter)
    times = {c: t[f"calibration.{c}"] for c in calibrations}
    scales = calibrate_gamma(gamma, calibrations, times, data, world, kernel_elements)
    samples = {"kernel_elements": kernel_elements, "medians": t, "calibration_scales": scales}
    return {**data, "gamma": gamma, "measured": measured, "hardware": measure.hardware(),
            "samples": samples}  # fmt: skip
