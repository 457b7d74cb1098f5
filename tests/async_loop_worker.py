"""Subprocess side of tests/test_async_loops.py: training loops the way users write them.

One process of a (processes x devices) CPU world. Modes:
  paced  One jitted step trains six copies of an MLP, one per gradient reducer (dense and every
         compressor), each in two buckets, so each step runs twelve jaxcomm collectives, six of
         them split into start and done. The loop runs STEPS steps with
         jaxcomm.paced (no per-step synchronization, fresh inputs transferred every step), then
         again waiting for every step; writes both runs' parameters to <out>/process<i>.npz.
  raw    The same step for one reducer (dense), dispatched without any synchronization or
         helper. Writes <out>/raw<i>.json: whether it finished, and the exception text if not.
  overlap A 4-layer MLP step whose gradient buckets are one layer each: writes
         <out>/overlap<i>.json with, per measured step, each device's collectives (when
         each was queued, started and finished) and when each layer's gradient existed.
         With several processes, every process but 0 calls the step LATE_S seconds late, so
         process 0's collectives cannot finish before that: if its backward still finishes
         first, backward ran while they were on the wire.
  killed Like paced, but process 1 kills itself (SIGKILL) before step DIE_AT while steps are
         queued; the others write <out>/killed<i>.json with what they raised and how many
         steps their loop had dispatched by then.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time

from collectives_harness import start_worker

STEPS = int(os.environ.get("JAXCOMM_TEST_STEPS", "300"))
DIE_AT = 5  # killed mode: process 1 kills itself before dispatching this step
LATE_S = 1.0


def main() -> None:
    args = start_worker(["paced", "raw", "killed", "overlap"])

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm.optax import allreduce_gradients, partition_specs

    out = pathlib.Path(args.out)
    if args.mode == "overlap":
        overlap(args, out)
        return
    mesh = jax.make_mesh((jax.device_count(),), ("dp",))
    world = mesh.size
    reducers = {
        "dense": None,
        "topk_allgather": jaxcomm.TopKAllgather(0.05),
        "gtopk": jaxcomm.GTopK(0.05),
        "onebit": jaxcomm.OneBit(),
        "threshold": jaxcomm.Threshold(0.01),
        "adaptive": jaxcomm.Adaptive(proportion=8),
    }
    if args.mode == "raw":
        reducers = {"dense": None}
    # bucket_size=1024: w2 (512 elements) and w1 (2048) are two buckets, so w2's collective is
    # split (start, then a done after w1's gradient: overlap) and w1's is not.
    txs = {
        name: optax.chain(allreduce_gradients("dp", c, bucket_size=1024), optax.sgd(0.05))
        for name, c in reducers.items()
    }
    rng = np.random.default_rng(0)
    base = {
        "w1": rng.standard_normal((32, 64)).astype(np.float32) * 0.2,
        "w2": rng.standard_normal((64, 8)).astype(np.float32) * 0.2,
    }
    replicated = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P("dp"))

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def init():
        params = {n: jax.device_put(base, replicated) for n in reducers}
        states, specs = {}, {}
        for n, tx in txs.items():
            specs[n] = partition_specs(jax.eval_shape(tx.init, base), "dp")
            states[n] = jax.jit(
                jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs[n])
            )(params[n])
        return params, states, specs

    params, states, specs = init()

    def local(params, states, x, y):
        new_p, new_s, losses = {}, {}, []
        for n, tx in txs.items():
            value, g = jax.value_and_grad(loss)(params[n], x, y)
            u, new_s[n] = tx.update(g, states[n])
            new_p[n] = optax.apply_updates(params[n], u)
            losses.append(value)
        # Per-rank losses, not lax.pmean: XLA's own collective (Gloo) would fail first when a
        # peer dies, and the test is about jaxcomm's.
        return new_p, new_s, jnp.stack(losses)[None]

    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), specs, P("dp"), P("dp")),
            out_specs=(P(), specs, P("dp")),
            check_vma=False,
        )
    )

    def batch(i):
        # Every process draws the same global batch (seeded by step) and feeds its rows.
        g = np.random.default_rng(1000 + i)
        x = g.standard_normal((world * 4, 32)).astype(np.float32)
        y = g.standard_normal((world * 4, 8)).astype(np.float32)
        return (
            jax.make_array_from_callback(x.shape, data, lambda idx: x[idx]),
            jax.make_array_from_callback(y.shape, data, lambda idx: y[idx]),
        )

    def run(max_in_flight, steps, die_at=None, progress=None):
        p, s, _ = init()
        paced = jaxcomm.paced(step, max_in_flight)
        for i in range(steps):
            if die_at is not None and i == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            p, s, _ = paced(p, s, *batch(i))
            if progress is not None:
                progress["dispatched"] = i + 1
        paced.wait()
        return p

    def host(tree):
        return {k: np.asarray(v.addressable_data(0)) for k, v in tree.items()}

    pid = args.process_id
    if args.mode == "paced":
        started = time.monotonic()
        free = run(jaxcomm.pacing.DEFAULT_MAX_IN_FLIGHT, STEPS)
        free_s = time.monotonic() - started
        synced = run(0, STEPS)
        arrays = {}
        for n in reducers:
            for leaf, value in host(free[n]).items():
                arrays[f"paced/{n}/{leaf}"] = value
            for leaf, value in host(synced[n]).items():
                arrays[f"synced/{n}/{leaf}"] = value
        np.savez(out / f"process{pid}.npz", **arrays)
        print(f"paced loop: {STEPS} steps x {len(reducers)} collectives in {free_s:.1f} s")
    elif args.mode == "raw":
        started = time.monotonic()
        report = {"finished": False, "error": None}
        p, s, _ = init()
        try:
            for i in range(STEPS):
                p, s, _ = step(p, s, *batch(i))  # no sync, no helper: JAX's async dispatch
            jax.block_until_ready(p)
            report["finished"] = True
        except Exception as error:  # noqa: BLE001 - the test inspects whatever was raised
            report["error"] = f"{type(error).__name__}: {error}"
        report["seconds"] = time.monotonic() - started
        (out / f"raw{pid}.json").write_text(json.dumps(report))
    else:
        started = time.monotonic()
        report = {"error": None, "dispatched": 0, "die_at": DIE_AT, "steps": STEPS}
        report["max_in_flight"] = jaxcomm.pacing.DEFAULT_MAX_IN_FLIGHT
        try:
            run(
                jaxcomm.pacing.DEFAULT_MAX_IN_FLIGHT,
                STEPS,
                die_at=DIE_AT if pid == 1 else None,
                progress=report,
            )
        except jaxcomm.CollectiveError as error:
            report["error"] = str(error)
        report["seconds"] = time.monotonic() - started
        (out / f"killed{pid}.json").write_text(json.dumps(report))
        # Stay up while the other survivors notice the dead peer (else they would see this
        # process go too, and could name it first), then skip jax.distributed's shutdown
        # barrier: the dead peer would fail it and abort us.
        time.sleep(5)
        os._exit(0)


def overlap(args, out: pathlib.Path) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm import _world
    from jaxcomm.optax import allreduce_gradients, partition_specs

    mesh = jax.make_mesh((jax.device_count(),), ("dp",))
    width, layers = 512, 4
    rng = np.random.default_rng(0)
    params = {
        f"l{i}": rng.standard_normal((width, width)).astype(np.float32) / np.sqrt(width)
        for i in range(layers)
    }
    replicated = NamedSharding(mesh, P())
    params = {
        k: jax.make_array_from_callback(v.shape, replicated, lambda idx, v=v: v[idx])
        for k, v in params.items()
    }
    # One layer per bucket: the buckets go last layer first.
    tx = optax.chain(allreduce_gradients("dp", bucket_size=width * width), optax.sgd(1e-3))
    specs = partition_specs(jax.eval_shape(tx.init, params), "dp")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def loss(p, x):
        for i in range(layers):
            x = jnp.tanh(x @ p[f"l{i}"])
        return jnp.mean(x**2)

    def local(p, s, x):
        g = jax.grad(loss)(p, x)
        # When each layer's gradient exists (backward produces l3's first, l0's last).
        g = {k: jaxcomm.timeline.mark(v, f"grad/{k}") for k, v in g.items()}
        u, s = tx.update(g, s)
        return optax.apply_updates(p, u), s

    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), specs, P("dp")),
            out_specs=(P(), specs),
            check_vma=False,
        )
    )
    rows = rng.standard_normal((mesh.size * 2048, width)).astype(np.float32)
    x = jax.make_array_from_callback(
        rows.shape, NamedSharding(mesh, P("dp")), lambda idx: rows[idx]
    )
    params, state = jax.block_until_ready(step(params, state, x))  # compile, warm up
    device_of_rank = _world.world("cpu").device_ids
    steps = []
    for _ in range(5):
        jaxcomm.reset_metrics()
        jaxcomm.timeline.reset_marks()
        if args.process_id > 0:
            time.sleep(LATE_S)
        params, state = jax.block_until_ready(step(params, state, x))
        first = {}  # device -> the record of its first collective (the last layer's bucket)
        for r in jaxcomm.metrics()["recent"]:
            device = device_of_rank[r["world_rank"]]
            if device not in first or r["started"] < first[device]["started"]:
                first[device] = r
        grads: dict = {}  # device -> {layer: when its gradient existed}
        for m in jaxcomm.timeline.marks():
            grads.setdefault(m["device_id"], {})[m["label"].split("/")[1]] = m["time"]
        collectives: dict = {}  # device -> its collectives in issue order (bucket order)
        for r in sorted(jaxcomm.metrics()["recent"], key=lambda r: r["seq"]):
            keys = ("seq", "elements", "queued", "started", "finished")
            collectives.setdefault(device_of_rank[r["world_rank"]], []).append(
                {k: r[k] for k in keys}
            )
        steps.append(
            {
                str(d): {
                    "first_collective_started": first[d]["started"],
                    "first_collective_finished": first[d]["finished"],
                    "grad_l0": grads[d]["l0"],
                    "grads": grads[d],
                    "collectives": collectives[d],
                }
                for d in grads
            }
        )
    (out / f"overlap{args.process_id}.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
