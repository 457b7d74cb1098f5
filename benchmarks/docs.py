"""Writes the measured tables of the docs from ``benchmarks/results/*.json``.

Every table of measurements in ``README.md`` and ``docs/*.md`` is generated here, so a number in
the docs and the JSON it came from cannot drift apart. A page holds hand-written prose and, where
a table goes, a marked region::

    <!-- generated: allreduce-25m -->
    ...replaced by this script...
    <!-- end generated: allreduce-25m -->

A section is one function decorated with :func:`section` that takes the results folder and returns
Markdown. Adding a section is that one function: if its page has no region for it yet, the script
appends one at the end of the page (creating the page if needed), and the prose can then be
written around it.

Usage (from the repository root; needs only the standard library)::

    python benchmarks/docs.py            # rewrite the generated regions
    python benchmarks/docs.py --check    # exit 1 naming each stale page (tests/test_docs.py)
    python benchmarks/docs.py --figures  # also redraw docs/when-it-pays.png (needs matplotlib)
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import statistics
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


class Section(NamedTuple):
    page: str  # path relative to the repository root
    name: str  # the region's name on that page
    render: Callable[[pathlib.Path], str]


SECTIONS: list[Section] = []


def section(page: str, name: str) -> Callable[[Callable[[pathlib.Path], str]], Callable]:
    """Registers ``render(results_dir) -> markdown`` as region ``name`` of ``page``.

    Example:
      >>> @section("docs/usage.md", "demo")
      ... def _demo(results: pathlib.Path) -> str:
      ...     return "| a |\\n|---|\\n| 1 |"
      >>> SECTIONS[-1].name, SECTIONS.pop().page
      ('demo', 'docs/usage.md')
    """

    def register(render: Callable[[pathlib.Path], str]) -> Callable[[pathlib.Path], str]:
        if any(s.page == page and s.name == name for s in SECTIONS):
            raise ValueError(f"section {name!r} of {page} is registered twice")
        SECTIONS.append(Section(page, name, render))
        return render

    return register


# ---------------------------------------------------------------------------------------------
# Formatting helpers


def load(results: pathlib.Path, name: str) -> dict[str, Any]:
    """Reads ``results/<name>.json``."""
    return json.loads((results / f"{name}.json").read_text())


def each(results: pathlib.Path, pattern: str, render: Callable[[dict[str, Any], str], str]) -> str:
    """``render(data, file name)`` of every result file matching ``pattern``, in name order,
    one paragraph each (a benchmark writes one file per configuration).

    Example:
      >>> each(RESULTS, "kernels-*.json", lambda data, file: file).splitlines()[0]
      'kernels-1core.json'
    """
    paths = sorted(results.glob(pattern), key=lambda p: p.stem)
    return "\n\n".join(render(load(results, p.stem), p.name) for p in paths)


def table(header: list[str], rows: list[list[Any]], caption: str | None = None) -> str:
    """A Markdown table; numbers must already be formatted. A caption (where the numbers come
    from) is the paragraph above it.

    Example:
      >>> print(table(["a", "b"], [[1, "x"]], caption="From `t.json`:"))
      From `t.json`:
      <BLANKLINE>
      | a | b |
      |---|---|
      | 1 | x |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return ("" if caption is None else caption + "\n\n") + "\n".join(lines)


def ms(seconds: float | None, digits: int | None = None) -> str:
    """Milliseconds with about three significant digits.

    Example:
      >>> ms(1.2695), ms(0.0586), ms(0.000708), ms(None)
      ('1270 ms', '58.6 ms', '0.708 ms', '–')
    """
    if seconds is None:
        return "–"
    v = seconds * 1e3
    if digits is None:
        digits = 0 if v >= 100 else 1 if v >= 10 else 2 if v >= 1 else 3
    return f"{round(v, digits) if digits else round(v):.{digits}f} ms"


def ratio(x: float | None) -> str:
    """A speed ratio, ``2.5×``; ``–`` when missing.

    Example:
      >>> ratio(11.06), ratio(4.629), ratio(0.666), ratio(None), ratio(float("nan"))
      ('11.1×', '4.63×', '0.67×', '–', '–')
    """
    if x is None or x != x:  # no baseline row in the run: nothing to compare with
        return "–"
    return f"{x:.1f}×" if x >= 10 else f"{x:.2f}×"


def mb(nbytes: float | None) -> str:
    """Megabytes (10⁶ bytes) with three significant digits.

    Example:
      >>> mb(150_000_000), mb(4_980_376), mb(400_000)
      ('150 MB', '4.98 MB', '0.400 MB')
    """
    if nbytes is None:
        return "–"
    v = nbytes / 1e6
    return (
        f"{v:.0f} MB"
        if v >= 100
        else f"{v:.1f} MB"
        if v >= 10
        else f"{v:.2f} MB"
        if v >= 1
        else f"{v:.3f} MB"
    )


def pct(x: float | None, signed: bool = False) -> str:
    """A fraction as a percentage.

    Example:
      >>> pct(0.2875), pct(-0.016, signed=True), pct(None)
      ('29 %', '-2 %', '–')
    """
    if x is None:
        return "–"
    return f"{x * 100:+.0f} %" if signed else f"{x * 100:.0f} %"


def elements(n: int) -> str:
    """``25M``, ``4M``, ``256``: element counts as the docs write them.

    Example:
      >>> elements(25_000_000), elements(16_777_216), elements(4096)
      ('25M', '16.8M', '4096')
    """
    if n >= 1_000_000:
        m = n / 1e6
        return f"{m:.0f}M" if m == int(m) else f"{m:.1f}M"
    return str(n)


def run_of(data: dict[str, Any]) -> str:
    """Where a benchmark ran: ``4 × 1, 1gbit emulated links`` or ``4 × 2, one host``."""
    world = f"{data['processes']} × {data.get('devices_per_process', 1)}"
    ranks = data["processes"] * data.get("devices_per_process", 1)
    if data.get("host_cores") and data["host_cores"] < ranks:  # recorded by newer runs
        world += f" (oversubscribed: {ranks} ranks on {data['host_cores']} cores)"
    if data.get("backend") == "emulated":
        return f"{world}, emulated {data.get('bandwidth')} links"
    return f"{world}, one host"


# ---------------------------------------------------------------------------------------------
# README.md


@section("README.md", "allreduce-25m")
@section("docs/benchmarks.md", "allreduce-25m")
def allreduce_25m(results: pathlib.Path) -> str:
    """The headline: every algorithm at 25M float32, 4 ranks, on 1 Gbit/s links and one host."""
    net = load(results, "allreduce-emulated-1gbit")
    host = load(results, "allreduce-local")
    host_rows = {r["algorithm"]: r for r in host["rows"]}
    rows = []
    for r in net["rows"]:
        h = host_rows.get(r["algorithm"], {})
        rows.append(
            [
                f"`{r['algorithm']}`",
                ms(r["median_s"]),
                ratio(r.get("speedup_vs_psum")),
                ms(h.get("median_s")),
                ratio(h.get("speedup_vs_psum")),
                mb(r.get("bytes_sent")),
            ]
        )
    header = ["algorithm", "1 Gbit/s links", "vs psum", "one host", "vs psum", "sent / rank"]
    n = elements(net["rows"][0]["elements"])
    return table(
        header,
        rows,
        caption=f"P = {net['processes']} processes, {n} float32 per rank, density "
        f"{net['density']}, median of {net['repeats']} "
        "(`benchmarks/results/allreduce-emulated-1gbit.json`, "
        "`benchmarks/results/allreduce-local.json`):",
    )


# ---------------------------------------------------------------------------------------------
# docs/benchmarks.md


@section("docs/benchmarks.md", "kernels-cpu")
def kernels_cpu(results: pathlib.Path) -> str:
    """``benchmarks/kernels.py`` on the CPU."""
    return _kernels(load(results, "kernels"), "kernels.json")


@section("docs/benchmarks.md", "kernels-cpu-1core")
def kernels_cpu_1core(results: pathlib.Path) -> str:
    """``benchmarks/kernels.py`` pinned to one core (``taskset -c 1``)."""
    return _kernels(load(results, "kernels-1core"), "kernels-1core.json")


def _kernels(data: dict[str, Any], file: str) -> str:
    by_baseline = {r["baseline"]: r for r in data["rows"] if r["baseline"]}
    rows = []
    for r in data["rows"]:
        if r["group"] == "topk" and r["baseline"] is None:
            lax = by_baseline["lax"]["median_s"]
            vs = f"{ratio(lax / r['median_s'])} faster than `lax.top_k(jnp.abs(x), k)`"
        elif r["group"] == "quantize" and r["baseline"] is None:
            vs = f"{r['gbps'] / by_baseline['copy']['gbps']:.2f} of copy bandwidth"
        else:
            vs = "baseline"
        name = r["name"].replace("jaxcomm.ops.topk_abs", f"jaxcomm.ops.topk_abs (k = {data['k']})")
        rows.append([f"`{name}`", ms(r["median_s"]), f"{r['gbps']:.1f}", vs])
    samples = f"medians of {data['repeats']}"
    if "calls_per_sample" in data:
        samples += f" samples of {data['calls_per_sample']} back-to-back calls"
    cores = data["machine"].get("cores_used")
    pinned = f", pinned to {cores} of them" if cores and cores < data["machine"]["cpus"] else ""
    return table(
        ["kernel", "median", "GB/s of x", "vs baseline"],
        rows,
        caption=f"n = {data['n']:,} float32 on `{data['device']}` ({data['machine']['cpus']} "
        f"CPUs{pinned}, jax {data['jax']}), {samples} (`benchmarks/results/{file}`):",
    )


