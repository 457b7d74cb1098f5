"""Dense allreduce against its peers on this machine: OpenMPI, mpi4jax, lax.psum and jaxcomm.

P processes with one CPU device each, started by ``mpirun`` on this host (loopback). Every
process runs, per size and per repeat, in this order and after a barrier each:

* ``openmpi``  — ``MPI.COMM_WORLD.Allreduce`` of NumPy buffers (mpi4py; OpenMPI picks its own
  algorithm and its shared-memory transport)
* ``mpi4jax``  — ``mpi4jax.allreduce`` inside ``jax.jit``
* ``psum``     — ``lax.psum`` inside ``jax.shard_map`` (XLA's CPU collectives: Gloo)
* ``jaxcomm``  — ``jaxcomm.allreduce`` inside ``jax.shard_map``
* ``jit_call`` — no communication and no memory traffic: the same jitted ``shard_map`` call on
  the same array, returning twice its first element: what dispatching and synchronizing a
  jitted step costs here. OpenMPI on NumPy buffers pays none of it; psum, mpi4jax and jaxcomm
  all pay it, so the last column compares ``jaxcomm - jit_call`` with OpenMPI.

so all of them share the machine's noise. A sample is ``--calls`` calls of one implementation
back to back after the barrier (each call waits for its result), rank 0's wall time divided by
``--calls``: one call per barrier times the ranks' wake-up from the barrier as much as the
allreduce (MPI's barrier leaves them yielding the cores; jaxcomm's engine threads then wait for a
core). The table shows the median over ``--repeats`` samples of every ``--rounds`` launch. Writes
``benchmarks/results/peers-local.json`` and a PNG.

Peers come from PyPI (``mpi4py``, ``mpi4jax``) and are installed into this Python when missing;
both need OpenMPI's development files (Debian: ``apt-get install libopenmpi-dev``).

Usage:
  python benchmarks/peers.py                                  # P=2,4; 1M and 25M floats
  python benchmarks/peers.py --processes 2 --sizes 1000000 --repeats 5 --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import time

IMPLEMENTATIONS = ("openmpi", "mpi4jax", "psum", "jaxcomm", "jit_call")
PEER_PACKAGES = ("mpi4py", "mpi4jax")


def ensure_peers() -> None:
    """Installs mpi4py and mpi4jax from PyPI when missing; exits with a clear message if OpenMPI
    (mpirun, or the headers mpi4jax builds against) is absent."""
    if shutil.which("mpirun") is None or shutil.which("mpicc") is None:
        sys.exit(
            "benchmarks/peers.py needs OpenMPI with its development files (mpirun, mpicc): "
            "on Debian/Ubuntu run `apt-get install libopenmpi-dev openmpi-bin` (root)."
        )
    missing = [p for p in PEER_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        print(f"installing {' '.join(missing)} from PyPI ...", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", *missing])
        if done.returncode != 0:
            sys.exit(f"pip install {' '.join(missing)} failed; install them by hand")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args: argparse.Namespace) -> None:
    """One rank under mpirun: measures every implementation, interleaved; rank 0 prints JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", size, rank)
    import jax.numpy as jnp
    import mpi4jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh = jax.make_mesh((size,), ("dp",))
    sharding = NamedSharding(mesh, P("dp"))

    def sharded(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")))

    psum = sharded(lambda v: lax.psum(v, "dp"))
    ours = sharded(lambda v: jaxcomm.allreduce(v[0], "dp")[None])
    call_only = sharded(lambda v: v[:, :1] * 2.0)
    mpi_jit = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=comm))

    def calls_for(local: np.ndarray, recv: np.ndarray) -> dict:
        """The four implementations' calls on this rank's `local` data (and their results)."""
        x_local = jnp.asarray(local)
        x_global = jax.make_array_from_process_local_data(sharding, local[None])
        return {
            "openmpi": lambda: comm.Allreduce(local, recv, op=MPI.SUM) or recv,
            "mpi4jax": lambda: mpi_jit(x_local).block_until_ready(),
            "psum": lambda: psum(x_global).block_until_ready(),
            "jaxcomm": lambda: ours(x_global).block_until_ready(),
            "jit_call": lambda: call_only(x_global).block_until_ready(),
        }

    def first_row(value) -> np.ndarray:
        """This rank's result: the array itself, or its row of a (P, n) global array."""
        if value.ndim == 1:
            return np.asarray(value)
        return np.asarray(value.addressable_shards[0].data)[0]

    times: dict[str, dict[int, list[float]]] = collections.defaultdict(dict)
    for n in args.sizes:
        local = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        calls = calls_for(local, np.empty_like(local))
        results = {}
        for name, call in calls.items():  # warm-up (compiles) and a numerics check
            comm.Barrier()
            results[name] = first_row(call()).copy()
        for name, value in results.items():
            if name == "jit_call":
                continue  # no allreduce
            np.testing.assert_allclose(
                value, results["openmpi"], rtol=1e-4, atol=1e-4, err_msg=name
            )
        for name in calls:
            times[name][n] = []
        for _ in range(args.repeats):
            for name, call in calls.items():
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[name][n].append((time.perf_counter() - start) / args.calls)
    if rank == 0:
        print("PEERS-JSON " + json.dumps(times), flush=True)
    jax.distributed.shutdown()


