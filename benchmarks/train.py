"""Time to target: train each workload with each gradient reduction until it reaches its target.

One command runs the end-to-end grid: workloads × networks × reductions × seeds. A *cell* is
one training run (``jaxcomm launch`` of the workload's recipe with one sweep entry) that stops
at the recipe's ``train.target`` (test accuracy, or validation bits per byte), at a time cap or
at its step cap, and records its metric against training wall clock, bytes and step time. Each
finished cell is written to ``--out/cells/<workload>/<network>/<label>-s<seed>.json`` and never
run again, so an interrupted grid resumes where it stopped (delete a cell's file to rerun it).

Networks (2 nodes by default, each pinned to a core of its own: ``backend.cpus_per_node``;
a world that needs more cores than the host has is marked oversubscribed):

- ``100mbit``, ``1gbit``: the emulated cluster (network namespaces, tbf-shaped links; root);
- ``host``: one machine, the processes talk through shared memory and loopback.

Reductions: ``psum`` and ``psum-bf16`` (XLA's ``lax.pmean`` in fp32 and bf16), ``dense`` and
``dense-bf16`` (jaxcomm's dense allreduce, fp32 and its 16-bit wire), ``gtopk`` and
``topk_allgather`` (with the gTop-k paper's warm-up), ``onebit``, ``adaptive``, and ``auto``
(jaxcomm's cost model picks per bucket, from a profile that ``jaxcomm probe`` measured on the
same world before: a cell of its own, ``cells/profiles/<network>.json``).

Before its first run, the grid measures each workload's compute step on one pinned core
(``cells/<workload>/compute.json``, ``compute-4x1.json`` for 4 nodes), and again before a run
when the last measurement is older than ``--compute-max-age`` hours: this machine's compute
step has drifted by half between sittings, and a prediction is only as good as the compute
step it adds. With the profile, ``jaxcomm.cost.plan`` predicts every cell's step time (compute
+ the reduction) from the compute step measured in the cell's sitting, and the report shows it
beside the measured one.

The report (``--report`` alone redraws it from the cells) prints, per workload and network:
time to target, the speedup over the fastest dense 16-bit run (``psum-bf16`` or
``dense-bf16``), the best metric, bytes and seconds per step, the predicted step time, and
``auto``'s pick. It writes ``--out/e2e.json``, ``e2e-curves.png`` (metric against wall clock,
a panel per cell), ``e2e-pays.png`` (workload × network coloured by the best speedup, ``auto``'s
pick marked) and ``docs/e2e.md``. A run that stopped at its cap did not reach its target: its
time to target is reported as "> cap", and a speedup over a capped baseline as a lower bound;
nothing is extrapolated.

Usage:
  python benchmarks/train.py                                     # the whole grid (hours)
  python benchmarks/train.py --workloads digits-small --networks host 1gbit
  python benchmarks/train.py --workloads lbann-mlp --networks 1gbit --algorithms psum-bf16 gtopk
  python benchmarks/train.py --report                            # tables and pictures only
  # DiLoCo over 2 sites of 2 devices against flat data-parallel, per-device DiLoCo and a
  # per-step compressor, in one world (oversubscribed on a host with fewer than 4 cores):
  python benchmarks/train.py --workloads bytes-lm --networks 100mbit --devices 2 \
      --algorithms dense-bf16 gtopk diloco-dense-bf16 diloco-gtopk diloco-sites-dense-bf16 \
      diloco-sites-gtopk diloco-sites-stream-gtopk
"""

from __future__ import annotations

import argparse
import calendar
import dataclasses
import functools
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import yaml
from _bench import jaxcomm_cli, pyplot
from jaxcomm_launcher.recipe import apply_overrides, parse_set

