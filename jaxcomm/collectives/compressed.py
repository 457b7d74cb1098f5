"""Compressed allreduce with error feedback (C++ in ffi/): TopK-allgather and gTop-k, and the
quantized allreduce of one-bit, threshold, adaptive and block quantization (flat or
hierarchical)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _ordering, _validate, algorithms
from jaxcomm.algorithms.adaptive import Adaptive
from jaxcomm.algorithms.blockquant import BlockQuant
from jaxcomm.algorithms.gtopk import GTopK
from jaxcomm.algorithms.onebit import OneBit
from jaxcomm.algorithms.threshold import Threshold
from jaxcomm.algorithms.topk_allgather import TopKAllgather
from jaxcomm.collectives import _attributes, _mesh
from jaxcomm.collectives._call import DeferDone, threaded_call


def compressed_allreduce(
    x: jax.Array,
    residual: jax.Array,
    axis_name: str | Sequence[str],
    algorithm: TopKAllgather | GTopK | OneBit | Threshold | Adaptive | BlockQuant,
    hierarchical: bool = False,
    hierarchical_scheme: str = "multi_leader",
    after: Any = None,
    step: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Compressed allreduce of ``x + residual`` with error feedback.

    ``TopKAllgather(density)`` sums every rank's local top-k (O(kP) bytes per rank);
    ``GTopK(density)`` keeps the global top-k through a tree of merges (O(k log P)). Either way
    ``sum_ranks(x + residual) == summed + sum_ranks(new_residual)`` up to float rounding, and
    ``summed`` is bit-identical on every rank.

    ``OneBit()``, ``Threshold(tau)`` and ``Adaptive(proportion)`` run the quantized allreduce of
    Dryden et al. (2016, §3.4): the vector is cut into P slices at multiples of the compressor's
    ``column_size`` (any element for Threshold) so no column straddles two slices; each rank
    quantizes every slice and sends it to the slice's owner, which dequantizes the P
    contributions in rank order, sums and requantizes them (its requantization error goes into
    its own ``new_residual``); a ring allgather of the quantized sums (``used`` words only)
    follows and every rank decodes them. With ``hierarchical=True`` and
    ``axis_name=(node_axis, local_axis)`` the sum is reduced densely inside each node, only the
    inter-node allreduce is quantized, and the result is shared inside the node.

    ``BlockQuant(bits, block)`` runs the same quantized allreduce with int8 or int4 codes and
    a float32 scale per block; its stochastic rounding draws from ``(seed, step, rank,
    element index)``, so pass the training step as ``step`` (``jaxcomm.optax`` does). With
    ``BlockQuant(error_feedback=False)`` the residual is ignored and ``new_residual`` is zero.

    bfloat16 / float16 ``x``: encoded from float32 (``x`` is widened exactly), the residual
    stays float32, and ``summed`` comes back in ``x``'s dtype. The rounding of the float32
    sum to 16 bits is error-fed too: every rank adds 1/P of it to its residual, so the
    conservation identity still holds (up to float32 rounding).

    Args:
      x: float32, bfloat16 or float16 array of any shape (same shape on every rank).
      residual: float32 array of x's shape: this rank's error-feedback state (float32 for
        16-bit x too).
      axis_name: mesh axis name (or tuple) to reduce over, inside ``jax.shard_map``; with
        ``hierarchical=True``: ``(node_axis, local_axis)``.
      algorithm: ``jaxcomm.TopKAllgather(density)``, ``jaxcomm.GTopK(density)``,
        ``jaxcomm.OneBit()``, ``jaxcomm.Threshold(tau)``, ``jaxcomm.Adaptive(proportion)`` or
        ``jaxcomm.BlockQuant(bits, block)``.
      hierarchical: two-level allreduce over (node, local) axes (quantizers only).
      hierarchical_scheme: ``"multi_leader"`` (default) or ``"leader"``; see
        :func:`jaxcomm.allreduce`.
      after: arrays (any pytree) to compute while the collective is on the wire; see
        :func:`jaxcomm.allreduce`.
      step: int32 scalar (or int), the training step of ``BlockQuant``'s stochastic rounding
        (None: 0); the other algorithms ignore it.

    Returns:
      ``(summed, new_residual)``, both with x's shape; ``summed`` in x's dtype,
      ``new_residual`` float32.

    Raises:
      TypeError: an unknown algorithm, or a leaf-shaped one (``jaxcomm.PowerSGD``: it runs in
        ``jaxcomm.optax.allreduce_gradients``).
      ValueError: bad shapes, an axis the mesh does not have, or ``hierarchical=True`` with
        other than two axes or with a sparse algorithm.

    Example:
      >>> step = jax.shard_map(
      ...     lambda g, r: jaxcomm.compressed_allreduce(g, r, "dp", jaxcomm.GTopK(0.01)),
      ...     mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P("dp"), P("dp")))
    """
    record = algorithms.of(algorithm)  # TypeError naming the known specs
    if record.leafwise is not None:
        raise TypeError(
            f"{algorithm!r} compresses each gradient leaf by its shape, not a flat vector: use "
            f"jaxcomm.optax.allreduce_gradients(axis_name, {type(algorithm).__name__}(...))"
        )
    if not record.residual or "flat" not in record.targets:
        raise TypeError(f"algorithm {algorithm!r} is not a compressed allreduce")
    if hierarchical and "hierarchical" not in record.targets:
        with_form = [a.spec.__name__ for a in algorithms.registered() if a.spec and a.hierarchical]
        raise ValueError(f"hierarchical=True supports {', '.join(with_form)}, not {algorithm!r}")
    dtype = _validate.float_array(x, "x").dtype
    x, residual = _validate.residual_like(x, residual)
    if dtype != jnp.float32 and isinstance(after, DeferDone):
        after.note(False)  # the rounding below reads the sum: not deferrable
        after = None
    summed, new_residual = _compressed_f32(
        x, residual, axis_name, algorithm, record, hierarchical, hierarchical_scheme, after, step
    )
    if dtype == jnp.float32:
        return summed, new_residual
    if not getattr(algorithm, "error_feedback", True):
        return summed.astype(dtype), new_residual  # nothing is fed back
    rounded = summed.astype(dtype)
    # Error feedback of the final rounding: the P ranks' residuals together keep what
    # rounding dropped from the (identical) sum.
    size = _mesh.resolve(axis_name, "jaxcomm.compressed_allreduce").group_size
    lost = (summed - rounded.astype(jnp.float32)) * np.float32(1.0 / size)
    return rounded, new_residual + lost