def parse_args() -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--calls", type=int, default=10, help="calls back to back per sample (after a barrier)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="mpirun launches per P")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    return args, parser


def run_rounds(args: argparse.Namespace) -> dict[tuple[int, str, int], list[float]]:
    """Launches the workers with mpirun, ``--rounds`` times per P; returns every sample by
    (P, implementation, elements)."""
    samples: dict[tuple[int, str, int], list[float]] = collections.defaultdict(list)
    for p in args.processes:
        for _ in range(args.rounds):
            command = [
                "mpirun", "-np", str(p), "--oversubscribe", "--bind-to", "none",
                "--mca", "mpi_yield_when_idle", "1",
            ]  # fmt: skip
            if os.geteuid() == 0:
                command.append("--allow-run-as-root")
            command += [sys.executable, __file__, "--worker", "--port", str(free_port())]
            command += ["--repeats", str(args.repeats), "--calls", str(args.calls)]
            command += ["--sizes", *map(str, args.sizes)]
            env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
            done = subprocess.run(command, env=env, text=True, capture_output=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PEERS-JSON ")]
            if done.returncode != 0 or not lines:
                sys.exit(f"mpirun (P={p}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            for name, per_size in json.loads(lines[0].split(" ", 1)[1]).items():
                for n, ts in per_size.items():
                    samples[(p, name, int(n))] += ts

    return samples


def print_ratios(args: argparse.Namespace, median: dict) -> list[dict]:
    """Prints each implementation's median per (P, size) and returns jaxcomm's ratios."""
    print(f"\ndense allreduce, loopback, P processes x 1 CPU device, float32, median of "
          f"{args.repeats * args.rounds} samples of {args.calls} calls")  # fmt: skip
    header = f"{'P':>2s} {'elements':>10s}" + "".join(f" {i:>10s}" for i in IMPLEMENTATIONS)
    print(header + "   jaxcomm vs openmpi / psum; jaxcomm - jit_call vs openmpi")
    ratios = []
    for p in args.processes:
        for n in args.sizes:
            ms = [median[(p, i, n)] * 1e3 for i in IMPLEMENTATIONS]
            ours = median[(p, "jaxcomm", n)]
            own = ours - median[(p, "jit_call", n)]  # the call beyond dispatch and sync
            ratio = {
                "processes": p,
                "elements": n,
                "jaxcomm_vs_openmpi": median[(p, "openmpi", n)] / ours,
                "jaxcomm_vs_psum": median[(p, "psum", n)] / ours,
                "collective_vs_openmpi": median[(p, "openmpi", n)] / own if own > 0 else None,
            }
            ratios.append(ratio)
            beyond = ratio["collective_vs_openmpi"]
            print(
                f"{p:2d} {n:10d}"
                + "".join(f" {t:8.2f}ms" for t in ms)
                + f"   {ratio['jaxcomm_vs_openmpi']:.2f}x / {ratio['jaxcomm_vs_psum']:.2f}x; "
                + (f"{beyond:.2f}x" if beyond else "-")
            )
    return ratios


def plot(args: argparse.Namespace, median: dict) -> None:
    """One log-log panel per P (without matplotlib: a note, no PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.processes), figsize=(5 * len(args.processes), 4))
        for ax, p in zip(list(getattr(axes, "flat", [axes])), args.processes, strict=True):
            for impl in IMPLEMENTATIONS:
                ax.plot(args.sizes, [median[(p, impl, n)] * 1e3 for n in args.sizes],
                        marker="o", label=impl)  # fmt: skip
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("float32 elements per rank")
            ax.set_ylabel("median ms per allreduce")
            ax.set_title(f"P = {p} processes, loopback")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "peers-local.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no PNG")


def main() -> None:
    args, parser = parse_args()
    if args.worker:
        worker(args)
        return
    if args.repeats < 5:
        parser.error("--repeats must be >= 5")
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    ensure_peers()
    samples = run_rounds(args)
    rows = []
    for (p, name, n), ts in sorted(samples.items()):
        rows.append({"processes": p, "implementation": name, "elements": n,
                     "median_s": statistics.median(ts), "times_s": ts})  # fmt: skip
    median = {(r["processes"], r["implementation"], r["elements"]): r["median_s"] for r in rows}
    ratios = print_ratios(args, median)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "peers-local.json"
    json_path.write_text(json.dumps({"repeats": args.repeats, "rounds": args.rounds,
                                     "calls": args.calls,
                                     "host_cores": os.cpu_count(), "rows": rows,
                                     "ratios": ratios}, indent=2))  # fmt: skip
    plot(args, median)
    print(f"\nwrote {json_path} and {args.out / 'peers-local.png'}")


if __name__ == "__main__":
    main()
