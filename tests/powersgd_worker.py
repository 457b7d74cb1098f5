"""Subprocess side of tests/test_powersgd.py: one process with N CPU devices.

``jax_num_cpu_devices`` must be set before JAX initializes, so every multi-device case runs
here and writes ``<out>/<mode>.npz`` (arrays) and ``<mode>.json``.

Modes:
  unit   every rank's gradients and the reduced outputs of several steps (float32 and bf16)
         for the NumPy reference of the hook, the calls in the compiled step, bytes from
         jaxcomm.metrics(), mean=False, the Orbax checkpoint round trip, SGD and AdamW runs.
  train  the digits MLP with dense and with PowerSGD rank 4 (accuracy sanity check).
"""

from __future__ import annotations

import os
import sys

from collectives_harness import digits_runs, rank_update_step, run_device_worker

# Leaves of every kind: compressed 2-D and 4-D ones, a 1-D one and a 2-D one too small to gain
# (both dense), in an order that interleaves them.
SHAPES = {"w1": (40, 30), "b1": (30,), "w2": (30, 7), "conv": (3, 3, 8, 16), "small": (6, 5)}
RANK, START, STEPS = 2, 2, 6
EPSILON = 0.5  # large enough to change the result visibly
# The "train" mode's digits runs: dense and PowerSGD rank 4.
TRAIN_RUNS = {"dense": {"algorithm": "dense"}, "powersgd": {"algorithm": "powersgd", "rank": 4}}


