"""Dense allreduce over UCX: ring reduce-scatter + allgather (C++ in ffi/allreduce.cc), and the
hierarchical variant over a (node, local) mesh (ffi/quantized_allreduce.cc)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm import _validate
from jaxcomm.collectives import _attributes, _mesh
from jaxcomm.collectives._call import collective_call

# 16-bit dense allreduce targets (ffi/allreduce_half.cc): 2 bytes per element on the wire,
# float32 sums rounded once. CPU only; GPU meshes widen to float32 and use NCCL.
_HALF_TARGETS = {
    jnp.dtype(jnp.bfloat16): "jaxcomm_allreduce_bf16",
    jnp.dtype(jnp.float16): "jaxcomm_allreduce_f16",
}


def allreduce(
    x: jax.Array,
    axis_name: str | Sequence[str],
    hierarchical: bool = False,
    hierarchical_scheme: str = "multi_leader",
    after: Any = None,
) -> jax.Array:
    """Sums ``x`` over the devices of ``axis_name``, like ``lax.psum``, over jaxcomm's UCX ring.

    Must be called inside ``jax.shard_map`` whose mesh spans all ``jax.devices()``. The sum
    is bit-identical on every rank; it may differ from ``lax.psum`` by float rounding (another
    summation order).

    bfloat16 and float16 inputs travel as 16-bit words (half the bytes of float32) and are
    summed in float32: each rank sends its 16-bit chunk straight to the chunk's owner, which
    adds the P contributions in float32 and rounds once, then a ring allgather shares the
    rounded chunks. The result has ``x``'s dtype and is the float32 sum rounded once (a
    16-bit ``lax.psum`` may round at every step). ``hierarchical=True`` and GPU meshes widen
    16-bit inputs to float32 for the transfer and round the result back.

    Args:
      x: float32, bfloat16 or float16 array of any shape (the same on every rank).
      axis_name: mesh axis name, or a tuple of names reduced jointly. With
        ``hierarchical=True``: ``(node_axis, local_axis)``, e.g. ``("node", "local")``.
      hierarchical: reduce inside each node over ``local_axis`` first, allreduce across nodes
        over ``node_axis``, then share the result inside the node (on CPU a process is a node
        and its devices are its local ranks).
      hierarchical_scheme: ``"multi_leader"`` (default: every local rank allreduces 1/L of the
        vector across nodes, after an intra-node reduce-scatter) or ``"leader"`` (local rank 0
        alone talks to the other nodes, then sends the sum to its node).
      after: arrays (any pytree) to compute while the allreduce is on the wire. The call is
        then split in two: the first half starts the allreduce on jaxcomm's engine and
        returns, the second waits for it and is scheduled after ``after`` exists, so XLA runs
        the computation of ``after`` in between. In a training step, pass the gradient that
        backward produces last (``jaxcomm.optax.allreduce_gradients`` does this for its
        buckets). On GPU meshes the start runs NCCL on jaxcomm's own CUDA stream behind an
        event and the done makes XLA's stream wait for it; the hierarchical GPU allreduce is
        not split (``after`` is then ignored).

    Returns:
      The sum over the group, with ``x``'s shape.

    Raises:
      ValueError: an axis the mesh does not have, or ``hierarchical=True`` with other than two
        axes.

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("dp",))
      >>> f = jax.jit(jax.shard_map(lambda v: jaxcomm.allreduce(v, "dp"), mesh=mesh,
      ...                           in_specs=P("dp"), out_specs=P("dp")))
      >>> v = jax.device_put(jnp.ones(jax.device_count()), jax.sharding.NamedSharding(mesh, P("dp")))
      >>> f(v).tolist() == [float(jax.device_count())] * jax.device_count()
      True

      Overlapping the last layer's gradient allreduce with the rest of backward (``g_last``
      and ``g_first`` from one ``jax.grad``):

      >>> g_last = jaxcomm.allreduce(g_last, "dp", after=g_first)  # doctest: +SKIP
    """
    x = _validate.float_array(x, "x")
    if x.dtype != jnp.float32:
        if x.size == 0:
            return x
        if hierarchical or _mesh.resolve(axis_name, "jaxcomm.allreduce").platform != "cpu":
            wide = allreduce(
                x.astype(jnp.float32), axis_name, hierarchical, hierarchical_scheme, after
            )
            return wide.astype(x.dtype)
        target = _HALF_TARGETS[jnp.dtype(x.dtype)]
        (out,) = collective_call(
            target, "jaxcomm.allreduce", axis_name, [x], [(x.shape, x.dtype)], after=after
        )
        return out
    target, attrs = "jaxcomm_allreduce", {}
    if hierarchical:
        target = "jaxcomm_hierarchical_allreduce"
        attrs = _attributes.hierarchical_attributes(
            axis_name, hierarchical_scheme, "jaxcomm.allreduce"
        )
    if x.size == 0:
        return x
    (out,) = collective_call(
        target, "jaxcomm.allreduce", axis_name, [x], [(x.shape, jnp.float32)], after=after, **attrs
    )
    return out
