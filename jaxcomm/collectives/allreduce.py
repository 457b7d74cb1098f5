"""Dense allreduce over UCX: ring reduce-scatter + allgather (C++ in ffi/allreduce.cc)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxcomm import _validate
from jaxcomm.collectives._call import collective_call


def allreduce(x: jax.Array, axis_name: str | Sequence[str]) -> jax.Array:
    """Sums ``x`` over the devices of ``axis_name``, like ``lax.psum``, over jaxcomm's UCX ring.

    Must be called inside ``jax.shard_map`` whose mesh spans all ``jax.devices()``. The sum
    is bit-identical on every rank; it may differ from ``lax.psum`` by float rounding (another
    summation order).

    Args:
      x: float32 array of any shape (the same on every rank).
      axis_name: mesh axis name, or a tuple of names reduced jointly.

    Returns:
      The sum over the group, with ``x``'s shape.

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("dp",))
      >>> f = jax.jit(jax.shard_map(lambda v: jaxcomm.allreduce(v, "dp"), mesh=mesh,
      ...                           in_specs=P("dp"), out_specs=P("dp")))
    """
    x = _validate.float32_array(x, "x")
    if x.size == 0:
        return x
    (out,) = collective_call(
        "jaxcomm_allreduce", "jaxcomm.allreduce", axis_name, [x], [(x.shape, jnp.float32)]
    )
    return out
