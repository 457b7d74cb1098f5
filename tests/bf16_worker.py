"""One process with N CPU devices running the 16-bit cases of tests/test_bf16.py.

Saves ``<out>/bf16.npz`` (keys "<case>/<output>", arrays stacked over ranks, 16-bit results
widened to float32 exactly) and ``<out>/bf16.json`` (per-case metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from collectives_harness import make_inputs

# (name, class, parameters): one of each compressor family; small columns so that every rank
# owns a few columns of the test sizes.
ALGORITHMS = {
    "topk_allgather": ("TopKAllgather", {"density": 0.05}),
    "gtopk": ("GTopK", {"density": 0.05}),
    "onebit": ("OneBit", {"column_size": 64}),
    "threshold": ("Threshold", {"tau": 0.8}),
    "adaptive": ("Adaptive", {"proportion": 4.0, "column_size": 100}),
}
DENSE_SIZES = (1, 3, 7, 1000, 65537)
COMPRESSED_SIZES = (7, 1000)
DTYPES = ("bfloat16", "float16")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    world = jax.device_count()
    mesh = jax.make_mesh((world,), ("dp",))
    rows = NamedSharding(mesh, P("dp"))
    results: dict[str, np.ndarray] = {}
    info: dict[str, dict] = {}

    def smap(fn, n_in, n_out):
        return jax.jit(
            jax.shard_map(
                fn,
                mesh=mesh,
                in_specs=(P("dp"),) * n_in,
                out_specs=(P("dp"),) * n_out if n_out > 1 else P("dp"),
            )
        )

    def wide(a) -> np.ndarray:
        return np.asarray(jnp.asarray(a).astype(jnp.float32))

    for dtype_name in DTYPES:
        dtype = jnp.dtype(dtype_name)
        for n in DENSE_SIZES:
            x = jax.device_put(jnp.asarray(make_inputs(world, n, n)).astype(dtype), rows)
            mine = smap(lambda v: jaxcomm.allreduce(v[0], "dp")[None], 1, 1)
            psum = smap(lambda v: lax.psum(v[0], "dp")[None], 1, 1)
            jaxcomm.reset_metrics()
            out = jax.block_until_ready(mine(x))
            totals = [t for t in jaxcomm.metrics()["totals"] if t["calls"]]
            case = f"dense/{dtype_name}/{n}"
            results[f"{case}/summed"] = wide(out)
            results[f"{case}/psum"] = wide(psum(x))
            results[f"{case}/dtype_ok"] = np.asarray(out.dtype == dtype)
            info[case] = {
                "bytes_sent": [t["bytes_sent"] for t in totals],
                "algorithms": sorted({t["algorithm"] for t in totals}),
            }

        for name, (cls, params) in ALGORITHMS.items():
            algorithm = getattr(jaxcomm, cls)(**params)
            for n in COMPRESSED_SIZES:
                x = jax.device_put(
                    jnp.asarray(make_inputs(world, n, 3 * n + 1)).astype(dtype), rows
                )
                r = jax.device_put(make_inputs(world, n, 3 * n + 2, scale=0.1), rows)
                f = smap(
                    lambda v, res, a=algorithm: tuple(
                        o[None] for o in jaxcomm.compressed_allreduce(v[0], res[0], "dp", a)
                    ),
                    2,
                    2,
                )
                summed, new_r = f(x, r)
                case = f"compressed/{name}/{dtype_name}/{n}"
                results[f"{case}/summed"] = wide(summed)
                results[f"{case}/residual"] = np.asarray(new_r)
                results[f"{case}/dtype_ok"] = np.asarray(
                    summed.dtype == dtype and new_r.dtype == jnp.float32
                )

        # Single-device ops: a 16-bit x compresses exactly like its float32 value.
        for name in ("onebit", "threshold", "adaptive"):
            cls, params = ALGORITHMS[name]
            c = getattr(jaxcomm, cls)(**params)
            x16 = jnp.asarray(make_inputs(1, 1000, 99)[0]).astype(dtype)
            r = jnp.asarray(make_inputs(1, 1000, 98, scale=0.1)[0])
            p16, r16 = jaxcomm.ops.compress(x16, r, c)
            p32, r32 = jaxcomm.ops.compress(x16.astype(jnp.float32), r, c)
            results[f"ops/{name}/{dtype_name}/same"] = np.asarray(
                bool(jnp.array_equal(p16, p32)) and bool(jnp.array_equal(r16, r32))
            )
        c = jaxcomm.TopK(0.05)
        x16 = jnp.asarray(make_inputs(1, 1000, 97)[0]).astype(dtype)
        p16, r16 = jaxcomm.ops.compress(x16, jnp.zeros(1000, jnp.float32), c)
        p32, r32 = jaxcomm.ops.compress(x16.astype(jnp.float32), jnp.zeros(1000, jnp.float32), c)
        results[f"ops/topk/{dtype_name}/same"] = np.asarray(
            bool(jnp.array_equal(p16, p32)) and bool(jnp.array_equal(r16, r32))
        )

    # Optax over a mixed-precision tree (bf16 and f32 leaves), dense and compressed.
    params = {
        "a": jnp.zeros((3, 5), jnp.bfloat16),
        "b": jnp.zeros((7,), jnp.float32),
        "c": jnp.zeros((), jnp.float16),
    }
    grads = {
        key: jax.device_put(
            jnp.asarray(make_inputs(world, int(np.prod(v.shape)) or 1, 50 + i)).astype(v.dtype),
            rows,
        )
        for i, (key, v) in enumerate(params.items())
    }
    shapes = {k: v.shape for k, v in params.items()}
    for label, comp in (("dense", None), ("adaptive", jaxcomm.Adaptive(2.0, column_size=8))):
        tx = jaxcomm.optax.allreduce_gradients("dp", comp)
        replicated = jax.device_put(params, NamedSharding(mesh, P()))
        specs = jaxcomm.optax.partition_specs(jax.eval_shape(tx.init, replicated), "dp")
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(
            replicated
        )

        def step(g, s, tx=tx):
            g = {k: v[0].reshape(shapes[k]) for k, v in g.items()}
            updates, s = tx.update(g, s)
            return {k: v.reshape(-1)[None] for k, v in updates.items()}, s

        f = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=({k: P("dp") for k in params}, specs),
                out_specs=({k: P("dp") for k in params}, specs),
                check_vma=False,
            )
        )
        updates, state = f(grads, state)
        for key, value in updates.items():
            results[f"optax/{label}/{key}/update"] = wide(value)
            results[f"optax/{label}/{key}/dtype_ok"] = np.asarray(value.dtype == params[key].dtype)
        if comp is not None:
            for key, value in state.residuals.items():
                results[f"optax/{label}/{key}/residual"] = np.asarray(value).reshape(world, -1)
    for key, value in grads.items():
        results[f"optax/grads/{key}"] = wide(value)

    np.savez(os.path.join(args.out, "bf16.npz"), **results)
    with open(os.path.join(args.out, "bf16.json"), "w") as f:
        json.dump(info, f)
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
