"""One process of tests/test_parallel_step.py's multi-process world (run_world): the step of
jaxcomm.data_parallel_step from unplaced host params and optimizer.init(params), each
process feeding its own rows of the batch; writes process<i>.npz."""

from __future__ import annotations

import os

import numpy as np
from collectives_harness import start_worker


def main() -> None:
    args = start_worker(["train"])
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh = jax.make_mesh((jax.device_count(),), ("dp",))
    rows = NamedSharding(mesh, P("dp"))
    rng = np.random.default_rng(0)  # the same parameters in every process
    params = {"w": rng.standard_normal((10, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}

    def loss_fn(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    tx = optax.adam(1e-2)
    step = jaxcomm.data_parallel_step(loss_fn, tx, mesh, algorithm=jaxcomm.GTopK(0.3))
    opt_state = tx.init(params)
    per_process = 4 * jax.local_device_count()
    losses = []
    for i in range(3):
        r = np.random.default_rng([i, jax.process_index()])  # this process's rows
        x = r.standard_normal((per_process, 10)).astype(np.float32)
        y = r.standard_normal((per_process, 3)).astype(np.float32)
        if i == 0:  # this process's own loss at the initial parameters
            local0 = float(np.mean((x @ params["w"] + params["b"] - y) ** 2))
        batch = [jax.make_array_from_process_local_data(rows, a) for a in (x, y)]
        params, opt_state, loss = step(params, opt_state, *batch)
        losses.append(float(loss.addressable_data(0)))
    step.wait()
    out = {
        "local0": np.asarray(local0),
        "loss": np.asarray(losses),
        "w": np.asarray(params["w"].addressable_data(0)),
    }
    np.savez(
        os.path.join(args.out, f"process{args.process_id}.npz"),
        **{f"{k}/{args.process_id}": v for k, v in out.items()},
    )


if __name__ == "__main__":
    main()
