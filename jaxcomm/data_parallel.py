"""A data-parallel training step in one call, from a loss function and an Optax optimizer.

:func:`data_parallel_step` builds what README's long form writes by hand: the per-rank step
inside ``jax.shard_map`` (``check_vma=False``: jaxcomm's sums are identical on every rank but
typed as varying), the optimizer state's partition specs and placement
(:func:`jaxcomm.optax.partition_specs`: residuals per rank, the rest replicated), the pacing
(:func:`jaxcomm.paced`) and the global mean of the loss and metrics. The caller keeps the
style JAX documents for ``jax.jit``: global arrays, the batch a ``NamedSharding`` over the
data-parallel axis, the parameters replicated.

The optimizer state may be what ``optimizer.init(params)`` returns, unplaced: the first call
places it (each rank starts from the same residuals) and, when ``algorithm=`` inserted the
reduction, adds the reduction's state in front of it. Later calls take the state the previous
call returned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcomm import optax as jc_optax
from jaxcomm.collectives import allreduce
from jaxcomm.pacing import DEFAULT_MAX_IN_FLIGHT, paced

AxisName = str | tuple[str, ...]
_NO_ALGORITHM: Any = object()  # algorithm= not given: the optimizer brings its own reduction


def _has_reduction(abstract_state: Any) -> bool:
    kinds = (jc_optax.AllreduceGradientsState,)
    leaves = jax.tree.leaves(abstract_state, is_leaf=lambda x: isinstance(x, kinds))
    return any(isinstance(x, kinds) for x in leaves)


def _as_transformation(optimizer: Any) -> optax.GradientTransformation:
    # optax.MultiSteps is not a GradientTransformation, and optax.chain unpacks its arguments.
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return optax.GradientTransformation(optimizer.init, optimizer.update)
    raise TypeError(
        "data_parallel_step: optimizer must be an optax.GradientTransformation (e.g. "
        "optax.adam(1e-3), optax.MultiSteps(...)) or jaxcomm.optax.diloco(...), got "
        f"{type(optimizer).__name__}"
    )


class DataParallelStep:
    """The step :func:`data_parallel_step` returns; see there.

    Attributes:
      mesh: the device mesh.
      axis_name: the data-parallel axis (or axes) the batch is split over.
      optimizer: the whole transformation the step applies (with ``algorithm=``: the
        reduction chained in front of the given optimizer). ``None`` for DiLoCo.
      diloco: the :class:`jaxcomm.optax.DiLoCo` it runs, or ``None``.
      traces: how many times the per-rank step was traced (compilations).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: Any,
        mesh: Mesh,
        axis_name: AxisName,
        algorithm: Any,
        has_aux: bool,
        average_metrics: bool,
        donate: bool,
        max_in_flight: int,
    ) -> None:
        self.mesh, self.axis_name = mesh, axis_name
        self.traces = 0
        self._loss_fn, self._has_aux = loss_fn, bool(has_aux)
        self._average = bool(average_metrics)
        self._donate = bool(donate)
        self.diloco = optimizer if isinstance(optimizer, jc_optax.DiLoCo) else None
        self._given: optax.GradientTransformation | None = None  # algorithm=: the user's part
        self.optimizer: optax.GradientTransformation | None = None
        if self.diloco is not None:
            if algorithm is not _NO_ALGORITHM:
                raise TypeError(
                    "data_parallel_step: DiLoCo takes its algorithm itself "
                    "(jaxcomm.optax.diloco(..., algorithm=...)); drop algorithm="
                )
        elif algorithm is _NO_ALGORITHM:
            self.optimizer = _as_transformation(optimizer)
        else:
            self._given = _as_transformation(optimizer)
            self._reducer = jc_optax.allreduce_gradients(axis_name, algorithm)
            self.optimizer = optax.chain(self._reducer, self._given)
        self._checked = False
        self._jitted: Any = None
        self._specs: Any = None
        self._last: Any = None  # the first leaves of the last outputs (already placed)
        self._paced = paced(self._run, max_in_flight)

    # ---- the state -------------------------------------------------------------------------

    def _init(self, params: Any) -> Any:
        return self.diloco.init(params) if self.diloco is not None else self.optimizer.init(params)

    def _check(self, params: Any) -> None:
        """Once: the optimizer reduces the gradient exactly once."""
        if self._checked or self.diloco is not None:
            return
        has = _has_reduction(jax.eval_shape(self._init, params))
        if self._given is None and not has:
            raise ValueError(
                "data_parallel_step: the optimizer does not average gradients over "
                f"{self.axis_name!r}; pass algorithm=None (dense), algorithm='auto' or an "
                "algorithm such as jaxcomm.GTopK(0.01), or chain "
                "jaxcomm.optax.allreduce_gradients(...) in front of it"
            )
        if self._given is not None and _has_reduction(jax.eval_shape(self._given.init, params)):
            raise ValueError(
                "data_parallel_step: the optimizer already holds "
                "jaxcomm.optax.allreduce_gradients, and algorithm= adds another; drop one"
            )
        self._checked = True

    def state_specs(self, opt_state: Any) -> Any:
        """The ``PartitionSpec`` of every leaf of a placed optimizer state
        (:func:`jaxcomm.optax.partition_specs`)."""
        return jc_optax.partition_specs(opt_state, self.axis_name)

    def _shardings(self, specs: Any) -> Any:
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)

    def _per_rank_call(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Any:
        return jax.jit(
            jax.shard_map(
                fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )
        )

    def init(self, params: Any) -> Any:
        """The optimizer state of ``params``, placed on the mesh (residuals per rank).

        Args:
          params: the parameters (any placement; the same on every process).

        Returns:
          The state, as the step takes and returns it.
        """
        self._check(params)
        params = self.replicate(params)
        specs = self.state_specs(jax.eval_shape(self._init, params))
        return self._per_rank_call(self._init, PartitionSpec(), specs)(params)

    def replicate(self, params: Any) -> Any:
        """``params`` replicated on every device of the mesh."""
        return jax.device_put(params, NamedSharding(self.mesh, PartitionSpec()))

    def place(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` placed as the step takes them.

        ``opt_state`` may be placed already, or be an unplaced ``optimizer.init(params)``
        (with ``algorithm=``: of the optimizer given), which every rank then starts from.
        """
        self._check(params)
        params = self.replicate(params)
        local = jax.eval_shape(self._init, params)
        specs = self.state_specs(local)
        if self._given is not None and jax.tree.structure(opt_state) != jax.tree.structure(local):
            given = jax.tree.structure(jax.eval_shape(self._given.init, params))
            if jax.tree.structure(opt_state) != given:
                raise ValueError(
                    "data_parallel_step: opt_state is neither optimizer.init(params) nor a "
                    "state this step returned (its tree differs from both)"
                )
            opt_state = (self._reducer.init(params), opt_state)  # the reduction's, in front
        if jax.tree.structure(opt_state) != jax.tree.structure(local):
            raise ValueError(
                "data_parallel_step: opt_state's tree differs from the optimizer's state; pass "
                "optimizer.init(params), step.init(params) or the state a step returned"
            )
        shapes = [jnp.shape(x) for x in jax.tree.leaves(opt_state)]
        if shapes == [x.shape for x in jax.tree.leaves(local)]:
            # Unplaced (one rank's shapes): every rank starts from this state.
            opt_state = self._per_rank_call(lambda s: s, PartitionSpec(), specs)(opt_state)
        return params, jax.device_put(opt_state, self._shardings(specs))

    # ---- the step --------------------------------------------------------------------------

    def _mean(self, values: Any, after: Any) -> Any:
        """The mean over the axis of every leaf of ``values`` (a jaxcomm allreduce, so every
        wait of the step has jaxcomm's deadline), after ``after`` exists: the reduction of
        the gradient may sit inside a ``lax.cond`` (optax.MultiSteps), whose collectives are
        ordered by data only."""
        leaves, treedef = jax.tree.flatten(values)
        flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
        flat, _ = lax.optimization_barrier((flat, jax.tree.leaves(after)))
        if not self._average:
            return treedef.unflatten([x[None] for x in leaves])  # one row per rank
        size = lax.psum(1, self.axis_name)
        flat = allreduce(flat, self.axis_name) / size
        out, offset = [], 0
        for x in leaves:
            part = flat[offset : offset + x.size].reshape(jnp.shape(x))
            dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
            out.append(part.astype(dtype))
            offset += x.size
        return treedef.unflatten(out)

    def _local_step(self, params: Any, opt_state: Any, *batch: jax.Array) -> tuple:
        """One rank's step: its gradient, the optimizer (which reduces it), the mean loss."""
        self.traces += 1  # trace time only
        grad_fn = jax.value_and_grad(self._loss_fn, has_aux=self._has_aux)
        if self.diloco is not None:
            value, grads = grad_fn(self.diloco.local_params(opt_state), *batch)
            params, opt_state = self.diloco.step(grads, opt_state, params)
            after = params
        else:
            value, grads = grad_fn(params, *batch)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            after = updates
        return params, opt_state, self._mean(value, after)

    def _compile(self, opt_state: Any, batch_count: int) -> None:
        self._specs = self.state_specs(opt_state)
        rows = PartitionSpec(self.axis_name)
        value = rows if not self._average else PartitionSpec()
        self._jitted = jax.jit(
            jax.shard_map(
                self._local_step,
                mesh=self.mesh,
                in_specs=(PartitionSpec(), self._specs) + (rows,) * batch_count,
                out_specs=(PartitionSpec(), self._specs, value),
                check_vma=False,
            ),
            donate_argnums=(0, 1) if self._donate else (),
        )

    def _run(self, params: Any, opt_state: Any, *batch: Any) -> tuple:
        params, opt_state, value = self._jitted(params, opt_state, *batch)
        self._last = (jax.tree.leaves(params)[:1], jax.tree.leaves(opt_state)[:1])
        if self._has_aux:
            return params, opt_state, value[0], value[1]
        return params, opt_state, value

    def _returned_last(self, params: Any, opt_state: Any) -> bool:
        if self._last is None:
            return False
        p, s = jax.tree.leaves(params)[:1], jax.tree.leaves(opt_state)[:1]
        same = all(a is b for a, b in zip(p + s, self._last[0] + self._last[1], strict=False))
        return same and len(p + s) == len(self._last[0] + self._last[1])

    def __call__(self, params: Any, opt_state: Any, *batch: Any) -> tuple:
        """One training step on the global batch.

        Args:
          params: the replicated parameters.
          opt_state: the state the previous call returned, ``step.init(params)``, or
            ``optimizer.init(params)`` (placed here, once).
          *batch: arrays split over the axis on their first dimension (e.g. placed with
            ``NamedSharding(mesh, P(axis_name))``).

        Returns:
          ``(params, opt_state, loss)``, or ``(params, opt_state, loss, aux)`` with
          ``has_aux``: the loss and aux averaged over the ranks (with
          ``average_metrics=False``: one row per rank).
        """
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)[:1])
        if not traced and not self._returned_last(params, opt_state):
            params, opt_state = self.place(params, opt_state)
        if self._jitted is None:
            self._compile(opt_state, len(batch))
        if traced:  # inside the caller's own jit: no pacing, the caller's trace decides
            return self._run(params, opt_state, *batch)
        return self._paced(params, opt_state, *batch)

    def wait(self) -> None:
        """Waits for every step in flight (before timing, saving or reading metrics)."""
        self._paced.wait()

    @property
    def in_flight(self) -> int:
        """Steps queued and not yet waited for."""
        return self._paced.in_flight

    # ---- DiLoCo's extra calls (identity otherwise) -------------------------------------------

    def finish(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """After the last step: applies every DiLoCo outer step still in flight
        (``delay > 0``), so no detached collective is left open. Otherwise ``(params,
        opt_state)``."""
        self.wait()
        if self.diloco is None:
            return params, opt_state
        specs = self.state_specs(opt_state)
        both = (specs, PartitionSpec())
        flush = self._per_rank_call(self.diloco.flush, both, both[::-1])
        return flush(opt_state, params)

    def restart(self, opt_state: Any) -> Any:
        """A restored DiLoCo state, its outer allreduces in flight at the save started again
        (``delay > 0``); otherwise ``opt_state``."""
        if self.diloco is None:
            return opt_state
        specs = self.state_specs(opt_state)
        return self._per_rank_call(self.diloco.restart, (specs,), specs)(opt_state)


def data_parallel_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    mesh: Mesh,
    axis_name: AxisName | None = None,
    *,
    algorithm: Any = _NO_ALGORITHM,
    has_aux: bool = False,
    average_metrics: bool = True,
    donate: bool = False,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> DataParallelStep:
    """The jitted data-parallel training step of ``loss_fn`` and ``optimizer`` over a mesh axis.

    Each rank takes the gradient of ``loss_fn`` on its shard of the batch; the optimizer
    averages it with jaxcomm (:func:`jaxcomm.optax.allreduce_gradients`) and updates the
    replicated parameters. The returned step hides ``shard_map``, the optimizer state's
    partition specs and placement, and the pacing (at most ``max_in_flight`` steps queued,
    :func:`jaxcomm.paced`); it returns the loss averaged over every rank, as ``jax.jit`` of
    the same loss over the global batch would.

    Args:
      loss_fn: ``(params, *batch) -> loss`` (a scalar mean over the examples), or
        ``-> (loss, aux)`` with ``has_aux=True`` (``aux``: a pytree of metrics, averaged
        over the ranks as float32).
      optimizer: an Optax transformation. Without ``algorithm=`` its chain must hold
        ``jaxcomm.optax.allreduce_gradients`` (any algorithm, ``"auto"``, PowerSGD, a density
        schedule, ``dense_dtype``; e.g. inside ``optax.MultiSteps``). Or a
        :func:`jaxcomm.optax.diloco`: the gradient is taken at each rank's own parameters
        and no gradient is reduced per step.
      mesh: the devices, e.g. ``jax.make_mesh((jax.device_count(),), ("dp",))``.
      axis_name: the data-parallel mesh axis (or axes); None: the mesh's only axis.
      algorithm: chain ``jaxcomm.optax.allreduce_gradients(axis_name, algorithm)`` in front
        of ``optimizer``: ``None`` (dense), ``"auto"``, or a spec such as
        ``jaxcomm.GTopK(0.01)`` or ``jaxcomm.PowerSGD(rank=4)``. Not given: ``optimizer``
        reduces the gradient itself.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      average_metrics: average the loss and aux over the ranks (one small jaxcomm allreduce
        per step, which DiLoCo otherwise avoids); False: return one row per rank.
      donate: let XLA reuse the buffers of the params and state passed in.
      max_in_flight: steps queued ahead of the devices (0 waits for every step).

    Returns:
      A :class:`DataParallelStep`: ``step(params, opt_state, *batch) -> (params, opt_state,
      loss[, aux])``; ``opt_state`` may be ``optimizer.init(params)`` on the first call (or
      ``step.init(params)``). ``step.wait()`` waits for the steps in flight.

    Raises:
      ValueError: the optimizer reduces no gradient (and no ``algorithm=``), or twice.

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("dp",))
      >>> tx = optax.adam(1e-3)
      >>> opt_state = tx.init(params)
      >>> step = jaxcomm.data_parallel_step(loss_fn, tx, mesh, algorithm="auto")
      >>> rows = NamedSharding(mesh, P("dp"))
      >>> params, opt_state, loss = step(params, opt_state, jax.device_put(x, rows),
      ...                                jax.device_put(y, rows))
    """
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"data_parallel_step: the mesh has axes {mesh.axis_names}; name the "
                "data-parallel one(s) with axis_name="
            )
        axis_name = mesh.axis_names[0]
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    missing = [n for n in names if n not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"data_parallel_step: axis_name {axis_name!r} is not an axis of the mesh "
            f"{mesh.axis_names}"
        )
    spanned = int(np.prod([mesh.shape[n] for n in names]))
    if spanned != mesh.size:
        raise ValueError(
            f"data_parallel_step: axis_name {axis_name!r} spans {spanned} "
            f"of the mesh's {mesh.size} devices; data parallelism over every device needs all "
            "of its axes"
        )
    return DataParallelStep(
        loss_fn,
        optimizer,
        mesh,
        axis_name,
        algorithm,
        has_aux,
        average_metrics,
        donate,
        max_in_flight,
    )


__all__: Sequence[str] = ["DataParallelStep", "data_parallel_step"]
