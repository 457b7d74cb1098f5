"""One rank-process of the BlockQuant tests (started by tests/collectives_harness.py run_world).

Every world has 4 ranks (1 x 4, 2 x 2 or 4 x 1 processes x devices). Each process builds the
same global inputs from a seed, runs every case inside jax.jit + jax.shard_map and saves its
devices' results to ``<out>/process<i>.npz`` keyed "<case>/<world rank>/<output>":

* ``flat/<name>/<n>``: ``compressed_allreduce`` over ("dp",) with the BlockQuant of
  ``FLAT_CASES[name]`` at step ``STEP`` (a traced operand);
* ``bf16/<n>``: the same with bfloat16 x (``summed`` saved as its uint16 bits);
* ``hier/<scheme>/<name>/<n>``: ``hierarchical=True`` over ("node", "local") =
  (processes, devices), or (2, 2) for one process of 4 devices;
* ``optax/<name>/<step>``: ``allreduce_gradients`` updates of two steps (the count is the
  stochastic rounding's step), one bucket, sum;
* ``adamw/params``: three AdamW steps after ``allreduce_gradients(BlockQuant())``;
* ``metrics``: the metric label and bytes sent of the ``flat/int8/65537`` call.
"""

from __future__ import annotations

from collectives_harness import RankResults, make_inputs, rank_update_step, start_worker

# name -> BlockQuant keyword arguments (tests/test_blockquant.py mirrors them).
FLAT_CASES = {
    "int8": {"bits": 8, "block": 64},
    "int4": {"bits": 4, "block": 37},
    "int8_stochastic": {"bits": 8, "block": 100, "rounding": "stochastic", "seed": 5},
    "int4_stochastic": {"bits": 4, "block": 32, "rounding": "stochastic", "seed": 6},
    "int8_no_feedback": {"bits": 8, "block": 64, "error_feedback": False},
}
FLAT_SIZES = [7, 1000, 65537]
HIER_CASES = ("int8", "int4_stochastic")
HIER_SIZES = [7, 65537]
STEP = 11