def _allreduce_table(data: dict[str, Any], file: str) -> str:
    rows = [
        [
            f"`{r['algorithm']}`",
            elements(r["elements"]),
            ms(r["median_s"]),
            ratio(r.get("speedup_vs_psum")),
            mb(r.get("bytes_sent")),
        ]
        for r in data["rows"]
    ]
    return table(
        ["algorithm", "elements", "median", "vs psum", "sent / rank"],
        rows,
        caption=f"{run_of(data)}, density {data['density']}, median of {data['repeats']} "
        f"(`benchmarks/results/{file}`):",
    )


@section("docs/benchmarks.md", "allreduce-hierarchical")
def allreduce_hierarchical(results: pathlib.Path) -> str:
    """Flat against hierarchical dense allreduce on 4 nodes × 2 devices."""
    return _allreduce_table(
        load(results, "allreduce-emulated-1gbit-4x2"), "allreduce-emulated-1gbit-4x2.json"
    )


@section("docs/benchmarks.md", "quantized-allreduce")
def quantized_allreduce(results: pathlib.Path) -> str:
    """The quantized allreduce runs (flat and hierarchical, loopback and emulated)."""
    return each(results, "quantized-allreduce-*.json", _allreduce_table)


@section("docs/benchmarks.md", "peers")
def peers(results: pathlib.Path) -> str:
    """``benchmarks/peers.py``: dense allreduce against OpenMPI, mpi4jax and psum."""
    data = load(results, "peers-local")
    median = {
        (r["processes"], r["elements"], r["implementation"]): r["median_s"] for r in data["rows"]
    }
    impls = ["openmpi", "mpi4jax", "psum", "jaxcomm"]
    rows = []
    for p, n in sorted({(r["processes"], r["elements"]) for r in data["rows"]}):
        t = {i: median.get((p, n, i)) for i in impls}
        rows.append(
            [p, elements(n)]
            + [ms(t[i]) for i in impls]
            + [ratio(t[i] / t["jaxcomm"]) if t[i] and t["jaxcomm"] else "–" for i in impls[:3]]
        )
    header = [
        "P",
        "elements",
        "OpenMPI `Allreduce`",
        "mpi4jax",
        "`lax.psum`",
        "`jaxcomm.allreduce`",
    ]
    header += ["vs OpenMPI", "vs mpi4jax", "vs psum"]
    return table(
        header,
        rows,
        caption=f"{data['calls']} calls per sample, median of "
        f"{data['repeats'] * data['rounds']} samples, {data['host_cores']} cores "
        "(`benchmarks/results/peers-local.json`):",
    )


@section("docs/benchmarks.md", "small-allreduce")
def small_allreduce(results: pathlib.Path) -> str:
    """``benchmarks/small_allreduce.py``: small- against large-vector schedules at every size."""
    out = []
    for path in sorted(results.glob("small-allreduce-*.json")):
        data = json.loads(path.read_text())
        cells: dict[tuple[str, int], dict[str, dict]] = {}
        for r in data["rows"]:
            cells.setdefault((r["path"], r["elements"]), {})[r["schedule"]] = r
        rows = []
        for (route, n), c in sorted(cells.items()):
            large, small = c.get("large"), c.get("small")
            rows.append(
                [
                    route,
                    n,
                    ms(c["psum"]["median_s"], 2) if "psum" in c else "–",
                    f"{ms(large['median_s'], 2)} (`{large['label']}`)" if large else "–",
                    f"{ms(small['median_s'], 2)} (`{small['label']}`)" if small else "–",
                    ratio(large["median_s"] / small["median_s"]) if large and small else "–",
                ]
            )
        cross = ", ".join(f"{k} {v:,} B" for k, v in sorted(data["crossover_bytes"].items()))
        out.append(
            table(
                [
                    "path",
                    "elements",
                    "`lax.psum`",
                    "large schedule",
                    "small schedule",
                    "small vs large",
                ],
                rows,
                caption=f"{run_of(data)}, median of {data['repeats']} "
                f"(`benchmarks/results/{path.name}`; "
                f"largest size where the small schedule wins: {cross or 'none'}):",
            )
        )
    return "\n\n".join(out)


def _overlap(data: dict[str, Any], file: str) -> str:
    rows = []
    smallest = min(r["bucket_size"] for r in data["rows"] if r["bucket_size"] > 0)
    for r in data["rows"]:
        hidden = pct(r["hidden_fraction"])
        if r["bucket_size"] == smallest:  # T_comm alone is inflated there: see the prose
            hidden = f"({hidden})"
        rows.append(
            [
                f"`{r['algorithm']}`",
                r["bucket"],
                ms(r["t_comm_s"]),
                ms(r["t_step_s"]),
                hidden,
                pct(r["saved_vs_single_bucket"], signed=True),
            ]
        )
    load_start = ", ".join(f"{v:.1f}" for v in data["loadavg_start"])
    return table(
        ["algorithm", "bucket", "T_comm", "T_step", "hidden", "vs one bucket"],
        rows,
        caption=f"{run_of(data)}: {data['layers']} layers of {data['width']}, "
        f"{data['elements']:,} gradient elements, T_compute {ms(data['t_compute_s'])}, median of "
        f"{data['repeats']}, load average at the start {load_start} "
        f"(`benchmarks/results/{file}`):",
    )


def _overlap_runs(results: pathlib.Path, faithful: bool) -> list[pathlib.Path]:
    """The ``benchmarks/overlap.py`` results: the runs before faithful nodes (no
    ``cpus_per_node``: ranks shared the cores) in name order, or those on faithful nodes (each
    node pinned to cores of its own) by bandwidth.

    Example:
      >>> [p.name for p in _overlap_runs(RESULTS, faithful=False)][:1]
      ['overlap-emulated-1gbit-4x1.json']
    """
    runs = []
    for path in sorted(results.glob("overlap-*.json"), key=lambda p: p.stem):
        data = json.loads(path.read_text())
        # overlap.py writes cpus_per_node always (None: not pinned); older runs lack it.
        if "rows" in data and bool(data.get("cpus_per_node")) == faithful:
            runs.append((_bits_per_s(data.get("bandwidth")), path))
    return [path for _, path in (sorted(runs) if faithful else runs)]


def _bits_per_s(rate: str | None) -> float:
    """A tc rate (``1gbit``, ``500mbit``) in bit/s; 0 for none (one host).

    Example:
      >>> _bits_per_s("500mbit"), _bits_per_s(None)
      (500000000.0, 0.0)
    """
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate and rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    return 0.0


@section("docs/benchmarks.md", "overlap")
def overlap(results: pathlib.Path) -> str:
    """``benchmarks/overlap.py``: how much communication the start/done split hides."""
    return "\n\n".join(
        _overlap(load(results, p.stem), p.name) for p in _overlap_runs(results, faithful=False)
    )


def _check(ok: bool | None) -> str:
    return "–" if ok is None else ("yes" if ok else "**no**")


@section("docs/overlap.md", "overlap-faithful")
def overlap_faithful(results: pathlib.Path) -> str:
    """``benchmarks/overlap.py`` on 2 faithful nodes: hidden fraction and the no-regression
    checks, per bandwidth, algorithm and bucket size."""
    out = []
    for path in _overlap_runs(results, faithful=True):
        data = load(results, path.stem)
        rows = []
        for r in data["rows"]:
            bound = r.get("step_over_comm_plus_forward")
            paired = r.get("overlap_minus_no_overlap_s")
            rows.append(
                [
                    f"`{r['algorithm']}`",
                    r["bucket"],
                    ms(r["t_compute_s"]),
                    f"{r['comm_over_compute']:.2f}",
                    ms(r["t_comm_s"]),
                    ms(r["t_step_s"]),
                    ms(r.get("t_step_no_overlap_s")),
                    "–" if paired is None else f"{paired * 1e3:+.1f} ms",
                    pct(r["hidden_fraction"]),
                    "–" if bound is None else f"{bound:.2f}",
                    _check(r.get("not_slower_than_no_overlap")),
                ]
            )
        out.append(
            f"{run_of(data)}, {data.get('cpus_per_node')} core per node: {data['layers']} layers "
            f"of {data['width']} ({data['elements']:,} gradient elements), "
            f"{data['batch_per_device']} rows per rank, T_forward {ms(data.get('t_forward_s'))}, "
            f"median of {data['repeats']} rounds, each timing compute, forward, comm, step and "
            f"step without overlap once (`benchmarks/results/{path.name}`):\n\n"
            + table(
                [
                    "algorithm",
                    "bucket",
                    "T_compute",
                    "T_comm / T_compute",
                    "T_comm",
                    "T_step",
                    "T_step, overlap=False",
                    "overlap − no overlap, per round",
                    "hidden",
                    "T_step / (T_comm + T_forward)",
                    "overlap ≤ no overlap",
                ],
                rows,
            )
        )
    # Not measured yet: say so, with the command, rather than leave the region empty.
    return "\n\n".join(out) or (
        "No run on faithful nodes yet: `benchmarks/overlap.py --backend emulated --processes 2 "
        "--cpus-per-node 1 --bandwidth RATE` writes one."
    )


@section("docs/overlap.md", "overlap-schedule")
def overlap_schedule(results: pathlib.Path) -> str:
    """``benchmarks/overlap_schedule.py``: what each bucket's start waits for in XLA's thunk
    graph beyond its own data."""
    out = []
    for path in sorted(results.glob("overlap-schedule-*.json"), key=lambda p: p.stem):
        data = load(results, path.stem)
        rows = [
            [
                r["bucket"],
                r["thunk"],
                len(r["backward_thunks_unrelated"]),
                ", ".join(f"`{n}`" for n in r["backward_thunks_unrelated"]) or "–",
                ", ".join(f"`{n}`" for n in r["collectives_unrelated"]) or "–",
            ]
            for r in data["collectives"]
            if r["role"] == "start"
        ]
        out.append(
            f"`{data['algorithm']}`, {data['layers']} layers of {data['width']}, bucket "
            f"{data['bucket_size']:,} elements: {data['thunks']} thunks, "
            f"`{data['command']}`:\n\n"
            + table(
                [
                    "bucket",
                    "start thunk",
                    "unrelated backward thunks",
                    "which",
                    "collectives it waits for",
                ],
                rows,
            )
        )
    return "\n\n".join(out)


