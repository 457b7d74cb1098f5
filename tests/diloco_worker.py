"""Subprocess side of tests/test_diloco.py: jaxcomm.optax.diloco and the detached collectives.

One process of a (processes x devices) CPU world (run_world of tests/collectives_harness.py).
Every step is its own jitted shard_map call, dispatched without waiting, as a training loop
does. Gradients are fed per rank (a (ranks, ...) array sharded over dp), the same on every
process, so the test can recompute every reference from them. Modes:

  core    identity (every=1, dense, outer sgd(1)), error-feedback conservation on Δ,
          streaming vs. non-streaming. Writes <out>/process<i>.npz.
  cases   core, then checkpoint resume (in flight and not) and bf16 training.
  misuse  handles waited twice, started again on a stream with an open handle, restored from
          "another process", and one left open at exit. Writes <out>/misuse<i>.json.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

from collectives_harness import start_worker

SHAPES = {"w": (5, 3), "b": (3,), "s": ()}  # a scalar leaf too


def grads_for(step: int, ranks: int, scale: float = 1.0) -> dict:
    """Per-rank gradients of step `step`: {leaf: (ranks, *shape) float32}."""
    import numpy as np

    rng = np.random.default_rng(1000 + step)
    return {
        k: (rng.standard_normal((ranks, *shape)) * scale).astype(np.float32)
        for k, shape in SHAPES.items()
    }


def initial_params() -> dict:
    import numpy as np

    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(shape).astype(np.float32) for k, shape in SHAPES.items()}


def main() -> None:
    args = start_worker(["cases", "core", "misuse"])
    out = pathlib.Path(args.out)
    if args.mode == "misuse":
        misuse(args, out)
    else:
        cases(args, out)


class World:
    """The dp mesh and the jitted DiLoCo calls of one transformation."""

    def __init__(self) -> None:
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.mesh = jax.make_mesh((jax.device_count(),), ("dp",))
        self.ranks = self.mesh.size
        self.rows = NamedSharding(self.mesh, P("dp"))
        self.replicated = NamedSharding(self.mesh, P())

    def place(self, tree: dict, rows: bool) -> dict:
        import jax

        sharding = self.rows if rows else self.replicated
        return {
            k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in tree.items()
        }

    def calls(self, tx, params):
        """(init, step, flush, restart, specs) of `tx`, jitted over the mesh."""
        import jax
        from jax.sharding import PartitionSpec as P

        from jaxcomm.optax import partition_specs

        specs = partition_specs(jax.eval_shape(tx.init, params), "dp")

        def smap(fn, in_specs, out_specs):
            return jax.jit(
                jax.shard_map(
                    fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
                )
            )

        def step(params, state, grads):
            return tx.step(jax.tree.map(lambda g: g[0], grads), state, params)

        init = smap(tx.init, P(), specs)
        stepped = smap(step, (P(), specs, P("dp")), (P(), specs))
        flush = smap(tx.flush, (specs, P()), (P(), specs))
        restart = smap(tx.restart, (specs,), specs)
        return init, stepped, flush, restart, specs

    def gather(self, tree) -> list:
        """Every leaf as a NumPy array: replicated leaves once, per-rank ones stacked."""
        import numpy as np
        from jax.experimental import multihost_utils

        leaves = []
        for leaf in _leaves(tree):
            if leaf.sharding.is_fully_replicated:
                leaves.append(np.asarray(leaf.addressable_data(0)))
            else:
                leaves.append(np.asarray(multihost_utils.process_allgather(leaf, tiled=True)))
        return leaves


def _leaves(tree) -> list:
    import jax

    return jax.tree.leaves(tree)


def run(world: World, tx, steps: int, params=None, scale: float = 1.0, flush: bool = True):
    """`steps` DiLoCo steps from `params` (default initial_params()); returns (params, state)."""
    import jax

    params = world.place(params if params is not None else initial_params(), rows=False)
    init, step, flush_fn, _, _ = world.calls(tx, params)
    state = init(params)
    for i in range(steps):
        params, state = step(params, state, world.place(grads_for(i, world.ranks, scale), True))
    if flush:
        params, state = flush_fn(state, params)
    return jax.block_until_ready((params, state))


def cases(args, out: pathlib.Path) -> None:
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxcomm
    from jaxcomm.optax import diloco, restore_state, save_state

    world = World()
    R = world.ranks
    results: dict[str, np.ndarray] = {}

    # -- identity: every=1, dense, outer sgd(1) == averaging each rank's inner update ---------
    steps = 4
    for name, make in (("sgd", lambda: optax.sgd(0.1)), ("adam", lambda: optax.adam(0.05))):
        params, _ = run(world, diloco(make(), optax.sgd(1.0), every=1), steps)
        results[f"identity/{name}/ours"] = np.concatenate(
            [np.ravel(x) for x in world.gather(params)]
        )
        # The reference on the host: each rank's own inner state, the updates averaged.
        inner = make()
        theta = {k: jnp.asarray(v) for k, v in initial_params().items()}
        states = [inner.init(theta) for _ in range(R)]
        avg_grad_state = inner.init(theta)
        theta_g = dict(theta)  # the inner optimizer on the averaged gradient, for contrast
        for i in range(steps):
            g = grads_for(i, R)
            ups = []
            for r in range(R):
                u, states[r] = inner.update({k: jnp.asarray(v[r]) for k, v in g.items()}, states[r])
                ups.append(u)
            theta = {k: theta[k] + sum(u[k] for u in ups) / R for k in theta}
            mean_g = {k: jnp.asarray(v.mean(0)) for k, v in g.items()}
            u, avg_grad_state = inner.update(mean_g, avg_grad_state)
            theta_g = optax.apply_updates(theta_g, u)
        for key, tree in (("ref", theta), ("avg_grad", theta_g)):
            results[f"identity/{name}/{key}"] = np.concatenate(
                [np.ravel(np.asarray(tree[k])) for k in sorted(tree)]
            )

    # -- error feedback on Δ: sum_r(Δ_r + r_in) == summed + sum_r(r_out) at each sync ----------
    # θ_global starts at 0, inner = scale(-1) (local -= g), outer = sgd(1): summed = -P·θ'.
    zeros = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    for name, algorithm in (("gtopk", jaxcomm.GTopK(0.2)), ("onebit", jaxcomm.OneBit(32))):
        tx = diloco(optax.scale(-1.0), optax.sgd(1.0), every=2, algorithm=algorithm)
        params = world.place(zeros, rows=False)
        init, step, _, _, _ = world.calls(tx, params)
        state = init(params)
        for i in range(6):
            params, state = step(params, state, world.place(grads_for(i, R), True))
            g_leaves, local, res = (
                world.gather(params),
                world.gather(state.local),
                world.gather(state.residuals),
            )
            results[f"ef/{name}/{i}/global"] = np.concatenate([np.ravel(x) for x in g_leaves])
            results[f"ef/{name}/{i}/local"] = np.concatenate(
                [x.reshape(R, -1) for x in local], axis=1
            )
            results[f"ef/{name}/{i}/residual"] = res[0].reshape(R, -1)

    # -- streaming (detached, across jitted calls) == non-streaming with the same delays ------
    for name, algorithm, fragments, delay in (
        ("dense", None, 2, 2),
        ("gtopk", jaxcomm.GTopK(0.3), 1, 1),
    ):
        key = f"stream/{name}/{fragments}/{delay}"
        for overlap in (True, False):
            tx = diloco(
                optax.adamw(0.02),
                every=4,
                algorithm=algorithm,
                delay=delay,
                fragments=fragments,
                overlap=overlap,
            )
            params, state = run(world, tx, 11)
            kept = (params, state.local, state.inner, state.outer, state.residuals)
            for j, leaf in enumerate(world.gather(kept)):
                results[f"{key}/{overlap}/{j}"] = leaf

    if args.mode == "core":
        finish(args, out, results)
        return

    # -- checkpoint and resume, bit for bit (a handle in flight at the save, and none) ---------
    ckpt = pathlib.Path(tempfile.mkdtemp(prefix="diloco-ckpt-", dir=out))
    for name, kw, save_at in (
        ("plain", {"every": 3}, 4),
        ("stream", {"every": 3, "delay": 2, "fragments": 1}, 3),  # started at 3, lands at 5
    ):
        tx = diloco(optax.adamw(0.02), algorithm=jaxcomm.GTopK(0.3), **kw)
        params = world.place(initial_params(), rows=False)
        init, step, flush, restart, specs = world.calls(tx, params)
        state = init(params)
        for i in range(save_at):
            params, state = step(params, state, world.place(grads_for(i, R), True))
        path = ckpt / name
        save_state(path, (params, state))
        like = (params, state)
        for i in range(save_at, 9):  # the uninterrupted run
            params, state = step(params, state, world.place(grads_for(i, R), True))
        params, state = flush(state, params)
        expected = world.gather((params, state.local, state.residuals, state.outer))
        params, state = restore_state(path, like)
        state = restart(state)  # re-sends what was in flight at the save
        for i in range(save_at, 9):
            params, state = step(params, state, world.place(grads_for(i, R), True))
        params, state = flush(state, params)
        resumed = world.gather((params, state.local, state.residuals, state.outer))
        for j, (a, b) in enumerate(zip(expected, resumed, strict=True)):
            results[f"ckpt/{name}/{j}/expected"] = a
            results[f"ckpt/{name}/{j}/resumed"] = b

    # -- bf16 parameters, AdamW inner, a loss the ranks see different data of ----------------
    bf16_cases = {
        "dense": {"algorithm": None, "dense_dtype": jnp.bfloat16},
        "onebit_stream": {"algorithm": jaxcomm.OneBit(32), "delay": 1},
    }
    for name, kw in bf16_cases.items():
        losses, dtypes = bf16_training(world, diloco(optax.adamw(0.03), every=4, **kw))
        results[f"bf16/{name}/losses"] = losses
        results[f"bf16/{name}/dtypes_ok"] = np.asarray(dtypes)

    finish(args, out, results)


def finish(args, out: pathlib.Path, results: dict) -> None:
    import jax
    import numpy as np

    from jaxcomm.collectives import handles

    results["open_handles"] = np.asarray(len(handles.open_handles()))
    np.savez(out / f"process{args.process_id}.npz", **results)
    jax.effects_barrier()


def bf16_training(world: World, tx):
    """A least-squares model in bf16 trained by `tx` for 24 steps: (loss per step, dtypes ok)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jaxcomm.optax import partition_specs

    rng = np.random.default_rng(3)
    true_w = rng.standard_normal((8, 2)).astype(np.float32)
    x = rng.standard_normal((world.ranks * 16, 8)).astype(np.float32)
    y = x @ true_w
    params = {"w": jnp.zeros((8, 2), jnp.bfloat16), "b": jnp.zeros((2,), jnp.bfloat16)}
    params = jax.device_put(params, world.replicated)
    specs = partition_specs(jax.eval_shape(tx.init, params), "dp")

    def loss_fn(p, xb, yb):
        pred = xb.astype(jnp.bfloat16) @ p["w"] + p["b"]
        return jnp.mean((pred.astype(jnp.float32) - yb) ** 2)

    def step(params, state, xb, yb):
        grads = jax.grad(loss_fn)(tx.local_params(state), xb, yb)
        return tx.step(grads, state, params)

    def host_loss(params) -> float:
        # On the host: an XLA collective in the step would be a second, unbounded channel.
        w, b = (np.asarray(params[k].addressable_data(0)).astype(np.float32) for k in "wb")
        return float(np.mean((x.astype(jnp.bfloat16).astype(np.float32) @ w + b - y) ** 2))

    smap = jax.shard_map(
        step,
        mesh=world.mesh,
        in_specs=(P(), specs, P("dp"), P("dp")),
        out_specs=(P(), specs),
        check_vma=False,
    )
    init = jax.jit(
        jax.shard_map(tx.init, mesh=world.mesh, in_specs=P(), out_specs=specs, check_vma=False)
    )
    flush = jax.jit(
        jax.shard_map(
            tx.flush,
            mesh=world.mesh,
            in_specs=(specs, P()),
            out_specs=(P(), specs),
            check_vma=False,
        )
    )
    stepped = jax.jit(smap)
    state = init(params)
    xs = jax.make_array_from_callback(x.shape, world.rows, lambda idx: x[idx])
    ys = jax.make_array_from_callback(y.shape, world.rows, lambda idx: y[idx])
    losses = [host_loss(params)]
    for _ in range(24):
        params, state = stepped(params, state, xs, ys)
        losses.append(host_loss(params))
    params, state = flush(state, params)
    dtypes = [leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves((params, state.local))]
    return np.asarray(losses), dtypes


