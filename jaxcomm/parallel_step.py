"""Data-parallel training steps for programs written with ``jax.jit`` and global arrays.

Two entry points, one result (:class:`DataParallelStep`):

- :func:`data_parallel` wraps the training step a plain ``jax.jit`` loop already has,
  ``step(params, opt_state, *batch) -> (params, opt_state, *metrics)``, in place of
  ``jax.jit``; the optimizer's chain holds :func:`jaxcomm.optax.allreduce_gradients`.
- :func:`data_parallel_step` builds the step from a loss function and an Optax optimizer
  (``algorithm=`` inserts the reduction), or a :func:`jaxcomm.optax.diloco`.

Either hides what README's long form writes by hand: the per-rank step inside
``jax.shard_map`` (``check_vma=False``: jaxcomm's sums are identical on every rank but typed
as varying), the optimizer state's partition specs and placement
(:func:`jaxcomm.optax.partition_specs`: residuals per rank, the rest replicated), the pacing
(:func:`jaxcomm.paced`) and the global mean of the loss and metrics. The caller keeps the
style JAX documents for ``jax.jit``: global arrays, the batch a ``NamedSharding`` over the
data-parallel axis, the parameters replicated.

The optimizer state may be what ``optimizer.init(params)`` returns: a state that is not on
the mesh is one rank's, and the first call places it (every rank starts from it). Later calls
take the state the previous call returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomm import optax as jc_optax
from jaxcomm.collectives import allreduce
from jaxcomm.pacing import DEFAULT_MAX_IN_FLIGHT, paced

AxisName = str | tuple[str, ...]
_NO_ALGORITHM: Any = object()  # algorithm= not given: the optimizer brings its own reduction
_REDUCING = (jc_optax.AllreduceGradientsState, jc_optax.DiLoCoState)


def _reduces(state: Any) -> bool:
    """Whether an optimizer state (or its eval_shape) holds a jaxcomm reduction's state."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, _REDUCING))
    return any(isinstance(x, _REDUCING) for x in leaves)


def _on_mesh(x: Any, sharding: NamedSharding) -> bool:
    return isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim)