@section("docs/benchmarks.md", "overlap-paced")
def overlap_paced(results: pathlib.Path) -> str:
    """Step time against the number of steps in flight (``jaxcomm.paced``)."""
    rows = []
    for path in _overlap_runs(results, faithful=False):
        data = json.loads(path.read_text())
        steps: dict[str, dict[int, float]] = {}
        for r in data.get("paced", []):
            steps.setdefault(r["algorithm"], {})[r["max_in_flight"]] = r["t_step_s"]
        for algorithm, by_n in steps.items():
            rows.append([run_of(data), f"`{algorithm}`"] + [ms(by_n.get(k)) for k in (0, 1, 2, 4)])
    return table(["run", "algorithm", "0 in flight", "1", "2", "4"], rows)


def _train(data: dict[str, Any], file: str) -> str:
    metric = data["metric"].replace("_", " ")
    fmt = (lambda v: f"{v * 100:.1f} %") if "accuracy" in data["metric"] else (lambda v: f"{v:.3f}")
    rows = [
        [
            f"`{r['algorithm']}`",
            fmt(r["final"]),
            "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s",
            ratio(r.get("speedup_vs_psum")),
            f"{r['step_s']:.2f}",
            "–" if r["comm_s"] is None else f"{r['comm_s']:.2f}",
            f"{r['bytes_sent_per_step'] / 1e6:.1f}",
        ]
        for r in data["rows"]
    ]
    steps = data["rows"][0]["steps"]
    params = data["rows"][0]["parameters"]
    header = [
        "reduction",
        f"{metric} at step {steps}",
        f"time to psum's {fmt(data['target'])}",
        "vs psum",
        "s/step",
        "jaxcomm s/step",
        "MB sent/step/rank",
    ]
    # The recorded command used an interface benchmarks/train.py no longer has: not shown, so
    # that every command on the pages runs.
    return table(
        header,
        rows,
        caption=f"`{data['workload']}` ({params:,} parameters), {run_of(data)}, {steps} steps "
        f"(`benchmarks/results/{file}`):",
    )


@section("docs/benchmarks.md", "train")
def train(results: pathlib.Path) -> str:
    """``benchmarks/train.py``: every reduction of one workload in the same run."""
    return each(results, "train-*.json", _train)


# ---------------------------------------------------------------------------------------------
# docs/e2e.md: time to target (benchmarks/train.py writes results/e2e/e2e.json)

E2E_HEADER = [
    "reduction",
    "time to target",
    "speedup vs 16-bit",
    "best",
    "steps",
    "s/step",
    "predicted s/step",
    "MB/step",
]


def _num(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None and v == v and abs(v) != float("inf") else "–"


def _seconds(v: float | None) -> str:
    return _num(v, ".1f") + (" s" if v is not None else "")


def e2e_title(row: dict[str, Any]) -> str:
    """The heading of one (workload, network) cell of the end-to-end grid.

    Example:
      >>> e2e_title({"workload": "w", "network": "1gbit-2x1", "metric": "test_accuracy",
      ...            "target": 0.9, "no_communication_bound": None, "oversubscribed": None})
      'w · 1gbit-2x1 · target test_accuracy ≥ 0.9'

    The compute-only figure is the baseline's time over its own steps of compute alone (the
    compute step measured with the baseline, ``bound_compute_s``): what the baseline would
    reach with free communication. It is not a bound for every run: a reduction that needs
    fewer steps than the baseline's median seed can beat it.

      >>> e2e_title({"workload": "w", "network": "1gbit-2x1", "metric": "test_accuracy",
      ...            "target": 0.9, "no_communication_bound": 4.2, "bound_compute_s": 0.198,
      ...            "compute_s": 0.112, "oversubscribed": None})
      'w · 1gbit-2x1 · target test_accuracy ≥ 0.9 · compute 198 ms/step: the baseline with free communication would be 4.2×'
    """
    sign = "≥" if row["metric"] == "test_accuracy" else "≤"
    title = f"{row['workload']} · {row['network']} · target {row['metric']} {sign} {row['target']}"
    if row.get("no_communication_bound"):
        title += (
            f" · compute {(row.get('bound_compute_s') or row['compute_s']) * 1e3:.3g} ms/step: "
            "the baseline with free communication would be "
            f"{row['no_communication_bound']:.1f}×"
        )
    if row.get("oversubscribed"):
        title += f" · {row['oversubscribed']}"
    return title


def e2e_columns(row: dict[str, Any]) -> list[str]:
    """One row of the end-to-end table, formatted (the columns of :data:`E2E_HEADER`).

    A run that stopped at its cap did not reach the target: ``> cap``; a speedup over a capped
    baseline is a lower bound (``≥``). A row of seeds, fewer than half of which missed the
    target, has their median time (the missed ones counted as the slowest) and says how many
    missed.

    Example:
      >>> e2e_columns({"label": "gtopk", "auto_pick": None, "time_to_target_s": 12.0,
      ...   "seeds": [0], "time_to_target_spread_s": None, "capped_at_s": None, "speedup": 2.0,
      ...   "speedup_is_lower_bound": False, "best": 0.98, "steps": 80, "step_s": 0.15,
      ...   "predicted_step_s": 0.12, "prediction_error": -0.2, "bytes_sent_per_step": 2e5})[:3]
      ['gtopk', '12.0 s', '2.00×']
    """
    t, spread = row["time_to_target_s"], row["time_to_target_spread_s"]
    n = len(row["seeds"])
    if t is not None:
        reach = f"{t:.1f} s"
        missed = n - row.get("reached", n)
        if n > 1 and spread:
            lo, hi = spread
            digits = ".1f" if hi < 10 else ".0f"  # a few seconds' spread in tenths
            reach += f" ({lo:{digits}}–{hi:{digits}}, {n} seeds"
            reach += f"; {missed} missed it, > {row['capped_at_s']:.0f} s)" if missed else ")"
    else:
        reach = f"> {row['capped_at_s']:.0f} s (cap)" if row["capped_at_s"] else "–"
        reached = row.get("reached", 0)
        if reached and spread:  # some seeds reached, not every one
            reach += f" on {n - reached} of {n} seeds, the others {spread[0]:.1f}–{spread[1]:.1f} s"
    speed = _num(row["speedup"], ".2f")
    if row["speedup"] is not None:
        speed = ("≥ " if row["speedup_is_lower_bound"] else "") + speed + "×"
    predicted = _num(row["predicted_step_s"], ".3f")
    if row["prediction_error"] is not None:
        predicted += f" ({row['prediction_error']:+.0%})"
    return [
        row["label"] + (f" → {row['auto_pick']}" if row["auto_pick"] else ""),
        reach,
        speed,
        _num(row["best"], ".4f"),
        _num(row["steps"], ".0f"),
        _num(row["step_s"], ".3f"),
        predicted,
        _num(row["bytes_sent_per_step"] / 1e6, ".2f"),
    ]


def e2e_cells(
    rows: list[dict[str, Any]], held_out: bool = False
) -> list[tuple[str, list[dict[str, Any]]]]:
    """The rows grouped by (workload, network), in their order: ``[(title, rows), ...]``, of
    the grid's workloads, or with `held_out` of the workloads kept out of auto's tuning."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if bool(r.get("held_out")) == held_out:
            groups.setdefault((r["workload"], r["network"]), []).append(r)
    return [(e2e_title(g[0]), g) for g in groups.values()]


def plan_errors(rows: list[dict[str, Any]], workloads: tuple[str, ...]) -> str:
    """`jaxcomm plan`'s per-step error (the tables' *predicted s/step* column): median and worst
    |error| over every row that has a prediction, then over the faithful emulated rows of
    ``workloads`` (2 nodes of a core each, not oversubscribed, not one host), the subset where
    the link rather than the shared cores sets the step.

    Example:
      >>> rows = [{"workload": "w", "network": n, "label": l, "prediction_error": e,
      ...          "oversubscribed": None} for n, l, e in
      ...         [("1gbit-2x1", "dense", 0.05), ("1gbit-2x1", "gtopk", -0.2),
      ...          ("host-2x1", "psum", -0.5)]]
      >>> plan_errors(rows, ("w",))
      'all 3 rows with a prediction: median 20 %, worst -50 % (psum, w host-2x1); the 2 emulated 2-node rows of w: median 12.5 %, worst -20 % (gtopk, w 1gbit-2x1)'
    """
    predicted = [r for r in rows if r.get("prediction_error") is not None]
    emulated = [
        r
        for r in predicted
        if r["workload"] in workloads
        and not r.get("oversubscribed")
        and not r["network"].startswith("host")
    ]

    def summary(group: list[dict[str, Any]]) -> str:
        worst = max(group, key=lambda r: abs(r["prediction_error"]))
        median = statistics.median(abs(r["prediction_error"]) for r in group)
        return (
            f"median {100 * median:.3g} %, worst {100 * worst['prediction_error']:+.3g} % "
            f"({worst['label']}, {worst['workload']} {worst['network']})"
        )

    if not predicted:
        return ""
    text = f"all {len(predicted)} rows with a prediction: {summary(predicted)}"
    if emulated:
        text += (
            f"; the {len(emulated)} emulated 2-node rows of {', '.join(workloads)}: "
            f"{summary(emulated)}"
        )
    return text


@section("docs/e2e.md", "e2e")
def e2e(results: pathlib.Path) -> str:
    """The end-to-end grid: one table per workload and network (``results/e2e/e2e.json``),
    then `jaxcomm plan`'s error over its faithful rows."""
    data = load(results / "e2e", "e2e")
    parts = [
        table(E2E_HEADER, [e2e_columns(r) for r in rows], caption=f"**{title}**")
        for title, rows in e2e_cells(data["rows"])
    ]
    plan = plan_errors(data["rows"], ("lbann-mlp", "bytes-lm"))
    return (
        "From `benchmarks/results/e2e/e2e.json` ({} runs).\n\n".format(data["cells"])
        + "\n\n".join(parts)
        + (
            f"\n\n`jaxcomm plan`'s per-step error (each row: its seeds' median) over {plan}."
            if plan
            else ""
        )
    )


