"""What the GPU test modules share: the local GPUs, the skip marks, and sharded runs.

NCCL refuses two ranks on one GPU, so the collective tests run one process over all local GPUs
(P = jax.device_count("gpu")): P = 1 on a one-GPU machine still runs the whole code path.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _gpu_devices() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpu_devices()

# `pytestmark = GPU_MARKS` in a module: gpu-marked, skipped without a GPU.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="needs a CUDA GPU: jax.devices('gpu') found none"),
]


def gpu_mesh() -> jax.sharding.Mesh:
    """All local GPUs on one axis "d"."""
    return jax.sharding.Mesh(np.array(GPUS), ("d",))


def per_rank_data(n: int, seed: int) -> list[np.ndarray]:
    """One standard-normal float32 vector of n elements per GPU rank."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in GPUS]


def run_sharded(fn, *per_rank: list[np.ndarray], mesh: jax.sharding.Mesh | None = None):
    """Runs jit(shard_map(fn)) with rank r (row-major over the mesh axes) holding per_rank[i][r].

    Args:
      fn: the per-rank body (takes and returns arrays of one rank's shape).
      *per_rank: for each argument, the list of its per-rank values.
      mesh: the mesh (default: :func:`gpu_mesh`).

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
