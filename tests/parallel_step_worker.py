"""Subprocess side of tests/test_parallel_step.py: one process with N CPU devices.

Each case trains the same small model a few steps twice: with jaxcomm.data_parallel_step (or
jaxcomm.data_parallel) and with the long form README documents (allreduce_gradients in the
chain, the state's partition specs and placement, jax.shard_map by hand), and writes both
runs' parameters and losses.

Modes:
  equal    every registered algorithm, "auto", PowerSGD, DiLoCo, bf16, optax.MultiSteps.
"""

from __future__ import annotations

import sys

from collectives_harness import run_device_worker

STEPS = 4


def equal(args) -> tuple[dict, dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm import algorithms, cost
    from jaxcomm.optax import allreduce_gradients, diloco, partition_specs

    devices = args.devices
    mesh = jax.make_mesh((devices,), ("dp",))
    rows = NamedSharding(mesh, P("dp"))
    rng = np.random.default_rng(0)
    base = {
        "w1": rng.standard_normal((24, 16)).astype(np.float32) * 0.3,
        "b1": np.zeros(16, np.float32),
        "w2": rng.standard_normal((16, 5)).astype(np.float32) * 0.3,
    }
    batches = [
        (
            rng.standard_normal((devices * 4, 24)).astype(np.float32),
            rng.integers(0, 5, devices * 4).astype(np.int32),
        )
        for _ in range(STEPS)
    ]

    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        logits = (h @ p["w2"]).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}

    def long_form(tx, params, dl=None):
        """README's long form: specs, placement and shard_map by hand; per-rank losses."""
        init = dl.init if dl is not None else tx.init
        specs = partition_specs(jax.eval_shape(init, params), "dp")
        state = jax.jit(
            jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=specs, check_vma=False)
        )(params)

        def local(p, s, x, y):
            if dl is not None:
                (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(dl.local_params(s), x, y)
                p, s = dl.step(g, s, p)
            else:
                (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(p, x, y)
                u, s = tx.update(g, s, p)
                p = optax.apply_updates(p, u)
            return p, s, loss[None], aux["accuracy"][None]

        step = jax.jit(
            jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(P(), specs, P("dp"), P("dp")),
                out_specs=(P(), specs, P("dp"), P("dp")),
                check_vma=False,
            )
        )
        losses, accs = [], []
        for x, y in batches:
            params, state, loss, acc = step(params, state, *jax.device_put((x, y), rows))
            losses.append(np.asarray(loss).mean())
            accs.append(np.asarray(acc).mean())
        if dl is not None:  # the outer steps still in flight (delay > 0) land
            flush = jax.shard_map(
                dl.flush, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs), check_vma=False
            )
            params, state = jax.jit(flush)(state, params)
        return params, np.asarray(losses), np.asarray(accs)

    def helper(step, params, opt_state):
        losses, accs = [], []
        for x, y in batches:
            params, opt_state, loss, aux = step(params, opt_state, *jax.device_put((x, y), rows))
            losses.append(float(loss))
            accs.append(float(aux["accuracy"]))
        params, opt_state = step.finish(params, opt_state)
        return params, np.asarray(losses), np.asarray(accs)

    arrays: dict[str, np.ndarray] = {"initial/w1": base["w1"]}
    info: dict = {"cases": []}

    def record(case, ours, ref):
        info["cases"].append(case)
        for tag, (p, losses, accs) in (("ours", ours), ("ref", ref)):
            for k, v in p.items():
                arrays[f"{case}/{tag}/{k}"] = np.asarray(v).astype(np.float32)
            arrays[f"{case}/{tag}/loss"] = losses
            arrays[f"{case}/{tag}/accuracy"] = accs

    options = cost.Options(density=0.1, tau=0.01, start_step=2, rank=2)
    specs = {n: algorithms.build(n, options) for n in algorithms.names() if n != "psum"}
    specs["auto"] = "auto"
    params32 = jax.device_put(base, NamedSharding(mesh, P()))
    for name, spec in specs.items():
        adam = optax.adam(1e-2)
        # algorithm= (the reduction inserted, state from the given optimizer's init) ...
        step = jaxcomm.data_parallel_step(loss_fn, adam, mesh, algorithm=spec, has_aux=True)
        ours = helper(step, params32, adam.init(params32))
        ref = long_form(optax.chain(allreduce_gradients("dp", spec), adam), params32)
        record(f"{name}/algorithm", ours, ref)
        if name == "auto":
            # ... and the reduction in the chain, the state from step.init.
            tx = optax.chain(allreduce_gradients("dp", spec), optax.adam(1e-2))
            step = jaxcomm.data_parallel_step(loss_fn, tx, mesh, has_aux=True)
            record(f"{name}/chain", helper(step, params32, step.init(params32)), ref)

    # bf16 parameters (bf16 gradients on the 16-bit wire) and bf16 wire for float32 ones.
    params16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params32)
    for case, params, kwargs in (
        ("bf16-params", params16, {}),
        ("bf16-wire", params32, {"dense_dtype": jnp.bfloat16}),
    ):
        tx = optax.chain(allreduce_gradients("dp", None, **kwargs), optax.sgd(0.1, momentum=0.9))
        step = jaxcomm.data_parallel_step(loss_fn, tx, mesh, has_aux=True)
        record(case, helper(step, params, tx.init(params)), long_form(tx, params))

    # Gradient accumulation: the reduction in front of MultiSteps, or inside it.
    multi = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    step = jaxcomm.data_parallel_step(
        loss_fn, multi, mesh, algorithm=jaxcomm.GTopK(0.1), has_aux=True
    )
    ref_tx = optax.chain(
        allreduce_gradients("dp", jaxcomm.GTopK(0.1)), multi.gradient_transformation()
    )
    record(
        "multisteps/front",
        helper(step, params32, multi.init(params32)),
        long_form(ref_tx, params32),
    )
    inside = optax.MultiSteps(
        optax.chain(allreduce_gradients("dp", jaxcomm.GTopK(0.1)), optax.adam(1e-2)), 2
    ).gradient_transformation()
    step = jaxcomm.data_parallel_step(loss_fn, inside, mesh, has_aux=True)
    record(
        "multisteps/inside",
        helper(step, params32, inside.init(params32)),
        long_form(inside, params32),
    )

    # DiLoCo: dense, compressed, and streamed (delay: the outer step lands a step later).
    for case, kwargs in (
        ("diloco/dense", {}),
        ("diloco/gtopk", {"algorithm": jaxcomm.GTopK(0.1)}),
        ("diloco/delay", {"delay": 1, "overlap": False}),
    ):
        dl = diloco(optax.adam(1e-2), every=2, **kwargs)
        step = jaxcomm.data_parallel_step(loss_fn, dl, mesh, has_aux=True)
        record(case, helper(step, params32, dl.init(params32)), long_form(None, params32, dl))

    # The wrapper of a plain step (README's five-line form) against the same long form.
    tx = optax.chain(allreduce_gradients("dp", "auto"), optax.adam(1e-2))

    @jaxcomm.data_parallel(mesh)
    def train_step(params, opt_state, x, y):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux

    record("wrapper/auto", helper(train_step, params32, tx.init(params32)), long_form(tx, params32))

    # Called inside the caller's own jax.jit (two steps in one program): no pacing there.
    tx = optax.chain(allreduce_gradients("dp", jaxcomm.GTopK(0.1)), optax.adam(1e-2))
    step = jaxcomm.data_parallel_step(loss_fn, tx, mesh, has_aux=True)

    @jax.jit
    def two_steps(params, state, xs, ys):
        losses, accs = [], []
        for x, y in zip(xs, ys, strict=True):
            params, state, loss, aux = step(params, state, x, y)
            losses.append(loss)
            accs.append(aux["accuracy"])
        return params, jnp.stack(losses), jnp.stack(accs)

    xs, ys = zip(*[jax.device_put(b, rows) for b in batches], strict=True)
    p, losses, accs = two_steps(params32, step.init(params32), xs, ys)
    record("inside-jit", (p, np.asarray(losses), np.asarray(accs)), long_form(tx, params32))
    info["traces"] = train_step.traces
    return arrays, info


if __name__ == "__main__":
    sys.exit(run_device_worker({"equal": equal}))