# Issue 40's targets for auto: its time to target over the fastest reduction's, and over the
# fastest dense 16-bit run's (benchmarks/learn_windows.py and steps_prior.py read them too).
TARGET_OVER_FASTEST = 1.15
TARGET_OVER_DENSE16 = 1.10
DENSE16 = ("psum-bf16", "dense-bf16")  # train_grid.BASELINES_16BIT (no grid import here)

HELDOUT_HEADER = [
    "workload · link",
    "learner",
    "`auto` (no profile)",
    "fastest reduction",
    "`auto` / fastest",
    "fastest dense 16-bit",
    "`auto` / dense 16-bit",
    "measuring, compiling at start",
    "targets",
]


def _reach(row: dict[str, Any] | None) -> str:
    if row is None:
        return "–"
    label, reach = e2e_columns(row)[:2]
    return f"{label}, {reach}"


def heldout_summary(rows: list[dict[str, Any]], bound: dict[str, Any] | None = None) -> list[str]:
    """One (workload, link) of a held-out workload: the learner its ``auto-bf16`` ran (the
    change its workload judged), auto's time to target against the
    fastest other reduction and the fastest dense 16-bit run of the same run of the grid, and
    whether it met the targets or what bounds them (``bound``: :func:`window_bound`).

    Example:
      >>> def row(label, t):
      ...     return {"workload": "w", "network": "1gbit-2x1", "label": label, "auto_pick": None,
      ...             "time_to_target_s": t, "seeds": [0], "time_to_target_spread_s": None,
      ...             "capped_at_s": None, "speedup": None, "speedup_is_lower_bound": False,
      ...             "best": 0.9, "steps": 10, "step_s": 0.1, "predicted_step_s": None,
      ...             "prediction_error": None, "bytes_sent_per_step": 1e6,
      ...             "measure_s": 0.5 if label.startswith("auto") else None, "compile_s": 2.0,
      ...             "learner": "lead"}
      >>> heldout_summary([row("dense-bf16", 10.0), row("gtopk", 5.0), row("auto-bf16", 5.5)])
      ['w · 1gbit-2x1', '`lead`', 'auto-bf16, 5.5 s', 'gtopk, 5.0 s', '1.10×', 'dense-bf16, 10.0 s', '0.55×', '0.5 s, 2.0 s', 'met']
      >>> capped = {**row("dense-bf16", None), "capped_at_s": 20.0, "reached": 0}
      >>> heldout_summary([capped, row("gtopk", 5.0), row("auto-bf16", 5.5)])[5:7]
      ['dense-bf16, > 20 s (cap)', '< 0.28×']
    """
    auto = next((r for r in rows if r["label"] == "auto-bf16"), None)
    fastest, dense16 = _bases(rows)
    # No dense 16-bit run reached the target: its cap bounds its time from below.
    capped = _capped_dense16(rows) if dense16 is None else None

    def ratio(base: dict[str, Any] | None) -> float:  # infinite: auto or base did not reach it
        if auto is None or base is None or auto["time_to_target_s"] is None:
            return math.inf
        return auto["time_to_target_s"] / (base["time_to_target_s"] or base["capped_at_s"])

    over_fastest, over_dense16 = ratio(fastest), ratio(dense16 or capped)
    met = _within_targets(over_fastest, over_dense16)
    # The prior's pick matters only where the windows' bound holds (window_bound).
    windowed = bound is not None and bound["bounded"]
    prior = prior_pick_of(rows, fastest, dense16) if windowed and not met else None
    start = [None if auto is None else auto.get(k) for k in ("measure_s", "compile_s")]
    learner = rows[0].get("learner")
    return [
        f"{rows[0]['workload']} · {rows[0]['network']}",
        f"`{learner}`" if learner else "shaped it",
        _reach(auto),
        _reach(fastest),
        "–" if over_fastest == math.inf else f"{over_fastest:.2f}×",
        _reach(dense16 or capped),
        "–" if over_dense16 == math.inf else f"{'< ' if capped else ''}{over_dense16:.2f}×",
        ", ".join(_seconds(v) for v in start),
        "met" if met else window_bound(bound, prior),
    ]


def _within_targets(over_fastest: float, over_dense16: float) -> bool:
    """Whether a time to target that many times the fastest reduction's and the fastest
    dense 16-bit run's meets the targets.

    Example:
      >>> _within_targets(1.10, 0.5), _within_targets(1.10, 1.2)
      (True, False)
    """
    return over_fastest <= TARGET_OVER_FASTEST and over_dense16 <= TARGET_OVER_DENSE16


def prior_pick_of(
    rows: list[dict[str, Any]],
    fastest: dict[str, Any] | None,
    dense16: dict[str, Any] | None,
) -> tuple[str, float] | None:
    """The pick of the learner as it stands on the prior alone, given each reduction's
    measured step (``benchmarks/prior_pick.py``), and its time to target over the fastest
    reduction's, where that misses the targets (over ``TARGET_OVER_FASTEST`` of the fastest
    or ``TARGET_OVER_DENSE16`` of the fastest dense 16-bit run); None where it meets them
    or it cannot be told (the row has no dense 16-bit run).

    Example:
      >>> prior_pick_of([], None, None) is None
      True
    """
    if fastest is None or dense16 is None:
        return None
    from prior_pick import prior_pick
    from steps_prior import label

    from jaxcomm.cost.learn import Learning  # the library: only where a row is judged

    labels = {r["label"]: r for r in rows if r["label"] != "auto-bf16"}
    if "dense-bf16" not in labels:
        return None
    # As the row's auto ran: its prior a delay where its cells were given dense's steps.
    auto = next((r for r in rows if r["label"] == "auto-bf16"), {})
    dense_steps = auto.get("dense_steps")
    pick = label(prior_pick(labels, Learning().for_run(dense_steps)))
    seconds = labels[pick]["time_to_target_s"]
    seconds = math.inf if seconds is None else seconds
    over = seconds / fastest["time_to_target_s"]
    if _within_targets(over, seconds / dense16["time_to_target_s"]):
        return None
    return pick, over


def window_bound(bound: dict[str, Any] | None, prior: tuple[str, float] | None = None) -> str:
    """A missed row's bound: bounded where both ways a learner has of choosing fail on it,
    trial windows (``bound``, ``benchmarks/learn_windows.py``: the least they cost, the
    cheaper measure, exceeds what the targets allow) and the prior's pick on measured steps
    (``prior``: :func:`prior_pick_of`, that pick and its time over the fastest's, where it
    misses); missed otherwise.

    Example:
      >>> bound = {"allowance_s": 0.2, "bounded": True,
      ...          "measures": {"batch": {"least_cost_s": 0.5}, "probe": {"least_cost_s": 0.4}}}
      >>> window_bound(bound, ("blockquant", 1.5))
      'bounded: windows cost ≥ 0.40 s, 0.20 s allowed; the prior picks blockquant, 1.50×'
      >>> window_bound(bound)
      'missed: windows cost ≥ 0.40 s, 0.20 s allowed; the prior picks within them'
      >>> window_bound(None)
      'missed'
    """
    if bound is None:
        return "missed"
    least = min(m["least_cost_s"] for m in bound["measures"].values())
    verdict = "bounded" if bound["bounded"] and prior is not None else "missed"
    text = f"{verdict}: windows cost ≥ {least:.2f} s, {bound['allowance_s']:.2f} s allowed"
    if not bound["bounded"]:
        return text
    return text + (f"; the prior picks {prior[0]}, {prior[1]:.2f}×" if prior else
                   "; the prior picks within them")  # fmt: skip