def main() -> None:
    args = start_worker(["blockquant"])

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm.optax import allreduce_gradients, partition_specs

    world = jax.device_count()
    mesh = jax.make_mesh((world,), ("dp",))
    results = RankResults(mesh)
    save = results.save

    def inputs(n: int, seed: int, scale: float = 1.0) -> np.ndarray:
        return make_inputs(world, n, seed, scale)

    def put(rows: np.ndarray, m: jax.sharding.Mesh, spec: P) -> jax.Array:
        return jax.make_array_from_callback(
            rows.shape, NamedSharding(m, spec), lambda idx: rows[idx]
        )

    step = jnp.int32(STEP)

    def flat(algo: jaxcomm.BlockQuant, x: jax.Array, r: jax.Array) -> tuple:
        def body(v: jax.Array, w: jax.Array, t: jax.Array) -> tuple:
            summed, new_r = jaxcomm.compressed_allreduce(v[0], w[0], "dp", algo, step=t)
            return summed[None], new_r[None]

        f = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P("dp"), P("dp"), P()), out_specs=(P("dp"), P("dp"))
            )
        )
        return f(x, r, step)

    for name, params in FLAT_CASES.items():
        algo = jaxcomm.BlockQuant(**params)
        for n in FLAT_SIZES:
            x = put(inputs(n, 23 * n + 1), mesh, P("dp"))
            r = put(inputs(n, 23 * n + 2, scale=0.1), mesh, P("dp"))
            jaxcomm.reset_metrics()
            summed, new_r = flat(algo, x, r)
            save(f"flat/{name}/{n}", "summed", summed)
            save(f"flat/{name}/{n}", "residual", new_r)
            if name == "int8" and n == FLAT_SIZES[-1]:  # the metrics of one call
                for record in jaxcomm.metrics()["recent"]:
                    rank = record["world_rank"]
                    results[f"metrics/{rank}/algorithm"] = np.asarray(record["algorithm"])
                    results[f"metrics/{rank}/bytes_sent"] = np.asarray(record["bytes_sent"])

    for n in FLAT_SIZES:  # bfloat16 x, float32 residual
        x = put(inputs(n, 29 * n + 1), mesh, P("dp")).astype(jnp.bfloat16)
        r = put(inputs(n, 29 * n + 2, scale=0.1), mesh, P("dp"))
        summed, new_r = flat(jaxcomm.BlockQuant(bits=8, block=64), x, r)
        assert summed.dtype == jnp.bfloat16, summed.dtype
        save(f"bf16/{n}", "summed", jax.lax.bitcast_convert_type(summed, jnp.uint16))
        save(f"bf16/{n}", "residual", new_r)

    # Hierarchical: a process is a node, its devices its local ranks; one process of 4 devices
    # is viewed as 2 x 2.
    nodes = max(2, args.processes)
    devices = np.array(jax.devices()).reshape(nodes, -1)
    mesh2 = jax.sharding.Mesh(devices, ("node", "local"))
    both = ("node", "local")
    spec2 = P(both)
    assert [results.rank_of[d.id] for d in devices.flat] == list(range(world))
    for scheme in ("multi_leader", "leader"):
        for name in HIER_CASES:
            algo = jaxcomm.BlockQuant(**FLAT_CASES[name])
            for n in HIER_SIZES:
                x = put(inputs(n, 31 * n + 1), mesh2, spec2)
                r = put(inputs(n, 31 * n + 2, scale=0.1), mesh2, spec2)

                def body(v, w, t, algo=algo, scheme=scheme):
                    outs = jaxcomm.compressed_allreduce(
                        v[0], w[0], both, algo, hierarchical=True, hierarchical_scheme=scheme,
                        step=t,
                    )  # fmt: skip
                    return tuple(o[None] for o in outs)

                f = jax.jit(
                    jax.shard_map(
                        body, mesh=mesh2, in_specs=(spec2, spec2, P()), out_specs=(spec2, spec2)
                    )
                )
                summed, new_r = f(x, r, step)
                save(f"hier/{scheme}/{name}/{n}", "summed", summed)
                save(f"hier/{scheme}/{name}/{n}", "residual", new_r)

    # allreduce_gradients: each rank's gradient is an input row, the updates come back per
    # rank (stacked over dp), two steps, so the update count reaches the rounding as its step.
    shapes = {"w": (30, 20), "b": (20,)}
    sizes = {k: int(np.prod(s)) for k, s in shapes.items()}
    for name in ("int8", "int4_stochastic"):
        tx = allreduce_gradients("dp", jaxcomm.BlockQuant(**FLAT_CASES[name]), mean=False)
        params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
        specs = partition_specs(jax.eval_shape(tx.init, params), "dp")
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
        f = rank_update_step(tx, mesh, specs)
        for t in range(2):
            grads = {
                k: put(inputs(sizes[k], 37 * t + 3 + i).reshape(world, *s), mesh, P("dp"))
                for i, (k, s) in enumerate(sorted(shapes.items()))
            }
            updates, state = f(grads, state)
            for k in shapes:
                save(f"optax/{name}/{t}", k, updates[k])

    # AdamW after allreduce_gradients(BlockQuant()): the parameters stay identical everywhere.
    tx = optax.chain(
        allreduce_gradients("dp", jaxcomm.BlockQuant()), optax.adamw(1e-2, weight_decay=1e-3)
    )
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((40, 8)), jnp.float32)}
    state = jax.jit(
        jax.shard_map(
            tx.init,
            mesh=mesh,
            in_specs=P(),
            out_specs=(partition_specs(jax.eval_shape(tx.init, params), "dp")),
        )
    )(params)
    specs = partition_specs(jax.eval_shape(tx.init, params), "dp")

    def train(p, s, x):
        g = jax.grad(lambda q: jnp.mean((x @ q["w"]) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, {"w": p["w"][None]}

    step_fn = jax.jit(
        jax.shard_map(
            train,
            mesh=mesh,
            in_specs=(P(), specs, P("dp")),
            out_specs=(P(), specs, P("dp")),
            check_vma=False,
        )
    )
    for _ in range(3):
        x = put(rng.standard_normal((world * 4, 40)).astype(np.float32), mesh, P("dp"))
        params, state, seen = step_fn(params, state, x)
    _, _, seen = step_fn(params, state, x)
    save("adamw", "params", seen["w"])

    results.write(args)


if __name__ == "__main__":
    main()
