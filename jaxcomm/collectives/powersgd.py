"""PowerSGD over a gradient tree: the leaf-shaped reduction behind
``jaxcomm.optax.allreduce_gradients(axis, jaxcomm.PowerSGD(...))``.

The spec lives in :mod:`jaxcomm.algorithms.powersgd` and its byte and time model in
:mod:`jaxcomm.cost.algorithm_costs.powersgd`; this module is its JAX side, the interface
``Algorithm.leafwise`` names: :func:`init` builds the per-leaf state and :func:`reduce` runs
one step. The steps follow PyTorch DDP's ``powerSGD_hook``
(see :class:`jaxcomm.PowerSGD` for the algorithm and the few differences).

Every compressed leaf's P travels in one ``jaxcomm.allreduce`` call and every Q in one more
(not one call per leaf: the calls' latency, not their bytes, dominates small factors), and the
leaves sent dense in a third; the three calls are chained in program order like every jaxcomm
collective. The dense warm-up (``start_step``) is one ``lax.cond`` on the step count: the
step compiles once and only the taken branch's collectives run, the same branch on every rank
(the count is identical everywhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm import _ordering
from jaxcomm.algorithms.powersgd import PowerSGD, leaf_plan
from jaxcomm.collectives._mesh import group_size
from jaxcomm.collectives.allreduce import allreduce

AxisName = str | tuple[str, ...]
# The thin products run at full float32 precision on every platform (GPUs default to TF32,
# which would make the factors, and the error fed back, differ from the hook's by ~1e-3).
_PRECISION = lax.Precision.HIGHEST
_PLACEHOLDER = (1,)  # the state of a leaf sent dense: one zero, never read


def _plan(shape: Sequence[int], spec: PowerSGD, name: str) -> tuple[int, int, int] | None:
    try:
        return leaf_plan(shape, spec.rank, spec.min_compression_rate, spec.layout)
    except ValueError as e:
        raise ValueError(f"jaxcomm.optax.allreduce_gradients: leaf {name}: {e}") from None


def init(
    leaves: Sequence[Any], spec: PowerSGD, names: Sequence[str]
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The PowerSGD state of gradient leaves shaped like ``leaves``.

    Args:
      leaves: the parameters (or anything with their shapes), in tree order.
      spec: the :class:`jaxcomm.PowerSGD` settings.
      names: each leaf's path, for error messages.

    Returns:
      ``(errors, qs)``, one entry per leaf: a compressed leaf's error (float32, the leaf's
      shape, zero; different on every rank once training runs; a ``(1,)`` zero without
      ``spec.error_feedback``) and its first Q (float32, ``(columns, r)``, :func:`random_q`,
      the same on every rank); a leaf sent dense gets a ``(1,)`` zero for both.

    Raises:
      ValueError: a 0-d leaf (naming it).

    Example:
      >>> errors, qs = init([jnp.zeros((64, 64)), jnp.zeros(64)], PowerSGD(rank=2), ["w", "b"])
      >>> [q.shape for q in qs]
      [(64, 2), (1,)]
    """
    errors, qs = [], []
    for i, (leaf, name) in enumerate(zip(leaves, names, strict=True)):
        plan = _plan(jnp.shape(leaf), spec, name)
        if plan is None:
            errors.append(jnp.zeros(_PLACEHOLDER, jnp.float32))
            qs.append(jnp.zeros(_PLACEHOLDER, jnp.float32))
            continue
        _, columns, r = plan
        shape = jnp.shape(leaf) if spec.error_feedback else _PLACEHOLDER
        errors.append(jnp.zeros(shape, jnp.float32))
        qs.append(random_q(spec, i, columns, r))
    return errors, qs


def random_q(
    spec: PowerSGD, index: int, columns: int, r: int, count: jax.Array | None = None
) -> jax.Array:
    """A Q drawn from the standard normal distribution, the same on every rank.

    The first Q of leaf ``index`` (``count`` None) comes from ``spec.seed`` and the index; the
    new Q of a compressed step without ``warm_start`` also from the step count (identical on
    every rank), so each step draws another one, as the hook does.

    Args:
      spec: the settings (its ``seed``).
      index: the leaf's position in the tree.
      columns, r: the shape of Q.
      count: int32 scalar, the updates applied so far, or None for the first Q.

    Returns:
      float32 ``(columns, r)``.

    Example:
      >>> random_q(PowerSGD(rank=2), 0, 5, 2).shape
      (5, 2)
    """
    key = jax.random.fold_in(jax.random.key(spec.seed), index)
    if count is not None:
        key = jax.random.fold_in(key, count)
    return jax.random.normal(key, (columns, r), jnp.float32)


