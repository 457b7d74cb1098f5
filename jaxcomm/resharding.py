"""Per-rank state saved with P ranks, restored onto P' ranks.

A per-rank leaf of an optimizer state (an error-feedback residual, DiLoCo's own parameters
and inner state) is stored as every rank's value stacked along its first dimension
(:func:`jaxcomm.optax.partition_specs`: ``P(axis_name)``), so a checkpoint written by P ranks
holds P rows and a state for P' ranks has P' of them. :func:`plan` says what a restore does
with such a leaf and :func:`convert` does it:

- ``"mean"`` (floating leaves): every new rank starts from the mean of the saved ranks'
  values. For a residual this keeps the update the ranks still owe: the step averages
  ``g_r + e_r`` over the ranks, so the pending part is ``mean_r(e_r)`` before and after. What
  is lost is how it was split among the ranks.
- ``"first"`` (other leaves: step counts, handles of collectives in flight): every new rank
  takes the first saved rank's value (the ranks' counts agree; a handle is replaced when
  the restored step re-sends what was in flight).

:func:`warning` is the one message a restore prints for all the leaves it changed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def ranks_of(leaf: Any) -> int | None:
    """The number of ranks a per-rank leaf is split over (its first dimension's mesh axes),
    None when ``leaf`` (an array or ``jax.ShapeDtypeStruct``) is not split on it."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not len(sharding.spec) or not jnp.ndim(leaf):
        return None
    first = sharding.spec[0]
    if first is None:
        return None
    names = (first,) if isinstance(first, str) else tuple(first)
    return math.prod(int(sharding.mesh.shape[n]) for n in names)


def plan(saved_shape: Sequence[int], saved_dtype: Any, like: Any) -> str | None:
    """What a restore does with a leaf saved as ``saved_shape`` where ``like`` is expected.

    Args:
      saved_shape: the leaf's shape in the checkpoint.
      saved_dtype: its dtype there.
      like: the leaf of the state restored into (``.shape``, ``.dtype``, ``.sharding``).

    Returns:
      ``"mean"`` or ``"first"`` for a per-rank leaf saved by another number of ranks; None
      when the shapes differ otherwise (another model: not a world-size change).

    Example:
      >>> rows = jax.sharding.NamedSharding(mesh, P("dp"))
      >>> like = jax.ShapeDtypeStruct((2 * mesh.size, 3), np.float32, sharding=rows)
      >>> plan((4 * mesh.size, 3), np.float32, like)  # saved by twice as many ranks
      'mean'
      >>> plan((4 * mesh.size, 5), np.float32, like) is None  # another model
      True
    """
    ranks = ranks_of(like)
    saved_shape, shape = tuple(saved_shape), tuple(like.shape)
    if ranks is None or len(saved_shape) != len(shape) or saved_shape[1:] != shape[1:]:
        return None
    rows = shape[0] // ranks  # one rank's first dimension
    if rows == 0 or shape[0] % ranks or saved_shape[0] % rows:
        return None
    return "mean" if jnp.issubdtype(saved_dtype, jnp.floating) else "first"


def world_sizes(saved_shape: Sequence[int], like: Any) -> tuple[int, int]:
    """(ranks that saved the leaf, ranks of ``like``) of a leaf :func:`plan` resizes."""
    ranks = ranks_of(like)
    return saved_shape[0] // (like.shape[0] // ranks), ranks


def convert(saved: jax.Array, like: Any, how: str) -> jax.Array:
    """The leaf for ``like``'s ranks from the restored ``saved`` (:func:`plan`'s ``how``)."""
    ranks = ranks_of(like)
    rows = like.shape[0] // ranks

    def build(x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0] // rows, rows) + x.shape[1:])
        if how == "mean":
            one = jnp.mean(x.astype(jnp.float32), axis=0).astype(like.dtype)
        else:
            one = x[0]
        return jnp.tile(one, (ranks,) + (1,) * (one.ndim - 1))

    return jax.jit(build, out_shardings=like.sharding)(saved)


def replicated(like: Any, shape: Sequence[int], dtype: Any) -> jax.ShapeDtypeStruct:
    """Where a leaf saved by another number of ranks is restored before :func:`convert`: at
    its saved shape, replicated on ``like``'s mesh."""
    sharding = NamedSharding(like.sharding.mesh, PartitionSpec())
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)


def warning(path: str, changed: dict[str, tuple[str, int, int]]) -> str:
    """The one message of a restore onto another world size.

    Args:
      path: the checkpoint.
      changed: leaf name -> (how, saved ranks, new ranks).

    Returns:
      The message: which leaves start from the saved ranks' mean, which from the first
      rank's, and what that loses.
    """
    (_, before, after), *_ = changed.values()
    mean = sorted(n for n, (how, *_) in changed.items() if how == "mean")
    first = sorted(n for n, (how, *_) in changed.items() if how == "first")
    parts = [
        f"{path} was saved by {before} ranks and is restored onto {after}: its per-rank state "
        "cannot be given back rank by rank."
    ]
    if mean:
        parts.append(
            f"{len(mean)} per-rank leaves start on every rank from the mean of the saved "
            "ranks' values, and each rank's own value is lost (an error-feedback residual "
            f"keeps the update the ranks still owe): {', '.join(mean)}."
        )
    if first:
        parts.append(
            f"{len(first)} per-rank integer leaves (counts, handles) take the first saved "
            f"rank's value: {', '.join(first)}."
        )
    return " ".join(parts)