from docs import e2e_cells, e2e_columns
from docs import main as docs_main
from jaxcomm import algorithms, cost

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "e2e"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A bundled recipe trained to its ``train.target``.

    Attributes:
      recipe: file under ``recipes/``.
      metric: the result's key (``test_accuracy``, ``validation_bits_per_byte``).
      higher_is_better: accuracy (True) or bits per byte (False).
      result_glob: the rank-0 result file the job writes in its run directory.
      held_out: kept out of everything that fits or tunes ``auto``: its auto cells get no
        profile, compute step or steps factors (auto measures its world and learns the steps
        from the run), and its cells feed nothing else.
    """

    recipe: str
    metric: str
    higher_is_better: bool
    result_glob: str
    held_out: bool = False

    def load(self) -> dict[str, Any]:
        return yaml.safe_load((REPO / "recipes" / self.recipe).read_text())


WORKLOADS = {
    "lbann-mlp": Workload("lbann-mlp.yaml", "test_accuracy", True, "digits-mlp-*.json"),
    "bytes-lm": Workload("bytes-lm.yaml", "validation_bits_per_byte", False, "bytes-lm-*.json"),
    "digits-small": Workload("digits-small.yaml", "test_accuracy", True, "digits-mlp-*.json"),
    # Held out: auto is judged on them, never tuned on them (recipes/heldout-*.yaml).
    "heldout-mlp": Workload("heldout-mlp.yaml", "test_accuracy", True, "digits-mlp-*.json", True),
    "heldout-cnn": Workload("heldout-cnn.yaml", "test_accuracy", True, "digits-cnn-*.json", True),
}

# The algorithm registry (jaxcomm/algorithms/, light: no JAX): a new algorithm joins the
# grid with nothing edited here.
ALGORITHMS = algorithms

# label -> the recipe sweep entry of that reduction: XLA's pmean and jaxcomm's dense allreduce
# in fp32 and 16-bit, then every other registered algorithm, then auto (tests/test_workloads.py
# validates every entry as a recipe).
VARIANTS: dict[str, dict[str, Any]] = {
    "psum": {"algorithm": "psum"},
    "psum-bf16": {"algorithm": "psum", "grad_dtype": "bfloat16"},
    "dense": {"algorithm": "dense"},
    "dense-bf16": {"algorithm": "dense", "grad_dtype": "bfloat16"},
    **{n: {"algorithm": n} for n in ALGORITHMS.names() if n not in ("psum", "dense")},
    ALGORITHMS.AUTO: {"algorithm": ALGORITHMS.AUTO},
    # auto given the 16-bit gradients of the baseline it is measured against: its dense
    # buckets then go on jaxcomm's 16-bit wire, which it weighs against the compressors.
    f"{ALGORITHMS.AUTO}-bf16": {"algorithm": ALGORITHMS.AUTO, "grad_dtype": "bfloat16"},
    # The same without the sparse algorithms' warm-up (the example's `args.warmup`, a
    # training choice auto does not make): the warm-up's dense-ish first epoch is what a
    # sparse pick pays most for on a slow link.
    f"{ALGORITHMS.AUTO}-bf16-nowarmup": {
        "algorithm": ALGORITHMS.AUTO,
        "grad_dtype": "bfloat16",
        "args": {"warmup": False},
    },
}
AUTO_LABELS = tuple(v for v, entry in VARIANTS.items() if entry["algorithm"] == ALGORITHMS.AUTO)
# What the grid runs by default: all but the algorithms whose bytes hang on a tuned setting
# (threshold's tau), which auto does not choose by default either, and auto with the 16-bit
# gradients of the baseline (float32 "auto" cells stay in the report where they were run).
DEFAULT_ALGORITHMS = [
    v
    for v, entry in VARIANTS.items()
    if (entry["algorithm"] in ("psum", "dense") or v == f"{ALGORITHMS.AUTO}-bf16")
    or entry["algorithm"] in cost.DEFAULT_ALLOWED
]
BASELINES_16BIT = ("psum-bf16", "dense-bf16")
# DiLoCo cells (issue 26; not in the default grid, --algorithms names them): AdamW inner steps,
# an outer step every DILOCO_EVERY with dense fp32 (MaxText's), dense bf16 or any compressed
# algorithm of the registry, and streaming (the compressed outer allreduce applied
# DILOCO_DELAY steps later, overlapped with the inner steps). No step-time prediction. The
# sparse outer allreduces keep DILOCO_DENSITY of the pseudo-gradient (SparseLoCo keeps 1-3 %
# with error feedback; the per-step density of 0.001 is tuned for one step's gradient, not
# for 20 steps of change).
DILOCO_EVERY, DILOCO_DELAY, DILOCO_DENSITY = 20, 5, 0.05
# The outer step: plain averaging of the ranks' weights (SGD, lr 1, no momentum). With DiLoCo's
# default (Nesterov, lr 0.7, momentum 0.9, tuned for H = 500 on 8 workers), bytes-lm at H = 20 on
# 2 nodes plateaued at 3.99 bits per byte at the global weights in 1851 steps while each rank's
# own loss matched dense training's (docs/e2e.md; the runs are in git history).
DILOCO_OUTER = {"outer_lr": 1.0, "outer_momentum": 0.0}
VARIANTS.update(
    {
        "diloco-dense": {"algorithm": "dense", "diloco": {"every": DILOCO_EVERY, **DILOCO_OUTER}},
        "diloco-dense-bf16": {
            "algorithm": "dense",
            "grad_dtype": "bfloat16",
            "diloco": {"every": DILOCO_EVERY, **DILOCO_OUTER},
        },
        **{
            f"diloco{kind}-{a.name}": {
                "algorithm": a.name,
                **({"density": DILOCO_DENSITY} if a.uses_density else {}),
                "diloco": {
                    "every": DILOCO_EVERY,
                    **DILOCO_OUTER,
                    **({"delay": DILOCO_DELAY} if kind else {}),
                },
            }
            for a in ALGORITHMS.registered()
            # DiLoCo's outer allreduce is one flat vector: not the leaf-shaped ones (PowerSGD)
            if a.residual and a.in_recipes and a.leafwise is None
            for kind in ("", "-stream")
        },
    }
)
# DiLoCo over sites (run them with --devices 2: 2 nodes of 2 devices, the 4 devices of the
# per-step and per-device DiLoCo cells of the same world): a node is one worker whose devices
# average their gradients every step, and each device sends its half of the node's change of
# the weights to the other node (jaxcomm.optax.diloco's inner_axis).
DILOCO_SITES = {"every": DILOCO_EVERY, **DILOCO_OUTER, "sites": True}
VARIANTS.update(
    {
        "diloco-sites-dense-bf16": {
            "algorithm": "dense",
            "grad_dtype": "bfloat16",
            "diloco": DILOCO_SITES,
        },
        **{
            f"diloco-sites{kind}-{a.name}": {
                "algorithm": a.name,
                **({"density": DILOCO_DENSITY} if a.uses_density else {}),
                "diloco": {**DILOCO_SITES, **({"delay": DILOCO_DELAY} if kind else {})},
            }
            for a in ALGORITHMS.registered()
            if a.residual and a.in_recipes and a.leafwise is None
            for kind in ("", "-stream")
        },
    }
)

# network -> the recipe backend (None: local, one host).
NETWORKS: dict[str, str | None] = {"100mbit": "100mbit", "1gbit": "1gbit", "host": None}

# Seconds of training after which a cell stops (it then did not reach its target). The fp32
# dense reductions at 100 Mbit/s are certain to be slower than their 16-bit twins (twice the
# bytes on a wire-bound step): they get a short cap that still measures their step time.
DEFAULT_CAPS = {"100mbit": 900.0, "1gbit": 300.0, "host": 300.0}
DEFAULT_LABEL_CAPS = {("psum", "100mbit"): 120.0, ("dense", "100mbit"): 120.0}


def network_dir(network: str, nodes: int, devices: int = 1) -> str:
    """The folder of a network's cells, e.g. ``1gbit-2x1`` (nodes × devices per node)."""
    return f"{network}-{nodes}x{devices}"


