"""GPU collectives (NCCL on XLA's stream, ffi/cuda/) against lax.psum and the NumPy references
of the whole algorithms (tests/reference.py), the same cases as the CPU collective suites.

Every test runs one process over all local GPUs (P = jax.device_count("gpu")): NCCL refuses two
ranks on one GPU, so a one-GPU machine checks P = 1 (the full code path: group discovery,
communicator, kernels, NCCL calls with one rank) and a multi-GPU machine checks the schedules.
Skipped without a GPU.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm


def _gpu_devices() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpu_devices()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="needs a CUDA GPU: jax.devices('gpu') found none"),
]


def gpu_mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(GPUS), ("d",))


def per_rank_data(n: int, seed: int) -> list[np.ndarray]:
    """One float32 vector per GPU rank."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in GPUS]


def run_sharded(fn, *per_rank: list[np.ndarray], mesh=None):
    """Runs jit(shard_map(fn)) with rank r holding per_rank[i][r]; returns per-rank NumPy lists.

    Args:
      fn: the per-rank body (takes and returns arrays of one rank's shape).
      *per_rank: for each argument, the list of its per-rank values.
      mesh: the mesh (default: all GPUs on axis "d").

    Returns:
      For each output of `fn`, the list of its per-rank values.
    """
    mesh = mesh or gpu_mesh()
    spec = P(mesh.axis_names)
    args = [
        jax.device_put(np.concatenate(values), NamedSharding(mesh, spec)) for values in per_rank
    ]
    f = jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec, check_vma=False)
    )
    outs = f(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ranks = int(np.prod(mesh.devices.shape))
    return [np.split(np.asarray(o), ranks) for o in outs]


# ---- dense ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 1000, 2**20 + 3])
def test_dense_allreduce_matches_psum(n):
    xs = per_rank_data(n, 10)
    (got,) = run_sharded(lambda v: jaxcomm.allreduce(v, "d"), xs)
    (want,) = run_sharded(lambda v: jax.lax.psum(v, "d"), xs)
    for g, w in zip(got, want, strict=True):
        # Both sum in float32 over the same ranks; the order may differ for > 2 ranks.
        np.testing.assert_allclose(g, w, rtol=1e-6 * len(GPUS), atol=1e-6)
    for g in got[1:]:
        np.testing.assert_array_equal(g, got[0])  # NCCL gives every rank the same bits


def test_dense_allreduce_records_metrics():
    jaxcomm.reset_metrics()
    run_sharded(lambda v: jaxcomm.allreduce(v, "d"), per_rank_data(4096, 1))
    rows = [r for r in jaxcomm.metrics()["totals"] if r["algorithm"] == "nccl"]
    assert rows and all(r["calls"] >= 1 for r in rows)
