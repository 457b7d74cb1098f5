"""What the end-to-end grid of ``benchmarks/train.py`` is: its workloads, reductions and
networks, where its files live, each cell's recipe, and what a finished cell says of ``auto``'s
picks.

The runner (``train.py``), the predictions (``train_predict.py``), the report
(``train_report.py``) and its pictures (``train_plots.py``) share these definitions, so that a
cell is named, placed and read one way.
"""

from __future__ import annotations

import calendar
import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import yaml
from jaxcomm_launcher.recipe import apply_overrides

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
      held_out: kept out of everything that fits ``auto``'s model: its auto cells get no
        profile, compute step or steps factors (auto measures its world and learns the steps
        from the run), and its cells feed nothing else.
      learner: of a held-out workload, the learner change its auto cells judged: they ran
        the learner with it, the learner before it ran in ``results/e2e-before-<learner>``
        ("" where they shaped the learner, "before-cut" where they ran the one before the
        cut windows).
    """

    recipe: str
    metric: str
    higher_is_better: bool
    result_glob: str
    held_out: bool = False
    learner: str = ""

    def load(self) -> dict[str, Any]:
        return yaml.safe_load((REPO / "recipes" / self.recipe).read_text())


def _held_out(name: str, model: str, learner: str) -> Workload:
    """A held-out digits job (``recipes/<name>.yaml``, ``model``: ``mlp`` or ``cnn``) trained
    to a test accuracy, its auto cells run by ``learner`` (:attr:`Workload.learner`)."""
    return Workload(f"{name}.yaml", "test_accuracy", True, f"digits-{model}-*.json", True, learner)


WORKLOADS = {
    "lbann-mlp": Workload("lbann-mlp.yaml", "test_accuracy", True, "digits-mlp-*.json"),
    "bytes-lm": Workload("bytes-lm.yaml", "validation_bits_per_byte", False, "bytes-lm-*.json"),
    "digits-small": Workload("digits-small.yaml", "test_accuracy", True, "digits-mlp-*.json"),
    # Held out: auto is judged on them; no profile or steps factor comes from them. The first
    # three were read while the learner was built; heldout-deep was read after it was frozen at
    # cee38fa, heldout-convadam and heldout-wideadam only after the learner they judge,
    # heldout-convsgd and heldout-tripleadam only after the probed windows, which lost there
    # and were reverted; heldout-bigbatch and heldout-plainsgd only after the cut windows and
    # the warm-up in seconds (5da6766), which they judged; heldout-shallow and
    # heldout-smallbatch only after the safe windows read past the flush (485d87b), which
    # they judged; heldout-convbatch and heldout-narrowdeep only after the guard that gives way
    # (add2e9c), which they judged; heldout-convsmall and heldout-fourmid only after the steps'
    # prior (07c6547), which they judged; heldout-convplain and heldout-adamdecay only after
    # the rarer re-checks (9710391), which they judged; heldout-convlowmom and heldout-himom
    # only after the unbracketed rounds (2941e9f), which they judged; heldout-digitsdeep and
    # heldout-convwide were defined for the change after those, and with heldout-digitsadam
    # and heldout-convdigits judged the lead (78808b7); heldout-teachermom and
    # heldout-convadamdigits judge the lead decided alone (bb796c1), as heldout-teacherbatch
    # and heldout-convteacher do on runs several times as long; heldout-convbigbatch and
    # heldout-wideshallow judge the windows cut after a cut one, and heldout-convadamwd and
    # heldout-midplain judge that learner again, unchanged, as heldout-fourwide does on runs of
    # tens of seconds; heldout-fivemom and heldout-convdigitsmom judge the arms timed at start
    # and the prior's pick until a round is cheap (fb7b37c), heldout-sixlong the same learner
    # on a run of minutes, long enough for its first round to open, and heldout-convmidmom and
    # heldout-fouradam judge that learner again, unchanged; heldout-convadambatch,
    # heldout-threelong and heldout-twoadamlong, whose recipes give dense's steps, judge the
    # prior that reads them as a delay over the run, and heldout-threeadamwd and
    # heldout-convlong judge that learner again, unchanged (recipes/heldout-*.yaml).
    **{
        name: _held_out(name, model, learner)
        for name, model, learner in [
            ("heldout-mlp", "mlp", ""),
            ("heldout-cnn", "cnn", ""),
            ("heldout-teacher", "mlp", ""),
            ("heldout-deep", "mlp", ""),
            ("heldout-convadam", "cnn", "before-cut"),
            ("heldout-wideadam", "mlp", "before-cut"),
            ("heldout-convsgd", "cnn", "before-cut"),
            ("heldout-tripleadam", "mlp", "before-cut"),
            ("heldout-bigbatch", "mlp", "cut"),
            ("heldout-plainsgd", "mlp", "cut"),
            ("heldout-shallow", "mlp", "flush"),
            ("heldout-smallbatch", "mlp", "flush"),
            ("heldout-convbatch", "cnn", "guard"),
            ("heldout-narrowdeep", "mlp", "guard"),
            ("heldout-convsmall", "cnn", "prior"),
            ("heldout-fourmid", "mlp", "prior"),
            ("heldout-convplain", "cnn", "rarer"),
            ("heldout-adamdecay", "mlp", "rarer"),
            ("heldout-convlowmom", "cnn", "unbracketed"),
            ("heldout-himom", "mlp", "unbracketed"),
            ("heldout-digitsdeep", "mlp", "lead"),
            ("heldout-convwide", "cnn", "lead"),
            ("heldout-digitsadam", "mlp", "lead"),
            ("heldout-convdigits", "cnn", "lead"),
            ("heldout-teachermom", "mlp", "lead-alone"),
            ("heldout-convadamdigits", "cnn", "lead-alone"),
            ("heldout-teacherbatch", "mlp", "lead-alone"),
            ("heldout-convteacher", "cnn", "lead-alone"),
            ("heldout-convbigbatch", "cnn", "recut"),
            ("heldout-wideshallow", "mlp", "recut"),
            ("heldout-convadamwd", "cnn", "recut"),
            ("heldout-midplain", "mlp", "recut"),
            ("heldout-fourwide", "mlp", "recut"),
            ("heldout-fivemom", "mlp", "timed"),
            ("heldout-convdigitsmom", "cnn", "timed"),
            ("heldout-sixlong", "mlp", "timed"),
            ("heldout-convmidmom", "cnn", "timed"),
            ("heldout-fouradam", "mlp", "timed"),
            ("heldout-convadambatch", "cnn", "delay"),
            ("heldout-threelong", "mlp", "delay"),
            ("heldout-twoadamlong", "mlp", "delay"),
            ("heldout-threeadamwd", "mlp", "delay"),
            ("heldout-convlong", "cnn", "delay"),
        ]
    },
}

LEARNER = next(w.learner for w in reversed(WORKLOADS.values()) if w.held_out)
"""The learner as it stands: the change the latest held-out workloads judged."""
LEARNERS = tuple(dict.fromkeys(w.learner for w in WORKLOADS.values() if w.held_out))
"""Every learner the held-out workloads judged, in the order they judged them."""

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
# DiLoCo cells (not in the default grid, --algorithms names them): AdamW inner steps,
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


def compute_path(out: pathlib.Path, workload: str, nodes: int, devices: int = 1) -> pathlib.Path:
    """Where a workload's compute step is cached: ``cells/<workload>/compute.json`` for the
    faithful 2-node world, ``compute-<N>x<D>.json`` for others (a node's batch is the global
    batch over the nodes, so its step differs; a node of D devices computes it on D cores)."""
    name = "compute.json" if (nodes, devices) == (2, 1) else f"compute-{nodes}x{devices}.json"
    return out / "cells" / workload / name


def write_json(path: pathlib.Path, data: Any) -> None:
    """Writes `data` atomically: a killed grid never leaves a half-written (so 'finished') cell."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def utc_now() -> str:
    """The time now, as cells and compute steps record it (ISO 8601, UTC, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def utc_epoch(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))  # UTC, whatever the zone


def compute_at(path: pathlib.Path, started_at: str | None) -> float | None:
    """The compute step a cell that started at `started_at` was run with: the last
    measurement taken before it (``compute.json`` and its ``history``).

    Cells and measurements from before the grid recorded times have none: such a cell gets the
    first measurement, the one every prediction used then.

    Example:
      >>> import tempfile
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
            if "measured_at" not in m or utc_epoch(m["measured_at"]) <= utc_epoch(started_at):
                return m["step_s"]
    return measured[-1]["step_s"]


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


