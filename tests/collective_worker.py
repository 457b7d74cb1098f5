"""One rank-process of a collective test run (started by tests/collectives_harness.py).

Each process builds the same global inputs from a seed, feeds its own devices' shards, runs
every case inside jax.jit + jax.shard_map, and saves its devices' results to
``<out>/process<i>.npz`` keyed "<case>/<world rank>/<output>".
"""

from __future__ import annotations

import os
import sys
import time

from collectives_harness import RankResults, make_inputs, start_worker

UNSTAGED_SIZE = (16 << 20) // 4 + 1  # float32 elements just past the shared staging area
HALF_UNSTAGED_SIZE = (16 << 20) // 2 + 1  # 16-bit elements just past it
# 16-bit dense allreduce cases (mode "half"): sizes below one rank per element, uneven slices,
# several L2 blocks per slice; with processes > 1 also UNSTAGED_SIZE (staged in 16 bits, not
# in float32) and HALF_UNSTAGED_SIZE (past the staging area: process_vm_readv).
HALF_SIZES = [1, 7, 1000, 65537, 786437]
HALF_DTYPES = ("bfloat16", "float16")


def main() -> None:
    args = start_worker(["cases", "die", "mismatch", "steps", "quantized", "half", "hier_spanning"])

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    world = jax.device_count()
    mesh = jax.make_mesh((world,), ("dp",))
    results = RankResults(mesh)
    save = results.save

    def shard(global_rows: np.ndarray) -> jax.Array:
        """Rows of a [world, ...] array become each device's (1, ...) shard."""
        sharding = NamedSharding(mesh, P("dp"))
        return jax.make_array_from_callback(
            global_rows.shape, sharding, lambda idx: global_rows[idx]
        )

    def smap(fn, n_in: int, n_out: int):
        spec = P("dp")
        return jax.jit(
            jax.shard_map(
                fn,
                mesh=mesh,
                in_specs=(spec,) * n_in,
                out_specs=(spec,) * n_out if n_out > 1 else spec,
            )
        )

    def inputs(n: int, seed: int, scale: float = 1.0) -> np.ndarray:
        return make_inputs(world, n, seed, scale)

    if args.mode == "die":
        # Rank-process 1 dies right before the collective; the others must fail, not hang.
        x = shard(inputs(1000, 1))
        f = smap(lambda v: jaxcomm.allreduce(v[0], "dp")[None], 1, 1)
        jax.block_until_ready(f(x))  # world bootstrapped, program compiled, first call done
        if args.process_id == 1:
            time.sleep(1.0)
            os.kill(os.getpid(), 9)
        start = time.monotonic()
        try:
            jax.block_until_ready(f(x))
        except Exception as error:  # noqa: BLE001 - the test reads the message
            print(f"COLLECTIVE FAILED after {time.monotonic() - start:.1f}s: {error}", flush=True)
            os._exit(3)
        print("COLLECTIVE UNEXPECTEDLY SUCCEEDED", flush=True)
        os._exit(0)

    if args.mode == "mismatch":
        n = 1000 + 24 * args.process_id  # every process believes in another size
        x = shard(inputs(n, 2))
        f = smap(lambda v: jaxcomm.allreduce(v[0], "dp")[None], 1, 1)
        try:
            jax.block_until_ready(f(x))
        except Exception as error:  # noqa: BLE001
            print(f"COLLECTIVE FAILED: {error}", flush=True)
            os._exit(3)
        os._exit(0)

    other_modes = {"quantized": quantized_cases, "half": half_cases, "hier_spanning": hier_spanning}
    if args.mode in other_modes:
        other_modes[args.mode](args, mesh, shard, save, smap, inputs, results)
        results.write(args)
        return

    # 786437: several pipelined segments (of 2^17 floats) per ring chunk on up to 6 ranks.
    sizes = [1, 7, 1000, 65537, 786437]
    if args.processes > 1 and world <= 4:
        # One float more than a 16 MiB staging area (ffi/transport/ucx_world.h): ranks of
        # different processes read each other's buffers with process_vm_readv instead.
        sizes.append(UNSTAGED_SIZE)
    for n in sizes:
        x = shard(inputs(n, n))
        f = smap(lambda v: (jaxcomm.allreduce(v[0], "dp")[None], jax.lax.psum(v, "dp")), 1, 2)
        ours, psum = f(x)
        save(f"allreduce/{n}", "out", ours)
        save(f"allreduce/{n}", "psum", psum)
    # Which schedule each size took (ffi/allreduce.h: by where the ranks are and by size).
    recent = [r for r in jaxcomm.metrics()["recent"] if r["name"] == "jaxcomm.allreduce"]
    for n in sizes:
        results[f"metrics/allreduce_algorithm/{n}"] = np.asarray(
            sorted({r["algorithm"] for r in recent if r["elements"] == n})
        )

    # A 2-D array, reduced as a whole.
    x2 = shard(inputs(6 * 35, 5).reshape(world, 6, 35))
    f2 = smap(lambda v: jaxcomm.allreduce(v[0], "dp")[None], 1, 1)
    save("allreduce/matrix", "out", f2(x2))

    # Ordering: 20 independent collectives in one jitted function.
    x20 = shard(inputs(257, 20))

    def twenty(v):
        outs = [jaxcomm.allreduce(v[0] * (i + 1), "dp") for i in range(20)]
        return jnp.stack(outs)[None]

    save("ordering", "out", smap(twenty, 1, 1)(x20))

    algorithms = {"topk_allgather": jaxcomm.TopKAllgather, "gtopk": jaxcomm.GTopK}
    for name, cls in algorithms.items():
        for n in [1, 7, 1000, 65537]:
            for density in [0.01, 0.3]:
                case = f"{name}/{n}/{density}"
                x = shard(inputs(n, 7 * n + 1))
                r = shard(inputs(n, 7 * n + 2, scale=0.1))
                algo = cls(density)
                f = smap(
                    lambda v, w, algo=algo: tuple(
                        o[None] for o in jaxcomm.compressed_allreduce(v[0], w[0], "dp", algo)
                    ),
                    2,
                    2,
                )
                summed, new_r = f(x, r)
                save(case, "summed", summed)
                save(case, "residual", new_r)
    # Ties: every rank holds the same all-equal vector.
    ties = shard(np.ones((world, 500), np.float32))
    zeros = shard(np.zeros((world, 500), np.float32))
    for name, cls in algorithms.items():
        f = smap(
            lambda v, w, cls=cls: tuple(
                o[None] for o in jaxcomm.compressed_allreduce(v[0], w[0], "dp", cls(0.02))
            ),
            2,
            2,
        )
        summed, new_r = f(ties, zeros)
        save(f"{name}/ties", "summed", summed)
        save(f"{name}/ties", "residual", new_r)

    totals = jaxcomm.metrics()["totals"]
    results["metrics/calls"] = np.asarray(sum(t["calls"] for t in totals))
    results["metrics/bytes_sent"] = np.asarray(sum(t["bytes_sent"] for t in totals))
    results.write(args)