def cell_path(
    out: pathlib.Path, workload: str, network: str, nodes: int, label: str, seed: int, devices=1
):
    folder = network_dir(network, nodes, devices)
    return out / "cells" / workload / folder / f"{label}-s{seed}.json"


def write_json(path: pathlib.Path, data: Any) -> None:
    """Writes `data` atomically: a killed grid never leaves a half-written (so 'finished') cell."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def backend(network: str, nodes: int, devices: int = 1) -> dict[str, Any] | str:
    """The recipe backend of `network`: emulated nodes pinned to a core per device each, or
    local."""
    rate = NETWORKS[network]
    if rate is None:
        return "local"
    return {
        "kind": "emulated",
        "bandwidth": rate,
        "burst": "128kb",
        "ipc_isolation": True,
        "ucx_tls": "tcp",
        "cpus_per_node": devices,
    }


def cell_recipe(
    workload: str,
    network: str,
    nodes: int,
    label: str,
    seed: int,
    cap: float | None,
    profile: pathlib.Path | None,
    overrides: Sequence[tuple[list[str], Any]],
    compute_s: float | None = None,
    steps_factor: dict[str, float] | None = None,
    devices: int = 1,
) -> dict[str, Any]:
    """The recipe of one cell: the workload's recipe with one sweep entry, the cell's world,
    seed and time cap (and, for ``auto``, the world's measured profile, the workload's
    measured compute step, which its extra steps would pay again, and the steps each
    algorithm needed on this workload, :func:`measured_steps_factor`).

    Example:
      >>> r = cell_recipe("digits-small", "host", 2, "gtopk", 0, 60.0, None, [])
      >>> r["sweep"], r["train"]["time_cap_s"], r["world"]["processes"]
      ([{'algorithm': 'gtopk'}], 60.0, 2)
    """
    recipe = WORKLOADS[workload].load()
    recipe["name"] = f"{workload}-{network}-{label}-s{seed}"
    entry = dict(VARIANTS[label])
    # A variant's example arguments (not jaxcomm settings) go to the recipe's args.
    recipe["args"] = {**recipe.get("args", {}), **entry.pop("args", {})}
    # A held-out workload's auto is given nothing measured beforehand: it measures its world
    # and learns the steps from the run.
    tuned = label in AUTO_LABELS and not WORKLOADS[workload].held_out
    if tuned and profile is not None:
        entry["profile"] = str(profile)
    if tuned and compute_s is not None:
        entry["compute_seconds"] = compute_s
    if tuned and steps_factor:
        entry["steps_factor"] = dict(steps_factor)
    recipe["sweep"] = [entry]
    recipe["world"] = {"processes": nodes, "devices_per_process": devices}
    recipe["backend"] = backend(network, nodes, devices)
    recipe["train"]["seed"] = seed
    if cap is not None:
        recipe["train"]["time_cap_s"] = cap
    recipe = apply_overrides(recipe, list(overrides))
    recipe["metrics"] = {**recipe.get("metrics", {}), "plots": False}
    return recipe


def launch(
    recipe: dict[str, Any], run_dir: pathlib.Path, timeout: float, prefix: tuple[str, ...] = ()
) -> int:
    """Runs `recipe` through ``jaxcomm launch`` (quiet) into `run_dir`; returns its exit code.

    `prefix` goes before the command (``taskset -c 0`` pins a local run to one core)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    path = run_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    command = [*prefix, *jaxcomm_cli("launch", str(path), "--out", str(run_dir / "run"), "-q")]
    command += ["--timeout", str(timeout)]
    done = subprocess.run(command, text=True, capture_output=True)
    (run_dir / "launch.log").write_text(done.stdout + done.stderr)
    return done.returncode


# -- the cost model's prediction ------------------------------------------------------------


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
    ``auto`` weighs too); XLA's bf16 ``lax.pmean`` was measured no faster than its fp32 one
    (README of issue 23), so it is predicted as fp32.
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
    factors = _seed_steps_factor(out, workload, nodes, seed, half, warmup, devices)
    others = [
        _seed_steps_factor(out, workload, nodes, s, half, warmup, devices)
        for s in seeds
        if s != seed
    ]
    for name in sorted({n for f in others for n in f} - set(factors)):
        factors[name] = round(statistics.median(f[name] for f in others if name in f), 3)
    return factors


def _seed_steps_factor(
    out: pathlib.Path,
    workload: str,
    nodes: int,
    seed: int,
    half: bool,
    warmup: bool = True,
    devices: int = 1,
) -> dict[str, float]:
    """Steps to the workload's target of each of auto's choices, relative to dense, from the
    cells of this workload already run (any network; the seed's own cells).

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
    runs, steps = _steps_to_target(out, workload, nodes, seed, devices)
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
            picks = set(_auto_picks(cell)) - {"dense"}
            if len(picks) != 1:
                continue
            name = picks.pop()
            if ALGORITHMS.get(name).uses_density:
                if not (off or _auto_dropped_warmup(cell)):
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


# -- running the grid -------------------------------------------------------------------------


def read_result(run_dir: pathlib.Path, workload: str) -> dict[str, Any] | None:
    paths = sorted((run_dir / "run").glob(f"*/{WORKLOADS[workload].result_glob}"))
    return json.loads(paths[0].read_text()) if paths else None


def compute_path(out: pathlib.Path, workload: str, nodes: int, devices: int = 1) -> pathlib.Path:
    """Where a workload's compute step is cached: ``cells/<workload>/compute.json`` for the
    faithful 2-node world, ``compute-<N>x<D>.json`` for others (a node's batch is the global
    batch over the nodes, so its step differs; a node of D devices computes it on D cores)."""
    name = "compute.json" if (nodes, devices) == (2, 1) else f"compute-{nodes}x{devices}.json"
    return out / "cells" / workload / name


def utc_now() -> str:
    """The time now, as cells and compute steps record it (ISO 8601, UTC, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _epoch(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))  # UTC, whatever the zone