def tuned(workload: str, label: str, untuned: bool = False) -> bool:
    """Whether the cell is an ``auto`` given what was measured beforehand (the world's profile,
    the compute step, each algorithm's steps): not on a held-out workload, nor ``untuned`` (a
    new user's auto), which measure their world and learn the steps from the run.

    Example:
      >>> tuned("bytes-lm", "auto-bf16"), tuned("bytes-lm", "auto-bf16", untuned=True)
      (True, False)
      >>> tuned("heldout-mlp", "auto-bf16"), tuned("bytes-lm", "gtopk")
      (False, False)
    """
    return label in AUTO_LABELS and not (WORKLOADS[workload].held_out or untuned)


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
    untuned: bool = False,
) -> dict[str, Any]:
    """The recipe of one cell: the workload's recipe with one sweep entry, the cell's world,
    seed and time cap (and, for ``auto`` on a workload that is not held out, unless
    ``untuned``, the world's measured profile, the workload's measured compute step, which
    its extra steps would pay again, and the steps each algorithm needed on this workload,
    ``train_predict.measured_steps_factor``).

    Example:
      >>> r = cell_recipe("digits-small", "host", 2, "gtopk", 0, 60.0, None, [])
      >>> r["sweep"], r["train"]["time_cap_s"], r["world"]["processes"]
      ([{'algorithm': 'gtopk'}], 60.0, 2)
      >>> given = ("bytes-lm", "100mbit", 2, "auto-bf16", 0, None, pathlib.Path("p.json"), [])
      >>> sorted(cell_recipe(*given, 0.1, {"gtopk": 2.0})["sweep"][0])
      ['algorithm', 'compute_seconds', 'grad_dtype', 'profile', 'steps_factor']
      >>> sorted(cell_recipe(*given, 0.1, {"gtopk": 2.0}, untuned=True)["sweep"][0])
      ['algorithm', 'grad_dtype']
    """
    recipe = WORKLOADS[workload].load()
    recipe["name"] = f"{workload}-{network}-{label}-s{seed}"
    entry = dict(VARIANTS[label])
    # A variant's example arguments (not jaxcomm settings) go to the recipe's args.
    recipe["args"] = {**recipe.get("args", {}), **entry.pop("args", {})}
    given = tuned(workload, label, untuned)
    if given and profile is not None:
        entry["profile"] = str(profile)
    if given and compute_s is not None:
        entry["compute_seconds"] = compute_s
    if given and steps_factor:
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


