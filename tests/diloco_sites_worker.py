"""Subprocess side of tests/test_diloco_sites.py: jaxcomm.optax.diloco over sites.

One process of a (processes x devices) CPU world of 4 devices (run_world of
tests/collectives_harness.py), viewed as a ("node", "local") mesh of 2 sites x 2 devices (a
process is a site when there are 2 processes), and as one site of 4 devices. Gradients are fed
per device (a (devices, ...) array, row r for the mesh's device r), the same on every process,
so the test recomputes every reference from them. Writes <out>/process<i>.npz.
"""

from __future__ import annotations

import json
import pathlib

from collectives_harness import start_worker

SHAPES = {"w": (7, 4), "b": (3,), "s": ()}  # 32 elements: two even shares of 16
FSDP_SHAPES = {"w": (8, 4), "b": (4,)}  # every leaf's first dimension splits over "local"
AXES = ("node", "local")


def grads_for(step: int, devices: int, shapes: dict = SHAPES) -> dict:
    """Per-device gradients of step `step`: {leaf: (devices, *shape) float32}."""
    import numpy as np

    rng = np.random.default_rng(2000 + step)
    return {k: rng.standard_normal((devices, *s)).astype(np.float32) for k, s in shapes.items()}


def initial_params(shapes: dict = SHAPES) -> dict:
    import numpy as np

    rng = np.random.default_rng(11)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def main() -> None:
    args = start_worker(["sites"])
    out = pathlib.Path(args.out)
    import jax
    import numpy as np

    import jaxcomm  # noqa: F401 - before JAX's CPU client exists: it sizes the launch pool

    results: dict[str, np.ndarray] = {}
    two = Mesh((2, 2))
    cases_one_site(Mesh((1, 4)), results)
    cases_identity(two, results)
    cases_error_feedback(two, results)
    cases_fsdp(two, results)
    cases_checkpoint(two, out, results)
    from jaxcomm.collectives import handles

    results["open_handles"] = np.asarray(len(handles.open_handles()))
    np.savez(out / f"process{args.process_id}.npz", **results)
    jax.effects_barrier()


class Mesh:
    """A ("node", "local") mesh of every device, rows = sites, and its jitted DiLoCo calls."""

    def __init__(self, shape: tuple[int, int]) -> None:
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        devices = np.array(jax.devices()).reshape(shape)
        if jax.process_count() == shape[0]:  # a process is a site
            for row, site in enumerate(devices):
                assert all(d.process_index == row for d in site), devices
        self.mesh = jax.sharding.Mesh(devices, AXES)
        self.sites, self.local = shape
        self.devices = self.mesh.size
        self.rows = NamedSharding(self.mesh, P(AXES))
        self.replicated = NamedSharding(self.mesh, P())

    def place(self, tree: dict, rows: bool, spec=None) -> dict:
        import jax
        from jax.sharding import NamedSharding

        sharding = self.rows if rows else self.replicated
        if spec is not None:
            sharding = NamedSharding(self.mesh, spec)
        return {
            k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in tree.items()
        }

    def smap(self, fn, in_specs, out_specs):
        import jax

        return jax.jit(
            jax.shard_map(
                fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )
        )

    def calls(self, tx, params, param_spec=None):
        """(init, step, flush, restart) of `tx`; step takes per-device gradient rows and also
        returns θ_global per device (stacked over every device, to compare bits)."""
        import jax
        from jax.sharding import PartitionSpec as P

        from jaxcomm.optax import partition_specs

        with jax.set_mesh(self.mesh):  # a device's share of Δ: its size is the mesh's
            specs = partition_specs(jax.eval_shape(tx.init, params), AXES)
        pspec = P() if param_spec is None else param_spec

        def step(params, state, grads):
            params, state = tx.step(jax.tree.map(lambda g: g[0], grads), state, params)
            return params, state, jax.tree.map(lambda x: x[None], params)

        init = self.smap(tx.init, (pspec,), specs)
        stepped = self.smap(step, (pspec, specs, P(AXES)), (pspec, specs, P(AXES)))
        flush = self.smap(tx.flush, (specs, pspec), (pspec, specs))
        restart = self.smap(tx.restart, (specs,), specs)
        return init, stepped, flush, restart


