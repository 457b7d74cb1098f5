"""Subprocess side of tests/test_optax.py: one process with N CPU devices.

``jax_num_cpu_devices`` must be set before JAX initializes, so every multi-device case runs
here and writes its measurements to ``<out>/<mode>.npz`` (arrays) and ``<mode>.json``.

Modes:
  unit         dense == lax.pmean, residual structure, error-feedback conservation,
               compilations, density schedule, checkpoint round trip.
  convergence  digits MLP for dense / gTop-k (warm-up) / TopK-allgather / adaptive.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from collectives_harness import digits_runs, run_device_worker

# The "convergence" mode's digits runs.
CONVERGENCE_RUNS = {
    "dense": {"algorithm": "dense"},
    "gtopk": {"algorithm": "gtopk", "density": 0.01, "warmup": True},
    "topk_allgather": {"algorithm": "topk_allgather", "density": 0.01, "warmup": True},
    "adaptive": {"algorithm": "adaptive", "proportion": 16.0},
}


def unit(devices: int, out: str) -> tuple[dict, dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm.examples import digits
    from jaxcomm.optax import allreduce_gradients, partition_specs, restore_state, save_state

    mesh = jax.make_mesh((devices,), ("dp",))
    arrays: dict[str, np.ndarray] = {}
    info: dict = {}
    rng = np.random.default_rng(0)
    # Leaves of several shapes, a scalar among them; bucket_size=1000 splits them into
    # several buckets (w1 alone is larger than a bucket).
    params = {
        "w1": rng.standard_normal((40, 30)).astype(np.float32) * 0.2,
        "b1": rng.standard_normal(30).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((30, 7)).astype(np.float32) * 0.2,
        "scale": np.float32(1.5),
    }
    params = jax.device_put(params, NamedSharding(mesh, P()))

    def loss(p: dict, x: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"]) ** 2) * p["scale"]

    def batch(step: int) -> jax.Array:
        x = np.random.default_rng(100 + step).standard_normal((devices * 3, 40)).astype(np.float32)
        return jax.device_put(x, NamedSharding(mesh, P("dp")))

    def make_step(tx: optax.GradientTransformation, specs: object, traces: list) -> object:
        def local(p: dict, s: object, x: jax.Array) -> tuple:
            traces.append(1)  # trace time only: counts compilations
            g = jax.grad(loss)(p, x)
            updates, s = tx.update(g, s)
            # per-rank gradients come back stacked over dp (leading axis of size 1 each)
            per_rank = jax.tree.map(lambda a: jnp.reshape(a, (1,) + a.shape), g)
            return updates, lax.pmean(g, "dp"), lax.psum(g, "dp"), per_rank, s

        return jax.jit(
            jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(P(), specs, P("dp")),
                out_specs=(P(), P(), P(), P("dp"), specs),
                check_vma=False,
            )
        )

    def init(tx: optax.GradientTransformation) -> tuple:
        specs = partition_specs(jax.eval_shape(tx.init, params), "dp")
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
        return specs, state

    # 1. Dense: mean equals lax.pmean, sum (mean=False) equals lax.psum.
    for mean in (True, False):
        tx = allreduce_gradients("dp", None, mean=mean, bucket_size=1000)
        specs, state = init(tx)
        traces: list = []
        f = make_step(tx, specs, traces)
        for step in range(3):
            updates, pmean, psum, _, state = f(params, state, batch(step))
            ref = pmean if mean else psum
            for k in updates:
                arrays[f"dense/{mean}/{step}/{k}/ours"] = np.asarray(updates[k])
                arrays[f"dense/{mean}/{step}/{k}/ref"] = np.asarray(ref[k])
        info[f"dense/{mean}/traces"] = len(traces)
        info[f"dense/{mean}/count"] = int(np.asarray(state.count))

    # 1b. "auto" keeps a bf16 gradient on dense's 16-bit wire (the cost model weighs that wire
    # against the compressors): the same custom call, so the same bits, as algorithm=None.
    def bf16_step(tx: optax.GradientTransformation, specs: object) -> object:
        def local(p: dict, s: object, x: jax.Array) -> tuple:
            g = jax.tree.map(lambda a: a.astype(jnp.bfloat16), jax.grad(loss)(p, x))
            return tx.update(g, s)

        mapped = jax.shard_map(
            local, mesh=mesh, in_specs=(P(), specs, P("dp")), out_specs=(P(), specs),
            check_vma=False,
        )  # fmt: skip
        return jax.jit(mapped)

    half: dict = {}
    for name, algo in (("none", None), ("auto", jaxcomm.cost.Auto(allowed=("dense",)))):
        tx = allreduce_gradients("dp", algo, bucket_size=1000)
        specs, state = init(tx)
        f = bf16_step(tx, specs)
        half[name] = jax.tree.map(np.asarray, f(params, state, batch(0))[0])
        info[f"bf16/{name}/hlo_has_bf16_wire"] = "jaxcomm_allreduce_bf16" in (
            f.lower(params, state, batch(0)).as_text()
        )
    info["bf16/auto_equals_dense"] = all(
        half["auto"][k].dtype == half["none"][k].dtype == np.dtype(jnp.bfloat16)
        and half["auto"][k].tobytes() == half["none"][k].tobytes()
        for k in params
    )
    info["bf16/auto_decision_bytes"] = sorted(
        {d["element_bytes"] for d in jaxcomm.cost.auto_decisions()}
    )

    # 1c. "auto" over bf16 gradients with a density schedule, on a slow link: the dense phase
    # keeps the 16-bit wire, the sparse phase sends gTop-k in float32; the switch over phases
    # needs both to return bf16.
    link = jaxcomm.cost.Link(1e-6, 8e-8)  # 100 Mbit/s, a microsecond per message
    slow = jaxcomm.cost.Profile(
        links={c: link for c in jaxcomm.cost.LINK_CLASSES},
        gamma={k: 0.0 for k in jaxcomm.cost.KERNELS},
        psum=link,
    )
    seen = len(jaxcomm.cost.auto_decisions())
    auto = jaxcomm.cost.Auto(allowed=("dense", "gtopk"), profile=slow)
    tx = allreduce_gradients("dp", auto, density_schedule={0: 0.9, 2: 0.0001}, bucket_size=1000)
    specs, state = init(tx)
    f = bf16_step(tx, specs)
    dtypes = set()
    for step in range(4):  # two steps in each phase, one trace
        updates, state = f(params, state, batch(step))
        dtypes |= {str(u.dtype) for u in jax.tree.leaves(updates)}
        finite = all(bool(np.isfinite(np.asarray(u, np.float32)).all()) for u in updates.values())
        info[f"bf16_schedule/{step}/finite"] = finite
    info["bf16_schedule/dtypes"] = sorted(dtypes)
    info["bf16_schedule/choices"] = sorted(
        {d["choice"] for d in jaxcomm.cost.auto_decisions()[seen:]}
    )
    info["bf16_schedule/count"] = int(np.asarray(state.count))

    # 1d. dense_dtype: float32 gradients, only the buckets auto sends dense go on the 16-bit
    # wire. The dense phase gives the bits of the dense allreduce of bf16 gradients; the sparse
    # phase gives gTop-k's bits on the float32 gradient itself (never cast to bf16 and back).
    def f32_step(tx: optax.GradientTransformation, specs: object) -> object:
        def local(p: dict, s: object, x: jax.Array) -> tuple:
            return tx.update(jax.grad(loss)(p, x), s)

        mapped = jax.shard_map(
            local, mesh=mesh, in_specs=(P(), specs, P("dp")), out_specs=(P(), specs),
            check_vma=False,
        )  # fmt: skip
        return jax.jit(mapped)

    tx = allreduce_gradients(
        "dp", auto, density_schedule={0: 0.9, 2: 0.0001}, bucket_size=1000,
        dense_dtype=jnp.bfloat16,
    )  # fmt: skip
    specs, state = init(tx)
    seen = len(jaxcomm.cost.auto_decisions())
    f = f32_step(tx, specs)
    info["wire/hlo_has_bf16_wire"] = "jaxcomm_allreduce_bf16" in (
        f.lower(params, state, batch(0)).as_text()
    )
    mixed = []
    for step in range(3):
        updates, state = f(params, state, batch(step))
        mixed.append(jax.tree.map(np.asarray, updates))
    info["wire/dtypes"] = sorted({str(u.dtype) for m in mixed for u in m.values()})
    tx = allreduce_gradients("dp", None, bucket_size=1000)
    specs0, state0 = init(tx)
    dense16 = jax.tree.map(np.asarray, bf16_step(tx, specs0)(params, state0, batch(0))[0])
    info["wire/dense_phase_equals_bf16_dense"] = all(
        mixed[0][k].tobytes() == dense16[k].astype(np.float32).tobytes() for k in params
    )
    tx = allreduce_gradients("dp", jaxcomm.GTopK(0.0001), bucket_size=1000)
    specs1, state1 = init(tx)
    sparse = jax.tree.map(np.asarray, f32_step(tx, specs1)(params, state1, batch(2))[0])
    # In the sparse phase auto sends the two weight buckets by gTop-k and the 31 elements of
    # the small leaves dense (a message that small costs its latency either way). Those 31 are
    # dense in both phases, so they are reduced once, before (outside) the phases' switch.
    decisions = jaxcomm.cost.auto_decisions()[seen:]
    info["wire/choices"] = [(d["elements"], d["choice"]) for d in decisions if "choice" in d]
    info["wire/sparse_phase_equals_float32_gtopk"] = all(
        mixed[2][k].tobytes() == sparse[k].tobytes() for k in ("w1", "w2")
    )

    # 1e. auto decides the warm-up: dropping it costs no steps here (factor 1.0), so the
    # dense-ish first phase is not worth its seconds, and gTop-k at the final density runs from
    # the first step (the same bits as gTop-k's on the weights).
    decider = dataclasses.replace(
        auto, dense_steps=10, steps_factor={"gtopk": 1.0}, steps_factor_no_warmup={"gtopk": 1.0}
    )
    tx = allreduce_gradients("dp", decider, density_schedule={0: 0.9, 2: 0.0001}, bucket_size=1000)
    specs, state = init(tx)
    seen = len(jaxcomm.cost.auto_decisions())
    first = jax.tree.map(np.asarray, f32_step(tx, specs)(params, state, batch(2))[0])
    decisions = jaxcomm.cost.auto_decisions()[seen:]
    info["warmup/decisions"] = [
        d["warmup_decision"]["warmup"] for d in decisions if "warmup_decision" in d
    ]
    info["warmup/choices"] = [(d["elements"], d["choice"]) for d in decisions if "choice" in d]
    info["warmup/first_step_is_final_density"] = all(
        first[k].tobytes() == sparse[k].tobytes() for k in params
    )

    # 1f. overlap=True on one core: the dense buckets are split (a start, then a done after
    # backward), the compressed ones are not (their selection would take the core from
    # backward). On this process's cores both are split. The decision is made at trace time.
    def dones(algo: object) -> int:
        tx = allreduce_gradients("dp", algo, bucket_size=1000)
        specs, state = init(tx)
        text = f32_step(tx, specs).lower(params, state, batch(0)).as_text()
        return text.count("jaxcomm_collective_done")

    # A split dense start sums in place (its result is its bucket's buffer: nothing for XLA to
    # place behind unrelated backward work); an unsplit call leaves its operand alone.
    def in_place_starts(overlap: bool) -> int:
        tx = allreduce_gradients("dp", None, bucket_size=1000, overlap=overlap)
        specs, state = init(tx)
        text = f32_step(tx, specs).lower(params, state, batch(0)).as_text()
        calls = [line for line in text.splitlines() if "@jaxcomm_allreduce" in line]
        return sum("operand_index = 2" in line for line in calls)

    info["overlap/in_place_starts"] = [in_place_starts(True), in_place_starts(False)]

    cores = os.sched_getaffinity(0)
    info["overlap/cores"] = len(cores)
    info["overlap/dones_all_cores"] = [dones(None), dones(jaxcomm.GTopK(0.05))]
    try:
        os.sched_setaffinity(0, {min(cores)})
        info["overlap/dones_one_core"] = [dones(None), dones(jaxcomm.GTopK(0.05))]
    finally:
        os.sched_setaffinity(0, cores)

    # 1g. A schedule whose phases all choose dense compiles no switch (its operands would be
    # copied for nothing); one whose phases choose differently keeps it.
    def has_switch(algo: object) -> bool:
        tx = allreduce_gradients("dp", algo, density_schedule={0: 0.9, 2: 0.001}, bucket_size=1000)
        specs, state = init(tx)
        return "stablehlo.case" in f32_step(tx, specs).lower(params, state, batch(0)).as_text()

    info["schedule/switch"] = [has_switch(jaxcomm.cost.Auto(allowed=("dense",))), has_switch(auto)]

    # 2. Compressed: residual structure, conservation, no retracing.
    for name, algo in (
        ("gtopk", jaxcomm.GTopK(0.05)),
        ("topk_allgather", jaxcomm.TopKAllgather(0.05)),
    ):
        tx = allreduce_gradients("dp", algo, mean=False, bucket_size=1000)
        specs, state = init(tx)
        traces = []
        f = make_step(tx, specs, traces)
        info[f"{name}/local_residual_shapes"] = {}
        for step in range(5):
            before = jax.tree.map(np.asarray, state.residuals)
            updates, _, _, per_rank, state = f(params, state, batch(step))
            for k in updates:
                arrays[f"{name}/{step}/{k}/update"] = np.asarray(updates[k])
                arrays[f"{name}/{step}/{k}/grads"] = np.asarray(per_rank[k])
                arrays[f"{name}/{step}/{k}/r_in"] = before[k]
                arrays[f"{name}/{step}/{k}/r_out"] = np.asarray(state.residuals[k])
        info[f"{name}/traces"] = len(traces)
        info[f"{name}/cache_size"] = f._cache_size()
        info[f"{name}/residual_tree_equal"] = jax.tree.structure(
            state.residuals
        ) == jax.tree.structure(params)
        for k, r in state.residuals.items():
            # The global residual stacks every rank's local one along axis 0.
            shard = r.addressable_shards[0].data
            info[f"{name}/local_residual_shapes"][k] = {
                "local_shape": list(shard.shape),
                "dtype": str(shard.dtype),
                "param_shape": list(params[k].shape),
                "param_dtype": str(params[k].dtype),
                "spec": str(r.sharding.spec),
            }

    # 3. Density schedule: one compilation, and the phase's k bounds the update's nonzeros.
    schedule = {0: 0.5, 2: 0.1, 4: 0.01}
    tx = allreduce_gradients(
        "dp", jaxcomm.GTopK(0.01), density_schedule=schedule, bucket_size=10**6
    )
    specs, state = init(tx)
    traces = []
    f = make_step(tx, specs, traces)
    nnz, sent = [], []
    for step in range(6):
        jaxcomm.reset_metrics()
        updates, *_, state = f(params, state, batch(step))
        jax.block_until_ready(updates)
        nnz.append(int(sum(np.count_nonzero(np.asarray(u)) for u in jax.tree.leaves(updates))))
        sent.append(int(sum(t["bytes_sent"] for t in jaxcomm.metrics()["totals"])))
    info["schedule"] = {
        "nnz": nnz,
        "bytes_sent": sent,
        "traces": len(traces),
        "cache_size": f._cache_size(),
        "n": int(sum(np.size(p) for p in jax.tree.leaves(params))),
        "densities": [schedule[s] for s in (0, 0, 2, 2, 4, 4)],
    }

    # 4. Checkpoint round trip on the digits trainer (gTop-k with warm-up: the restored run
    # must also resume the density schedule at the right step).
    cfg = digits.DigitsConfig(algorithm="gtopk", density=0.01, steps=12, batch_size=64)
    trainer = digits.build(cfg, mesh)
    p, s = trainer.init()
    prefix = os.path.join(out, "ckpt")
    for i in range(12):
        if i == 6:
            save_state(prefix, (p, s))
            saved = [np.asarray(x) for x in jax.tree.leaves((p, s))]
        p, s, *_ = trainer.step(p, s, *trainer.batch(i))
    straight = jax.tree.map(np.asarray, (p, s))
    fresh = digits.build(cfg, mesh)
    p2, s2 = restore_state(prefix, fresh.init())
    info["restored_count"] = int(np.asarray(s2[0].count))
    # Every leaf, each rank's residual shard included, comes back bit for bit (Orbax).
    restored = [np.asarray(x) for x in jax.tree.leaves((p2, s2))]
    info["restored_identical"] = len(restored) == len(saved) and all(
        a.dtype == b.dtype and a.tobytes() == b.tobytes()
        for a, b in zip(saved, restored, strict=True)
    )
    wrong = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding), (p2, s2)
    )
    try:
        restore_state(prefix, wrong)
        info["wrong_dtype_error"] = ""
    except ValueError as error:
        info["wrong_dtype_error"] = str(error)
    for i in range(6, 12):
        p2, s2, *_ = fresh.step(p2, s2, *fresh.batch(i))
    resumed = jax.tree.map(np.asarray, (p2, s2))
    info["checkpoint_leaves"] = len(jax.tree.leaves(straight))
    info["checkpoint_identical"] = all(
        a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True)
    )
    info["checkpoint_residual_nonzero"] = bool(
        any(np.any(r) for r in jax.tree.leaves(straight[1][0].residuals))
    )
    return arrays, info


if __name__ == "__main__":
    modes = {"unit": lambda a: unit(a.devices, a.out), "convergence": digits_runs(CONVERGENCE_RUNS)}
    sys.exit(run_device_worker(modes))