def load_cells(out: pathlib.Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*/*/*-s*.json"))]


def auto_picks(cell: dict[str, Any]) -> list[str]:
    """The algorithms auto chose in a cell, sorted (its warm-up decision aside): a learning
    auto's decisions (``["trials"]`` when the run ended before its first), else each bucket's
    choice at trace time."""
    events = cell.get("auto_learned") or []
    learned = [d["choice"] for d in events if d["event"] == "decision"]
    if learned:
        return sorted(set(learned))
    if events:
        return ["trials"]
    return sorted({c["choice"] for c in cell.get("auto_choices") or [] if "choice" in c})


def auto_dropped_warmup(cell: dict[str, Any]) -> bool:
    """Whether auto decided to train without the warm-up (jaxcomm.cost.warmup_pays)."""
    return any(
        not c["warmup_decision"]["warmup"]
        for c in cell.get("auto_choices") or []
        if "warmup_decision" in c
    )


def auto_pick(cell: dict[str, Any]) -> str | None:
    """``"dense+gtopk"``, and `` (no warm-up)`` where auto dropped the warm-up of a pick that
    has one (a pick without a density, e.g. BlockQuant, trains alike either way)."""
    picks = auto_picks(cell)
    if not picks:
        return None
    sparse = any(p in ALGORITHMS.names() and ALGORITHMS.get(p).uses_density for p in picks)
    return "+".join(picks) + (" (no warm-up)" if sparse and auto_dropped_warmup(cell) else "")