def misuse(args, out: pathlib.Path) -> None:
    """Each misuse must raise one clear error; the world keeps working afterwards."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    world = World()
    report: dict[str, str | None] = {}

    def smap(fn, in_specs, out_specs):
        return jax.jit(
            jax.shard_map(
                fn, mesh=world.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )
        )

    x = world.place({"x": np.arange(world.ranks * 4, dtype=np.float32)}, rows=True)["x"]
    start = smap(lambda v: jaxcomm.start_allreduce(v, "dp", stream=5), P("dp"), P("dp"))
    wait = smap(jaxcomm.wait, P("dp"), P("dp"))

    def attempt(name, fn):
        try:
            jax.block_until_ready(fn())
            report[name] = None
        except Exception as e:  # noqa: BLE001 - the test reads the message
            report[name] = str(e)

    pending = start(x)
    attempt("first_wait", lambda: wait(pending))
    attempt("waited_twice", lambda: wait(pending))
    pending = start(x)
    attempt("started_again", lambda: start(x))
    attempt("after_refusal", lambda: wait(pending))
    # A handle of another process (as one restored from a checkpoint saved in flight would
    # be): its epoch changed inside a jitted shard_map, as every other step here runs. An eager
    # `.at[].add` would mix a 1-device operand with the handle's 2-device explicit-axis
    # sharding, which JAX refuses outside `jax.set_mesh`.
    forge = smap(lambda p: jaxcomm.Pending(p.handle.at[:, 0].add(1), p.results), P("dp"), P("dp"))
    pending = start(x)
    stale = forge(pending)
    attempt("another_process", lambda: wait(stale))
    attempt("own_process", lambda: wait(pending))
    # The world still reduces (no rank hangs on the refused calls).
    total = smap(lambda v: jaxcomm.allreduce(v, "dp"), P("dp"), P("dp"))(x)
    report["allreduce_after"] = str(np.asarray(total.addressable_data(0)).tolist())
    report["expected_after"] = str(
        np.arange(world.ranks * 4, dtype=np.float32).reshape(world.ranks, 4).sum(0).tolist()
    )
    # Left open on purpose: reported on stderr at exit.
    jax.block_until_ready(start(x))
    (out / f"misuse{args.process_id}.json").write_text(json.dumps(report))
    del jnp


if __name__ == "__main__":
    main()
