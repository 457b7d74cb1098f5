"""``probe``: measure the cost model's alpha, beta per link class and gamma per kernel.

``jaxcomm probe RECIPE --out profile.json`` runs this job on the recipe's own world (its
processes, devices per process and backend), so the numbers include what that world adds:
several ranks sharing cores, loopback or a shaped network. Every measurement runs on every
rank at once (a barrier first), the median of ``repeats`` timed calls is kept, and rank 0
fits the model (:mod:`jaxcomm.cost`) and writes the profile:

* links: ``jaxcomm.allreduce`` over all ranks, modeled as ``messages * alpha + bytes * beta``
  of the schedule it took at each size (``jaxcomm.cost.dense_path``: the ring or recursive
  doubling over a transport, the direct or one-shot path through shared memory) after
  removing the call overhead and the reduction kernel. Alpha comes from a 2-element
  allreduce (a latency test: one tiny message per round), beta from the sizes by least
  squares with that alpha fixed (Hockney's two-step fit). A joint fit of both let a shaped
  link's token bucket, which passes a small message at line rate, pull alpha to 0: the
  model then charged a small gradient's extra messages nothing;
  this measures the slowest link class of the world: between processes (``same_host``, or
  ``across_hosts`` when the processes are on different hosts or emulated ones), or between
  devices of one process when there is a single process. With several processes of several
  devices, a ring over each process's devices alone measures ``same_process`` too.
  Classes a world cannot measure keep the built-in default (``measured`` lists the others).
* psum: ``lax.psum`` (XLA's collectives) at the same sizes and over a tree of
  ``PSUM_TREE_LEAVES`` leaves, fit to ``alpha * operands + beta * ring bytes``. XLA:CPU runs
  the one all-reduce that ``lax.psum`` of a tree emits as one collective per operand, each
  paying its latency (a 70-leaf transformer's gradient cost 0.35 s per step on one host,
  where one array of its size costs 0.02 s), so alpha is the cost of an operand.
* call: the time of a jitted shard_mapped step that does nothing but add 1 to one element
  (dispatch and synchronization), which every call pays.
* gamma: each local kernel through ``jaxcomm.ops`` on ``args.kernel_elements`` elements per
  device: top-k compress (``topk``; at ρ = 0.25 too, whose extra time per extra selected
  entry is ``topk.entry``), each quantizer's compress and decompress
  (``quantize.*``, ``decode.*``), the sparse merge of two k-entry sets (``merge``, per input
  entry) and an in-place float32 add (``sum``). Then gTop-k and each quantized allreduce run
  at that size, and their time beyond what the links and the other kernels explain rescales
  their kernels' gamma (the ops' ratio of quantize to decode is kept): the kernels' cost
  inside the collective, which is what the model predicts.

Recipe ``args`` (all optional; declared in ``jobs/args.py``, ``ProbeArgs``): sizes (ring/psum
elements per rank, default 4096, 65536, 1048576, 4194304), kernel_elements (default 4194304),
repeats (default 5), out (a path rank 0 also writes the profile to, replacing an older one only
once the new one is written). The profile goes to ``profile.json`` in the run directory.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import socket
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm.cost.measure import calibrate_gamma, fit_link, hardware
from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import AXIS, data_parallel_mesh
from jaxcomm_launcher.jobs.args import ProbeArgs

LATENCY_ELEMENTS = 2  # the latency test's allreduce: one 8-byte message per round
# lax.psum of a tree: this many leaves of PSUM_TREE_ELEMENTS each (a model's gradient tree,
# e.g. bytes-lm's 70 leaves), to measure what each operand of its all-reduce costs.
PSUM_TREE_LEAVES, PSUM_TREE_ELEMENTS = 64, 1 << 12
TOPK_DENSITY = 0.001  # top-k's density of the kernel timings and of the algorithms built
WIDE_DENSITY = 0.25  # top-k at the warm-up's first density, for gamma["topk.entry"]
MATMUL_RANK = 4  # PowerSGD's thin products are timed at this rank (a typical one)
LOCAL = ("proc", "local")


class _Rounds:
    """Times named calls in interleaved rounds: every call once per round, ``repeats`` rounds.

    On a machine shared with other work a burst of load then slows one sample of every call
    instead of all samples of one call, so the medians stay comparable with each other.
    """

    def __init__(self, barrier: Callable[[], None]) -> None:
        self.barrier = barrier
        self.calls: dict[str, Callable[[], Any]] = {}

    def add(self, name: str, fn: Callable[[], Any]) -> None:
        jax.block_until_ready(fn())  # compile
        jax.block_until_ready(fn())  # a second warm-up: first calls set up connections, pages
        self.calls[name] = fn

    def run(self, repeats: int) -> dict[str, float]:
        samples: dict[str, list[float]] = {name: [] for name in self.calls}
        for _ in range(repeats):
            for name, fn in self.calls.items():
                self.barrier()  # every rank starts the call together
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                samples[name].append(time.perf_counter() - t0)
        return {name: statistics.median(ts) for name, ts in samples.items()}


def _placed(mesh: Mesh, spec: P, local: np.ndarray) -> jax.Array:
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)


def _inter_process_link(ctx: JobContext) -> str:
    """``across_hosts`` when the processes sit on different (or emulated) hosts."""
    if jax.process_count() == 1:
        return "same_host"
    if ctx.recipe.backend.kind == "emulated":
        return "across_hosts"  # each rank has its own network namespace and shaped link
    from jax.experimental import multihost_utils

    mine = np.asarray([zlib.crc32(socket.gethostname().encode())], np.int64)
    hosts = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
    return "same_host" if len(set(hosts.tolist())) == 1 else "across_hosts"


class _Bench:
    """This rank's mesh, random inputs and timing rounds: what every measurement shares."""

    def __init__(self, ctx: JobContext) -> None:
        import jaxcomm

        self.ctx = ctx
        self.args = ProbeArgs.model_validate(ctx.args)  # the recipe validator checked them already
        self.flat = data_parallel_mesh()
        self.ranks, self.local = self.flat.size, ctx.devices_per_process
        self.spec = P(AXIS)
        self.rng = np.random.default_rng(1000 + ctx.rank)
        tiny = self.placed(np.ones((self.local, 1), np.float32))
        barrier_fn = jax.jit(
            jax.shard_map(
                lambda v: jaxcomm.allreduce(v[0], AXIS)[None],
                mesh=self.flat,
                in_specs=self.spec,
                out_specs=self.spec,
            )
        )

        def barrier() -> None:
            if self.ranks > 1:
                jax.block_until_ready(barrier_fn(tiny))

        self.rounds = _Rounds(barrier)

    def placed(self, local: np.ndarray) -> jax.Array:
        """`local` (one row per local device) split over the flat mesh."""
        return _placed(self.flat, self.spec, local)

    def normal(self, n: int) -> np.ndarray:
        """The next ``(local devices, n)`` standard normal float32 block of this rank."""
        return self.rng.standard_normal((self.local, n)).astype(np.float32)

    def per_device(
        self, fn: Callable, *arrays: np.ndarray, donate: tuple[int, ...] = ()
    ) -> Callable:
        """A call of ``fn`` on every local device at once (a jitted shard_map)."""
        placed = [self.placed(a) for a in arrays]
        f = jax.jit(
            jax.shard_map(
                lambda *xs: jax.tree.map(lambda y: y[None], fn(*(x[0] for x in xs))),
                mesh=self.flat,
                in_specs=(self.spec,) * len(placed),
                out_specs=self.spec,
            ),
            donate_argnums=donate,
        )
        if not donate:
            return lambda: f(*placed)

        def call() -> Any:  # the donated operand is the previous call's output (in place)
            placed[0] = f(*placed)
            return placed[0]

        return call