def gather(tree) -> list:
    """Every leaf as a NumPy array (per-device leaves stacked, in the mesh's device order)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    leaves = []
    for leaf in jax.tree.leaves(tree):
        if leaf.sharding.is_fully_replicated:
            leaves.append(np.asarray(leaf.addressable_data(0)))
        else:
            leaves.append(np.asarray(multihost_utils.process_allgather(leaf, tiled=True)))
    return leaves


def flat_rows(tree, devices: int):
    """A per-device tree as one (devices, n) array, leaves in tree order."""
    import numpy as np

    return np.concatenate([x.reshape(devices, -1) for x in gather(tree)], axis=1)


def flat(tree):
    import numpy as np

    return np.concatenate([np.ravel(x) for x in gather(tree)])


def run(m: Mesh, tx, steps: int, *, params=None, shapes=SHAPES, flush=True):
    """`steps` steps from `params`; returns (params, state, θ_global per device)."""
    import jax

    params = m.place(params if params is not None else initial_params(shapes), rows=False)
    init, step, flush_fn, _ = m.calls(tx, params)
    state = init(params)
    per_device = None
    for i in range(steps):
        grads = m.place(grads_for(i, m.devices, shapes), rows=True)
        params, state, per_device = step(params, state, grads)
    if flush:
        params, state = flush_fn(state, params)
    return jax.block_until_ready((params, state, per_device))


def cases_one_site(m: Mesh, results: dict) -> None:
    """One site of every device, outer sgd(1): plain data-parallel training with the inner
    optimizer (the site's mean gradient every step), up to float rounding."""
    import optax

    from jaxcomm.optax import diloco

    inner = "dense" if m.devices > 1 else "psum"
    tx = diloco(
        optax.adam(0.05),
        optax.sgd(1.0),
        every=3,
        axis_name="node",
        inner_axis="local",
        inner_allreduce=inner,
    )
    params, state, _ = run(m, tx, 6)
    results["one_site/global"] = flat(params)
    results["one_site/local"] = flat_rows(state.local, m.devices)


def cases_identity(m: Mesh, results: dict) -> None:
    """every=1, dense outer, outer sgd(1), with the outer exchange's bytes."""
    import numpy as np
    import optax

    import jaxcomm
    from jaxcomm.optax import diloco

    for name, make, inner in (
        ("sgd", lambda: optax.sgd(0.1), "psum"),
        ("adam", lambda: optax.adam(0.05), "dense"),
    ):
        tx = diloco(
            make(),
            optax.sgd(1.0),
            every=1,
            axis_name="node",
            inner_axis="local",
            inner_allreduce=inner,
        )
        jaxcomm.reset_metrics()
        params, _, per_device = run(m, tx, 4)
        results[f"identity/{name}/global"] = flat(params)
        results[f"identity/{name}/per_device"] = flat_rows(per_device, m.devices)
        if name == "sgd":  # jaxcomm's calls: the outer exchanges and the gathers in a site
            calls = [
                [r["world_rank"], r["group_size"], r["elements"], r["bytes_sent"]]
                for r in jaxcomm.metrics()["recent"]
            ]
            labels = sorted({r["algorithm"] for r in jaxcomm.metrics()["recent"]})
            results["bytes/calls"] = np.asarray(calls, np.int64)
            results["bytes/labels"] = np.asarray(json.dumps(labels))


def cases_error_feedback(m: Mesh, results: dict) -> None:
    """gTop-k on each device's share: θ_global from 0, inner scale(-1), outer sgd(1)."""
    import numpy as np
    import optax

    import jaxcomm
    from jaxcomm.optax import diloco

    tx = diloco(
        optax.scale(-1.0),
        optax.sgd(1.0),
        every=2,
        algorithm=jaxcomm.GTopK(0.25),
        axis_name="node",
        inner_axis="local",
    )
    params = m.place({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}, rows=False)
    init, step, _, _ = m.calls(tx, params)
    state = init(params)
    for i in range(6):
        grads = m.place(grads_for(i, m.devices), rows=True)
        params, state, per_device = step(params, state, grads)
        results[f"ef/{i}/global"] = flat(params)
        results[f"ef/{i}/per_device"] = flat_rows(per_device, m.devices)
        results[f"ef/{i}/local"] = flat_rows(state.local, m.devices)
        results[f"ef/{i}/residual"] = flat_rows(state.residuals, m.devices)


def fsdp_loss(params, x, y, local: int, sharded: bool):
    """Least squares on this device's batch, divided by the site's devices (the site's loss is
    the mean of its devices'); sharded weights are gathered over "local" first."""
    import jax.numpy as jnp
    from jax import lax

    if sharded:
        params = {k: lax.all_gather(v, "local", axis=0, tiled=True) for k, v in params.items()}
    pred = x @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2) / local