class DataParallelStep:
    """A jitted data-parallel training step; made by :func:`data_parallel` or
    :func:`data_parallel_step`.

    ``step(params, opt_state, *batch) -> (params, opt_state, *metrics)`` on global arrays:
    ``params`` replicated, each batch array split over the axis on its first dimension,
    ``opt_state`` as the previous call returned it (or one rank's unplaced state, placed
    here); the metrics are averaged over the ranks.

    Attributes:
      mesh: the device mesh.
      axis_name: the data-parallel axis (or axes).
      traces: times the per-rank step was traced (compilations).
    """

    def __init__(
        self,
        local_step: Callable[..., tuple],
        mesh: Mesh,
        axis_name: AxisName,
        *,
        init: Callable[[Any], Any] | None = None,
        complete: Callable[[Any, Any], Any] | None = None,
        diloco: jc_optax.DiLoCo | None = None,
        average_metrics: bool = True,
        donate: bool = False,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        self.mesh, self.axis_name = mesh, axis_name
        self.traces = 0
        self._local_step, self._init, self._diloco = local_step, init, diloco
        self._complete = complete  # (params, state) -> the whole state, from a partial one
        self._average, self._donate = bool(average_metrics), bool(donate)
        self._jitted: Any = None
        self._compiled: Any = None  # compiled ahead (:meth:`compile`)
        self._last: list = []  # the leaves the last call returned (placed already)
        self._paced = paced(self._run_placed, max_in_flight)

    # ---- the state -------------------------------------------------------------------------

    def state_specs(self, opt_state: Any) -> Any:
        """The ``PartitionSpec`` of every leaf of an optimizer state (residuals
        ``P(axis_name)``, the rest ``P()``; :func:`jaxcomm.optax.partition_specs`)."""
        return jc_optax.partition_specs(opt_state, self.axis_name)

    def shardings(self, opt_state: Any) -> Any:
        """The ``NamedSharding`` of every leaf of a placed optimizer state."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs(opt_state))

    def _per_rank(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Any:
        return jax.jit(
            jax.shard_map(
                fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
            )
        )

    def replicate(self, params: Any) -> Any:
        """``params`` replicated on every device of the mesh."""
        return jax.device_put(params, NamedSharding(self.mesh, P()))

    def init(self, params: Any) -> Any:
        """The optimizer state of ``params``, placed on the mesh.

        Only for steps built by :func:`data_parallel_step` (with :func:`data_parallel`, pass
        ``optimizer.init(params)`` to the first call).
        """
        if self._init is None:
            raise TypeError(
                "init: this step wraps your own step function and does not know its optimizer; "
                "pass opt_state = optimizer.init(params) to its first call"
            )
        params = self.replicate(params)
        with jax.set_mesh(self.mesh):  # DiLoCo over sites: a device's share is the mesh's
            specs = self.state_specs(jax.eval_shape(self._init, params))
        return self._per_rank(self._init, P(), specs)(params)

    def place(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` placed as the step takes them.

        Args:
          params: the parameters, anywhere (replicated onto the mesh).
          opt_state: a state placed already (left as it is), or one rank's state such as
            ``optimizer.init(params)``, which every rank then starts from.

        Returns:
          The placed ``(params, opt_state)``.

        Raises:
          ValueError: the state holds no jaxcomm reduction (nothing would average the
            gradients across ranks).
        """
        if self._complete is not None:
            opt_state = self._complete(params, opt_state)
        params = self.replicate(params)
        if not _reduces(opt_state):
            raise ValueError(
                "data_parallel: the optimizer state holds no jaxcomm reduction, so nothing "
                f"averages the gradients over {self.axis_name!r}; chain "
                "jaxcomm.optax.allreduce_gradients(axis_name, algorithm) in front of the "
                "optimizer (or pass algorithm= to data_parallel_step)"
            )
        specs = self.state_specs(opt_state)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)
        placed = jax.tree.leaves(jax.tree.map(_on_mesh, opt_state, shardings))
        if not all(placed):
            opt_state = self._per_rank(lambda s: s, P(), specs)(opt_state)  # one rank's
        # The exact shardings: on a mesh of explicit axes the spec is part of the array's type.
        return params, jax.device_put(opt_state, shardings)

    # ---- the step --------------------------------------------------------------------------

    def _mean(self, metrics: tuple, after: Any) -> tuple:
        """The metrics averaged over the axis (as float32; one jaxcomm allreduce, so every
        wait of the step has jaxcomm's deadline), computed after ``after``: a reduction
        inside a ``lax.cond`` (``optax.MultiSteps``) is ordered with this one by data only."""
        leaves, treedef = jax.tree.flatten(metrics)
        if not leaves:
            return metrics
        if not self._average:
            return treedef.unflatten([jnp.asarray(x)[None] for x in leaves])  # a row per rank
        flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
        flat, _ = lax.optimization_barrier((flat, jax.tree.leaves(after)))
        flat = allreduce(flat, self.axis_name) / lax.psum(1, self.axis_name)
        out, offset = [], 0
        for x in leaves:
            part = flat[offset : offset + np.size(x)].reshape(jnp.shape(x))
            floating = jnp.issubdtype(jnp.result_type(x), jnp.floating)
            out.append(part.astype(jnp.result_type(x)) if floating else part)
            offset += np.size(x)
        return treedef.unflatten(out)

    def _body(self, params: Any, opt_state: Any, *batch: jax.Array) -> tuple:
        self.traces += 1  # trace time only
        out = self._local_step(params, opt_state, *batch)
        if not isinstance(out, tuple) or len(out) < 2:
            raise TypeError(
                "data_parallel: the step must return (params, opt_state, *metrics), got "
                f"{type(out).__name__}"
            )
        return out[0], out[1], self._mean(tuple(out[2:]), out[0])

    def _compile(self, opt_state: Any, batch_count: int) -> None:
        specs = self.state_specs(opt_state)
        rows = P(self.axis_name)
        self._jitted = jax.jit(
            jax.shard_map(
                self._body,
                mesh=self.mesh,
                in_specs=(P(), specs) + (rows,) * batch_count,
                out_specs=(P(), specs, P() if self._average else rows),
                check_vma=False,
            ),
            donate_argnums=(0, 1) if self._donate else (),
        )

    def compile(self, params: Any, opt_state: Any, *batch: Any) -> None:
        """Compiles the step ahead of its first call, for arguments shaped like these (arrays
        or ``jax.ShapeDtypeStruct`` with their shardings; the state placed as the step takes
        it). It may run in a thread while another step trains.

        Example:
          >>> like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
          >>> step.compile(*jax.tree.map(like, (params, opt_state, x, y)))  # doctest: +SKIP
        """
        if self._jitted is None:
            self._compile(opt_state, len(batch))
        self._compiled = self._jitted.lower(params, opt_state, *batch).compile()

    def _run(self, params: Any, opt_state: Any, *batch: Any, run: Any = None) -> tuple:
        params, opt_state, metrics = (run or self._jitted)(params, opt_state, *batch)
        return (params, opt_state, *metrics)

    def _run_placed(self, params: Any, opt_state: Any, *batch: Any) -> tuple:
        out = self._run(params, opt_state, *batch, run=self._compiled)
        self._last = jax.tree.leaves(out[:2])
        return out

    def _returned_last(self, params: Any, opt_state: Any) -> bool:
        leaves = jax.tree.leaves((params, opt_state))
        return len(leaves) == len(self._last) and all(
            a is b for a, b in zip(leaves, self._last, strict=True)
        )

    def __call__(self, params: Any, opt_state: Any, *batch: Any) -> tuple:
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))
        if not traced and not self._returned_last(params, opt_state):
            params, opt_state = self.place(params, opt_state)
        if self._jitted is None:
            self._compile(opt_state, len(batch))
        if traced:  # inside the caller's own jit: its trace decides when anything runs
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
        """After the last step: waits for the steps in flight and applies every DiLoCo outer
        step still on the wire (``delay > 0``), so no detached collective is left open.

        Returns:
          ``(params, opt_state)``, unchanged without DiLoCo.
        """
        self.wait()
        if self._diloco is None:
            return params, opt_state
        specs = self.state_specs(opt_state)
        flush = self._per_rank(self._diloco.flush, (specs, P()), (P(), specs))
        return flush(opt_state, params)

    def restart(self, opt_state: Any) -> Any:
        """A restored state, ready to continue: DiLoCo's outer allreduces that were in flight
        at the save start again (``delay > 0``). Otherwise ``opt_state``."""
        if self._diloco is None:
            return opt_state
        specs = self.state_specs(opt_state)
        return self._per_rank(self._diloco.restart, (specs,), specs)(opt_state)


