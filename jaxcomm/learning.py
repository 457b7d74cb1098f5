"""A gradient reduction whose algorithm is chosen while training, over one shared state.

:func:`learned_gradients` compiles every candidate reduction ("arm") as a branch of one
``lax.switch`` indexed by an arm number in the state, which the training loop sets between
steps (:func:`set_arm`) as a :class:`jaxcomm.cost.learn.Learner` decides; or, with ``fixed``,
one arm alone over the same state, so that a loop may run each arm by a program of its own.
The arm must be the same on every rank: the learner decides from losses averaged over the
ranks and seconds agreed over them.

Every arm shares one set of error-feedback residuals: a compressor adds them to its gradient
and keeps what it did not send; the dense arm sends gradient and residuals and leaves zero.
So for every rank, at every step and across any switch,
``sum of gradients == sum of what was sent + residual``: a switch loses no signal.

Example:
  >>> tx = learned_gradients("dp", [None, jaxcomm.GTopK(0.01)])
  >>> state = tx.init(params)  # doctest: +SKIP
  >>> state = set_arm(state, 1, NamedSharding(mesh, P()))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import _ordering
from jaxcomm import optax as jc_optax

__all__ = ["LearnedState", "learned_gradients", "set_arm"]


class LearnedState(NamedTuple):
    """State of :func:`learned_gradients`.

    Attributes:
      arm: int32 scalar, the branch the next update runs (the same on every rank).
      inner: the :class:`jaxcomm.optax.AllreduceGradientsState` every arm shares (the update
        count and the per-rank residuals).
    """

    arm: jax.Array
    inner: Any


def learned_gradients(
    axis_name: str | tuple[str, ...],
    arms: Sequence[Any],
    fixed: int | None = None,
    flush: bool = True,
    **options: Any,
) -> optax.GradientTransformation:
    """``jaxcomm.optax.allreduce_gradients`` over every one of ``arms``, the one that runs
    chosen by the state's ``arm``.

    Args:
      axis_name: the data-parallel axis.
      arms: ``allreduce_gradients`` algorithms: ``None`` (dense) first, then compressors with
        error feedback or :class:`jaxcomm.cost.Auto` (not a leaf-shaped one such as
        PowerSGD, whose state differs).
      fixed: compile arm ``fixed`` alone, whatever the state's ``arm`` says: the same state,
        without the ``lax.switch``. The examples' loop runs every arm so, one program each
        (on XLA:CPU a switched step ran slower than the same reduction alone:
        ``benchmarks/arm_step.py``).
      flush: with ``fixed=0`` (dense), ``False`` passes the residuals on untouched rather
        than sending them with the gradient and zeroing them: for a step that follows a
        dense one, whose residuals are zero, it spares two passes over them.
      **options: the other arguments of ``allreduce_gradients`` (``bucket_size``,
        ``dense_dtype``, ``mean``, ...), the same for every arm.

    Returns:
      An ``optax.GradientTransformation`` with a :class:`LearnedState`; ``partition_specs``
      of :mod:`jaxcomm.optax` places it.

    Raises:
      ValueError: no arm, a first arm that is not dense, or no arm with residuals.
    """
    arms = list(arms)
    if len(arms) < 1 or arms[0] is not None or any(a is None for a in arms[1:]):
        raise ValueError(
            f"learned_gradients: arms must be None (dense) first, then compressors; got {arms!r}"
        )
    if fixed is not None and not 0 <= fixed < len(arms):
        raise ValueError(f"learned_gradients: fixed must index arms (0 to {len(arms) - 1})")
    if not flush and fixed != 0:
        raise ValueError("learned_gradients: flush=False needs fixed=0 (dense alone)")
    txs = [jc_optax.allreduce_gradients(axis_name, a, **options) for a in arms]
    # The residuals every arm shares: any compressor's state has them (dense has none).
    carrier = txs[1] if len(txs) > 1 else jc_optax.allreduce_gradients(axis_name, "auto")

    def init_fn(params: Any) -> LearnedState:
        return LearnedState(jnp.zeros((), jnp.int32), carrier.init(params))

    def branch(k: int) -> Any:
        def run(token: jax.Array, updates: Any, inner: Any, params: Any) -> tuple:
            _ordering.token_out(token)
            if arms[k] is None:  # dense: the residuals go with the gradient, unless zero
                sent, left = updates, inner.residuals  # dense after dense (not flush)
                if flush:
                    sent = jax.tree.map(_plus, updates, inner.residuals)
                    left = jax.tree.map(jnp.zeros_like, inner.residuals)
                dense = jc_optax.AllreduceGradientsState(inner.count, None)
                out, state = txs[k].update(sent, dense, params)
                new_inner = jc_optax.AllreduceGradientsState(state.count, left)
            else:
                out, new_inner = txs[k].update(updates, inner, params)
            return _ordering.token_in(), out, new_inner

        return run

    def update_fn(updates: Any, state: LearnedState, params: Any = None) -> tuple:
        operands = (_ordering.token_in(), updates, state.inner, params)
        if fixed is not None:
            token, out, inner = branch(fixed)(*operands)
        else:
            token, out, inner = lax.switch(
                state.arm, [branch(k) for k in range(len(arms))], *operands
            )
        _ordering.token_out(token)
        return out, LearnedState(state.arm, inner)

    return optax.GradientTransformation(init_fn, update_fn)


def _plus(g: jax.Array, r: jax.Array) -> jax.Array:
    """``g + r`` summed in float32, in ``g``'s dtype (``r``: the flat residual)."""
    return (g.astype(jnp.float32) + r.reshape(jnp.shape(g))).astype(g.dtype)


def set_arm(state: Any, arm: int, sharding: jax.sharding.Sharding) -> Any:
    """``state`` (an optimizer state containing a :class:`LearnedState`) with every learned
    reduction's next arm set to ``arm``; outside the jitted step, the same on every process.

    Args:
      state: the optimizer state (placed on the mesh).
      arm: the branch index (its position in ``arms``).
      sharding: a replicated sharding of the mesh, e.g. ``NamedSharding(mesh, P())``.

    Returns:
      The state with the new arm.
    """
    value = jax.make_array_from_process_local_data(sharding, np.asarray(arm, np.int32))

    def visit(node: Any) -> Any:
        return node._replace(arm=value) if isinstance(node, LearnedState) else node

    return jax.tree.map(visit, state, is_leaf=lambda n: isinstance(n, LearnedState))