def window_bounds(results: pathlib.Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Each held-out (workload, link)'s bound of ``benchmarks/learn_windows.py``."""
    out = {}
    for path in sorted(results.glob("learn-windows-heldout-*.json")):
        data = load(results, path.stem)
        out.update({(data["workload"], link): b for link, b in data.get("bounds", {}).items()})
    return out


def _bases(rows: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A held-out (workload, link)'s fastest reduction and fastest dense 16-bit run, of
    those that reached the target (``auto-bf16`` left out)."""
    others = [r for r in rows if r["label"] != "auto-bf16" and r["time_to_target_s"] is not None]
    fastest = min(others, key=lambda r: r["time_to_target_s"], default=None)
    dense = [r for r in others if r["label"] in DENSE16]
    return fastest, min(dense, key=lambda r: r["time_to_target_s"], default=None)


def _capped_dense16(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Of a held-out (workload, link) where no dense 16-bit run reached the target, the one
    stopped at the longest cap (None: there is none)."""
    capped = [r for r in rows if r["label"] in DENSE16 and r["capped_at_s"]]
    return max(capped, key=lambda r: r["capped_at_s"], default=None)


def _prior_misses(rows: list[dict[str, Any]]) -> bool:
    """Whether the prior's pick on the row's measured steps misses the targets
    (:func:`prior_pick_of`)."""
    return prior_pick_of(rows, *_bases(rows)) is not None


def _verdict(summary: list[str]) -> str:
    """A held-out summary's verdict (:func:`heldout_summary`): met, bounded or missed.

    Example:
      >>> _verdict(["w", "`lead`", "bounded: windows cost ≥ 1 s"])
      'bounded'
    """
    return summary[-1].split(":")[0]


def _tally(summaries: list[list[str]]) -> str:
    """How many of the held-out summaries (:func:`heldout_summary`) met the targets, are
    bounded, or missed them.

    Example:
      >>> _tally([["w", "`lead`", "met"], ["v", "`lead`", "bounded: windows cost ≥ 1 s"]])
      '2 rows: 1 met, 1 bounded, 0 missed'
    """
    verdicts = [_verdict(s) for s in summaries]
    tally = ", ".join(f"{verdicts.count(v)} {v}" for v in ("met", "bounded", "missed"))
    return f"{len(summaries)} rows: {tally}"


@section("docs/e2e.md", "e2e-heldout")
def e2e_heldout(results: pathlib.Path) -> str:
    """The held-out workloads (``results/e2e/e2e.json`` rows marked ``held_out``): auto's time
    to target against the fastest reduction of the same run, then each cell's table."""
    data = load(results / "e2e", "e2e")
    cells = e2e_cells(data["rows"], held_out=True)
    if not cells:
        return "No held-out cells in `benchmarks/results/e2e/e2e.json` yet."
    bounds = window_bounds(results)
    summaries = [
        heldout_summary(rows, bounds.get((rows[0]["workload"], rows[0]["network"])))
        for _, rows in cells
    ]
    floors = [  # per row bounded both ways: whether auto met the targets
        _verdict(s) == "met"
        for s, (_, rows) in zip(summaries, cells, strict=True)
        if bounds.get((rows[0]["workload"], rows[0]["network"]), {}).get("bounded")
        and _prior_misses(rows)
    ]
    now = data.get("learner")
    current = [
        s for s, (_, rows) in zip(summaries, cells, strict=True) if rows[0].get("learner") == now
    ]
    summary = table(
        HELDOUT_HEADER,
        summaries,
        caption=f"{_tally(summaries)}; of the learner as it stands (`{now}`), "
        f"{_tally(current)}. *Learner*: the change whose learner ran the row's `auto` (the "
        "learner before it: `benchmarks/results/e2e-before-<change>`). `auto` against the "
        "fastest reduction of the same run (`auto` / fastest below "
        f"{TARGET_OVER_FASTEST}× and `auto` / dense 16-bit below {TARGET_OVER_DENSE16:.2f}× "
        "are the targets). *At start*: the "
        "seconds `auto` spent measuring its world, then compiling its arms' programs, "
        "outside the training clock as every run's first compilation (and timing its arms' "
        "steps, from the learner `timed`). *Targets*: where missed, bounded where neither way "
        "a learner has of choosing could meet them: one round of trial windows costs more "
        "than the targets allow (the least expected cost of the round and the pick it makes, "
        "`benchmarks/learn_windows.py`, in `docs/cost-model.md`), and the pick of the learner "
        "as it stands on the prior alone, given each reduction's measured step, misses them "
        "(`benchmarks/prior_pick.py`: the pick and its time over the fastest's); missed "
        "otherwise. The bound holds for a learner with this prior; of the "
        f"{len(floors)} rows bounded both ways, `auto` met {sum(floors)}.",
    )
    parts = [
        table(E2E_HEADER, [e2e_columns(r) for r in rows], caption=f"**{title}**")
        for title, rows in cells
    ]
    return "\n\n".join([summary, *_seen_again(results, now, cells, summaries, bounds), *parts])


def _seen_again(
    results: pathlib.Path,
    now: str | None,
    cells: list[tuple[str, list[dict[str, Any]]]],
    summaries: list[list[str]],
    bounds: dict[tuple[str, str], dict[str, Any]],
) -> list[str]:
    """Earlier learners' rows re-run by a later learner, up to the one as it stands (``now``;
    ``results/e2e-<learner>-checks/e2e.json``, the latest re-run of each row), each under the
    row as its own learner ran it: seen by then, they do not judge the learner, but say what
    its change did to those rows. A re-run's baselines are the grid's, or its own where the
    whole row ran again, back to back (``whole row``). An empty list where none was re-run."""
    rechecks = _rechecks(results, now)
    again, by = [], []
    for summary, (_, rows) in zip(summaries, cells, strict=True):
        key = (rows[0]["workload"], rows[0]["network"])
        latest = [(name, autos, own) for name, autos, own in rechecks
                  if key in autos and rows[0].get("learner") not in (now, name)]  # fmt: skip
        if not latest:
            continue
        name, autos, own = latest[-1]
        seen = own.get(key) or [r for r in rows if r["label"] != "auto-bf16"]
        learner = f"`{name}`, seen" + (", whole row" if key in own else "")
        row = heldout_summary([*seen, autos[key]], bounds.get(key))
        again += [summary, [row[0], learner, *row[2:]]]
        by.append(name)
    if not again:
        return []
    names = ", ".join(f"`{n}`" for n in dict.fromkeys(by))
    return [
        table(
            HELDOUT_HEADER,
            again,
            caption="Earlier rows, each as its learner ran it and then re-run by a later one "
            f"({names}; re-run: {_tally(again[1::2])}; as first run: {_tally(again[::2])}). "
            "These workloads had judged an earlier learner, so they do not judge the later "
            "one; `benchmarks/results/e2e-<learner>-checks` holds the runs, made after the "
            "grid's baselines, or with their own (whole row).",
        )
    ]


def _rechecks(results: pathlib.Path, now: str | None) -> list[tuple[str, dict, dict]]:
    """Each learner up to ``now``, in the order the held-out workloads judged them
    (``train_grid.WORKLOADS``), that re-ran seen rows (``results/e2e-<it>-checks``): its
    name, its auto rows and its own baselines' rows, by (workload, network)."""
    from train_grid import LEARNERS

    out = []
    for learner in LEARNERS[: LEARNERS.index(now) + 1] if now in LEARNERS else []:
        path = results / f"e2e-{learner}-checks" / "e2e.json"
        if not path.exists():
            continue
        autos: dict[tuple[str, str], dict[str, Any]] = {}
        own: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in json.loads(path.read_text())["rows"]:
            key = (r["workload"], r["network"])
            if r["label"] == "auto-bf16":
                autos[key] = r
            else:
                own.setdefault(key, []).append(r)
        out.append((learner, autos, own))
    return out


@section("docs/e2e.md", "diloco-sites-inner")
def diloco_sites_inner(results: pathlib.Path) -> str:
    """DiLoCo over sites' inner average (psum and dense over each site's devices, ``axis=local``)
    against the hierarchical dense allreduce of the same gradient, 2 sites of 2 devices."""
    name = "diloco-sites-inner-emulated-100mbit-2x2"
    if not (results / f"{name}.json").exists():
        return f"No `benchmarks/results/{name}.json` yet."
    return _allreduce_table(load(results, name), f"{name}.json")


@section("docs/e2e.md", "e2e-burst")
def e2e_burst(results: pathlib.Path) -> str:
    """digits-small at 100 Mbit/s with a 4 KB tbf burst (``results/e2e-burst4kb/e2e.json``):
    the grid's 128 KB burst lets its 19 KB gradient through at memory speed."""
    data = load(results / "e2e-burst4kb", "e2e")
    parts = [
        table(E2E_HEADER, [e2e_columns(r) for r in rows], caption=f"**{title}**, 4 KB burst")
        for title, rows in e2e_cells(data["rows"])
    ]
    return "From `benchmarks/results/e2e-burst4kb/e2e.json` ({} runs).\n\n".format(
        data["cells"]
    ) + "\n\n".join(parts)


@section("README.md", "headline")
def readme_headline(results: pathlib.Path) -> str:
    """README's end-to-end headline: ``auto`` and the best DiLoCo run on the two larger
    workloads, each link, with the conditions; then `jaxcomm plan`'s error over every row."""
    data = load(results / "e2e", "e2e")
    body = []
    cells = [rows for _, rows in e2e_cells(data["rows"])]
    for rows in sorted(cells, key=lambda rows: -(gradient_bytes(rows) or 0)):  # stable: links
        first = rows[0]
        if first["workload"] == "digits-small" or first.get("oversubscribed"):
            continue
        auto = next(r for r in rows if r["label"] == "auto-bf16")
        diloco = [r for r in rows if r["label"].startswith("diloco") and r["speedup"]]
        seeds = f" ({len(auto['seeds'])} seeds)" if len(auto["seeds"]) > 1 else ""
        body.append(
            [
                f"{first['workload']} ({gradient_size(rows)}, "
                f"{WORKLOAD_OPTIMIZER.get(first['workload'], '?')})",
                link_name(first["network"]),
                f"{ratio(auto['speedup'])}{seeds}",
                _speed(max(diloco, key=lambda r: r["speedup"])) if diloco else "–",
            ]
        )
    plan = plan_errors(data["rows"], ("lbann-mlp", "bytes-lm"))
    return (
        table(
            ["workload (gradient, optimizer)", "world", "`auto` vs dense bf16", "best DiLoCo"],
            body,
            caption="Time to the target accuracy against jaxcomm's dense allreduce on a bf16 "
            "wire; emulated nodes have one CPU core each (`benchmarks/results/e2e/e2e.json`):",
        )
        + f"\n\n`jaxcomm plan`'s error on the step time, over {plan}."
    )


# ---------------------------------------------------------------------------------------------
# docs/which-algorithm.md: the end-to-end results as a recommendation per cell

# What the JSON does not record: each workload's optimizer (its recipe's).
WORKLOAD_OPTIMIZER = {
    "lbann-mlp": "SGD+momentum",
    "bytes-lm": "AdamW",
    "digits-small": "SGD+momentum",
}
# Reductions that are not a compressor of the gradient: baselines and the cost model's pick.
NOT_COMPRESSORS = ("psum", "psum-bf16", "dense", "dense-bf16")


def link_name(network: str, burst: str | None = None) -> str:
    """``100mbit-2x1`` as the guide writes it.

    Example:
      >>> link_name("100mbit-2x1"), link_name("host-2x1"), link_name("1gbit-2x1", "4 KB burst")
      ('100 Mbit/s, 2 nodes', 'one host, 2 processes', '1 Gbit/s, 2 nodes, 4 KB burst')
    """
    rate, world = network.rsplit("-", 1)
    nodes = world.split("x")[0]
    if rate == "host":
        return f"one host, {nodes} processes"
    rate = rate.replace("mbit", " Mbit/s").replace("gbit", " Gbit/s")
    return f"{rate}, {nodes} nodes" + (f", {burst}" if burst else "")


def gradient_bytes(rows: list[dict[str, Any]]) -> float | None:
    """The float32 gradient of a cell's workload, in bytes, from its psum (or dense) row: a
    ring allreduce sends 2(P − 1)/P of the vector per rank.

    Example:
      >>> gradient_bytes([{"label": "psum", "nodes": 2, "bytes_sent_per_step": 13229056}])
      13229056.0
    """
    for label in ("psum", "dense"):
        for r in rows:
            if r["label"] == label and r.get("bytes_sent_per_step"):
                p = r["nodes"]
                return r["bytes_sent_per_step"] * p / (2 * (p - 1))
    return None


def gradient_size(rows: list[dict[str, Any]]) -> str:
    """:func:`gradient_bytes` as the guide writes it: ``13.2 MB``, ``19 KB``."""
    nbytes = gradient_bytes(rows)
    if nbytes is None:
        return "–"
    return mb(nbytes) if nbytes >= 1e6 else f"{nbytes / 1e3:.0f} KB"


def _speed(r: dict[str, Any]) -> str:
    seeds = f", {len(r['seeds'])} seeds" if len(r["seeds"]) > 1 else ""
    return f"`{r['label']}` {ratio(r['speedup'])}{seeds}"


def recommendation(rows: list[dict[str, Any]]) -> list[str]:
    """One row of the guide for one (workload, network) cell: the fastest per-step reduction to
    the target, ``auto``'s pick, the best DiLoCo run, and the compressors that lost (slower than
    the dense bf16 baseline, or never reached the target within their time cap).

    Example:
      >>> row = lambda label, s, **kw: {"workload": "w", "network": "1gbit-2x1", "label": label,
      ...     "speedup": s, "seeds": [0], "time_to_target_s": s and 1.0, "auto_pick": None,
      ...     "nodes": 2, "bytes_sent_per_step": 4e6, "no_communication_bound": 1.5, **kw}
      >>> recommendation([row("psum", 0.5), row("dense-bf16", 1.0), row("gtopk", 0.9),
      ...                 row("onebit", None), row("auto-bf16", 1.2, auto_pick="blockquant")])[3:]
      ['`auto-bf16` 1.20×', 'blockquant: 1.20×', '–', '`gtopk` 0.90×; never reached: `onebit`']
    """
    first = rows[0]
    reached = [r for r in rows if r["time_to_target_s"] is not None and r["speedup"]]
    per_step = [r for r in reached if not r["label"].startswith("diloco")]
    best = max(per_step, key=lambda r: r["speedup"])
    auto = next((r for r in rows if r["label"] == "auto-bf16"), None)
    diloco = [r for r in reached if r["label"].startswith("diloco")]
    compressors = [
        r
        for r in rows
        if r["label"] not in NOT_COMPRESSORS and not r["label"].startswith(("auto", "diloco"))
    ]
    lost = [_speed(r) for r in compressors if r["speedup"] is not None and r["speedup"] < 1]
    never = [f"`{r['label']}`" for r in compressors if r["time_to_target_s"] is None]
    losers = "; ".join(
        part
        for part in [", ".join(lost), "never reached: " + ", ".join(never) if never else ""]
        if part
    )
    return [
        f"{first['workload']} ({gradient_size(rows)}, {WORKLOAD_OPTIMIZER.get(first['workload'], '?')})",
        link_name(first["network"]),
        ratio(first.get("no_communication_bound")),
        _speed(best),
        f"{auto['auto_pick'] or 'dense'}: {ratio(auto['speedup'])}" if auto else "–",
        _speed(max(diloco, key=lambda r: r["speedup"])) if diloco else "–",
        losers or "none",
    ]


GUIDE_HEADER = [
    "workload (gradient, optimizer)",
    "link",
    "free communication",
    "use (fastest measured)",
    "`auto` picked",
    "best DiLoCo",
    "compressors that lost",
]


@section("docs/which-algorithm.md", "which-algorithm")
def which_algorithm(results: pathlib.Path) -> str:
    """The guide's table: one row per (workload, link) of ``results/e2e/e2e.json`` on 2
    faithful nodes, and the 4 KB-burst cell of ``results/e2e-burst4kb/e2e.json``."""
    cells = [
        rows
        for _, rows in e2e_cells(load(results / "e2e", "e2e")["rows"])
        if not rows[0].get("oversubscribed")
    ]
    order = {"100mbit": 0, "1gbit": 1, "host": 2}
    cells.sort(
        key=lambda rows: (
            order.get(rows[0]["network"].split("-")[0], 9),
            -(gradient_bytes(rows) or 0),
        )
    )
    body = [recommendation(rows) for rows in cells]
    for _, rows in e2e_cells(load(results / "e2e-burst4kb", "e2e")["rows"]):
        row = recommendation(rows)
        row[1] = link_name(rows[0]["network"], "4 KB burst")
        body.append(row)
    return table(
        GUIDE_HEADER,
        body,
        caption="Speedup: time to the target accuracy against jaxcomm's dense allreduce on its "
        "bf16 wire (`dense-bf16`), the fastest dense 16-bit run; median over seeds where "
        "several ran. *Free communication*: the baseline's own steps at the compute step "
        "alone. From `benchmarks/results/e2e/e2e.json` and "
        "`benchmarks/results/e2e-burst4kb/e2e.json` (how they were measured: "
        "[results](e2e.md)).",
    )


# ---------------------------------------------------------------------------------------------
# docs/gpus.md


@section("docs/gpus.md", "kernels-gpu")
def kernels_gpu(results: pathlib.Path) -> str:
    """``benchmarks/kernels.py --device gpu``."""
    data = load(results, "kernels-gpu")
    return _kernels(data, "kernels-gpu.json")


# ---------------------------------------------------------------------------------------------
# docs/cost-model.md


def _link_bound(r: dict[str, Any]) -> bool:
    """A case on rate-limited (emulated) links that the model predicts to spend at least 95 % of
    its time on the wire. Loopback runs have no such link: their "communication" is memory
    traffic on the same cores as the compute."""
    return (
        r["backend"].startswith("emulated")
        and r["predicted_communication_s"] >= 0.95 * r["predicted_s"]
    )


@section("docs/cost-model.md", "validation-summary")
def cost_summary(results: pathlib.Path) -> str:
    """``benchmarks/cost_model.py``: one line per run."""
    rows, files = [], []
    for path in sorted(results.glob("cost-model-*.json")):
        data = json.loads(path.read_text())
        if "summary" not in data:
            continue
        files.append(f"`benchmarks/results/{path.name}`")
        s, a = data["summary"], data["args"]
        setup = f"{a['backend']}" + (f" {a['bandwidth']}" if a["backend"] == "emulated" else "")
        bound = [
            f"{r['algorithm']} {elements(r['elements'])} {pct(r['error'], signed=True)}"
            for r in data["rows"]
            if _link_bound(r)
        ]
        auto_run = (
            f"{s['auto_run_within_10pct']}/{s['auto_run_cases']}"
            if "auto_run_cases" in s
            else "not run"
        )
        rows.append(
            [
                f"{setup} {' '.join(a['worlds'])}",
                s["cases"],
                pct(s["median_abs_error"]),
                pct(s["worst_abs_error"]),
                ", ".join(bound) or "–",
                f"{s['auto_within_10pct']}/{s['auto_cases']}",
                auto_run,
                f"{s['bytes_exact']}/{s['bytes_cases']}",
            ]
        )
    header = [
        "setup",
        "cases",
        "median \\|error\\|",
        "worst",
        "link-bound cases (emulated, ≥ 95 % on the wire)",
        "auto's pick within 10 % of best",
        "the job's own auto run within 10 %",
        "bytes exact",
    ]
    return table(header, rows, caption=f"From {', '.join(files)}:")


@section("docs/cost-model.md", "validation-emulated-1gbit")
def cost_rows(results: pathlib.Path) -> str:
    """Every case of the emulated 1 Gbit/s validation run."""
    data = load(results, "cost-model-emulated-1gbit")
    rows = [
        [
            f"`{r['algorithm']}`",
            r["elements"],
            ms(r["measured_s"]),
            ms(r["predicted_s"]),
            pct(r["error"], signed=True),
            f"{r['measured_bytes']:.0f}",
            f"{r['predicted_bytes']:.0f}",
        ]
        for r in data["rows"]
    ]
    a = data["args"]
    header = [
        "algorithm",
        "elements",
        "measured",
        "predicted",
        "error",
        "bytes measured",
        "bytes predicted",
    ]
    return table(
        header,
        rows,
        caption=f"`python benchmarks/cost_model.py --backend {a['backend']} --bandwidth "
        f"{a['bandwidth']} --worlds {' '.join(a['worlds'])} --repeats {a['repeats']}` "
        "(`benchmarks/results/cost-model-emulated-1gbit.json`):",
    )


@section("docs/cost-model.md", "extrapolation")
def cost_extrapolation(results: pathlib.Path) -> str:
    """``benchmarks/cost_model.py --extrapolate``: the model alone at cluster scale."""
    data = load(results, "cost-model-extrapolation")
    algos = data["algorithms"]
    rows = []
    for r in data["rows"]:
        cells = [f"{r['seconds'][a] * 1e3:.0f}" if a in r["seconds"] else "" for a in algos]
        rows.append([f"{r['gbit']:g} Gbit/s", r["ranks"], r["layout"], *cells, f"`{r['pick']}`"])
    return table(
        ["network", "P", "layout", *algos, "pick"],
        rows,
        caption=f"{elements(data['elements'])} float32, density {data['density']}, α = "
        f"{data['alpha_s'] * 1e6:g} µs between processes, kernels of {data['profile']}; ms per "
        "call (`benchmarks/results/cost-model-extrapolation.json`):",
    )


@section("docs/cost-model.md", "arm-step")
def arm_step(results: pathlib.Path) -> str:
    """``benchmarks/arm_step.py``: a learning auto's arm, its own program and a switched one,
    against the reduction alone."""

    def render(data: dict[str, Any], file: str) -> str:
        rows = [[r["way"], ", ".join(f"`{a}`" for a in r["sent"]), f"{r['median_s'] * 1e3:.2f}",
                 f"{r['over_alone']:.3f}×"] for r in data["rows"]]  # fmt: skip
        return table(
            ["way", "collectives", "ms a step (median)", "over alone"],
            rows,
            caption=f"`python benchmarks/arm_step.py --bandwidth {data['bandwidth']} --arm "
            f"{data['arm']}`: 2 emulated nodes, a core each, heldout-fivemom's model; each way "
            f"{data['steps']} steps a round in turns, {data['rounds']} rounds "
            f"(`benchmarks/results/{file}`):",
        )  # fmt: skip

    return each(results, "arm-step-*.json", render)


@section("docs/cost-model.md", "learn-windows")
def learn_windows(results: pathlib.Path) -> str:
    """``benchmarks/learn_windows.py``: what a trial window's loss decrease can tell, in detail
    on two workloads, then what windows must cost on every held-out row."""
    detail = "\n\n".join(
        _learn_windows(load(results, name), f"{name}.json")
        for name in ("learn-windows-bytes-lm", "learn-windows-heldout-teacher")
        if (results / f"{name}.json").exists()
    )
    return detail + "\n\n" + _window_bounds_table(results)


def _learn_windows(data: dict[str, Any], file: str) -> str:
    by = {(r["arm"], r["window"], r["measure"]): r for r in data["noise"]}
    rows = []
    for arm, w in dict.fromkeys((r["arm"], r["window"]) for r in data["noise"]):
        cells = []
        for measure in ("batch", "probe"):
            r = by[(arm, w, measure)]
            below = r.get("below_reference_se")
            cells += [f"{r['decrease_per_step']:.4f} ± {r['noise']:.4f}",
                      "" if below is None else f"{below:.1f}"]  # fmt: skip
        rows.append([f"`{arm}`", w, *cells])
    reference = data["noise"][0]["arm"]
    return table(
        ["arm", "window", "batch slope", f"below `{reference}` (SE)", "probe", "below (SE)"],
        rows,
        caption=f"`{data['workload']}`, each reduction alone, seeds {data['seeds']}, windows "
        f"from step {data['start']}; loss decrease per step ± its scatter across the seeds "
        f"(`benchmarks/results/{file}`):",
    )


def _window_bounds_table(results: pathlib.Path) -> str:
    """One row per (workload, link) measured: the rivals windows must rule out, what each
    costs at least, and the sum against what the targets allow."""
    held_out = e2e_cells(load(results / "e2e", "e2e")["rows"], held_out=True)
    met = {
        (r[0]["workload"], r[0]["network"]): _verdict(heldout_summary(r)) == "met"
        for _, r in held_out
    }
    rows = []
    for (workload, link), b in sorted(window_bounds(results).items()):
        rivals = ", ".join(
            f"`{arm}` {math.exp(r['margin_log']):.2f}× "
            + " / ".join(f"{m['least_cost_s']:.2f}" for m in r["measures"].values())
            for arm, r in b["rivals"].items()
        )
        costs = [f"{m['least_cost_s']:.2f} s" for m in b["measures"].values()]
        source = f"../benchmarks/results/learn-windows-{workload}.json"
        rows.append([f"[{workload}]({source}) · {link}", f"`{b['fastest']}`", rivals or "none", *costs,
                     f"{b['allowance_s']:.2f} s", "yes" if b["bounded"] else "no",
                     {True: "yes", False: "no"}.get(met.get((workload, link)), "–")])  # fmt: skip
    return table(
        [
            "workload · link",
            "fastest",
            "rivals: slower by, least cost s (batch / probe)",
            "least cost, batch",
            "least cost, probe",
            "allowed",
            "bounded",
            "`auto` met",
        ],
        rows,
        caption="The held-out workloads measured, both links (each links its result). The "
        "model: one round "
        "of windows, then the pick kept to the target. Each *rival*, a reduction whose full "
        f"run is over {(TARGET_OVER_FASTEST - 1) * 100:.0f} % slower than the fastest, runs a window; it costs the rival's seconds "
        "a step beyond what the fastest needs for the same progress, and with the chance that "
        "it ranks the rival above the fastest (the pair's relative error of the ratio of their "
        "decreases, on the same seed's windows, against the log of their times' ratio) the run "
        "is the rival's. Each rival's least expected cost is over every window length (10 "
        f"steps or more). *Allowed*: {(TARGET_OVER_FASTEST - 1) * 100:.0f} % of the fastest run, or "
        f"{(TARGET_OVER_DENSE16 - 1) * 100:.0f} % over the fastest dense 16-bit run where that is less. "
        "*Bounded*: the least cost exceeds it by both measures. The model ranks by windows "
        "alone, so the bound is a floor for a learner that reads windows only; one that picks "
        "on its prior spends no windows and is bounded by its pick's run instead, and the "
        "held-out table's verdict joins both (*`auto` met*: that table's verdict).",
    )


@section("docs/cost-model.md", "window-order")
def window_order(results: pathlib.Path) -> str:
    """``benchmarks/window_order.py``: what the held-out runs' lossy trial windows measured."""
    data = load(results, "window-order")
    rows = [
        [r["after"], r["windows"], r["not_falling"],
         " / ".join(f"{q:.2f}" for q in r["quartiles"] or [])]
        for r in data["summary"]
    ]  # fmt: skip
    closing = "".join(
        f"\n\nThe round's closing safe window, read {c['read']}: a greater decrease per step "
        f"than its opening one (earlier in training) in {c['closer_more']} of {c['rounds']} "
        f"rounds, median ratio {c['median_ratio']:.2f}."
        for c in data.get("closing", [])
    )
    head = table(
        ["what ran before", "lossy windows", "loss not falling", "quotient: quartiles"],
        rows,
        caption=f"`python benchmarks/window_order.py`, the auto cells of `{data['cells']}`: "
        "each lossy window's decrease per step over the safe windows' around it, divided by "
        "the full runs' safe steps over the arm's (1: the window agrees with the full runs; "
        "`benchmarks/results/window-order.json`):",
    )
    return head + closing


@section("docs/cost-model.md", "steps-prior")
def steps_prior(results: pathlib.Path) -> str:
    """``benchmarks/steps_prior.py``: the recorded explorations' decisions, replayed under
    each setting of the steps' prior."""
    data = load(results, "steps-prior")
    prior, noise = data["learner"]["prior_steps"], data["learner"]["noise"]
    shown = [
        e for e in data["summary"]
        if "learning" not in e or e["learning"]["prior_steps"] == prior
    ]  # fmt: skip
    rows = [
        [e["rule"] + (" (the learner's)" if e.get("learning", {}).get("noise") == noise
                      and e["learning"]["prior_steps"] == prior else ""),
         e["decisions_of"], f"{e['met']} of {e['decisions']}", f"{e['mean_ratio']:.2f}",
         f"{e['worst']:.2f}"]
        for e in shown
    ]  # fmt: skip
    return table(
        ["rule", "decisions", f"within {data['met']}× of the fastest", "mean ratio", "worst"],
        rows,
        caption="`python benchmarks/steps_prior.py`: each exploration of the auto cells of "
        f"`benchmarks/results/e2e*` (not {', '.join(data['judged_left_out'])}), its "
        "pick's full-run time to target over the fastest reduction's (a miss counts 5×); "
        "`recorded`: what the learner that ran chose; `keep the decision`: a re-check that "
        "keeps the pick of the exploration before; `every round's windows so far`: the "
        "learner's prior read on every exploration's windows of the run, not the last "
        "one's alone; `prior 1 + D / steps so far`: the prior a delay of D steps "
        "(`benchmarks/steps_delay.py`) gives a run as long again as it has gone; noise 0.01 "
        "reads the windows at face "
        "value, 1000 leaves the prior alone (`benchmarks/results/steps-prior.json`):",
    )


@section("docs/cost-model.md", "prior-pick")
def prior_pick(results: pathlib.Path) -> str:
    """``benchmarks/prior_pick.py``: the learner's pick on the prior alone, given each
    reduction's measured step, against auto as it ran."""
    data = load(results, "prior-pick")

    def met(tally: dict[str, int]) -> str:
        return f"{tally['met']} of {tally['rows']}" if tally["rows"] else "–"

    rows = [[s["rows_of"], met(s["prior"]), met(s["given_steps"]), met(s["auto"])]
            for s in data["summary"]]  # fmt: skip
    return table(
        ["rows", "the prior's pick within the target", "given dense's steps", "`auto` as it ran"],
        rows,
        caption="`python benchmarks/prior_pick.py`: on each row of two emulated nodes, the "
        "learner given each reduction's seconds a step from its full runs as the timed ones: "
        "its pick's time to target within "
        f"{data['met']}× of the fastest reduction's, as if it ran from the first step; given "
        "too the row's dense steps (its recipe's, else its 16-bit dense run's), its prior a "
        "delay over them; "
        "beside it, `auto` as each row's learner ran it (`benchmarks/results/prior-pick.json`):",
    )


@section("docs/cost-model.md", "steps-delay")
def steps_delay(results: pathlib.Path) -> str:
    """``benchmarks/steps_delay.py``: a compressor's extra steps fitted as a factor and as a
    delay on the workloads the prior's replay reads, scored on those it leaves out."""
    if not (results / "steps-delay.json").exists():
        return "No `benchmarks/results/steps-delay.json` yet."
    data = load(results, "steps-delay")

    def scored(e: dict[str, Any]) -> str:
        return f"{e['median_log_error']:.2f}, {e['within']} of {e['of']}"

    rows = [
        [f"`{r['arms']}`" if r["arms"] != "all" else "all, one prior", f"{r['factor']:.2f}×",
         f"{r['delay']:.0f}", scored(r["factor_left_out"]), scored(r["delay_left_out"])]
        for r in data["summary"]
    ]  # fmt: skip
    return table(
        ["compressor", "factor", "delay (steps)", "factor on the rest", "delay on the rest"],
        rows,
        caption="`python benchmarks/steps_delay.py`: each workload's median steps to target "
        "(both links' seeds) in `benchmarks/results/e2e/cells`; fitted on the workloads the "
        "prior's replay reads (the factor: the geometric median of a compressor's steps over "
        "dense's; the delay: the median of its steps beyond dense's), then scored on the "
        "rest: the median absolute log error of the steps each predicts, and how many land "
        f"within {data['met']}× (`benchmarks/results/steps-delay.json`, "
        "`benchmarks/results/steps-delay.png`):",
    )


# ---------------------------------------------------------------------------------------------
# The README's picture (a PNG: drawn on request, not compared by --check)


def draw_when_it_pays(results: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Draws ``docs/when-it-pays.png``: measured speed over ``lax.psum`` at 25M float32 (1 Gbit/s
    links and one host), and the model's time per call at P = 256 against network bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    net = load(results, "allreduce-emulated-1gbit")
    host = {r["algorithm"]: r for r in load(results, "allreduce-local")["rows"]}
    names = [r["algorithm"] for r in net["rows"]]
    y = range(len(names))
    left.barh(
        [i + 0.2 for i in y],
        [r["speedup_vs_psum"] for r in net["rows"]],
        0.4,
        label="1 Gbit/s links",
    )
    left.barh(
        [i - 0.2 for i in y], [host[n]["speedup_vs_psum"] for n in names], 0.4, label="one host"
    )
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_yticks(list(y), names)
    left.invert_yaxis()
    left.set_xlabel("speed over lax.psum (measured, higher is better)")
    left.set_title(
        f"measured: P = {net['processes']}, {elements(net['rows'][0]['elements'])} float32"
    )
    left.legend(loc="lower right")
    model = load(results, "cost-model-extrapolation")
    flat = [r for r in model["rows"] if r["ranks"] == 256 and r["layout"] == "flat"]
    for a in ["dense", "topk_allgather", "gtopk", "onebit", "adaptive"]:
        right.plot(
            [r["gbit"] for r in flat], [r["seconds"][a] * 1e3 for r in flat], marker="o", label=a
        )
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("network bandwidth (Gbit/s)")
    right.set_ylabel("ms per allreduce (model)")
    right.set_title(f"cost model: P = 256, {elements(model['elements'])} float32")
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------
# docs/faults.md

FAULT_HEADER = [
    "fault",
    "outcome",
    "detect (s)",
    "recover (s)",
    "steps lost",
    "accuracy = fault-free",
    "bit-identical",
    "wall (s)",
]


def fault_cells(row: dict[str, Any]) -> list[str]:
    """One row of the fault table (``benchmarks/faults.py``'s JSON rows).

    Example:
      >>> fault_cells({"kind": "loss", "outcome": "refused", "detail": "no netem (`tc`)"})[:2]
      ['loss', 'refused: no netem']
    """
    if row["outcome"] == "refused":
        why = row["detail"].split(" (`")[0]  # the JSON keeps the whole message
        return [row["kind"], f"refused: {why}"] + ["–"] * 6

    def num(key: str) -> str:
        return "–" if row.get(key) is None else f"{row[key]:.2f}"

    accuracy = "–" if row.get("test_accuracy") is None else f"{row['test_accuracy']:.4f}"
    return [
        row["fault"] or row["kind"],
        row["outcome"],
        num("detect_s"),
        num("recover_s"),
        str(row["steps_lost"]),
        f"{'yes' if row['accuracy_matches'] else 'no'} ({accuracy})",
        "yes" if row["bit_identical"] else "no",
        f"{row['wall_s']:.1f}",
    ]


def fault_table(data: dict[str, Any], file: str) -> str:
    """The fault table of one ``benchmarks/faults.py`` result, with its command and source."""
    free = data["fault_free"]
    return table(
        FAULT_HEADER,
        [fault_cells(r) for r in data["rows"]],
        caption=f"`{data['command']}` (`benchmarks/results/{file}`); fault-free run: test "
        f"accuracy {free['test_accuracy']:.4f}, {free['wall_s']:.1f} s.",
    )


@section("docs/faults.md", "faults")
def faults(results: pathlib.Path) -> str:
    """Every fault kind half-way between two checkpoints (``results/faults-emulated.json``)."""
    return fault_table(load(results, "faults-emulated"), "faults-emulated.json")


@section("docs/faults.md", "faults-at-checkpoint")
def faults_at_checkpoint(results: pathlib.Path) -> str:
    """Kill and partition while the ranks write a checkpoint."""
    name = "faults-emulated-at-checkpoint"
    return fault_table(load(results, name), f"{name}.json")


# ---------------------------------------------------------------------------------------------
# docs/DESIGN.md: the environment settings (declared in jaxcomm/config.py)


@section("docs/DESIGN.md", "env-settings")
def env_settings(results: pathlib.Path) -> str:
    """``jaxcomm.config.markdown_table()``, loaded from its file: the module needs only the
    standard library, and importing the package would load JAX and the compiled library."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_jaxcomm_config", REPO / "jaxcomm" / "config.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module.markdown_table()


@section("docs/DESIGN.md", "host-malloc")
def host_malloc(results: pathlib.Path) -> str:
    """``benchmarks/host_malloc.py``: glibc's own malloc thresholds against freed memory kept."""

    def render(data: dict[str, Any], file: str) -> str:
        rows = [
            [r["algorithm"], f"`{r['setting']}`", r["runs"], r["faulting"],
             f"{r['median_step_ms']:.1f}", _seconds(r["median_time_to_target_s"])]
            for r in data["summary"]
        ]  # fmt: skip
        return table(
            ["reduction", "`JAXCOMM_HOST_MALLOC`", "runs", "with a faulting rank",
             "median ms a step", "median time to target"],
            rows,
            caption=f"`python benchmarks/host_malloc.py --workload {data['workload']} "
            f"--network {data['network']}`: the two settings run by run, a rank counted as "
            "faulting above 10,000 page faults a second in training "
            f"(`benchmarks/results/{file}`):",
        )  # fmt: skip

    return each(results, "host-malloc-*.json", render)


# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# README's five-line adoption: the diff of the two example programs (not a measurement)

ADOPT_DIFF = ("<!-- adopt-diff:start -->", "<!-- adopt-diff:end -->")
ADOPT_PROGRAMS = ("jaxcomm/examples/adopt_plain.py", "jaxcomm/examples/adopt_jaxcomm.py")


def adopt_diff(root: pathlib.Path = REPO) -> str:
    """The unified diff from the plain loop to its jaxcomm version, as a Markdown block.

    Example:
      >>> adopt_diff().splitlines()[0]
      '```diff'
    """
    import difflib

    plain, ours = ((root / p).read_text().splitlines() for p in ADOPT_PROGRAMS)
    lines = difflib.unified_diff(plain, ours, *ADOPT_PROGRAMS, n=1, lineterm="")
    return "\n".join(["```diff", *[x for x in lines if not x.startswith(("---", "+++"))], "```"])


def render_adopt_diff(text: str, root: pathlib.Path = REPO) -> str:
    """``text`` with the block between :data:`ADOPT_DIFF`'s markers regenerated (unchanged
    without the markers)."""
    begin, end = ADOPT_DIFF
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    block = f"{begin}\n{adopt_diff(root)}\n{end}"
    return pattern.sub(lambda _: block, text, count=1)


def _region(name: str) -> tuple[str, str]:
    return f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"


def render_page(text: str, sections: list[Section], results: pathlib.Path) -> str:
    """Returns ``text`` with each section's region replaced by its freshly rendered table; a
    section with no region yet is appended at the end.

    Example:
      >>> s = Section("p.md", "t", lambda results: "| new |")
      >>> render_page("intro\\n<!-- generated: t -->\\nold\\n<!-- end generated: t -->\\n", [s], RESULTS)
      'intro\\n<!-- generated: t -->\\n| new |\\n<!-- end generated: t -->\\n'
    """
    for s in sections:
        begin, end = _region(s.name)
        body = s.render(results).strip("\n")
        block = f"{begin}\n{body}\n{end}"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
        match = pattern.search(text)
        if match:
            text = text[: match.start()] + block + text[match.end() :]
        else:
            text = text.rstrip("\n") + ("\n\n" if text.strip() else "") + block + "\n"
    return text


def generate(results: pathlib.Path = RESULTS, root: pathlib.Path = REPO) -> dict[pathlib.Path, str]:
    """Every page's text with its regions regenerated: ``{path: text}``."""
    pages: dict[str, list[Section]] = {}
    for s in SECTIONS:
        pages.setdefault(s.page, []).append(s)
    out = {}
    for page, sections in pages.items():
        path = root / page
        old = path.read_text() if path.exists() else ""
        out[path] = render_page(old, sections, results)
    readme = root / "README.md"
    out[readme] = render_adopt_diff(out.get(readme) or readme.read_text(), root)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="only check; exit 1 if a page is stale"
    )
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    parser.add_argument(
        "--figures", action="store_true", help="also redraw docs/when-it-pays.png (matplotlib)"
    )
    args = parser.parse_args(argv)
    if args.figures and not args.check:
        print(
            f"wrote {draw_when_it_pays(args.results, REPO / 'docs' / 'when-it-pays.png').relative_to(REPO)}"
        )
    stale = []
    for path, text in generate(args.results).items():
        old = path.read_text() if path.exists() else None
        if old == text:
            continue
        stale.append(path.relative_to(REPO))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print(
            "stale generated docs (run `python benchmarks/docs.py`): "
            + ", ".join(str(p) for p in stale),
            file=sys.stderr,
        )
        return 1
    for p in stale:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