def _axis_of(mesh: Mesh, axis_name: AxisName | None, api: str) -> AxisName:
    """The data-parallel axis: checked against the mesh, spanning every device."""
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"{api}: the mesh has axes {mesh.axis_names}; name the data-parallel one(s) "
                "with axis_name="
            )
        return mesh.axis_names[0]
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if any(n not in mesh.axis_names for n in names):
        raise ValueError(f"{api}: axis_name {axis_name!r} is not in the mesh's {mesh.axis_names}")
    spanned = int(np.prod([mesh.shape[n] for n in names]))
    if spanned != mesh.size:
        raise ValueError(
            f"{api}: axis_name {axis_name!r} spans {spanned} of the mesh's {mesh.size} "
            "devices; name every mesh axis (data parallelism over all devices)"
        )
    return axis_name


def data_parallel(
    mesh: Mesh,
    axis_name: AxisName | None = None,
    *,
    average_metrics: bool = True,
    donate: bool = False,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
) -> Callable[[Callable[..., tuple]], DataParallelStep]:
    """Makes a plain training step data-parallel with jaxcomm: use it in place of ``jax.jit``.

    The step runs on each rank's shard of the batch; its optimizer averages the gradients,
    so its chain must hold :func:`jaxcomm.optax.allreduce_gradients` (the first call checks
    the state). What the step returns after ``(params, opt_state)`` is averaged over the
    ranks, so a loss comes back as the global mean, as under ``jax.jit``.

    Args:
      mesh: the devices, e.g. ``jax.make_mesh((jax.device_count(),), ("dp",))``.
      axis_name: the data-parallel mesh axis (or axes); None: the mesh's only axis.
      average_metrics: average the metrics over the ranks (one small jaxcomm allreduce per
        step); False: return one row per rank.
      donate: let XLA reuse the buffers of the params and state passed in.
      max_in_flight: steps queued ahead of the devices (:func:`jaxcomm.paced`; 0 waits for
        every step).

    Returns:
      A decorator: ``step_fn(params, opt_state, *batch) -> (params, opt_state, *metrics)``
      to a :class:`DataParallelStep` of the same signature on global arrays.

    Example:
      >>> tx = optax.chain(jaxcomm.optax.allreduce_gradients("dp", "auto"), optax.adam(1e-3))
      >>> opt_state = tx.init(params)
      >>> @jaxcomm.data_parallel(mesh)
      ... def train_step(params, opt_state, x, y):
      ...     value, grads = jax.value_and_grad(loss)(params, x, y)
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     return optax.apply_updates(params, updates), opt_state, value
      >>> rows = jax.sharding.NamedSharding(mesh, P("dp"))  # each device: its rows
      >>> params, opt_state, value = train_step(params, opt_state, *jax.device_put((x, y), rows))
      >>> value.shape  # the mean over every rank's rows
      ()
    """
    axis_name = _axis_of(mesh, axis_name, "data_parallel")
    options = {"average_metrics": average_metrics, "donate": donate, "max_in_flight": max_in_flight}

    def wrap(step_fn: Callable[..., tuple]) -> DataParallelStep:
        return DataParallelStep(step_fn, mesh, axis_name, **options)

    return wrap


