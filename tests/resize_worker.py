"""Subprocess side of tests/test_resize.py: trains, saves or restores with N CPU devices.

  --mode save     3 steps on N devices (gTop-k with error feedback, and DiLoCo), then a
                  checkpoint of (params, state) of each in DIR.
  --mode restore  the checkpoints restored onto N devices (another world size), then 2 more
                  steps.
Writes DIR/<mode>-<devices>.npz (the per-rank leaves, params, losses) and .json (warnings).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--mode", choices=("save", "restore"), required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    from jaxcomm import checkpoints

    mesh = jax.make_mesh((args.devices,), ("dp",))
    rows = NamedSharding(mesh, P("dp"))
    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((12, 6)).astype(np.float32) * 0.3,
        "b": np.zeros(6, np.float32),
    }

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)

    def batch(i):
        r = np.random.default_rng(10 + i)
        x = r.standard_normal((args.devices * 6, 12)).astype(np.float32)
        return jax.device_put(
            (x, r.standard_normal((args.devices * 6, 6)).astype(np.float32)), rows
        )

    steps = {
        "gtopk": jaxcomm.data_parallel_step(
            loss_fn, optax.adam(1e-2), mesh, algorithm=jaxcomm.GTopK(0.2)
        ),
        "diloco": jaxcomm.data_parallel_step(
            loss_fn, jaxcomm.optax.diloco(optax.adam(1e-2), every=4), mesh
        ),
    }
    arrays, info = {}, {"warnings": {}}
    for name, step in steps.items():
        directory = os.path.join(args.dir, name)
        p, state = step.replicate(params), step.init(params)
        first = 0
        if args.mode == "restore":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                (p, state), _ = checkpoints.restore(directory, 3, (p, state))
            info["warnings"][name] = [str(w.message) for w in caught]
            first = 3
        for leaf_path, leaf in jax.tree_util.tree_flatten_with_path((p, state))[0]:
            arrays[f"{name}/start/{jax.tree_util.keystr(leaf_path)}"] = np.asarray(leaf)
        losses = []
        for i in range(first, first + (3 if args.mode == "save" else 2)):
            p, state, loss = step(p, state, *batch(i))
            losses.append(float(loss))
        p, state = step.finish(p, state)
        arrays[f"{name}/losses"] = np.asarray(losses)
        for leaf_path, leaf in jax.tree_util.tree_flatten_with_path((p, state))[0]:
            arrays[f"{name}/end/{jax.tree_util.keystr(leaf_path)}"] = np.asarray(leaf)
        if args.mode == "save":
            checkpoints.save(directory, 3, (p, state))
    out = os.path.join(args.dir, f"{args.mode}-{args.devices}")
    np.savez(out + ".npz", **arrays)
    with open(out + ".json", "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
