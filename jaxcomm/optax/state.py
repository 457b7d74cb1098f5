"""The optimizer states of :func:`jaxcomm.optax.allreduce_gradients` and
:func:`jaxcomm.optax.diloco`, and where their leaves live (:func:`partition_specs`).

Saving and restoring them, every rank's shard bit-exact, is :mod:`jaxcomm.checkpoints`
(``save_state``, ``restore_state``, and the numbered checkpoints a restarted run resumes from).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec

from jaxcomm.optax.plan import AxisName


class AllreduceGradientsState(NamedTuple):
    """State of :func:`allreduce_gradients`.

    Attributes:
      count: int32 scalar, the number of updates applied (selects the scheduled density, and
        ends PowerSGD's dense warm-up).
      residuals: error-feedback residuals, a float32 tree of the gradient's structure and
        shapes (``(1,)`` for scalar leaves), different on every rank; ``None`` when dense.
        PowerSGD: each compressed leaf's error (a leaf sent dense has a ``(1,)`` zero).
      shared: state that is identical on every rank, a tree of the gradient's structure, or
        ``None``. PowerSGD: each compressed leaf's warm-start Q, float32 ``(columns, rank)``
        (a leaf sent dense has a ``(1,)`` zero).
    """

    count: jax.Array
    residuals: Any
    shared: Any = None


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`.

    Per-rank fields hold one rank's values with a leading axis of length 1 inside
    ``shard_map`` (so scalar leaves shard too): place them with ``P(axis_name)``, which
    :func:`partition_specs` does; the others are replicated.

    Attributes:
      count: int32 scalar, inner steps taken.
      local: per rank: this rank's parameters, the tree and dtypes of the params.
      inner: per rank: the inner optimizer's state.
      outer: per fragment, the outer optimizer's state over that fragment's float32 leaves.
      residuals: per rank, per fragment: the float32 ``(1, n)`` error-feedback residual of the
        pseudo-gradient; ``None`` for the dense algorithm.
      pending: per rank, per fragment, the outer gradient between its start and its
        application (``delay > 0``): ``(jaxcomm.Pending, Δ)`` (``overlap=True``; Δ, float32
        ``(1, n)``, is kept so that ``restart`` can send it again after a restore) or the
        float32 ``(1, n)`` average (``overlap=False``); ``None`` when ``delay == 0``.
    """

    count: jax.Array
    local: Any
    inner: Any
    outer: tuple
    residuals: tuple | None
    pending: tuple | None


def partition_specs(state: Any, axis_name: AxisName) -> Any:
    """PartitionSpecs for an optimizer state that contains :class:`AllreduceGradientsState` or
    :class:`DiLoCoState`.

    Residual leaves, and DiLoCo's per-rank parameters, inner state and pending outer
    gradients, are per rank and get ``P(axis_name)`` (each rank's value stacked along the
    first dimension); every other leaf (the ``shared`` state included: PowerSGD's Q) is
    replicated, ``P()``.

    Args:
      state: an optimizer state, or its ``jax.eval_shape``.
      axis_name: the axis the residuals are split over (the reducer's ``axis_name``).

    Returns:
      A tree of ``PartitionSpec`` usable as ``shard_map`` in/out specs of the state.

    Example:
      >>> tx = jaxcomm.optax.allreduce_gradients("dp", jaxcomm.GTopK(0.01))
      >>> specs = partition_specs(jax.eval_shape(tx.init, params), "dp")
      >>> specs.residuals["layer0"]["w"] == P("dp")
      True
    """

    def split(tree: Any) -> Any:
        return jax.tree.map(lambda _: PartitionSpec(axis_name), tree)

    def replicated(tree: Any) -> Any:
        return jax.tree.map(lambda _: PartitionSpec(), tree)

    def visit(node: Any) -> Any:
        if isinstance(node, AllreduceGradientsState):
            return AllreduceGradientsState(
                count=PartitionSpec(),
                residuals=split(node.residuals),
                shared=replicated(node.shared),
            )
        if isinstance(node, DiLoCoState):
            return DiLoCoState(
                count=PartitionSpec(),
                local=split(node.local),
                inner=split(node.inner),
                outer=replicated(node.outer),
                residuals=split(node.residuals),
                pending=split(node.pending),
            )
        return PartitionSpec()

    kinds = (AllreduceGradientsState, DiLoCoState)
    return jax.tree.map(visit, state, is_leaf=lambda x: isinstance(x, kinds))