def orthogonalize(matrix: jax.Array, epsilon: float = 0.0) -> jax.Array:
    """Gram-Schmidt on the columns of a thin matrix, as the hook's ``_orthogonalize``.

    Each column in turn is divided by its norm (plus ``epsilon``) and its projection removed
    from the columns after it (modified Gram-Schmidt). With ``epsilon`` 0, a column of norm
    zero becomes zero (the hook's division would make it NaN).

    Args:
      matrix: float32 ``(rows, r)`` with a small static ``r``.
      epsilon: added to each norm (the hook's ``orthogonalization_epsilon``).

    Returns:
      The orthonormalized matrix, same shape.

    Example:
      >>> q = orthogonalize(jnp.array([[1.0, 1.0], [0.0, 1.0]]))
      >>> q.round(6).tolist()
      [[1.0, 0.0], [0.0, 1.0]]
    """
    columns = [matrix[:, j] for j in range(matrix.shape[1])]
    for i, col in enumerate(columns):
        norm = jnp.sqrt(jnp.sum(col * col))
        if epsilon:
            col = col / (norm + epsilon)
        else:
            col = jnp.where(norm > 0, col / jnp.where(norm > 0, norm, 1.0), 0.0)
        columns[i] = col
        for j in range(i + 1, len(columns)):
            columns[j] = columns[j] - jnp.sum(col * columns[j]) * col
    return jnp.stack(columns, axis=1)


def _allreduce_all(
    xs: list[jax.Array], dtype: Any, axis_name: AxisName, hierarchical: bool
) -> list[jax.Array]:
    """Sums every array of ``xs`` over the axis in one call (raveled, concatenated in
    ``dtype``); returns them with their shapes, in ``dtype``."""
    flat = [jnp.ravel(x).astype(dtype) for x in xs]
    total = sum(f.size for f in flat)
    if total == 0:
        return [f.reshape(jnp.shape(x)) for f, x in zip(flat, xs, strict=True)]
    joined = jnp.concatenate(flat) if len(flat) > 1 else flat[0]
    summed = allreduce(joined, axis_name, hierarchical=hierarchical)
    out, offset = [], 0
    for f, x in zip(flat, xs, strict=True):
        out.append(summed[offset : offset + f.size].reshape(jnp.shape(x)))
        offset += f.size
    return out


def _dense_step(
    leaves: list[jax.Array],
    axis_name: AxisName,
    size: int,
    mean: bool,
    hierarchical: bool,
) -> list[jax.Array]:
    """Every leaf averaged (or summed) densely in one call, in the leaves' common dtype."""
    if not leaves:
        return []
    wire = jnp.result_type(*leaves)
    sums = _allreduce_all(leaves, wire, axis_name, hierarchical)
    pairs = zip(sums, leaves, strict=True)
    return [(s * (1.0 / size) if mean else s).astype(g.dtype) for s, g in pairs]