def _compressed_f32(
    x: jax.Array,
    residual: jax.Array,
    axis_name: str | Sequence[str],
    algorithm: Any,
    record: algorithms.Algorithm,
    hierarchical: bool,
    hierarchical_scheme: str,
    after: Any,
    step: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The float32 collective call of :func:`compressed_allreduce` (arguments checked)."""
    api = "jaxcomm.compressed_allreduce"
    target = record.targets["hierarchical" if hierarchical else "flat"]
    attrs = dict(record.attributes(algorithm, x.size)) if record.attributes else {}
    if hierarchical:
        attrs.update(_attributes.hierarchical_attributes(axis_name, hierarchical_scheme, api))
    if x.size == 0:
        return x, residual
    operands = [x, residual]
    if record.stepped:  # the step operand of a counter-based stochastic rounding
        operands.append(_validate.step_operand(step, api))
    (summed, new_residual), token = threaded_call(
        _ordering.token_in(),
        target,
        api,
        axis_name,
        operands,
        [(x.shape, jnp.float32), (x.shape, jnp.float32)],
        # residual -> new_residual, in place when the caller donates it; the handlers read
        # each residual element before writing it (kernels may alias).
        aliases={1: 1},
        after=after,
        **attrs,
    )
    _ordering.token_out(token)
    return summed, new_residual
