"""Runs jaxcomm.learning's reduction on 2 CPU devices of one process and prints JSON.

Used by tests/test_learning.py (the device count is set before JAX starts, so it runs in a
subprocess). Each rank feeds its own random gradient every step while the arm switches
between dense, gTop-k and one-bit, each arm by its own program as the examples' loop runs
them; the worker reports, per rank, how far the sum of every gradient is from what was sent
(the summed outputs) plus the residuals left, whether dense left zero residuals, and whether
each arm's own program gives what the ``lax.switch`` over every arm gives at that arm.
"""

from __future__ import annotations

import json

import jax

jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm import learning  # noqa: E402
from jaxcomm import optax as jc_optax  # noqa: E402

mesh = Mesh(np.asarray(jax.devices()), ("dp",))
RANKS = 2
params = {"w": jnp.zeros((64, 32), jnp.float32), "b": jnp.zeros((32,), jnp.float32)}
arms = [None, jaxcomm.GTopK(0.05), jaxcomm.OneBit()]
tx = learning.learned_gradients("dp", arms, mean=False)
specs = jc_optax.partition_specs(jax.eval_shape(tx.init, params), "dp")
state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs, check_vma=False))(
    params
)
grad_specs = {"w": P("dp"), "b": P("dp")}


def local(s, g):
    g = jax.tree.map(lambda x: x[0], g)  # this rank's gradient
    out, s = tx.update(g, s)
    return jax.tree.map(lambda x: x[None], out), s


step = jax.jit(
    jax.shard_map(local, mesh=mesh, in_specs=(specs, grad_specs),
                  out_specs=(grad_specs, specs), check_vma=False)
)  # fmt: skip
replicated = NamedSharding(mesh, P())


def fixed_step(arm: int):
    """The same reduction compiled with arm ``arm`` alone (no switch)."""
    one = learning.learned_gradients("dp", arms, fixed=arm, mean=False)

    def local_fixed(s, g):
        g = jax.tree.map(lambda x: x[0], g)
        out, s = one.update(g, s)
        return jax.tree.map(lambda x: x[None], out), s

    return jax.jit(
        jax.shard_map(local_fixed, mesh=mesh, in_specs=(specs, grad_specs),
                      out_specs=(grad_specs, specs), check_vma=False)
    )  # fmt: skip


# The training loop's way: each step runs the program of its arm, one state for all.
programs = [fixed_step(arm) for arm in range(len(arms))]
rng = np.random.default_rng(0)
schedule = [1, 1, 1, 2, 2, 0, 1, 1, 2, 1, 0, 0, 2, 1]
given = {k: np.zeros((RANKS, *v.shape), np.float64) for k, v in params.items()}
sent = {k: np.zeros(v.shape, np.float64) for k, v in params.items()}
for arm in schedule:
    g = {k: rng.standard_normal((RANKS, *v.shape)).astype(np.float32) for k, v in params.items()}
    out, state = programs[arm](
        state, {k: jax.device_put(v, NamedSharding(mesh, P("dp"))) for k, v in g.items()}
    )
    for k in params:
        given[k] += g[k]
        got = np.asarray(out[k])
        sent[k] += got[0]  # the sum over the ranks, identical on every rank
    if arm == 0:
        zero = all(float(np.abs(np.asarray(r)).max()) == 0.0
                   for r in jax.tree.leaves(state.inner.residuals))  # fmt: skip
residuals = {k: np.asarray(state.inner.residuals[k]).astype(np.float64) for k in params}
gap = max(
    float(
        np.abs(
            given[k].sum(0) - sent[k] - residuals[k].reshape(RANKS, *params[k].shape).sum(0)
        ).max()
    )
    for k in params
)
scale = max(float(np.abs(given[k].sum(0)).max()) for k in params)


# Each arm's own program gives what the switch gives at that arm, from the same state.
same = True
for arm in range(len(arms)):
    state = learning.set_arm(state, arm, replicated)
    g = {k: rng.standard_normal((RANKS, *v.shape)).astype(np.float32) for k, v in params.items()}
    g = {k: jax.device_put(v, NamedSharding(mesh, P("dp"))) for k, v in g.items()}
    a = jax.tree.leaves(step(state, g))
    b = jax.tree.leaves(programs[arm](state, g))
    same = same and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True)
    )
print(
    json.dumps(
        {
            "gap": gap,
            "scale": scale,
            "residual_nonzero": any(float(np.abs(r).max()) > 0 for r in residuals.values()),
            "dense_left_zero_residual": zero,
            "fixed_same_as_switch": same,
            "count": int(np.asarray(state.inner.count)),
            "steps": len(schedule),
        }
    )
)