def _compressed_step(
    leaves: list[jax.Array],
    errors: list[jax.Array],
    qs: list[jax.Array],
    plans: list[tuple[int, int, int] | None],
    spec: PowerSGD,
    count: jax.Array,
    axis_name: AxisName,
    size: int,
    mean: bool,
    hierarchical: bool,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    """One PowerSGD step: the hook's steps I-III over every leaf."""
    outs: list[jax.Array] = list(leaves)
    new_errors, new_qs = list(errors), list(qs)
    compressed = [i for i, p in enumerate(plans) if p is not None]
    dense = [i for i, p in enumerate(plans) if p is None]
    # The leaves not worth compressing: one dense call, as for the warm-up.
    for i, out in zip(
        dense,
        _dense_step([leaves[i] for i in dense], axis_name, size, mean, hierarchical),
        strict=True,
    ):
        outs[i] = out
    if not compressed:
        return outs, new_errors, new_qs
    eps = spec.orthogonalization_epsilon
    # Error feedback: M = g + e, viewed as (rows, columns).
    ms = {}
    for i in compressed:
        rows, columns, _ = plans[i]
        m = leaves[i].astype(jnp.float32)
        ms[i] = (m + errors[i] if spec.error_feedback else m).reshape(rows, columns)
    # P = M Q with the warm-started (or freshly drawn) Q orthogonalized first; all Ps in one
    # allreduce (summed: they are orthogonalized next, so the scale does not matter).
    starts = {i: qs[i] for i in compressed}
    if not spec.warm_start:
        starts = {i: random_q(spec, i, *plans[i][1:], count) for i in compressed}
    ps = [
        jnp.matmul(ms[i], orthogonalize(starts[i], eps), precision=_PRECISION) for i in compressed
    ]
    ps = _allreduce_all(ps, jnp.float32, axis_name, hierarchical)
    ps = [orthogonalize(p, eps) for p in ps]
    # Q = Mᵀ P; all Qs in one allreduce, averaged: the warm start of the next step.
    qs_local = [
        jnp.matmul(ms[i].T, p, precision=_PRECISION) for i, p in zip(compressed, ps, strict=True)
    ]
    q_sums = _allreduce_all(qs_local, jnp.float32, axis_name, hierarchical)
    for i, p, q_sum in zip(compressed, ps, q_sums, strict=True):
        q = q_sum * (1.0 / size)
        approx = jnp.matmul(p, q.T, precision=_PRECISION)  # the average of the ranks' M
        shape, dtype = jnp.shape(leaves[i]), leaves[i].dtype
        average = approx.reshape(shape).astype(dtype)
        # What this rank did not get across, including the rounding to the gradient's dtype.
        if spec.error_feedback:
            new_errors[i] = ms[i].reshape(shape) - average.astype(jnp.float32)
        new_qs[i] = q
        outs[i] = average if mean else (approx * size).reshape(shape).astype(dtype)
    return outs, new_errors, new_qs


def reduce(
    leaves: Sequence[jax.Array],
    errors: Sequence[jax.Array],
    qs: Sequence[jax.Array],
    count: jax.Array,
    axis_name: AxisName,
    spec: PowerSGD,
    *,
    names: Sequence[str],
    mean: bool = True,
    hierarchical: bool = False,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    """One step of PowerSGD over gradient leaves, inside ``jax.shard_map``.

    Before ``spec.start_step`` updates (``count``) every leaf is averaged densely in one
    call and the state is left as it is; from then on the compressed leaves go as P and Q
    factors (one call each) and the others densely (one call).

    Args:
      leaves: this rank's gradient leaves (float32, bfloat16 or float16), in tree order.
      errors: the error of each leaf (:func:`init`).
      qs: the warm-start Q of each leaf (:func:`init`).
      count: int32 scalar, the updates applied so far.
      axis_name: the data-parallel axis (or axes) to reduce over.
      spec: the :class:`jaxcomm.PowerSGD` settings.
      names: each leaf's path, for error messages.
      mean: divide the sum by the number of ranks.
      hierarchical: each allreduce is hierarchical over ``(node, local)`` axes
        (``jaxcomm.allreduce(..., hierarchical=True)``).

    Returns:
      ``(outputs, errors, qs)``: the averaged (or summed) leaves in their dtypes, identical
      on every rank, and the new state.

    Raises:
      ValueError: a 0-d leaf (naming it).

    Example:
      A rank-1 gradient goes through rank-1 factors exactly:

      >>> spec = jaxcomm.PowerSGD(rank=1, start_step=0)
      >>> grads = [jnp.ones((16, 16))]
      >>> errors, qs = init(grads, spec, ["w"])
      >>> step = jax.jit(jax.shard_map(
      ...     lambda g, e, q: reduce(g, e, q, jnp.int32(0), "dp", spec, names=["w"]),
      ...     mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
      >>> outs, errors, qs = step(grads, errors, qs)
      >>> bool(jnp.allclose(outs[0], 1.0, atol=1e-5)), bool(jnp.abs(errors[0]).max() < 1e-5)
      (True, True)
    """
    leaves, errors, qs = list(leaves), list(errors), list(qs)
    plans = [_plan(jnp.shape(g), spec, n) for g, n in zip(leaves, names, strict=True)]
    size = group_size(axis_name)

    def compressed(token: jax.Array, leaves: list, errors: list, qs: list) -> tuple:
        _ordering.token_out(token)
        out = _compressed_step(
            leaves, errors, qs, plans, spec, count, axis_name, size, mean, hierarchical
        )
        return _ordering.token_in(), out

    if spec.start_step == 0:
        return _compressed_step(
            leaves, errors, qs, plans, spec, count, axis_name, size, mean, hierarchical
        )

    def warmup(token: jax.Array, leaves: list, errors: list, qs: list) -> tuple:
        # The hook's vanilla allreduce: no error is accumulated before compression starts.
        _ordering.token_out(token)
        out = _dense_step(leaves, axis_name, size, mean, hierarchical)
        return _ordering.token_in(), (out, errors, qs)

    # The ordering token goes through the branches so their collectives stay chained with the
    # step's other jaxcomm calls (as allreduce_gradients' density schedule does).
    token, (outs, errors, qs) = lax.cond(
        count >= spec.start_step, compressed, warmup, _ordering.token_in(), leaves, errors, qs
    )
    _ordering.token_out(token)
    return list(outs), list(errors), list(qs)
