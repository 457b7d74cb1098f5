"""Compressed allreduce with error feedback: TopK-allgather and gTop-k (C++ in ffi/)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _validate
from jaxcomm.collectives._call import collective_call
from jaxcomm.compressors import GTopK, TopKAllgather

_TARGETS = {TopKAllgather: "jaxcomm_topk_allgather", GTopK: "jaxcomm_gtopk"}


def compressed_allreduce(
    x: jax.Array,
    residual: jax.Array,
    axis_name: str | Sequence[str],
    algorithm: TopKAllgather | GTopK,
) -> tuple[jax.Array, jax.Array]:
    """Sparse allreduce of ``x + residual`` with error feedback.

    ``TopKAllgather(density)`` sums every rank's local top-k (O(kP) bytes per rank);
    ``GTopK(density)`` keeps the global top-k through a tree of merges (O(k log P)). Either way
    ``sum_ranks(x + residual) == summed + sum_ranks(new_residual)`` up to float rounding, and
    ``summed`` is bit-identical on every rank.

    Args:
      x: float32 array of any shape (same shape on every rank).
      residual: float32 array of x's shape: this rank's error-feedback state.
      axis_name: mesh axis name (or tuple) to reduce over, inside ``jax.shard_map``.
      algorithm: ``jaxcomm.TopKAllgather(density)`` or ``jaxcomm.GTopK(density)``.

    Returns:
      ``(summed, new_residual)``, both with x's shape.

    Example:
      >>> step = jax.shard_map(
      ...     lambda g, r: jaxcomm.compressed_allreduce(g, r, "dp", jaxcomm.GTopK(0.01)),
      ...     mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P("dp"), P("dp")))
    """
    if type(algorithm) not in _TARGETS:
        raise TypeError(
            "algorithm must be jaxcomm.TopKAllgather(density) or jaxcomm.GTopK(density), got "
            f"{algorithm!r}"
        )
    x = _validate.float32_array(x, "x")
    residual = _validate.float32_array(residual, "residual")
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}; "
            "start from jnp.zeros_like(x)"
        )
    if x.size == 0:
        return x, residual
    n = x.size
    summed, new_residual = collective_call(
        _TARGETS[type(algorithm)],
        "jaxcomm.compressed_allreduce",
        axis_name,
        [x, residual],
        [(x.shape, jnp.float32), (x.shape, jnp.float32)],
        aliases={1: 1},  # residual -> new_residual, in place when the caller donates it
        k=np.int64(algorithm.k(n)),
    )
    return summed, new_residual
