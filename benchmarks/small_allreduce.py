"""Small dense allreduces: the latency-optimal schedules against the bandwidth-optimal ones.

``jaxcomm.allreduce`` picks its schedule by where the ranks are and by size (ffi/allreduce.h):
up to ``JAXCOMM_SMALL_ALLREDUCE_BYTES`` it runs recursive doubling over a transport and the
one-shot read through shared memory; above, the pipelined ring and the direct reduce-scatter +
allgather. This script measures both schedules at every size, with ``lax.psum`` in the same
runs, on each path:

* ``shared``    — ranks of one host through shared memory (the default on one machine);
* ``transport`` — ``JAXCOMM_SHARED_MEMORY=0``: every byte through UCX, as between hosts
  (``--backend emulated`` puts real, shaped links between the processes).

Each (path, schedule) is one launch of the ``allreduce`` job, the schedule forced with
``JAXCOMM_SMALL_ALLREDUCE_BYTES`` (0: the large schedules at every size; 2^30: the small ones).
Each timed call runs ``--chain`` allreduces back to back in one jitted step (the job's
``chain``): one call at a time would time Python's work and the ranks' skew between calls,
which at these sizes is larger than the collective.
Prints the medians and, per path, the largest size at which the small schedule still wins (the
threshold to set), writes JSON and a PNG.

Usage:
  python benchmarks/small_allreduce.py                       # P=4 local, 256..1M floats
  python benchmarks/small_allreduce.py --processes 2 --paths shared
  python benchmarks/small_allreduce.py --backend emulated --bandwidth 1gbit
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
from typing import Any

from _bench import (
    add_repeats_argument,
    add_world_arguments,
    run_recipe,
    setup_fields,
    setup_tag,
    write_job_recipe,
    write_time_per_allreduce,
)

PATHS = {"shared": {}, "transport": {"JAXCOMM_SHARED_MEMORY": "0"}}
# JAXCOMM_SMALL_ALLREDUCE_BYTES forcing each schedule at every size.
SCHEDULES = {"large": "0", "small": str(1 << 30)}
# The metrics label of each (path, schedule), as ffi/allreduce.h names them.
LABELS = {
    ("shared", "large"): "dense_direct",
    ("shared", "small"): "dense_direct_oneshot",
    ("transport", "large"): "dense",
    ("transport", "small"): "dense_doubling",
}


def measure(args: argparse.Namespace, path: str, schedule: str) -> list[dict]:
    """Rank 0's records of one launch: psum and dense at every size."""
    env = {**PATHS[path], "JAXCOMM_SMALL_ALLREDUCE_BYTES": SCHEDULES[schedule]}
    job_args = {
        "sizes": args.sizes,
        "repeats": args.repeats,
        "chain": args.chain,
        "algorithms": ["psum", "dense"],
    }
    records, _ = run_recipe(
        lambda recipe: write_job_recipe(args, recipe, "allreduce", job_args, env=env)
    )
    return records


def crossover(rows: list[dict], path: str) -> int | None:
    """The largest size (bytes) up to which the small schedule is at least as fast, or None."""
    best = None
    for size in sorted({r["size_bytes"] for r in rows if r["path"] == path}):
        t = {
            r["schedule"]: r["median_s"]
            for r in rows
            if r["path"] == path and r["size_bytes"] == size
        }
        if "small" in t and "large" in t:
            if t["small"] > t["large"]:
                break
            best = size
    return best


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_world_arguments(parser)
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[256, 1024, 4096, 16384, 65536, 262144, 1048576]
    )
    add_repeats_argument(parser, 20)
    parser.add_argument(
        "--chain", type=int, default=20, help="allreduces back to back per timed call"
    )
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args()
    return args


def measure_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each path's rows: both schedules of the dense allreduce, and psum, per size."""
    rows: list[dict[str, Any]] = []
    for path in args.paths:
        psum: dict[int, list[float]] = collections.defaultdict(list)
        for schedule in SCHEDULES:
            dense: dict[int, list[dict]] = collections.defaultdict(list)
            for r in measure(args, path, schedule):
                if r["algorithm"] == "psum":
                    psum[r["size_bytes"]].append(r["step_time_s"])
                else:
                    dense[r["size_bytes"]].append(r)
            for size, rs in sorted(dense.items()):
                rows.append(
                    {
                        "path": path,
                        "schedule": schedule,
                        "label": LABELS[(path, schedule)],
                        "size_bytes": size,
                        "elements": size // 4,
                        "median_s": statistics.median(r["step_time_s"] for r in rs),
                        "times_s": [r["step_time_s"] for r in rs],
                        "bytes_sent": statistics.median(r["bytes_sent"] for r in rs),
                    }
                )
        for size, times in sorted(psum.items()):  # both launches' psum calls
            rows.append(
                {
                    "path": path,
                    "schedule": "psum",
                    "label": "psum",
                    "size_bytes": size,
                    "elements": size // 4,
                    "median_s": statistics.median(times),
                    "times_s": times,
                    "bytes_sent": None,
                }
            )

    return rows


def print_rows(args: argparse.Namespace, tag: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{tag}: median ms per allreduce, repeats={args.repeats} per launch")
    print(f"{'path':10s} {'elements':>9s} {'psum':>8s} {'large':>8s} {'small':>8s}  small vs large")
    for path in args.paths:
        for size in sorted({r["size_bytes"] for r in rows if r["path"] == path}):
            t = {
                r["schedule"]: r["median_s"]
                for r in rows
                if r["path"] == path and r["size_bytes"] == size
            }
            print(
                f"{path:10s} {size // 4:9d} {t['psum'] * 1e3:8.3f} {t['large'] * 1e3:8.3f} "
                f"{t['small'] * 1e3:8.3f}  {t['large'] / t['small']:.2f}x"
            )


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = setup_tag("small-allreduce", args) + f"-{args.processes}x{args.devices_per_process}"
    rows = measure_rows(args)
    print_rows(args, tag, rows)
    crossovers = {path: crossover(rows, path) for path in args.paths}
    for path, size in crossovers.items():
        print(f"{path}: the small schedule wins up to {size} bytes" if size else
              f"{path}: the small schedule never wins")  # fmt: skip
    result = {
        **setup_fields(args),
        "devices_per_process": args.devices_per_process,
        "repeats": args.repeats,
        "crossover_bytes": crossovers,
        "rows": rows,
    }

    curves = {
        f"{path}: {LABELS.get((path, schedule), 'psum')}": [
            r for r in rows if r["path"] == path and r["schedule"] == schedule
        ]
        for path in args.paths
        for schedule in ("psum", *SCHEDULES)
    }
    write_time_per_allreduce(
        args.out, tag, result, curves, figsize=(7.5, 4.8), title=f"{tag}: small vs large schedules"
    )


if __name__ == "__main__":
    main()