@dataclasses.dataclass
class _Kernels:
    """What the kernel timings were taken with, for their fits and the calibrations."""

    options: Any  # cost.Options of every algorithm built here
    quantizers: dict[str, Any]  # registry name -> its quantizer spec
    merge_entries: int  # entries of each of the two sets the merge timing merges
    matmul_elements: int  # elements of the matrix the thin product multiplies


def _add_kernels(b: _Bench) -> _Kernels:
    """Adds the call overhead and each local kernel through ``jaxcomm.ops`` to the rounds."""
    import jaxcomm
    from jaxcomm import algorithms, cost
    from jaxcomm.cost.algorithm_costs.powersgd import matrix_of

    kernel_n, local, rounds = b.args.kernel_elements, b.local, b.rounds
    # Per-call overhead: a jitted shard_mapped step that does (almost) nothing.
    rounds.add("call", b.per_device(lambda v: v + 1.0, np.ones((local, 1), np.float32)))
    x = b.normal(kernel_n)
    zeros = np.zeros_like(x)
    # sum: in place (the accumulator donated and fed back), as the C++ reductions add into
    # their buffer; a fresh output per call would time page faults instead.
    rounds.add("gamma.sum", b.per_device(lambda a, c: a + c, zeros, x, donate=(0,)))
    # matmul: PowerSGD's thin products (jaxcomm/cost/algorithm_costs/powersgd.py), a
    # near-square matrix of the kernel's elements times a (columns x 4) one, per multiply-add.
    _, mm_columns = matrix_of(kernel_n)
    mm_rows = kernel_n // mm_columns
    thin = b.rng.standard_normal((local, mm_columns, MATMUL_RANK)).astype(np.float32)
    rounds.add(
        "gamma.matmul",
        b.per_device(lambda a, q: a[: mm_rows * mm_columns].reshape(mm_rows, -1) @ q, x, thin),
    )
    topk = jaxcomm.TopK(TOPK_DENSITY)
    rounds.add("gamma.topk", b.per_device(lambda a, r: jaxcomm.ops.compress(a, r, topk), x, zeros))
    # The same at the gTop-k warm-up's first density: what each selected entry adds.
    wide = jaxcomm.TopK(WIDE_DENSITY)
    rounds.add("topk.wide", b.per_device(lambda a, r: jaxcomm.ops.compress(a, r, wide), x, zeros))
    # Every quantizer of the registry (jaxcomm/algorithms/), as `options` configures it.
    options = cost.Options(density=TOPK_DENSITY, tau=3.0, threshold_fraction=0.0027)
    quantizers = {q.name: q.build(options) for q in algorithms.quantizers()}
    for kind, q in quantizers.items():
        rounds.add(
            f"gamma.quantize.{kind}",
            b.per_device(lambda a, r, q=q: jaxcomm.ops.compress(a, r, q), x, zeros),
        )
        packed, _ = jax.jit(lambda a, r, q=q: jaxcomm.ops.compress(a, r, q))(x[0], zeros[0])
        packed = np.tile(np.asarray(packed), (local, 1))
        rounds.add(
            f"gamma.decode.{kind}",
            b.per_device(lambda p, q=q: jaxcomm.ops.decompress(p, q, kernel_n), packed),
        )
    k = _add_merge(b)
    return _Kernels(options, quantizers, k, mm_rows * mm_columns)