def _as_transformation(optimizer: Any) -> optax.GradientTransformation:
    # optax.MultiSteps is not a GradientTransformation, and optax.chain unpacks its arguments.
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return optax.GradientTransformation(optimizer.init, optimizer.update)
    raise TypeError(
        "data_parallel_step: optimizer must be an Optax transformation (e.g. optax.adam(1e-3), "
        f"optax.MultiSteps(...)) or jaxcomm.optax.diloco(...), got {type(optimizer).__name__}"
    )


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
    """The data-parallel training step of ``loss_fn`` and ``optimizer`` over a mesh axis.

    Each rank takes the gradient of ``loss_fn`` on its shard of the batch; the optimizer
    averages it with jaxcomm and updates the replicated parameters (:func:`data_parallel`
    runs it: the same placement, pacing and global mean loss).

    Args:
      loss_fn: ``(params, *batch) -> loss`` (a scalar mean over the examples), or
        ``-> (loss, aux)`` with ``has_aux=True`` (``aux``: a pytree of metrics, averaged
        over the ranks).
      optimizer: an Optax transformation (``optax.MultiSteps`` too: the gradients are
        still reduced every micro-step, in front of the accumulation or inside it, since
        MultiSteps runs its inner update every step). Without ``algorithm=``
        its chain must hold :func:`jaxcomm.optax.allreduce_gradients` (any algorithm,
        ``"auto"``, PowerSGD, a density schedule, ``dense_dtype``). Or a
        :func:`jaxcomm.optax.diloco`: the gradient is taken at each rank's own parameters.
      mesh: the devices.
      axis_name: the data-parallel mesh axis (or axes); None: the mesh's only axis.
      algorithm: chain ``jaxcomm.optax.allreduce_gradients(axis_name, algorithm)`` in front
        of ``optimizer``: ``None`` (dense), ``"auto"``, or a spec such as
        ``jaxcomm.GTopK(0.01)`` or ``jaxcomm.PowerSGD(rank=4)``.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      average_metrics, donate, max_in_flight: as for :func:`data_parallel`.

    Returns:
      A :class:`DataParallelStep`: ``step(params, opt_state, *batch) -> (params, opt_state,
      loss)`` (``+ (aux,)`` with ``has_aux``). ``opt_state``: ``step.init(params)``, or on
      the first call ``optimizer.init(params)`` of the optimizer given.

    Raises:
      ValueError: no reduction (no ``algorithm=`` and none in the chain), or two.

    Example:
      >>> step = jaxcomm.data_parallel_step(loss, optax.adam(1e-3), mesh, algorithm="auto")
      >>> opt_state = step.init(params)
      >>> rows = jax.sharding.NamedSharding(mesh, P("dp"))
      >>> params, opt_state, value = step(params, opt_state, *jax.device_put((x, y), rows))
      >>> step.wait()  # every step in flight done
      >>> int(opt_state[0].count)  # the reduction's state, in front of Adam's
      1
    """
    axis_name = _axis_of(mesh, axis_name, "data_parallel_step")
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def metrics(value: Any) -> tuple:
        return value if has_aux else (value,)

    options = {"average_metrics": average_metrics, "donate": donate, "max_in_flight": max_in_flight}
    if isinstance(optimizer, jc_optax.DiLoCo):
        if algorithm is not _NO_ALGORITHM:
            raise TypeError(
                "data_parallel_step: DiLoCo takes its algorithm itself "
                "(jaxcomm.optax.diloco(..., algorithm=...)); drop algorithm="
            )
        tx = optimizer

        def diloco_step(params: Any, state: Any, *batch: jax.Array) -> tuple:
            value, grads = grad_fn(tx.local_params(state), *batch)
            params, state = tx.step(grads, state, params)
            return (params, state, *metrics(value))

        return DataParallelStep(diloco_step, mesh, axis_name, init=tx.init, diloco=tx, **options)

    given = _as_transformation(optimizer)
    if algorithm is _NO_ALGORITHM:
        full = given
    else:
        reducer = jc_optax.allreduce_gradients(axis_name, algorithm)
        full = optax.chain(reducer, given)

    def local_step(params: Any, state: Any, *batch: jax.Array) -> tuple:
        value, grads = grad_fn(params, *batch)
        updates, state = full.update(grads, state, params)
        return (optax.apply_updates(params, updates), state, *metrics(value))

    complete = None if algorithm is _NO_ALGORITHM else _completing(given, reducer)
    return DataParallelStep(
        local_step, mesh, axis_name, init=full.init, complete=complete, **options
    )


def _completing(given: Any, reducer: Any) -> Callable[[Any, Any], Any]:
    """With ``algorithm=``: the whole state from ``given.init(params)`` (the reduction's fresh
    state in front, as ``optax.chain(reducer, given)`` holds them) or the whole state itself."""

    def complete(params: Any, opt_state: Any) -> Any:
        if _reduces(jax.eval_shape(given.init, params)):
            raise ValueError(
                "data_parallel_step: the optimizer already holds "
                "jaxcomm.optax.allreduce_gradients and algorithm= adds another; drop one"
            )
        if jax.tree.structure(opt_state) == jax.tree.structure(jax.eval_shape(given.init, params)):
            return (reducer.init(params), opt_state)
        return opt_state

    return complete


__all__ = ["DataParallelStep", "data_parallel", "data_parallel_step"]
