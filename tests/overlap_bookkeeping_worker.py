"""Runs allreduce_gradients(overlap=True) on 2 CPU devices under two fakes, and prints JSON.

`--cached-trace`: the allreduce's emitting body runs its Python once per type of call, as
jax >= 0.11 traces a ``custom_vmap`` body once per (function, input types) and reuses the
jaxpr: a repeated call gets the real body with a throwaway ``after`` record, so whatever
bookkeeping it does is lost, as with a cached trace. `--no-split`: the platform answers "does
not split" for every target, as a CUDA handler registered without start/done does.
"""

from __future__ import annotations

import argparse
import importlib
import json

import jax

jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm.collectives import _call  # noqa: E402

WIDTHS = [32, 64, 32, 64, 10]  # three equal-sized kernels: buckets of one type


def cache_traces() -> None:
    # The module, not the function the package exports under the same name.
    allreduce_module = importlib.import_module("jaxcomm.collectives.allreduce")
    real = allreduce_module._emit
    seen: set = set()

    def emit_once_per_type(x, axis_name, hierarchical, scheme, after, token):
        key = (x.shape, x.dtype, axis_name, hierarchical, jax.tree.structure(after))
        if key in seen and isinstance(after, _call.DeferDone):
            noted = getattr(after, "is_noted", False)
            after = _call.DeferDone()  # its record is thrown away
            after.is_noted = noted
        seen.add(key)
        return real(x, axis_name, hierarchical, scheme, after, token)

    allreduce_module._emit = emit_once_per_type


def train(overlap: bool, steps: int = 3) -> tuple[dict, str]:
    mesh = jax.make_mesh((2,), ("d",))
    rng = np.random.default_rng(5)
    params = {
        f"w{i}": jnp.asarray(rng.standard_normal((a, b)).astype(np.float32) / np.sqrt(a))
        for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
    }
    batch = jax.device_put(
        rng.standard_normal((16, WIDTHS[0])).astype(np.float32), NamedSharding(mesh, P("d"))
    )

    def loss(p, x):
        for i in range(len(WIDTHS) - 1):
            x = jnp.tanh(x @ p[f"w{i}"])
        return jnp.mean(x**2)

    opt = optax.chain(
        jaxcomm.optax.allreduce_gradients("d", bucket_size=1000, overlap=overlap),
        optax.adamw(1e-2),
    )

    def step(p, s, x):
        updates, s = opt.update(jax.grad(loss)(p, x), s, p)
        return optax.apply_updates(p, updates), s

    sharded = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P()), check_vma=False
        )
    )
    p, s = params, opt.init(params)
    text = sharded.lower(p, s, batch).as_text()
    for _ in range(steps):  # dispatched without a sync between steps
        p, s = sharded(p, s, batch)
    return {k: np.asarray(v).tolist() for k, v in jax.device_get(p).items()}, text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cached-trace", action="store_true")
    parser.add_argument("--no-split", action="store_true")
    args = parser.parse_args()
    if args.cached_trace:
        cache_traces()
    if args.no_split:
        _call.splits_on = lambda platform, target: False
    split_params, split_text = train(True)
    plain_params, plain_text = train(False)
    print(
        json.dumps(
            {
                "equal": split_params == plain_params,
                "split_dones": split_text.count("jaxcomm_collective_done"),
                "plain_dones": plain_text.count("jaxcomm_collective_done"),
            }
        )
    )


if __name__ == "__main__":
    main()
