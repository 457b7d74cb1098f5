"""Runs each jaxcomm allreduce once on D CPU devices of one process and prints its metrics.

Used by tests/test_cost.py (the device count must be set before JAX starts, so it runs in a
subprocess): ``python tests/cost_worker.py DEVICES N`` prints one JSON object mapping
"algorithm" to the bytes_sent of every world rank, as ``jaxcomm.metrics()`` counted them.
The flat algorithms run over a ("dp",) mesh of all D devices, the hierarchical ones over a
("node", "local") mesh of shape (2, D // 2).

Inputs are chosen so the data-dependent quantizers send known amounts (see
tests/test_cost.py): every rank gets the same vector of alternating signs (adaptive: balanced
signs, identical selections) with |x| > tau everywhere (threshold: every entry passes).
"""

from __future__ import annotations

import json
import sys

import jax

devices, n = int(sys.argv[1]), int(sys.argv[2])
jax.config.update("jax_num_cpu_devices", devices)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402

TAU = 0.5
HIER = ("node", "local")


def run(fn, mesh: Mesh, spec: P) -> dict[int, int]:
    sharding = NamedSharding(mesh, spec)
    signs = np.where(np.arange(n) % 2 == 0, 1.0, -1.0).astype(np.float32)
    row = signs * (1.0 + np.linspace(0.0, 1.0, n, dtype=np.float32))
    x = jax.device_put(np.tile(row, (devices, 1)), sharding)
    r = jax.device_put(np.zeros((devices, n), np.float32), sharding)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
    jax.block_until_ready(f(x, r))  # compile (no collective runs while tracing)
    jaxcomm.reset_metrics()
    jax.block_until_ready(f(x, r))
    return {t["world_rank"]: t["bytes_sent"] for t in jaxcomm.metrics()["totals"]}


def compressed(algo, axes, **kw):
    def fn(v, r):
        s, nr = jaxcomm.compressed_allreduce(v[0], r[0], axes, algo, **kw)
        return s[None], nr[None]

    return fn


flat = Mesh(np.asarray(jax.devices()), ("dp",))
hier = Mesh(np.asarray(jax.devices()).reshape(2, -1), HIER)
out = {
    "dense": run(lambda v, r: (jaxcomm.allreduce(v[0], "dp")[None], r), flat, P("dp")),
    # The 16-bit dense allreduce (2 bytes per element; not an algorithm of jaxcomm.cost).
    "dense_bf16": run(
        lambda v, r: (jaxcomm.allreduce(v[0].astype("bfloat16"), "dp").astype(v.dtype)[None], r),
        flat,
        P("dp"),
    ),
    "topk_allgather": run(compressed(jaxcomm.TopKAllgather(0.01), "dp"), flat, P("dp")),
    "gtopk": run(compressed(jaxcomm.GTopK(0.01), "dp"), flat, P("dp")),
    "onebit": run(compressed(jaxcomm.OneBit(), "dp"), flat, P("dp")),
    "threshold": run(compressed(jaxcomm.Threshold(TAU), "dp"), flat, P("dp")),
    "adaptive": run(compressed(jaxcomm.Adaptive(64), "dp"), flat, P("dp")),
}
for name, scheme in (("hier_dense", "multi_leader"), ("hier_dense_leader", "leader")):
    out[name] = run(
        lambda v, r, s=scheme: (
            jaxcomm.allreduce(v[0], HIER, hierarchical=True, hierarchical_scheme=s)[None],
            r,
        ),
        hier,
        P(HIER),
    )
out["hier_onebit"] = run(compressed(jaxcomm.OneBit(), HIER, hierarchical=True), hier, P(HIER))
out["hier_onebit_leader"] = run(
    compressed(jaxcomm.OneBit(), HIER, hierarchical=True, hierarchical_scheme="leader"),
    hier,
    P(HIER),
)
print(json.dumps(out))