def _add_merge(b: _Bench) -> int:
    """Adds the sparse merge of two sets of 1/64 of the kernel's elements; returns their size."""
    import jaxcomm

    kernel_n, local = b.args.kernel_elements, b.local
    k = max(1, kernel_n // 64)
    idx = np.stack([np.sort(b.rng.choice(kernel_n, k, replace=False)) for _ in range(2 * local)])
    idx = idx.astype(np.int32)
    val = b.rng.standard_normal((2 * local, k)).astype(np.float32)
    b.rounds.add(
        "gamma.merge",
        b.per_device(
            lambda ia, va, ib, vb: jaxcomm.ops.sparse_merge(ia, va, ib, vb, k),
            idx[:local],
            val[:local],
            idx[local:],
            val[local:],
        ),
    )
    return k


def _add_links(b: _Bench, inter: str) -> dict[str, int]:
    """Adds jaxcomm's ring over all ranks, and within each process when there are several of
    each, and lax.psum over all ranks; returns each ring's link class and size."""
    import jaxcomm

    sizes, local, rounds = b.args.sizes, b.local, b.rounds
    rings: dict[str, int] = {}  # link class -> ring size

    def add_ring(mesh: Mesh, axis: str, mspec: P, parts: int, name: str) -> None:
        rings[name] = parts
        for n in [LATENCY_ELEMENTS, *sizes]:
            placed = _placed(mesh, mspec, b.normal(n))
            f = jax.jit(
                jax.shard_map(
                    lambda v, a=axis: jaxcomm.allreduce(v[0], a)[None],
                    mesh=mesh,
                    in_specs=mspec,
                    out_specs=mspec,
                )
            )
            rounds.add(f"ring.{name}.{n}", lambda f=f, placed=placed: f(placed))

    if b.ranks > 1:
        name = "same_process" if jax.process_count() == 1 else inter
        add_ring(b.flat, AXIS, b.spec, b.ranks, name)
        psum = jax.jit(
            jax.shard_map(
                lambda v: lax.psum(v, AXIS), mesh=b.flat, in_specs=b.spec, out_specs=b.spec
            )
        )
        for n in sizes:
            placed = b.placed(b.normal(n))
            rounds.add(f"psum.{n}", lambda placed=placed: psum(placed))
        leaves = [b.placed(b.normal(PSUM_TREE_ELEMENTS)) for _ in range(PSUM_TREE_LEAVES)]
        rounds.add("psum.tree", lambda leaves=leaves: psum(leaves))
    if jax.process_count() > 1 and local > 1:
        proc_mesh = Mesh(np.asarray(jax.devices()).reshape(jax.process_count(), local), LOCAL)
        add_ring(proc_mesh, "local", P(LOCAL), local, "same_process")
    return rings


def _add_calibrations(b: _Bench, kernels: _Kernels) -> dict[str, tuple[tuple[str, ...], Any]]:
    """Adds the compressed collectives at ``kernel_elements``, to calibrate gamma inside them;
    returns, per calibration, the gamma entries it rescales and the options it ran with."""
    import jaxcomm
    from jaxcomm import algorithms

    # "gtopk.wide": gTop-k at the warm-up's first density, where the selected entries and
    # their merge, not the scan, take the time; calibrated after "gtopk" (dicts keep order).
    options = kernels.options
    wide_options = dataclasses.replace(options, density=WIDE_DENSITY)
    calibrations = {
        "gtopk": (algorithms.build("gtopk", options), ("topk",), options),
        "gtopk.wide": (
            algorithms.build("gtopk", wide_options),
            ("topk.entry", "merge"),
            wide_options,
        ),
        **{
            kind: (q, (f"quantize.{kind}", f"decode.{kind}"), options)
            for kind, q in kernels.quantizers.items()
        },
    }
    x_placed = b.placed(b.normal(b.args.kernel_elements))
    zero_r = b.placed(np.zeros((b.local, b.args.kernel_elements), np.float32))
    for calibration, (compressor, _, _) in calibrations.items():

        def reduce(v: jax.Array, r: jax.Array, c: Any = compressor) -> tuple:
            summed, new_r = jaxcomm.compressed_allreduce(v[0], r[0], AXIS, c)
            return summed[None], new_r[None]

        f = jax.jit(
            jax.shard_map(
                reduce, mesh=b.flat, in_specs=(b.spec, b.spec), out_specs=(b.spec, b.spec)
            )
        )
        b.rounds.add(f"calibration.{calibration}", lambda f=f: f(x_placed, zero_r))
    return {c: (names, opts) for c, (_, names, opts) in calibrations.items()}


def _fit_gamma(t: dict[str, float], kernel_n: int, kernels: _Kernels) -> dict[str, float]:
    """Each kernel's time per element (per entry for the merge, per multiply-add for matmul)."""
    import jaxcomm
    from jaxcomm import cost

    # Kernels this probe has no measurement for (an algorithm's own new kernel) keep the
    # registry's default: Profile.from_json fills them in and `measured` does not list them.
    gamma = {
        k: t[f"gamma.{k}"] / kernel_n
        for k in cost.KERNELS
        if k not in ("merge", "matmul") and f"gamma.{k}" in t
    }
    extra = jaxcomm.TopK(WIDE_DENSITY).k(kernel_n) - jaxcomm.TopK(TOPK_DENSITY).k(kernel_n)
    gamma["topk.entry"] = max(0.0, t["topk.wide"] - t["gamma.topk"]) / extra
    gamma["merge"] = t["gamma.merge"] / (2 * kernels.merge_entries)
    gamma["matmul"] = t["gamma.matmul"] / (kernels.matmul_elements * MATMUL_RANK)
    return gamma


def _fit_links(
    t: dict[str, float], rings: dict[str, int], sizes: list[int], gamma_sum: float
) -> dict[str, dict[str, float]]:
    """Each ring's link: alpha from the latency test, beta by least squares with alpha fixed
    (:func:`jaxcomm.cost.measure.fit_link`)."""
    links: dict[str, dict[str, float]] = {}
    for name, parts in rings.items():
        link = fit_link(
            t[f"ring.{name}.{LATENCY_ELEMENTS}"],
            {n: t[f"ring.{name}.{n}"] for n in sizes},
            parts,
            name,
            t["call"],
            gamma_sum,
        )
        links[name] = dataclasses.asdict(link)
    return links


def _fit_psum(t: dict[str, float], sizes: list[int], ranks: int) -> dict[str, float]:
    """lax.psum's line: alpha per operand, beta per ring byte, beyond the call overhead."""
    from jaxcomm import cost

    call = t["call"]
    # [operands, ring bytes]: the single arrays and the tree (one all-reduce of 64 operands).
    tree_bytes = PSUM_TREE_LEAVES * cost.ring_bytes(PSUM_TREE_ELEMENTS, ranks, 0)
    rows = [[1.0, cost.ring_bytes(n, ranks, 0)] for n in sizes]
    rows.append([float(PSUM_TREE_LEAVES), tree_bytes])
    ys = [max(0.0, t[f"psum.{n}"] - call) for n in sizes]
    ys.append(max(0.0, t["psum.tree"] - call))
    a, b = cost.fit_line(rows, ys)
    return {"alpha": a, "beta": b}


def _fit(
    b: _Bench,
    t: dict[str, float],
    kernels: _Kernels,
    rings: dict[str, int],
    calibrations: dict[str, tuple[tuple[str, ...], Any]],
    inter: str,
) -> dict[str, Any]:
    """The profile's measured entries from the medians `t`, ``measured`` naming each, and the
    samples they came from."""
    from jaxcomm import cost

    kernel_n, sizes = b.args.kernel_elements, b.args.sizes
    gamma = _fit_gamma(t, kernel_n, kernels)
    links = _fit_links(t, rings, sizes, gamma["sum"])
    measured = ["call", *(f"gamma.{name}" for name in gamma), *(f"links.{n}" for n in links)]
    fitted: dict[str, Any] = {"inter_process": inter, "links": links, "call": t["call"]}
    if b.ranks > 1:
        fitted["psum"] = _fit_psum(t, sizes, b.ranks)
        measured.append("psum")
    # Calibrate gamma inside the collectives: a kernel inside a collective does not run as it
    # does alone (other buffers, the handler's threads, memory shared with the transport), so
    # each compressed collective's time beyond what the links and the other kernels explain
    # sets its kernels' gamma (split between quantize and decode in the ratio the ops gave).
    world = cost.World(jax.process_count(), b.local, inter)
    times = {c: t[f"calibration.{c}"] for c in calibrations}
    base = {"version": 1, "links": links, "call": t["call"], "inter_process": inter}
    scales = calibrate_gamma(gamma, calibrations, times, base, world, kernel_n)
    samples = {"kernel_elements": kernel_n, "medians": t, "calibration_scales": scales}
    return {**fitted, "gamma": gamma, "measured": measured, "samples": samples}


def _write_profile(ctx: JobContext, fitted: dict[str, Any], out: str | None) -> Any:
    """Rank 0 writes the profile to ``profile.json`` of the run and to `out`; returns it."""
    from jaxcomm import cost

    world = {
        "processes": jax.process_count(),
        "devices_per_process": ctx.devices_per_process,
        "backend": ctx.recipe.backend.kind,
    }
    data = {
        "version": 1,
        "source": (
            f"jaxcomm probe of recipe {ctx.recipe.name} ({ctx.recipe.backend.kind}, "
            f"{jax.process_count()} processes x {ctx.devices_per_process} devices, "
            f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')})"
        ),
        **{k: fitted[k] for k in ("inter_process", "links", "call", "gamma", "measured")},
        "hardware": hardware(),  # a run on other hardware is warned about (jaxcomm.cost.measure)
        "world": world,
        "samples": fitted["samples"],
    }
    if "psum" in fitted:
        data["psum"] = fitted["psum"]
    profile = cost.Profile.from_json(data)  # validates; fills unmeasured entries
    full = {**profile.to_json(), "world": world, "samples": fitted["samples"]}
    text = json.dumps(full, indent=2) + "\n"
    paths = [ctx.run_dir / "profile.json"]
    if out:
        paths.append(pathlib.Path(out))
    for path in paths:
        # Whole or not at all: a profile already there stays until the new one is complete.
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    _print_profile(ctx, profile, fitted["measured"])
    ctx.print(f"probe profile written to {', '.join(str(p) for p in paths)}")
    return profile


def _print_profile(ctx: JobContext, profile: Any, measured: list[str]) -> None:
    for name, link in profile.links.items():
        ctx.print(
            f"probe link {name:13s} alpha {link.alpha * 1e6:9.2f} us  "
            f"beta {link.beta * 1e9:8.4f} ns/B ({1 / max(link.beta, 1e-30) / 1e9 * 8:8.2f} Gbit/s)"
            + ("" if f"links.{name}" in measured else "  [default]")
        )
    ctx.print(f"probe call overhead {profile.call * 1e6:9.2f} us")
    for name, g in profile.gamma.items():
        ctx.print(f"probe gamma {name:20s} {g * 1e9:8.3f} ns/element")


def run(ctx: JobContext) -> None:
    """Measures links, psum and kernels on this world; rank 0 writes ``profile.json``.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; rank 0 writes ``profile.json`` (and ``args.out`` when given).

    Example:
        >>> # jaxcomm probe recipes/digits-dense.yaml --out profile.json
    """
    b = _Bench(ctx)
    kernels = _add_kernels(b)
    inter = _inter_process_link(ctx)
    rings = _add_links(b, inter)
    calibrations = _add_calibrations(b, kernels)
    fitted = _fit(b, b.rounds.run(b.args.repeats), kernels, rings, calibrations, inter)
    if ctx.is_main:
        _write_profile(ctx, fitted, b.args.out)
