"""The cost model's view of the end-to-end grid: a cell's predicted step time (the measured
compute step plus ``jaxcomm.cost``'s reduction of the workload's gradient buckets over the
network's profile), and the steps to target each of ``auto``'s choices needed, read from the
cells already run (what ``auto`` is given as its steps factors)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import statistics
from collections.abc import Callable
from typing import Any

from train_grid import (
    ALGORITHMS,
    AUTO_LABELS,
    NETWORKS,
    VARIANTS,
    auto_dropped_warmup,
    auto_picks,
)


def leaf_sizes(workload: str, recipe: dict[str, Any]) -> list[int]:
    """Element counts of the workload's parameters in tree order (the optimizer's buckets are
    built from them), from the example's model without running it."""
    return [math.prod(s) for s in leaf_shapes(workload, recipe)]


def leaf_shapes(workload: str, recipe: dict[str, Any]) -> list[tuple[int, ...]]:
    """Shapes of the workload's parameters in tree order (a leaf-shaped algorithm, PowerSGD,
    sends by shape), from the example's model without running it."""
    args = recipe.get("args", {})
    if workload == "bytes-lm":
        fields = ("width", "layers", "heads", "seq_len")
        model = tuple((k, args[k]) for k in fields if k in args)
    else:
        model = (
            ("hidden", recipe["train"]["hidden"]),
            ("layers", args.get("layers", 1)),
            ("model", args.get("model", "mlp")),
        )
    return list(_leaf_shapes(workload, model))


