"""Allreduce benchmark: lax.psum vs jaxcomm's ring, TopK-allgather and gTop-k (and quantized).

Starts P rank-processes through the launcher (``jaxcomm launch``, job ``allreduce``) on this
machine (``--backend local``) or on the emulated cluster of docs/DESIGN.md §5 (``--backend
emulated``: network namespaces on a bridge with tbf-shaped links, root needed). Every
algorithm is measured in the same run, per size, median of ``--repeats`` calls. Prints a
table, writes JSON and a PNG (median time vs size per algorithm).

Usage:
  python benchmarks/allreduce.py                                  # P=4 local, 1M..25M floats
  python benchmarks/allreduce.py --backend emulated --bandwidth 1gbit
  python benchmarks/allreduce.py --sizes 1000000 --repeats 5 --algorithms psum dense gtopk
  # variants: block quantization int8 and int4 against psum and the dense 16-bit wire
  python benchmarks/allreduce.py --backend emulated --bandwidth 1gbit --sizes 25000000 \
      --algorithms psum dense:dtype=bfloat16 blockquant blockquant:bits=4
  # flat vs hierarchical, 4 nodes x 2 local devices (8 ranks):
  python benchmarks/allreduce.py --devices-per-process 2 --sizes 16777216 \
      --algorithms psum dense hier_dense hier_dense_leader adaptive hier_adaptive
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import statistics

from _bench import (
    add_repeats_argument,
    add_world_arguments,
    run_recipe,
    setup_fields,
    setup_tag,
    write_job_recipe,
    write_time_per_allreduce,
)
from jaxcomm_launcher.jobs.allreduce import ALL_ALGORITHMS, parse_variant

# The job that runs in every rank owns the list of algorithms it can measure.
ALGORITHMS = ALL_ALGORITHMS


def write_recipe(args: argparse.Namespace, path: pathlib.Path) -> None:
    write_job_recipe(
        args,
        path,
        "allreduce",
        {
            "sizes": args.sizes,
            "repeats": args.repeats,
            "density": args.density,
            "algorithms": args.algorithms,
            "tau": args.tau,
            "proportion": args.proportion,
        },
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_world_arguments(parser)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000, 25_000_000])
    add_repeats_argument(parser, 5)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument("--proportion", type=float, default=64.0)
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=ALGORITHMS,
        help="registered names, or variants name:key=value,... (blockquant:bits=4, "
        "dense:dtype=bfloat16; the allreduce job's parse_variant)",
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument(
        "--name",
        default=None,
        help="file name (without .json) of the result; default allreduce-<backend>[-<bandwidth>]"
        "[-<P>x<L>] (docs/benchmarks.md renders quantized-allreduce-*.json as their own tables)",
    )
    args = parser.parse_args()
    for entry in args.algorithms:
        try:
            parse_variant(entry)
        except ValueError as error:
            parser.error(str(error))

    return args


def _order(algorithm: str) -> tuple[int, str]:
    """Rows and curves in the registry's order, variants after their base."""
    name = parse_variant(algorithm)[0]
    return (ALGORITHMS.index(name) if name in ALGORITHMS else len(ALGORITHMS), algorithm)


def rows_of(records: list[dict]) -> list[dict]:
    """One row per (algorithm, size): the median time and bytes of its records."""
    grouped: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    for r in records:
        grouped[(r["algorithm"], r["size_bytes"])].append(r)
    rows = []
    for (algorithm, size_bytes), rs in sorted(
        grouped.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]))
    ):
        times = [r["step_time_s"] for r in rs]
        rows.append(
            {
                "algorithm": algorithm,
                "size_bytes": size_bytes,
                "elements": size_bytes // 4,
                "median_s": statistics.median(times),
                "times_s": times,
                "bytes_sent": statistics.median(r["bytes_sent"] for r in rs),
                "bytes_received": statistics.median(r["bytes_received"] for r in rs),
            }
        )
    return rows


def print_rows(args: argparse.Namespace, tag: str, rows: list[dict]) -> None:
    """Prints the table, and adds each row's ``speedup_vs_psum``."""
    psum = {r["size_bytes"]: r["median_s"] for r in rows if r["algorithm"] == "psum"}
    print(
        f"\n{tag}: P={args.processes} x {args.devices_per_process} devices, "
        f"density={args.density}, repeats={args.repeats}"
    )
    print(
        f"{'elements':>10s} {'algorithm':22s} {'median ms':>10s} {'sent MB/rank':>13s} {'vs psum':>9s}"
    )
    for r in rows:
        speedup = psum.get(r["size_bytes"], float("nan")) / r["median_s"]
        r["speedup_vs_psum"] = speedup
        print(
            f"{r['elements']:10d} {r['algorithm']:22s} {r['median_s'] * 1e3:10.2f} "
            f"{r['bytes_sent'] / 1e6:13.3f} {speedup:8.2f}x"
        )


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = setup_tag("allreduce", args)
    if args.devices_per_process > 1:
        tag += f"-{args.processes}x{args.devices_per_process}"
    tag = args.name or tag
    records, wall = run_recipe(lambda path: write_recipe(args, path))
    rows = rows_of(records)
    print_rows(args, tag, rows)
    result = {
        **setup_fields(args),
        "devices_per_process": args.devices_per_process,
        # The host's cores: fewer than ranks means the emulated nodes share (oversubscribe) them.
        "host_cores": os.cpu_count(),
        "density": args.density,
        "repeats": args.repeats,
        "wall_s": wall,
        "rows": rows,
    }
    curves = {
        algorithm: [r for r in rows if r["algorithm"] == algorithm]
        for algorithm in sorted({r["algorithm"] for r in rows}, key=_order)
    }
    write_time_per_allreduce(
        args.out,
        tag,
        result,
        curves,
        figsize=(7, 4.5),
        title=f"{tag}, P = {args.processes}, density {args.density}",
    )


if __name__ == "__main__":
    main()
