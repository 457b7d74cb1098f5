"""A launcher job (``job: gpu_world_job:run``) for tests/test_gpu_worlds.py: every collective
once on this rank's devices, on the same inputs in every world, saved for the test to check
against the NumPy references and against a CPU world of as many ranks."""

from __future__ import annotations

import numpy as np
from collectives_harness import make_inputs

N = 1000  # elements per rank: uneven ring slices at P = 3, several per rank
CASES = {
    "dense": None,
    "topk_allgather": ("TopKAllgather", {"density": 0.05}),
    "gtopk": ("GTopK", {"density": 0.05}),
    "onebit": ("OneBit", {"column_size": 64}),
    "threshold": ("Threshold", {"tau": 0.8}),
    "adaptive": ("Adaptive", {"proportion": 4.0, "column_size": 100}),
}
"""Case name -> (jaxcomm class, its parameters); ``dense`` is ``jaxcomm.allreduce``."""


def run(ctx) -> None:
    """Runs every case and writes ``rank<R>.npz``: ``<case>/<world rank>/<output>``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh = jax.make_mesh((jax.device_count(),), ("dp",))
    world = mesh.size
    rank_of = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    xs, rs = make_inputs(world, N, 1), make_inputs(world, N, 2, scale=0.1)

    def shard(rows: np.ndarray) -> jax.Array:
        sharding = NamedSharding(mesh, P("dp"))
        return jax.make_array_from_callback(rows.shape, sharding, lambda idx: rows[idx])

    def smap(fn, n_in: int, n_out: int):
        spec = P("dp")
        out = (spec,) * n_out if n_out > 1 else spec
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * n_in, out_specs=out))

    results: dict[str, np.ndarray] = {}

    def save(case: str, name: str, value: jax.Array) -> None:
        for s in value.addressable_shards:
            results[f"{case}/{rank_of[s.device.id]}/{name}"] = np.asarray(s.data)[0]

    dense = smap(lambda v: jaxcomm.allreduce(v[0], "dp")[None], 1, 1)
    save("dense", "summed", dense(shard(xs)))
    for case, spec in CASES.items():
        if spec is None:
            continue
        algorithm = getattr(jaxcomm, spec[0])(**spec[1])
        step = smap(
            lambda v, r, a=algorithm: tuple(
                o[None] for o in jaxcomm.compressed_allreduce(v[0], r[0], "dp", a)
            ),
            2,
            2,
        )
        summed, residual = step(shard(xs), shard(rs))
        save(case, "summed", summed)
        save(case, "residual", residual)
    np.savez(ctx.run_dir / f"rank{ctx.rank}.npz", **results)
    ctx.print(f"gpu-world: {len(CASES)} collectives on {jax.devices()[0].platform}, world {world}")