@functools.cache
def _leaf_shapes(workload: str, model: tuple[tuple[str, Any], ...]) -> tuple[tuple[int, ...], ...]:
    # Tracing a model's init costs seconds; the report asks for every cell's, and the cells of a
    # workload share their model.
    import jax
    import jax.numpy as jnp

    fields = dict(model)
    if workload == "bytes-lm":
        from jaxcomm.examples.bytes_lm import BytesLMConfig, ByteTransformer

        cfg = BytesLMConfig(**fields)
        model = ByteTransformer(cfg.width, cfg.layers, cfg.heads, cfg.seq_len)
        shapes = jax.eval_shape(
            model.init, jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32)
        )
    else:
        from jaxcomm.examples.digits import CNN, MLP

        if fields["model"] == "cnn":  # the digits example's CNN: channels are half the width
            net = CNN(fields["hidden"] // 2)
        else:
            net = MLP(fields["hidden"], fields["layers"])
        shapes = jax.eval_shape(net.init, jax.random.key(0), jnp.zeros((1, 64), jnp.float32))
    return tuple(tuple(int(d) for d in x.shape) for x in jax.tree.leaves(shapes))


@functools.cache
def _profile(path: pathlib.Path) -> Any:
    """A network's profile, read once (every cell of the network predicts with it)."""
    from jaxcomm import cost

    return cost.Profile.load(path)


def warmup_phase(workload: str, recipe: dict[str, Any]) -> int:
    """Steps per density of the sparse algorithms' warm-up: the recipe's
    ``args.warmup_phase_steps``, else an epoch of the digits (the gTop-k paper's choice)."""
    args = recipe.get("args", {})
    if args.get("warmup_phase_steps"):
        return int(args["warmup_phase_steps"])
    if workload == "bytes-lm":
        from jaxcomm.examples.bytes_lm import BytesLMConfig

        return BytesLMConfig().warmup_phase_steps
    return 1500 // recipe["train"]["batch_size"]  # digits: 1500 training images per epoch


def predict_step(
    workload: str,
    recipe: dict[str, Any],
    label: str,
    network: str,
    nodes: int,
    compute_s: float | None,
    profile_path: pathlib.Path | None,
    steps: int | None = None,
    devices: int = 1,
) -> dict[str, Any] | None:
    """``jaxcomm.cost``'s step time of a cell: the measured compute step plus the predicted
    reduction of every bucket. The sparse algorithms follow their warm-up schedule (one
    density per phase): with `steps`, the prediction is the mean over the timed steps
    ``1 .. steps-1`` of the run, else the step after the warm-up.

    16-bit cells: jaxcomm's dense reduction goes on its 16-bit wire (``element_bytes=2``, what
    ``auto`` weighs too); XLA's bf16 ``lax.pmean`` was measured no faster than its fp32 one,
    so it is predicted as fp32.
    """
    if compute_s is None or "diloco" in VARIANTS[label]:
        return None
    from jaxcomm import cost
    from jaxcomm.examples._loop import Reduction

    inter = "same_host" if NETWORKS[network] is None else "across_hosts"
    world = cost.World(processes=nodes, devices_per_process=devices, inter_process=inter)
    profile = _profile(profile_path) if profile_path and profile_path.exists() else None
    jc = recipe.get("jaxcomm", {})
    entry = (recipe.get("sweep") or [{}])[0]
    density = entry.get("density", jc.get("density", cost.Options().density))
    algorithm = entry.get("algorithm", VARIANTS[label]["algorithm"])
    half = entry.get("grad_dtype", jc.get("grad_dtype")) == "bfloat16"
    auto = algorithm == "auto"
    width = 2 if half else 4
    if not auto and ALGORITHMS.get(algorithm).leafwise is not None:
        return _predict_leafwise(
            workload, recipe, algorithm, world, profile, compute_s, width, steps
        )
    buckets = Reduction(VARIANTS[label]["algorithm"]).gradient_buckets(leaf_sizes(workload, recipe))

    def seconds(d: float) -> tuple[float, str]:
        """The step's reductions at density d, and the algorithm (auto's pick)."""
        options = cost.Options(density=d, element_bytes=width)
        if auto:
            pick = cost.plan(
                buckets,
                world,
                profile,
                options,
                algorithms=cost.DEFAULT_ALLOWED,
                steps_factor=_factors(entry.get("steps_factor")),
                compute_seconds=compute_s,
            )["pick"]
            return pick["seconds"], pick["algorithm"]
        return sum(cost.predict(algorithm, n, world, profile, options).seconds for n in buckets), (
            algorithm
        )

    # {first step: density}: the warm-up phases of the sparse algorithms (auto's sparse
    # candidates follow it too), else one entry.
    schedule = {0: density}
    if (auto or algorithm in ("gtopk", "topk_allgather")) and recipe.get("args", {}).get(
        "warmup", True
    ):
        from jaxcomm.optax import gtopk_warmup_schedule

        schedule = gtopk_warmup_schedule(warmup_phase(workload, recipe), density)
    starts = sorted(schedule)
    timed = range(1, steps) if steps and steps > 1 else [starts[-1]]
    comm = 0.0
    for d_start, d_end, d in zip(
        starts, [*starts[1:], math.inf], [schedule[k] for k in starts], strict=True
    ):
        share = sum(1 for i in timed if d_start <= i < d_end) / len(timed)
        if share:
            phase_s, _ = seconds(d)
            comm += share * phase_s
    if auto:
        algorithm = seconds(schedule[starts[-1]])[1]  # the pick after the warm-up
    return _step_prediction(compute_s, comm, Reduction(algorithm), world, profile, buckets)


def _step_prediction(
    compute_s: float,
    comm: float,
    reduction: Any,
    world: Any,
    profile: Any,
    buckets: list[int] | None,
) -> dict[str, Any]:
    """A predicted step: the compute step, the gradient's reduction (``comm``) and the average
    of loss and metric (``reduction.metric_collectives()``), which every step also pays and the
    one-rank compute step does not."""
    from jaxcomm import cost

    scalars = 0.0
    if world.ranks > 1:
        scalars = sum(
            cost.predict(name, n, world, profile).seconds
            for name, n in reduction.metric_collectives()
        )
    return {
        "compute_s": compute_s,
        "comm_s": comm,
        "scalar_pmeans_s": scalars,
        "step_s": compute_s + comm + scalars,
        "algorithm": reduction.algorithm,
        "buckets": buckets,
    }


def _predict_leafwise(
    workload: str,
    recipe: dict[str, Any],
    algorithm: str,
    world: Any,
    profile: Any,
    compute_s: float,
    width: int,
    steps: int | None,
) -> dict[str, Any]:
    """predict_step of a leaf-shaped algorithm (PowerSGD): it sends by leaf shape, not by the
    optax buckets. Its settings come from the recipe's args as the run's Reduction resolves
    them (rank, min_compression_rate, start_step: a warm-up phase by default); before
    start_step every leaf goes in one dense call, then ``jaxcomm.cost.predict_tree``."""
    from jaxcomm import cost
    from jaxcomm.examples._loop import Reduction

    args = recipe.get("args", {})
    names = {f.name for f in dataclasses.fields(Reduction)} - {"algorithm"}
    reduction = Reduction(algorithm, **{k: v for k, v in args.items() if k in names})
    options = dataclasses.replace(
        reduction.options(warmup_phase(workload, recipe)), element_bytes=width
    )
    shapes = leaf_shapes(workload, recipe)
    total = sum(math.prod(s) for s in shapes)
    warm = cost.predict("dense", total, world, profile, options).seconds
    compressed = cost.predict_tree(algorithm, shapes, world, profile, options).seconds
    timed = range(1, steps) if steps and steps > 1 else [options.start_step]
    share = sum(1 for i in timed if i < options.start_step) / len(timed)
    comm = share * warm + (1 - share) * compressed
    return _step_prediction(compute_s, comm, reduction, world, profile, None)  # by leaf shape


def _factors(measured: dict[str, float] | None) -> dict[str, float] | None:
    """Measured steps factors over the registry's defaults (None: the defaults)."""
    if not measured:
        return None
    from jaxcomm import cost

    return {**cost.DEFAULT_STEPS_FACTOR, **measured}


def _steps_to_target(
    out: pathlib.Path, workload: str, nodes: int, seed: int, devices: int = 1
) -> tuple[dict[str, list[dict[str, Any]]], Callable[[str], tuple[int, bool] | None]]:
    """The workload's cells of this seed by label, and ``label -> (steps, reached)`` over them
    (any network: the steps a reduction needs do not depend on the link): the fewest steps of
    a run that reached the target, else the most a capped run took (a lower bound), else
    None."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((out / "cells" / workload).glob(f"*-{nodes}x{devices}/*-s{seed}.json")):
        cell = json.loads(path.read_text())
        runs.setdefault(cell["label"], []).append(cell)

    def steps(label: str) -> tuple[int, bool] | None:
        reached = [c["steps"] for c in runs.get(label, []) if c["time_to_target_s"] is not None]
        if reached:
            return min(reached), True
        capped = [c["steps"] for c in runs.get(label, [])]
        return (max(capped), False) if capped else None

    return runs, steps


def measured_dense_steps(
    out: pathlib.Path, workload: str, nodes: int, seed: int, half: bool, devices: int = 1
) -> int | None:
    """Steps dense (``dense-bf16`` for 16-bit auto) needed to reach the workload's target with
    this seed, None if no such run reached it: auto's ``dense_steps``."""
    dense = _steps_to_target(out, workload, nodes, seed, devices)[1](
        "dense-bf16" if half else "dense"
    )
    return dense[0] if dense is not None and dense[1] else None


def measured_steps_factor(
    out: pathlib.Path,
    workload: str,
    nodes: int,
    seed: int,
    half: bool,
    warmup: bool = True,
    devices: int = 1,
) -> dict[str, float]:
    """Steps to the workload's target of each of auto's choices, relative to dense: the seed's
    own (:func:`_seed_steps_factor`), and for a choice this seed has not measured, the median
    of the other seeds' factors.

    A factor is a property of the workload and the algorithm; seeds only add noise to it. A
    seed's first cells would otherwise see none and fall back on the registry's defaults:
    bytes-lm's seeds 1 and 2 then sent everything by adaptive, whose 8.2x the steps of dense
    seed 0 had measured, and needed 1071 steps and more than 2061 (docs/e2e.md).

    Returns:
      ``{name: factor}`` for the choices measured on any seed (empty if none was).
    """
    seeds = sorted(
        {
            int(p.stem.rpartition("-s")[2])
            for p in (out / "cells" / workload).glob(f"*-{nodes}x{devices}/*-s*.json")
        }
    )

    def of_seed(s: int) -> dict[str, float]:
        return _seed_steps_factor(_steps_to_target(out, workload, nodes, s, devices), half, warmup)

    factors = of_seed(seed)
    others = [of_seed(s) for s in seeds if s != seed]
    for name in sorted({n for f in others for n in f} - set(factors)):
        factors[name] = round(statistics.median(f[name] for f in others if name in f), 3)
    return factors


def _seed_steps_factor(
    seed_cells: tuple[dict[str, list[dict[str, Any]]], Callable[[str], tuple[int, bool] | None]],
    half: bool,
    warmup: bool,
) -> dict[str, float]:
    """Steps to the workload's target of each of auto's choices, relative to dense, from the
    cells of this workload already run with one seed (any network): `seed_cells` is
    :func:`_steps_to_target`'s answer for that seed.

    Dense is ``dense-bf16`` for auto with 16-bit gradients (its dense buckets use that wire),
    else ``dense``. A run that stopped at its cap without reaching the target needed more
    steps than it ran: its factor is that lower bound, so auto weighs it at least as slow as
    it was measured. A factor is at least 1. Algorithms with no cell keep the registry's
    default.

    The sparse cells ran with the warm-up. Without it (``warmup=False``) a sparse choice's
    factor comes from the auto cells run without the warm-up whose only sparse pick it was;
    with none, it keeps the registry's default.

    Returns:
      ``{name: factor}`` for the choices measured (empty if dense itself has no cell).
    """
    runs, steps = seed_cells
    dense = steps("dense-bf16" if half else "dense")
    if dense is None or not dense[1]:
        return {}
    factors = {"dense": 1.0}
    from jaxcomm import cost

    # Auto cells whose one compressed pick trained without the warm-up (a sparse pick's steps
    # without it), or whose one pick has no density (no warm-up to differ: its steps).
    no_warmup: dict[str, tuple[int, bool]] = {}
    density_free: dict[str, tuple[int, bool]] = {}
    for label, cells in runs.items():
        if label not in AUTO_LABELS:
            continue
        off = not VARIANTS[label].get("args", {}).get("warmup", True)
        for cell in cells:
            picks = set(auto_picks(cell)) - {"dense"}
            if len(picks) != 1:
                continue
            name = picks.pop()
            if ALGORITHMS.get(name).uses_density:
                if not (off or auto_dropped_warmup(cell)):
                    continue
                into = no_warmup
            else:
                into = density_free
            got = (cell["steps"], cell["time_to_target_s"] is not None)
            if name not in into or (got[1], -got[0]) > (into[name][1], -into[name][0]):
                into[name] = got  # the fewest steps of a run that reached the target
    for name in cost.AUTO_CHOICES:
        sparse = ALGORITHMS.get(name).uses_density
        if name == "dense":
            continue
        got = no_warmup.get(name) if sparse and not warmup else steps(name)
        if got is None and not sparse:
            got = density_free.get(name)
        if got is not None:
            # At least 1: a compressor with error feedback approximates dense's update and
            # does not converge in fewer steps in expectation; fewer measured is seed noise
            # (dense bf16's own steps to lbann-mlp's target spread 111-141 over 3 seeds, and
            # gTop-k's 86 on seed 0, taken as 0.68, made auto pick it on one host at 2x dense).
            factors[name] = round(max(got[0] / dense[0], 1.0), 3)
    return factors
