"""``allreduce``: time and bytes of every allreduce algorithm over message sizes, side by side.

In each rank, for each size and each algorithm in ``args.algorithms`` (default: all), one
warm-up call, then ``repeats`` timed calls of a jitted shard_mapped step:

* ``psum``            — ``lax.psum`` (XLA's own CPU collectives, Gloo across processes): baseline
* ``dense``           — ``jaxcomm.allreduce`` (ring reduce-scatter + allgather over UCX)
* ``topk_allgather``  — ``jaxcomm.compressed_allreduce`` with ``TopKAllgather(density)``
* ``gtopk``           — ``jaxcomm.compressed_allreduce`` with ``GTopK(density)``
* ``adaptive``/``onebit``/``threshold`` — quantized allreduce
* ``<name>:<key>=<value>,...`` (a variant row): ``bits``/``block`` configure the
  algorithm (``blockquant:bits=4``), ``dtype=bfloat16`` sends ``psum``/``dense`` in 16 bits
  (``dense:dtype=bfloat16``: jaxcomm's 16-bit wire), ``axis=local`` sums ``psum``/``dense``
  over each process's own devices only (the inner average of DiLoCo over sites, whose sites
  are processes: compare it with ``hier_dense``, the whole gradient's hierarchical allreduce)
* ``auto`` (only when listed) — what ``algorithm="auto"`` picks for the size from the cost
  model (``jaxcomm.cost``; ``args.allowed``, ``args.profile``), printed by rank 0
* ``hier_dense``/``hier_dense_leader``/``hier_adaptive`` — hierarchical allreduce over a
  ("node", "local") mesh (a process is a node, its devices the local ranks): multi-leader
  dense, single-leader dense, multi-leader with Adaptive(proportion) across nodes. Compare
  them with ``dense``/``psum`` in a world with ``devices_per_process`` > 1 (flat over all ranks).

Recipe ``args`` (declared in ``jobs/args.py``, ``AllreduceArgs``): sizes (float32 elements per
device), repeats, density (default 0.001), algorithms, tau (threshold), proportion (adaptive),
every other algorithm setting of the cost model, allowed and profile (``auto``; the profile
defaults to the run's ``jaxcomm.profile``),
chain (default 1: allreduces per timed call, each on the previous one's result scaled by
1/P, so that latency-bound sizes are timed back to back instead of each behind the Python
work and rank skew between calls). One metrics line per timed call: algorithm, size_bytes,
chain, step_time_s (per allreduce: the call's time / chain), bytes_sent/bytes_received (per
allreduce; measured by jaxcomm's counters for jaxcomm algorithms; the ring-allreduce volume
for psum).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import algorithms as registry
from jaxcomm import cost
from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import (
    AXIS,
    data_parallel_mesh,
    ring_allreduce_bytes,
    shard_batch,
)
from jaxcomm_launcher.jobs.args import ALLREDUCE_SIZES, AllreduceArgs

DEFAULT_SIZES = ALLREDUCE_SIZES  # declared with the job's other args (jobs/args.py)
# The algorithms run by default, from the registry (jaxcomm/algorithms/); every registered name
# (e.g. hier_onebit) is accepted in args.algorithms.
# A leaf-shaped algorithm (PowerSGD: factors of each gradient matrix) has no flat-vector
# allreduce to time: it runs in training (allreduce_gradients), not here.
ALL_ALGORITHMS = [a for a in registry.planned() if registry.get(a).leafwise is None]
KNOWN = [a.name for a in registry.registered() if a.leafwise is None]
HIERARCHICAL = ("node", "local")
# Accepted in args.algorithms but not run by default: the cost model's choice per size.
AUTO = registry.AUTO
# What a variant row may set (``blockquant:bits=4``, ``dense:dtype=bfloat16``).
VARIANT_KEYS = {"bits": int, "block": int, "dtype": str, "axis": str}
# The mesh axis of an ``axis=local`` row: a process's devices (a site's inner axis).
LOCAL = HIERARCHICAL[1]


def parse_variant(entry: str) -> tuple[str, dict]:
    """``"name:key=value,..."`` -> (registered name, settings); a plain name has none.

    Raises:
        ValueError: an unknown name, key or dtype (the message lists the allowed ones).

    Example:
        >>> parse_variant("blockquant:bits=4,block=128")
        ('blockquant', {'bits': 4, 'block': 128})
    """
    name, _, rest = entry.partition(":")
    if name not in KNOWN and name != AUTO:
        raise ValueError(f"args.algorithms: unknown {name!r}; allowed: {[*KNOWN, AUTO]}")
    settings: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in VARIANT_KEYS or not value:
            raise ValueError(
                f"args.algorithms: {entry!r}: settings are key=value with keys "
                f"{sorted(VARIANT_KEYS)}, e.g. 'blockquant:bits=4'"
            )
        settings[key] = VARIANT_KEYS[key](value)
    if settings.get("dtype", "bfloat16") != "bfloat16" or (
        "dtype" in settings and name not in ("psum", "dense")
    ):
        raise ValueError(f"args.algorithms: {entry!r}: only psum and dense take dtype=bfloat16")
    if settings.get("axis", LOCAL) != LOCAL or (
        "axis" in settings and name not in ("psum", "dense")
    ):
        raise ValueError(f"args.algorithms: {entry!r}: only psum and dense take axis=local")
    return name, settings


def _on_node_mesh(name: str, settings: dict) -> bool:
    """Whether the row runs on the ("node", "local") mesh: a hierarchical algorithm, or a sum
    over the local axis alone."""
    return "axis" in settings or (name != AUTO and registry.get(name).hierarchy is not None)


def _step(algorithm: str, settings: dict, args: dict) -> Callable:
    """The per-device function of a row: `algorithm` with its variant `settings`
    (:func:`parse_variant`)."""
    import jaxcomm

    args = {**args, **settings}
    # Every algorithm setting in args (density, tau, proportion, bits, ...), as the registry
    # declares it; a missing one keeps its declared default.
    options = cost.Options.from_args(args)
    if "dtype" in settings:  # the 16-bit wire: cast in, sum, widen back
        base = _step(algorithm, {k: v for k, v in settings.items() if k != "dtype"}, args)
        return lambda v, r: (base(v.astype(jax.numpy.bfloat16), r)[0].astype(v.dtype), r)
    if algorithm == AUTO:
        auto = cost.Auto(
            allowed=tuple(args.get("allowed", cost.DEFAULT_ALLOWED)),
            profile=args.get("profile"),
            options=options,
        )

        def chosen(v: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
            c = cost.auto_algorithm(auto, v[0].size, AXIS)
            if c is None:
                return jaxcomm.allreduce(v[0], AXIS)[None], r
            summed, new_r = jaxcomm.compressed_allreduce(v[0], r[0], AXIS, c)
            return summed[None], new_r[None]

        return chosen
    if algorithm == "psum":
        return lambda v, r: (lax.psum(v, settings.get("axis", AXIS)), r)
    record = registry.get(algorithm)
    axis, kwargs = settings.get("axis", AXIS), {}
    if record.hierarchy is not None:
        axis = HIERARCHICAL
        kwargs = {"hierarchical": True, "hierarchical_scheme": record.hierarchy[1]}
    spec = record.build(options)  # from the registry: GTopK(density), OneBit(), ...
    if spec is None:  # the dense allreduce
        return lambda v, r: (jaxcomm.allreduce(v[0], axis, **kwargs)[None], r)

    def step(v: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        summed, new_r = jaxcomm.compressed_allreduce(v[0], r[0], axis, spec, **kwargs)
        return summed[None], new_r[None]

    return step


def _chained(fn: Callable, chain: int, ranks: int) -> Callable:
    """``fn`` applied ``chain`` times in a row, each on the last sum scaled by 1/ranks."""
    if chain == 1:
        return fn

    def chained(v: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        for _ in range(chain - 1):
            summed, r = fn(v, r)
            v = summed * (1.0 / ranks)  # the next allreduce depends on this one
        return fn(v, r)

    return chained


def _inputs(
    hierarchical: bool, local: np.ndarray, flat_mesh: Mesh, node_mesh: Mesh
) -> tuple[Mesh, P, jax.Array, jax.Array]:
    """``(mesh, spec, x, zeros)``: this rank's `local` rows and a zero residual, placed on the
    ("node", "local") mesh for a hierarchical algorithm, else on the flat one."""
    if hierarchical:
        mesh, spec = node_mesh, P(HIERARCHICAL)
        sharding = NamedSharding(mesh, spec)
        x = jax.make_array_from_process_local_data(sharding, local)
        zeros = jax.make_array_from_process_local_data(sharding, np.zeros_like(local))
        return mesh, spec, x, zeros
    mesh, spec = flat_mesh, P(AXIS)
    x = shard_batch(local, mesh)
    zeros = shard_batch(np.zeros_like(local), mesh)  # donated below: fresh each time
    return mesh, spec, x, zeros


def _compile(fn: Callable, name: str, mesh: Mesh, spec: P) -> Callable:
    """The jitted ``(v, r) -> (sum, r)`` call of `fn` over `mesh`."""
    if name != AUTO and not registry.get(name).residual:
        # Nothing to carry: passing a donated residual through unchanged made XLA alias it
        # to the sum and copy both of them on every call.
        dense = jax.jit(
            jax.shard_map(lambda v: fn(v, None)[0], mesh=mesh, in_specs=spec, out_specs=spec)
        )
        return lambda v, r: (dense(v), r)
    # The residual is donated, as a training step does with its optimizer state.
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)),
        donate_argnums=1,
    )


def _bytes_per_allreduce(
    name: str, settings: dict, size: int, devices: int, chain: int
) -> tuple[float, float]:
    """(sent, received) bytes of one allreduce of the last call: jaxcomm's counters, or for
    psum the ring-allreduce volume."""
    import jaxcomm

    if name == "psum":
        element_bytes = 2 if "dtype" in settings else 4
        group = jax.local_device_count() if "axis" in settings else devices
        sent = ring_allreduce_bytes(size * element_bytes, group)
        return sent, sent
    totals = jaxcomm.metrics()["totals"]
    ranks = max(1, len({t["world_rank"] for t in totals}))
    sent = sum(t["bytes_sent"] for t in totals) / ranks / chain
    received = sum(t["bytes_received"] for t in totals) / ranks / chain
    return sent, received


def run(ctx: JobContext) -> None:
    """Measures every requested algorithm at every size; rank 0 prints medians.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; one metrics line per timed call.

    Example:
        >>> # jaxcomm launch recipes/allreduce-sweep.yaml
    """
    import jaxcomm

    args = AllreduceArgs.model_validate(ctx.args)  # the recipe validator checked them already
    sizes, repeats, chain = args.sizes, args.repeats, args.chain
    algorithms = list(ALL_ALGORITHMS if args.algorithms is None else args.algorithms)
    # auto's profile: args.profile, else the run's (jaxcomm.profile, `launch --profile`).
    step_args = dict(ctx.args)
    if args.profile is None and ctx.jaxcomm.profile:
        step_args["profile"] = ctx.jaxcomm.profile
    variants = {entry: parse_variant(entry) for entry in algorithms}  # raises on bad ones
    flat_mesh = data_parallel_mesh()
    # Nodes x local ranks: jax.devices() lists each process's devices together, in order.
    node_mesh = Mesh(np.asarray(jax.devices()).reshape(jax.process_count(), -1), HIERARCHICAL)
    step_index = 0
    for size in sizes:
        rng = np.random.default_rng(ctx.rank)
        local = rng.standard_normal((ctx.devices_per_process, size)).astype(np.float32)
        for algorithm in algorithms:
            name, settings = variants[algorithm]
            hierarchical = _on_node_mesh(name, settings)
            mesh, spec, x, zeros = _inputs(hierarchical, local, flat_mesh, node_mesh)
            fn = _chained(_step(name, settings, step_args), chain, mesh.size)
            compiled = _compile(fn, name, mesh, spec)
            _, residual = jax.block_until_ready(compiled(x, zeros))  # compile + warm up
            if name == AUTO and ctx.is_main:
                ctx.print(
                    f"allreduce auto {size} elements -> {cost.auto_decisions()[-1]['choice']}"
                )
            times = []
            for _ in range(repeats):
                jaxcomm.reset_metrics()
                t0 = time.perf_counter()
                _, residual = jax.block_until_ready(compiled(x, residual))
                dt = (time.perf_counter() - t0) / chain
                times.append(dt)
                sent, received = _bytes_per_allreduce(name, settings, size, mesh.size, chain)
                ctx.metrics.log(
                    step_index,
                    force=True,
                    algorithm=algorithm,
                    size_bytes=size * 4,
                    chain=chain,
                    step_time_s=dt,
                    collective_time_s=dt,
                    bytes_sent=sent,
                    bytes_received=received,
                    compression_ratio=ring_allreduce_bytes(size * 4, mesh.size) / max(sent, 1),
                )
                step_index += 1
            if ctx.is_main:
                ctx.print(
                    f"allreduce {algorithm:15s} {size * 4:>11d} B: median "
                    f"{np.median(times) * 1e3:9.3f} ms"
                )