# Quantizers of the quantized-allreduce cases (tests/test_quantized_allreduce.py mirrors them):
# small columns so that a slice holds several, a threshold that sends a fraction.
QUANTIZED_CASES = {
    "onebit": ("OneBit", {"column_size": 64}),
    "threshold": ("Threshold", {"tau": 0.5}),
    "threshold_capped": ("Threshold", {"tau": 0.5, "max_density": 0.05}),
    "adaptive": ("Adaptive", {"proportion": 4.0, "column_size": 100}),
}
QUANTIZED_SIZES = [1, 7, 1000, 65537]
ADAPTIVE_BYTES_N = 1 << 17  # the byte-count case: Adaptive(proportion=64), 1024-element columns


def quantized_cases(args, mesh, shard, save, smap, inputs, results) -> None:
    """Quantized allreduce cases over ("dp",); with 4 devices also hierarchical ones on 2 x 2."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    def run_case(case, algo, x, r, axis="dp", **kw):
        jaxcomm.reset_metrics()
        f = smap(
            lambda v, w: tuple(
                o[None] for o in jaxcomm.compressed_allreduce(v[0], w[0], axis, algo, **kw)
            ),
            2,
            2,
        )
        summed, new_r = f(x, r)
        save(case, "summed", summed)
        save(case, "residual", new_r)
        for record in jaxcomm.metrics()["recent"]:
            for key in ("bytes_sent", "dense_bytes_sent", "compression_ratio"):
                results[f"{case}/{record['world_rank']}/{key}"] = np.asarray(record[key])

    for name, (cls, params) in QUANTIZED_CASES.items():
        algo = getattr(jaxcomm, cls)(**params)
        for n in QUANTIZED_SIZES:
            x = shard(inputs(n, 11 * n + 1))
            r = shard(inputs(n, 11 * n + 2, scale=0.1))
            run_case(f"quantized/{name}/{n}", algo, x, r)
    x = shard(inputs(ADAPTIVE_BYTES_N, 3))
    r = shard(np.zeros((jax.device_count(), ADAPTIVE_BYTES_N), np.float32))
    run_case("quantized/adaptive_bytes", jaxcomm.Adaptive(proportion=64), x, r)

    if jax.device_count() != 4:
        return
    # Hierarchical: a process is a node, its devices are its local ranks; one process with 4
    # devices is viewed as 2 x 2. Rows must hold one process's devices, in world-rank order.
    nodes = max(2, args.processes)
    devices = np.array(jax.devices()).reshape(nodes, -1)
    if args.processes > 1:
        for row, node_devices in enumerate(devices):
            assert all(d.process_index == row for d in node_devices), devices
    mesh2 = jax.sharding.Mesh(devices, ("node", "local"))
    spec = P(("node", "local"))
    assert [results.rank_of[d.id] for d in devices.flat] == list(range(devices.size))

    def shard2(rows):
        return jax.make_array_from_callback(
            rows.shape, NamedSharding(mesh2, spec), lambda i: rows[i]
        )

    def smap2(fn, n_in, n_out):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh2, in_specs=(spec,) * n_in, out_specs=(spec,) * n_out)
        )

    both = ("node", "local")
    for scheme in ("multi_leader", "leader"):
        for n in QUANTIZED_SIZES:
            x = shard2(inputs(n, 13 * n + 1))
            f = smap2(
                lambda v, scheme=scheme: (
                    jaxcomm.allreduce(v[0], both, hierarchical=True, hierarchical_scheme=scheme)[
                        None
                    ],
                    jax.lax.psum(v, both),
                ),
                1,
                2,
            )
            ours, psum = f(x)
            save(f"hierarchical/{scheme}/{n}", "out", ours)
            save(f"hierarchical/{scheme}/{n}", "psum", psum)
        for name, (cls, params) in QUANTIZED_CASES.items():
            algo = getattr(jaxcomm, cls)(**params)
            for n in (7, 65537):
                x = shard2(inputs(n, 17 * n + 1))
                r = shard2(inputs(n, 17 * n + 2, scale=0.1))
                f = smap2(
                    lambda v, w, algo=algo, scheme=scheme: tuple(
                        o[None]
                        for o in jaxcomm.compressed_allreduce(
                            v[0], w[0], both, algo, hierarchical=True, hierarchical_scheme=scheme
                        )
                    ),
                    2,
                    2,
                )
                summed, new_r = f(x, r)
                save(f"hierarchical_q/{scheme}/{name}/{n}", "summed", summed)
                save(f"hierarchical_q/{scheme}/{name}/{n}", "residual", new_r)


def half_sizes(processes: int) -> list[int]:
    """The sizes of half_cases in a world of `processes` processes."""
    return HALF_SIZES + ([UNSTAGED_SIZE, HALF_UNSTAGED_SIZE] if processes > 1 else [])


def half_cases(args, mesh, shard, save, smap, inputs, results) -> None:
    """The dense allreduce of 16-bit arrays over ("dp",): the result's bits (uint16) and each
    rank's metric label and bytes_sent per case "half/<dtype>/<n>". Inputs: inputs(n, n) rounded
    to the dtype; case "half/<dtype>/zeros" has -0.0 on every rank (a float32 sum that starts
    at the first input would keep -0, the ring's sum starting at +0 gives +0)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxcomm

    world = jax.device_count()
    for dtype in HALF_DTYPES:
        cases = {str(n): inputs(n, n) for n in half_sizes(args.processes)}
        cases["zeros"] = np.full((world, 7), -0.0, np.float32)
        f = smap(
            lambda v, dtype=dtype: jax.lax.bitcast_convert_type(
                jaxcomm.allreduce(v[0].astype(dtype), "dp"), jnp.uint16
            )[None],
            1,
            1,
        )
        for name, rows in cases.items():
            case = f"half/{dtype}/{name}"
            x = shard(rows)
            jaxcomm.reset_metrics()
            save(case, "bits", jax.block_until_ready(f(x)))
            for record in jaxcomm.metrics()["recent"]:
                rank = record["world_rank"]
                results[f"{case}/{rank}/algorithm"] = np.asarray(record["algorithm"])
                results[f"{case}/{rank}/bytes_sent"] = np.asarray(record["bytes_sent"])


HIER_SPANNING_SIZES = [7, 65537, UNSTAGED_SIZE]


def hier_spanning(args, mesh, shard, save, smap, inputs, results) -> None:
    """The dense hierarchical allreduce over a ("node", "local") mesh of the world's devices
    reshaped to (2, world / 2), whatever the processes: with 4 processes x 1 device a node's
    local ranks live in two processes (the single leader's broadcast then crosses processes:
    staged up to 16 MiB, process_vm_readv past it). Case "hier_spanning/<scheme>/<n>": out and
    psum; inputs(n, 19 * n + 1)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh2 = jax.sharding.Mesh(mesh.devices.reshape(2, -1), ("node", "local"))
    spec = P(("node", "local"))
    both = ("node", "local")
    for scheme in ("multi_leader", "leader"):
        f = jax.jit(
            jax.shard_map(
                lambda v, scheme=scheme: (
                    jaxcomm.allreduce(v[0], both, hierarchical=True, hierarchical_scheme=scheme)[
                        None
                    ],
                    jax.lax.psum(v, both),
                ),
                mesh=mesh2,
                in_specs=spec,
                out_specs=(spec, spec),
            )
        )
        for n in HIER_SPANNING_SIZES:
            rows = inputs(n, 19 * n + 1)
            x = jax.make_array_from_callback(
                rows.shape, NamedSharding(mesh2, spec), lambda i, rows=rows: rows[i]
            )
            ours, psum = f(x)
            save(f"hier_spanning/{scheme}/{n}", "out", ours)
            save(f"hier_spanning/{scheme}/{n}", "psum", psum)


if __name__ == "__main__":
    sys.exit(main())