def compute_at(path: pathlib.Path, started_at: str | None) -> float | None:
    """The compute step a cell that started at `started_at` was run with: the last
    measurement taken before it (``compute.json`` and its ``history``).

    Cells and measurements from before the grid recorded times have none: such a cell gets the
    first measurement, the one every prediction used then.

    Example:
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "compute.json"
      >>> _ = p.write_text(json.dumps({"step_s": 0.2, "measured_at": "2026-11-27T07:00:00Z",
      ...                              "history": [{"step_s": 0.1}]}))
      >>> compute_at(p, "2026-11-27T08:00:00Z"), compute_at(p, None)
      (0.2, 0.1)
    """
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    measured = [data, *data.get("history", [])]  # newest first
    if started_at is not None:
        for m in measured:
            if "measured_at" not in m or _epoch(m["measured_at"]) <= _epoch(started_at):
                return m["step_s"]
    return measured[-1]["step_s"]


def measure_compute(args: argparse.Namespace, workload: str) -> float | None:
    """The workload's step on one pinned core with nothing to reduce (one rank): what each
    node computes per step. Cached in :func:`compute_path`, and measured again when the cached
    one is older than ``args.compute_max_age`` hours (the older ones move to its ``history``,
    for :func:`compute_at`)."""
    path = compute_path(args.out, workload, args.nodes, args.devices)
    cached = json.loads(path.read_text()) if path.exists() else None
    if cached is not None:
        stamp = cached.get("measured_at")
        age_h = (time.time() - _epoch(stamp)) / 3600 if stamp else math.inf
        if args.dry_run or age_h <= args.compute_max_age:
            return cached["step_s"]
    if args.dry_run:
        return None
    # One local process: the links' settings (--set backend.*) are not its.
    training = [(k, v) for k, v in args.set if k[0] != "backend"]
    # A node of several devices: its devices average their gradients (psum), as a site does.
    recipe = cell_recipe(workload, "host", 1, "psum", 0, None, None, training, devices=args.devices)
    recipe["name"] = f"{workload}-compute"
    recipe["train"]["steps"] = args.compute_steps
    recipe["train"].pop("target", None)
    recipe.setdefault("args", {}).pop("epochs", None)
    recipe["train"]["eval_every"] = args.compute_steps
    # The batch one node computes in the grid's world: the global batch over its nodes.
    recipe["train"]["batch_size"] = max(1, recipe["train"]["batch_size"] // args.nodes)
    if "batch_size" in recipe.get("args", {}):
        recipe["args"]["batch_size"] = max(1, recipe["args"]["batch_size"] // args.nodes)
    # One node pinned to a core per device, as an emulated node is.
    run_dir = args.work / f"{workload}-compute"
    cores = ",".join(str(c) for c in range(args.devices))
    prefix = ("taskset", "-c", cores) if shutil.which("taskset") else ()
    code = launch(recipe, run_dir, args.timeout, prefix)
    result = read_result(run_dir, workload)
    if code != 0 or result is None:
        print(f"  compute calibration of {workload} failed (exit {code}); see {run_dir}")
        return None
    data = {
        "step_s": result["step_seconds"],
        "steps": result["steps"],
        "pinned": bool(prefix),
        "batch_size": recipe["train"]["batch_size"],
        "measured_at": utc_now(),
    }
    if cached is not None:
        older = {k: v for k, v in cached.items() if k != "history"}
        data["history"] = [older, *cached.get("history", [])]
    write_json(path, data)
    return data["step_s"]


def measure_profile(args: argparse.Namespace, network: str) -> pathlib.Path | None:
    """``jaxcomm probe`` on the network's world (what ``auto`` and the predictions read)."""
    path = (
        args.out / "cells" / "profiles" / f"{network_dir(network, args.nodes, args.devices)}.json"
    )
    if path.exists() or args.dry_run:
        return path if path.exists() else None
    recipe = {
        "name": f"probe-{network}",
        "job": "probe",
        "world": {"processes": args.nodes, "devices_per_process": args.devices},
        "backend": backend(network, args.nodes, args.devices),
        "metrics": {"plots": False},
    }
    # The probe measures the cells' links: the --set overrides of the backend apply to it too
    # (e.g. backend.burst), the training ones do not.
    recipe = apply_overrides(recipe, [(k, v) for k, v in args.set if k[0] == "backend"])
    work = args.work / f"probe-{network}"
    work.mkdir(parents=True, exist_ok=True)
    recipe_path = work / "probe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        jaxcomm_cli("probe", str(recipe_path), "--out", str(path.with_suffix(".tmp"))),
        text=True,
        capture_output=True,
    )
    (work / "probe.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not path.with_suffix(".tmp").exists():
        print(f"  probe of {network} failed (exit {done.returncode}); see {work}/probe.log")
        return None
    os.replace(path.with_suffix(".tmp"), path)
    return path


def cap_of(args: argparse.Namespace, label: str, network: str) -> float:
    return args.label_caps.get((label, network), args.caps[network])


def auto_factors(
    args: argparse.Namespace, workload: str, label: str, seed: int
) -> tuple[dict | None, dict[str, Any]]:
    """An auto cell's measured steps factors (None: none measured) and what it decides the
    warm-up from (empty: it follows the schedule)."""
    if label not in AUTO_LABELS or WORKLOADS[workload].held_out:
        return None, {}  # a held-out workload's auto is given nothing measured on it
    half = VARIANTS[label].get("grad_dtype") == "bfloat16"
    warmup = VARIANTS[label].get("args", {}).get("warmup", True)
    world = (args.out, workload, args.nodes, seed, half)
    factors = measured_steps_factor(*world, warmup, args.devices) or None
    dense_steps = measured_dense_steps(*world, args.devices)
    without = measured_steps_factor(*world, False, args.devices)
    if warmup and dense_steps and set(without) - {"dense"}:
        # auto decides the warm-up from what was measured: its seconds per step against
        # the steps dropping it costs (jaxcomm.cost.warmup_pays).
        return factors, {"dense_steps": dense_steps, "steps_factor_no_warmup": without}
    return factors, {}


def cell_of(
    args: argparse.Namespace,
    result: dict[str, Any],
    summary: dict[str, Any],
    keys: dict[str, Any],
    recipe: dict[str, Any],
) -> dict[str, Any]:
    """The cell's record: ``keys`` (workload, network, nodes, label, seed, time_cap_s,
    predicted, wall_s, started_at) and what the run reported."""
    workload = keys["workload"]
    metric = WORKLOADS[workload].metric
    higher = WORKLOADS[workload].higher_is_better
    values = [h[metric] for h in result["history"] if h[metric] is not None]
    return {
        "workload": workload,
        "network": keys["network"],
        "nodes": keys["nodes"],
        "devices": args.devices,
        "label": keys["label"],
        "seed": keys["seed"],
        "metric": metric,
        "higher_is_better": higher,
        "target": result.get("target"),
        "time_cap_s": keys["time_cap_s"],
        "stopped": result.get("stopped"),
        "time_to_target_s": result.get("time_to_target_s"),
        "training_s": result["seconds"],
        "steps": result["steps"],
        "best": (max(values) if higher else min(values)) if values else None,
        "final": result[metric],
        "step_s": result["step_seconds"],
        "comm_s": result.get("comm_seconds_per_step"),
        "bytes_sent_per_step": result["bytes_sent_per_step"],
        "dense_bytes_per_step": result.get("dense_bytes_per_step"),
        "parameters": result["parameters"],
        "predicted": keys["predicted"],
        "auto_choices": result.get("auto_choices"),
        # A learning auto's trial windows and decisions (jaxcomm.cost.learn).
        "auto_learned": (result.get("auto") or {}).get("learned"),
        # Seconds auto spent measuring its world before deciding (no profile given).
        "auto_measure_s": _measure_seconds(result),
        "placement": summary.get("placement"),
        "oversubscribed": summary.get("oversubscribed"),
        "wall_s": keys["wall_s"],
        "started_at": keys["started_at"],
        "history": result["history"],
        "recipe": recipe,
        "command": " ".join(sys.argv),
    }


def _measure_seconds(result: dict[str, Any]) -> float | None:
    """The seconds auto spent measuring its world (``jaxcomm.metrics()["auto"]``), if it did."""
    measured = (result.get("auto") or {}).get("measured") or {}
    return sum(measured.get("seconds") or []) or None


def run_cell(
    args: argparse.Namespace,
    workload: str,
    network: str,
    label: str,
    seed: int,
    profile: pathlib.Path | None,
    compute: Callable[[], float | None],
) -> dict[str, Any] | None:
    """Runs one cell, or reads it if it ran before. `compute` gives the workload's compute
    step, measured (again) only when a cell is about to run."""
    path = cell_path(args.out, workload, network, args.nodes, label, seed, args.devices)
    if path.exists():
        return json.loads(path.read_text())
    compute_s = compute()
    cap = cap_of(args, label, network)
    factors, warmup_choice = auto_factors(args, workload, label, seed)
    recipe = cell_recipe(
        workload,
        network,
        args.nodes,
        label,
        seed,
        cap,
        profile,
        args.set,
        compute_s,
        factors,
        args.devices,
    )
    recipe["sweep"][0].update(warmup_choice)
    prediction = predict_step(
        workload, recipe, label, network, args.nodes, compute_s, profile, None, args.devices
    )
    if args.dry_run:
        print(f"  would run {path.relative_to(args.out)} (cap {cap:.0f} s)")
        if factors:
            print(f"    steps factors measured on {workload}: {factors}")
        if warmup_choice:
            print(f"    auto decides the warm-up from: {warmup_choice}")
        return None
    run_dir = args.work / f"{workload}-{network}-{label}-s{seed}"
    started_at = utc_now()
    t0 = time.monotonic()
    code = launch(recipe, run_dir, timeout=cap * 3 + 600)
    wall = time.monotonic() - t0
    result = read_result(run_dir, workload)
    summary_path = run_dir / "run" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if code != 0 or result is None:
        log = (run_dir / "launch.log").read_text()[-2000:]
        print(f"  {label}: launch failed (exit {code}); cell not written. Log tail:\n{log}")
        return None
    keys = {
        "workload": workload, "network": network, "nodes": args.nodes, "label": label,
        "seed": seed, "time_cap_s": cap, "predicted": prediction, "wall_s": wall,
        "started_at": started_at,
    }  # fmt: skip
    cell = cell_of(args, result, summary, keys, recipe)
    write_json(path, cell)
    return cell


def fmt_cell(cell: dict[str, Any]) -> str:
    reach = cell["time_to_target_s"]
    pred = (cell.get("predicted") or {}).get("step_s")
    return (
        f"  {cell['label']:15s} {cell['stopped']:8s} steps {cell['steps']:5d}  "
        f"to target {'> cap' if reach is None else f'{reach:8.1f} s'}  "
        f"best {cell['best']:.4f}  step {cell['step_s']:.3f} s"
        + (f" (predicted {pred:.3f})" if pred else "")
        + f"  {cell['bytes_sent_per_step'] / 1e6:.2f} MB/step"
    )


def run_grid(args: argparse.Namespace) -> None:
    for workload in args.workloads:
        # Measured (or re-measured, when stale) before the first cell that runs, not before
        # a resumed grid whose cells are all done.
        compute = functools.cache(functools.partial(measure_compute, args, workload))
        for network in args.networks:
            # The profile of this world: auto reads it, and every cell's prediction uses it.
            profile = measure_profile(args, network)
            print(f"{workload} · {network_dir(network, args.nodes, args.devices)}")
            cells = {}
            for label in args.algorithms:
                for seed in args.seeds:
                    cell = run_cell(args, workload, network, label, seed, profile, compute)
                    if cell is not None:
                        cells[label] = cell
                        print(fmt_cell(cell), flush=True)
            if args.winner_seeds and network in args.winner_networks:
                for label in winners(cells):
                    for seed in args.winner_seeds:
                        cell = run_cell(args, workload, network, label, seed, profile, compute)
                        if cell is not None:
                            print(fmt_cell(cell), flush=True)


def winners(cells: dict[str, dict[str, Any]]) -> list[str]:
    """The fastest dense 16-bit run and the fastest jaxcomm run of one (workload, network):
    the two that get more seeds."""

    def key(c: dict[str, Any]) -> tuple[float, float]:
        t = c["time_to_target_s"]
        return (0 if t is not None else 1, t if t is not None else c["step_s"])

    base = [cells[b] for b in BASELINES_16BIT if b in cells]
    jc = [c for label, c in cells.items() if label not in ("psum", "psum-bf16")]
    out = []
    if base:
        out.append(min(base, key=key)["label"])
    if jc:
        best = min(jc, key=key)["label"]
        if best not in out:
            out.append(best)
    return out


# -- the report ---------------------------------------------------------------------------------


def load_cells(out: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*/*/*-s*.json"))]


def summarize(
    cells: list[dict[str, Any]], computes: dict[tuple[str, int, int], float] | None = None
) -> list[dict[str, Any]]:
    """One row per (workload, network, label): seeds pooled (median time to target, spread),
    the speedup over the fastest dense 16-bit run of the same cell, and the bound on any
    speedup there (``computes``: each workload's measured compute step)."""
    computes = computes or {}
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for c in cells:
        net = network_dir(c["network"], c["nodes"], c.get("devices", 1))
        groups.setdefault((c["workload"], net, c["label"]), []).append(c)
    rows = [
        _summary_row(workload, net, label, runs) for (workload, net, label), runs in groups.items()
    ]
    by_cell: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_cell.setdefault((r["workload"], r["network"]), []).append(r)
    for cell_rows in by_cell.values():
        _add_speedups(cell_rows, computes)
    order = {k: i for i, k in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (r["workload"], r["network"], order.get(r["label"], 99)))
    return rows


def _summary_row(workload: str, net: str, label: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The seeds of one (workload, network, label) pooled into a row of :func:`summarize`."""
    reached = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
    caps = [r["training_s"] for r in runs if r["time_to_target_s"] is None]
    first = runs[0]
    higher = first["higher_is_better"]
    bests = [r["best"] for r in runs if r["best"] is not None]
    # Each seed predicted with the compute step measured before it, against each seed's step.
    pred = _median([(r.get("predicted") or {}).get("step_s") for r in runs])
    step = _median([r["step_s"] for r in runs])
    return {
        "workload": workload,
        "network": net,
        "nodes": first["nodes"],
        "devices": first.get("devices", 1),
        "label": label,
        "seeds": sorted(r["seed"] for r in runs),
        "reached": len(reached),
        "time_to_target_s": _median(reached) if len(reached) == len(runs) else None,
        "time_to_target_spread_s": (min(reached), max(reached)) if reached else None,
        "capped_at_s": max(caps) if caps else None,
        "target": first["target"],
        "metric": first["metric"],
        "best": (max(bests) if higher else min(bests)) if bests else None,
        "step_s": step,
        "predicted_step_s": pred,
        "prediction_error": (pred - step) / step if pred and step else None,
        "bytes_sent_per_step": _median([r["bytes_sent_per_step"] for r in runs]),
        "steps": _median([r["steps"] for r in runs]),
        # Every seed's pick, where they differ ("a / b"): seeds decide apart.
        "auto_pick": " / ".join(dict.fromkeys(p for p in map(_auto_pick, runs) if p)) or None,
        "oversubscribed": first.get("oversubscribed"),
        "held_out": WORKLOADS[workload].held_out if workload in WORKLOADS else False,
        "measure_s": _median([r.get("auto_measure_s") for r in runs]),
        # The compute step its runs were predicted with.
        "compute_s": _median([(r.get("predicted") or {}).get("compute_s") for r in runs]),
    }


def _add_speedups(cell_rows: list[dict[str, Any]], computes: dict) -> None:
    """Adds to each row of one (workload, network) its speedup over the fastest dense 16-bit
    baseline and the bound a free reduction would reach there."""
    base = [r for r in cell_rows if r["label"] in BASELINES_16BIT]
    done = [r for r in base if r["time_to_target_s"] is not None]
    if done:
        b = min(done, key=lambda r: r["time_to_target_s"])
        base_t, lower = b["time_to_target_s"], False
    elif base:  # no 16-bit baseline reached the target: the longest cap bounds it
        b = max(base, key=lambda r: r["capped_at_s"] or 0)
        base_t, lower = b["capped_at_s"], True
    else:
        b, base_t, lower = None, None, False
    # The speedup a reduction that cost nothing and needed no more steps than the baseline
    # would get: the baseline's time over its steps of compute alone.
    first = cell_rows[0]
    latest = computes.get((first["workload"], first["nodes"], first.get("devices", 1)))
    compute = (b["compute_s"] if b is not None else None) or latest
    bound = (
        base_t / (b["steps"] * compute)
        if (b is not None and base_t and compute and b["steps"])
        else None
    )
    for r in cell_rows:
        r["compute_s"] = r["compute_s"] or latest
        r["no_communication_bound"] = bound
        r["bound_compute_s"] = compute if bound else None
        r["baseline"] = None if b is None else b["label"]
        t = r["time_to_target_s"]
        r["speedup"] = base_t / t if (base_t and t) else None
        r["speedup_is_lower_bound"] = lower and r["speedup"] is not None


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _auto_picks(cell: dict[str, Any]) -> list[str]:
    """The algorithms auto chose in a cell, sorted (its warm-up decision aside): a learning
    auto's decisions, else each bucket's choice at trace time."""
    learned = [d["choice"] for d in cell.get("auto_learned") or [] if d["event"] == "decision"]
    if learned:
        return sorted(set(learned))
    return sorted({c["choice"] for c in cell.get("auto_choices") or [] if "choice" in c})


def _auto_dropped_warmup(cell: dict[str, Any]) -> bool:
    """Whether auto decided to train without the warm-up (jaxcomm.cost.warmup_pays)."""
    return any(
        not c["warmup_decision"]["warmup"]
        for c in cell.get("auto_choices") or []
        if "warmup_decision" in c
    )


def _auto_pick(cell: dict[str, Any]) -> str | None:
    """``"dense+gtopk"``, and `` (no warm-up)`` where auto dropped the warm-up of a pick that
    has one (a pick without a density, e.g. BlockQuant, trains alike either way)."""
    picks = _auto_picks(cell)
    if not picks:
        return None
    sparse = any(ALGORITHMS.get(p).uses_density for p in picks)
    return "+".join(picks) + (" (no warm-up)" if sparse and _auto_dropped_warmup(cell) else "")


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report as text for the terminal (docs/e2e.md gets the same through docs.py)."""
    widths = [34, 30, 18, 8, 6, 8, 16, 9]
    lines: list[str] = []
    for title, cell_rows in e2e_cells(rows):
        lines += ["", title, ""]
        for r in cell_rows:
            cols = e2e_columns(r)
            lines.append(
                " ".join(
                    c.rjust(w) if i else c.ljust(w)
                    for i, (c, w) in enumerate(zip(cols, widths, strict=True))
                )
            )
    return lines


def draw_curves(cells: list[dict[str, Any]], path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None or not cells:
        return
    keys = sorted(
        {(c["workload"], network_dir(c["network"], c["nodes"], c.get("devices", 1))) for c in cells}
    )
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (workload, net) in zip(axes.flat, keys, strict=False):
        for c in cells:
            if (c["workload"], network_dir(c["network"], c["nodes"], c.get("devices", 1))) != (
                workload,
                net,
            ):
                continue
            if c["seed"] != 0:
                continue
            pts = [(h["seconds"], h[c["metric"]]) for h in c["history"]]
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker=".", markersize=3, label=c["label"])
            target = c["target"]
        ax.axhline(target, color="gray", linestyle=":", linewidth=1)
        ax.set_title(f"{workload} · {net}", fontsize=9)
        # Linear up to 1 s (the small workload's whole run), logarithmic beyond.
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlim(left=0)
        ax.set_xlabel("training wall clock (s)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def draw_pays(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
    """Workload × network, coloured by the best jaxcomm speedup over the 16-bit baseline; the
    text names the best algorithm and ``auto``'s pick."""
    plt = pyplot()
    if plt is None or not rows:
        return
    workloads = sorted({r["workload"] for r in rows})
    networks = sorted(
        {r["network"] for r in rows}, key=lambda n: list(NETWORKS).index(n.split("-")[0])
    )
    import numpy as np

    grid = np.full((len(workloads), len(networks)), np.nan)
    fig, ax = plt.subplots(figsize=(2.2 + 2.0 * len(networks), 1.2 + 1.1 * len(workloads)))
    for i, w in enumerate(workloads):
        for j, n in enumerate(networks):
            cell = [r for r in rows if r["workload"] == w and r["network"] == n]
            jc = [r for r in cell if r["label"] not in ("psum", "psum-bf16") and r["speedup"]]
            autos = [r for r in cell if r["label"] in AUTO_LABELS]
            # The grid's auto (16-bit gradients, the workload's warm-up), else another.
            preferred = f"{ALGORITHMS.AUTO}-bf16"
            auto = next((r for r in autos if r["label"] == preferred), None) or next(
                iter(autos), None
            )
            if not jc:
                text = "no jaxcomm run\nreached the target" if cell else "not run"
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
                continue
            best = max(jc, key=lambda r: r["speedup"])
            grid[i, j] = math.log2(best["speedup"])
            text = f"{best['label']}\n{'≥' if best['speedup_is_lower_bound'] else ''}{best['speedup']:.2f}×"
            if auto is not None:
                pick = auto["auto_pick"] or "?"
                auto_s = "–" if auto["speedup"] is None else f"{auto['speedup']:.2f}"
                text += f"\nauto: {pick} {auto_s}×"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    lim = max(1.0, float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0)
    im = ax.imshow(grid, cmap="RdYlGn", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(len(networks)), networks, fontsize=8)
    ax.set_yticks(range(len(workloads)), workloads, fontsize=8)
    cbar = fig.colorbar(im, ax=ax)
    cbar.set_label("log2 speedup over the fastest dense 16-bit run", fontsize=7)
    ax.set_title("When compression pays (time to target)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _profiles_by_source(out: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every profile of the grid by its ``source`` (the probe's run): the current ones
    (``cells/profiles/<network>.json``) and the earlier ones that cells' auto runs read
    (``cells/profiles/read/``); a current one wins."""
    profiles = out / "cells" / "profiles"
    paths = sorted((profiles / "read").glob("*.json")) + sorted(profiles.glob("*.json"))
    return {json.loads(path.read_text()).get("source"): path for path in paths}


def repredict(args: argparse.Namespace, cells: list[dict[str, Any]]) -> None:
    """Predicts every cell's step time again with this commit's cost model (each cell keeps
    the prediction made before it ran as ``predicted_before_run``).

    An auto cell is predicted with the profile its run read (its decisions name the probe),
    so that the prediction is of the choices it made: a profile probed later may choose
    otherwise (lbann-mlp at 1 Gbit/s: BlockQuant with this session's profile, TopK-allgather
    with the one the run read), and the step it would then predict is not the run's."""
    sources = _profiles_by_source(args.out)
    for c in cells:
        devices = c.get("devices", 1)
        compute = compute_path(args.out, c["workload"], c["nodes"], devices)
        net = network_dir(c["network"], c["nodes"], devices)
        profile = args.out / "cells" / "profiles" / f"{net}.json"
        read = [d["profile"] for d in c.get("auto_choices") or [] if "profile" in d]
        if read and read[0] in sources:
            profile = sources[read[0]]
        compute_s = compute_at(compute, c.get("started_at"))
        if compute_s is None:
            continue
        c.setdefault("predicted_before_run", c.get("predicted"))
        recipe = c["recipe"]
        if _auto_dropped_warmup(c):  # predict the run auto made: no warm-up, its factors
            entry = dict(recipe["sweep"][0])
            entry["steps_factor"] = entry.get("steps_factor_no_warmup", entry.get("steps_factor"))
            recipe = {
                **recipe,
                "sweep": [entry],
                "args": {**recipe.get("args", {}), "warmup": False},
            }
        c["predicted"] = predict_step(
            c["workload"],
            recipe,
            c["label"],
            c["network"],
            c["nodes"],
            compute_s,
            profile if profile.exists() else None,
            c["steps"],
            devices,
        )


def report(args: argparse.Namespace) -> None:
    cells = load_cells(args.out)
    if not cells:
        print(f"no cells in {args.out}/cells yet")
        return
    repredict(args, cells)
    computes = {}
    for c in cells:
        key = (c["workload"], c["nodes"], c.get("devices", 1))
        path = compute_path(args.out, *key)
        if path.exists():
            computes[key] = json.loads(path.read_text())["step_s"]
    rows = summarize(cells, computes)
    for line in table_lines(rows):
        print(line)
    write_json(args.out / "e2e.json", {"rows": rows, "cells": len(cells)})
    draw_curves(cells, args.out / "e2e-curves.png")
    draw_pays(rows, args.out / "e2e-pays.png")
    if args.out.resolve() == DEFAULT_OUT.resolve():
        # docs/e2e.md's table comes from e2e.json through benchmarks/docs.py, as every table does.
        docs_main([])


def parse_caps(items: list[str]) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """``NET=SECONDS`` and ``LABEL@NET=SECONDS`` items over the defaults.

    Example:
      >>> parse_caps(["1gbit=60", "psum@host=30"])[1][("psum", "host")]
      30.0
    """
    caps, label_caps = dict(DEFAULT_CAPS), dict(DEFAULT_LABEL_CAPS)
    for item in items:
        key, _, value = item.partition("=")
        if "@" in key:
            label, net = key.split("@")
            label_caps[(label, net)] = float(value)
        else:
            caps[key] = float(value)
    return caps, label_caps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--networks", nargs="+", choices=list(NETWORKS), default=list(NETWORKS))
    parser.add_argument(
        "--algorithms", nargs="+", choices=list(VARIANTS), default=DEFAULT_ALGORITHMS
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument(
        "--winner-seeds",
        nargs="*",
        type=int,
        default=[1, 2],
        help="more seeds for the fastest 16-bit baseline and the fastest jaxcomm run",
    )
    parser.add_argument("--winner-networks", nargs="*", default=["1gbit"])
    parser.add_argument("--nodes", type=int, default=2, help="nodes (processes)")
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="devices per node, a core each (2 nodes x 2 devices: the DiLoCo-over-sites "
        "cells; more cores than the host has are marked oversubscribed)",
    )
    parser.add_argument(
        "--cap",
        nargs="*",
        default=[],
        help="time caps: NET=SECONDS or LABEL@NET=SECONDS (defaults: "
        + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_CAPS.items())
        + ")",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        help="recipe fields for every cell, dotted.key=value (e.g. train.steps=100)",
    )
    parser.add_argument("--compute-steps", type=int, default=20)
    parser.add_argument(
        "--compute-max-age",
        type=float,
        default=3.0,
        help="hours after which a workload's compute step is measured again before a run",
    )
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=pathlib.Path, default=None, help="run directories")
    parser.add_argument("--report", action="store_true", help="only redraw the report")
    parser.add_argument("--dry-run", action="store_true", help="list the cells that would run")
    args = parser.parse_args()
    args.caps, args.label_caps = parse_caps(args.cap)
    args.set = parse_set(args.set)  # the launcher's own --set: dotted.key=YAML value
    args.work = args.work or pathlib.Path(tempfile.gettempdir()) / "jaxcomm-e2e"
    if not args.report:
        run_grid(args)
    report(args)


if __name__ == "__main__":
    main()