def unit(devices: int, out: str) -> tuple[dict, dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm import cost
    from jaxcomm.cost.algorithm_costs import powersgd
    from jaxcomm.optax import allreduce_gradients, partition_specs, restore_state, save_state

    mesh = jax.make_mesh((devices,), ("dp",))
    arrays: dict[str, np.ndarray] = {}
    info: dict = {}
    zeros = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}

    def grads_of(step: int, dtype: object = np.float32) -> dict:
        rng = np.random.default_rng(1000 + step)
        # A shared low-rank-ish part plus per-rank noise, as data-parallel gradients look.
        return {
            k: (rng.standard_normal(s) + 0.3 * rng.standard_normal((devices, *s))).astype(dtype)
            for k, s in SHAPES.items()
        }

    def runner(tx: optax.GradientTransformation) -> tuple:
        specs = partition_specs(jax.eval_shape(tx.init, zeros), "dp")
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
        traces: list = []
        return init, rank_update_step(tx, mesh, specs, traces), specs, traces

    def place(g: dict) -> dict:
        return jax.device_put(g, NamedSharding(mesh, P("dp")))

    # 1. Several steps, float32 and bf16, for the hook's reference (rank 0's outputs, and
    # whether every rank got the same).
    for label, dtype in (("f32", np.float32), ("bf16", jnp.bfloat16)):
        spec = jaxcomm.PowerSGD(rank=RANK, start_step=START)
        init, step, _, traces = runner(allreduce_gradients("dp", spec))
        state = init(zeros)
        for k in SHAPES:
            arrays[f"{label}_q0_{k}"] = np.asarray(state.shared[k])
        identical = True
        for t in range(STEPS):
            g = grads_of(t, dtype)
            for k in SHAPES:
                arrays[f"{label}_g{t}_{k}"] = np.asarray(g[k]).astype(np.float32)
            u, state = step(place(g), state)
            for k in SHAPES:
                ranks = np.asarray(u[k]).astype(np.float32)
                identical &= bool((ranks == ranks[0]).all())
                arrays[f"{label}_out{t}_{k}"] = ranks[0]
                assert u[k].dtype == dtype
        info[f"{label}_identical"] = identical
        info[f"{label}_compilations"] = len(traces)
        info[f"{label}_count"] = int(state.count)
        for k in SHAPES:
            arrays[f"{label}_error_{k}"] = np.asarray(state.residuals[k])  # stacked per rank

    # 1b. The hook's other settings, float32: no error feedback, no warm start (and the Qs
    # drawn at each step, which the reference takes as inputs), an orthogonalization epsilon.
    from jaxcomm.collectives.powersgd import random_q

    variants = {
        "noef": {"error_feedback": False},
        "nows": {"warm_start": False},
        "eps": {"orthogonalization_epsilon": EPSILON},
    }
    tree_paths = jax.tree_util.tree_flatten_with_path(zeros)[0]
    for label, options in variants.items():
        spec = jaxcomm.PowerSGD(rank=RANK, start_step=START, **options)
        init, step, _, _ = runner(allreduce_gradients("dp", spec))
        state = init(zeros)
        # Leaf indices in the tree's flattening order (a dict's: sorted keys), as jaxcomm
        # numbers the leaves.
        leaf_index = {path[0].key: i for i, (path, _) in enumerate(tree_paths)}
        for k in SHAPES:
            i = leaf_index[k]
            arrays[f"{label}_q0_{k}"] = np.asarray(state.shared[k])
            arrays[f"{label}_errorshape_{k}"] = np.asarray(state.residuals[k].shape)
            plan = spec.plan(SHAPES[k])
            for t in range(STEPS if plan else 0):
                q = random_q(spec, i, plan[1], plan[2], jnp.int32(t))
                arrays[f"{label}_fq{t}_{k}"] = np.asarray(q)
        for t in range(STEPS):
            u, state = step(place(grads_of(t)), state)
            for k in SHAPES:
                arrays[f"{label}_out{t}_{k}"] = np.asarray(u[k])[0]

    # 2. The collectives of the compiled step: jaxcomm allreduce calls, with and without the
    # warm-up branch.
    for start in (0, START):
        tx = allreduce_gradients("dp", jaxcomm.PowerSGD(rank=RANK, start_step=start))
        init, step, _, _ = runner(tx)
        state = init(zeros)
        text = step.lower(place(grads_of(0)), state).as_text()
        info[f"allreduce_calls_start{start}"] = text.count("@jaxcomm_allreduce(")
        info[f"all_custom_calls_start{start}"] = text.count("stablehlo.custom_call")

    # 3. Bytes of one compressed step, as jaxcomm.metrics() counts them, against the model.
    init, step, _, _ = runner(allreduce_gradients("dp", jaxcomm.PowerSGD(rank=RANK, start_step=0)))
    state = init(zeros)
    jax.block_until_ready(step(place(grads_of(0)), state))  # compiles
    jaxcomm.reset_metrics()
    jax.block_until_ready(step(place(grads_of(1)), state))
    sent = {t["world_rank"]: t["bytes_sent"] for t in jaxcomm.metrics()["totals"]}
    world = cost.World(1, devices)
    info["bytes_measured"] = {str(r): b for r, b in sorted(sent.items())}
    info["bytes_model"] = {
        str(r): powersgd.tree_bytes(list(SHAPES.values()), world, cost.Options(rank=RANK), r)
        for r in range(devices)
    }
    info["sizes"] = list(powersgd.tree_sizes(list(SHAPES.values()), jaxcomm.PowerSGD(RANK)))

    # 4. mean=False: the sum, devices times the average.
    spec = jaxcomm.PowerSGD(rank=RANK, start_step=1)
    outs = {}
    for mean in (True, False):
        init, step, _, _ = runner(allreduce_gradients("dp", spec, mean=mean))
        state = init(zeros)
        for t in range(3):
            u, state = step(place(grads_of(t)), state)
        outs[mean] = {k: np.asarray(v)[0] for k, v in u.items()}
    info["sum_is_devices_times_mean"] = all(
        np.allclose(outs[False][k], devices * outs[True][k], rtol=1e-5, atol=1e-5) for k in SHAPES
    )

    # 5. Orbax round trip mid-training: the resumed run continues bit for bit.
    tx = allreduce_gradients("dp", jaxcomm.PowerSGD(rank=RANK, start_step=1))
    init, step, _, _ = runner(tx)
    state = init(zeros)
    for t in range(3):
        _, state = step(place(grads_of(t)), state)
    path = os.path.join(out, "ckpt")
    save_state(path, state)
    straight = []
    s = state
    for t in range(3, 6):
        u, s = step(place(grads_of(t)), s)
        straight.append((u, s))
    restored = restore_state(path, init(zeros))
    info["restored_count"] = int(restored.count)
    info["restored_error_nonzero"] = bool(np.abs(np.asarray(restored.residuals["w1"])).max() > 0)
    same = True
    s = restored
    for t, (u_ref, s_ref) in zip(range(3, 6), straight, strict=True):
        u, s = step(place(grads_of(t)), s)
        pairs = zip(jax.tree.leaves((u, s)), jax.tree.leaves((u_ref, s_ref)), strict=True)
        same &= all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
    info["resume_bit_identical"] = same

    # 6. Training a small model with SGD and AdamW: the loss goes down.
    rng = np.random.default_rng(7)
    true_w = rng.standard_normal((32, 16)).astype(np.float32)
    x_all = rng.standard_normal((devices * 64, 32)).astype(np.float32)
    y_all = np.tanh(x_all @ true_w)
    params0 = {
        "w1": (rng.standard_normal((32, 64)) * 0.1).astype(np.float32),
        "b1": np.zeros(64, np.float32),
        "w2": (rng.standard_normal((64, 16)) * 0.1).astype(np.float32),
    }

    def loss_fn(p: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    for name, opt in (("sgd", optax.sgd(0.1, momentum=0.9)), ("adamw", optax.adamw(3e-3))):
        for dtype in ("float32", "bfloat16"):
            tx = optax.chain(
                allreduce_gradients("dp", jaxcomm.PowerSGD(rank=4, start_step=5)),
                optax.stateless(lambda u, p: jax.tree.map(lambda g: g.astype(jnp.float32), u)),
                opt,
            )
            params = jax.device_put(params0, NamedSharding(mesh, P()))
            specs = partition_specs(jax.eval_shape(tx.init, params), "dp")
            state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(
                params
            )

            def local(p: dict, s: object, x: jax.Array, y: jax.Array, tx=tx, dtype=dtype) -> tuple:
                loss, g = jax.value_and_grad(loss_fn)(p, x, y)
                g = jax.tree.map(lambda a: a.astype(dtype), g)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s, jaxcomm.allreduce(loss, "dp") / devices

            train_step = jax.jit(
                jax.shard_map(
                    local,
                    mesh=mesh,
                    in_specs=(P(), specs, P("dp"), P("dp")),
                    out_specs=(P(), specs, P()),
                    check_vma=False,
                )
            )
            xs = jax.device_put(x_all, NamedSharding(mesh, P("dp")))
            ys = jax.device_put(y_all, NamedSharding(mesh, P("dp")))
            losses = []
            for _ in range(60):  # dispatched asynchronously; read at the end
                params, state, loss = train_step(params, state, xs, ys)
                losses.append(loss)
            info[f"{name}_{dtype}_losses"] = [float(v) for v in losses]
    return arrays, info


if __name__ == "__main__":
    modes = {"unit": lambda a: unit(a.devices, a.out), "train": digits_runs(TRAIN_RUNS)}
    sys.exit(run_device_worker(modes))