def cases_fsdp(m: Mesh, results: dict) -> None:
    """The same model with its weights replicated in a site and sharded over "local"."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm.optax import diloco, partition_specs

    rng = np.random.default_rng(5)
    true_w = rng.standard_normal((8, 4)).astype(np.float32)
    x = rng.standard_normal((m.devices * 16, 8)).astype(np.float32)
    y = (x @ true_w + 0.1).astype(np.float32)
    data = m.place({"x": x, "y": y}, rows=True)
    for sharded in (False, True):
        tx = diloco(
            optax.adamw(0.05),
            every=4,
            axis_name="node",
            inner_axis="local",
            params_sharded=sharded,
            inner_allreduce="psum",
        )
        pspec = P("local") if sharded else P()
        params = m.place(initial_params(FSDP_SHAPES), rows=False, spec=pspec)
        with jax.set_mesh(m.mesh):
            specs = partition_specs(jax.eval_shape(tx.init, params), AXES)

        def step(params, state, xb, yb, tx=tx, sharded=sharded):
            grads = jax.grad(fsdp_loss)(tx.local_params(state), xb, yb, m.local, sharded)
            params, state = tx.step(grads, state, params)
            return params, state, jax.tree.map(lambda leaf: leaf[None], params)

        init = m.smap(tx.init, (pspec,), specs)
        stepped = m.smap(step, (pspec, specs, P(AXES), P(AXES)), (pspec, specs, P(AXES)))
        state = init(params)
        jaxcomm.reset_metrics()
        losses = []
        for _ in range(12):
            params, state, per_device = stepped(params, state, data["x"], data["y"])
            full = {k: v for k, v in zip(sorted(params), gather(params), strict=True)}
            losses.append(float(np.mean((x @ full["w"] + full["b"] - y) ** 2)))
        results[f"fsdp/{sharded}/global"] = flat(params)
        results[f"fsdp/{sharded}/per_device"] = flat_rows(per_device, m.devices)
        results[f"fsdp/{sharded}/losses"] = np.asarray(losses)
        # The sizes of its jaxcomm calls (the inner average is XLA's psum here).
        calls = {(r["group_size"], r["elements"]) for r in jaxcomm.metrics()["recent"]}
        results[f"fsdp/{sharded}/calls"] = np.asarray(sorted(calls), np.int64)


def cases_checkpoint(m: Mesh, out: pathlib.Path, results: dict) -> None:
    """Saved while a streamed outer exchange is in flight (started at 3, lands at 5)."""
    import optax

    import jaxcomm
    from jaxcomm.optax import diloco, restore_state, save_state

    ckpt = out / "sites-ckpt"  # one path for every process: they save one checkpoint
    tx = diloco(
        optax.adamw(0.02),
        every=3,
        delay=2,
        algorithm=jaxcomm.GTopK(0.3),
        axis_name="node",
        inner_axis="local",
    )
    params = m.place(initial_params(), rows=False)
    init, step, flush, restart = m.calls(tx, params)
    state = init(params)
    for i in range(3):
        params, state, _ = step(params, state, m.place(grads_for(i, m.devices), rows=True))
    save_state(ckpt / "stream", (params, state))
    like = (params, state)
    for i in range(3, 9):
        params, state, per_device = step(params, state, m.place(grads_for(i, m.devices), True))
    params, state = flush(state, params)
    expected = gather((params, state.local, state.residuals, state.outer, per_device))
    params, state = restore_state(ckpt / "stream", like)
    state = restart(state)
    for i in range(3, 9):
        params, state, per_device = step(params, state, m.place(grads_for(i, m.devices), True))
    params, state = flush(state, params)
    resumed = gather((params, state.local, state.residuals, state.outer, per_device))
    for j, (a, b) in enumerate(zip(expected, resumed, strict=True)):
        results[f"ckpt/{j}/expected"] = a
        results[f"ckpt/{j}/resumed"] = b


if __name__ == "__main__":
    main()
