"""DiLoCo: H local steps of an inner optimizer, then an outer step on the averaged change.

The outer allreduce may be compressed (error feedback on the pseudo-gradient), delayed and
overlapped with the next inner steps (Streaming DiLoCo), and split into fragments synced at
staggered steps. Each piece of a step is a function of this module over the :class:`Config`
of one :func:`diloco` call; the state is :class:`jaxcomm.optax.DiLoCoState`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm import _ordering, algorithms
from jaxcomm.collectives import handles
from jaxcomm.optax import diloco_outer
from jaxcomm.optax.diloco_outer import Config
from jaxcomm.optax.plan import AxisName
from jaxcomm.optax.state import DiLoCoState

DILOCO_OUTER_LR = 0.7
"""The outer learning rate of DiLoCo (Douillard et al. 2023), :func:`diloco`'s default."""
DILOCO_OUTER_MOMENTUM = 0.9
"""The outer Nesterov momentum of DiLoCo, :func:`diloco`'s default."""
STREAMING_MIX = 0.5
"""Streaming DiLoCo's alpha: how much of its own parameters a rank keeps when a delayed outer
step lands (Douillard et al. 2025, §2.3)."""
DILOCO_STREAM = 1 << 20
"""Stream id of fragment 0's detached outer allreduce (fragment f: ``DILOCO_STREAM + f``)."""


class DiLoCo(NamedTuple):
    """The functions of :func:`diloco`, each run inside the ``shard_map``.

    Attributes:
      init: ``params -> DiLoCoState`` (``params`` replicated).
      step: ``(grads, state, params) -> (params, state)``: one inner step from this rank's
        gradient at ``local_params(state)``, and the outer step when it is due; ``params``
        in and out are the global parameters, bit-identical on every rank.
      local_params: ``state -> this rank's parameters``, where the gradient is taken.
      flush: ``(state, params) -> (params, state)``: applies every outer gradient in flight
        now (``delay > 0``; e.g. after the last step, so no handle is left open).
      restart: ``state -> state``: after restoring a checkpoint saved while outer
        allreduces were in flight (``overlap=True``), starts them again in this process from
        the Δ and residual the state kept; the run then continues bit for bit. Identity
        otherwise.
    """

    init: Callable[[Any], DiLoCoState]
    step: Callable[[Any, DiLoCoState, Any], tuple[Any, DiLoCoState]]
    local_params: Callable[[DiLoCoState], Any]
    flush: Callable[[DiLoCoState, Any], tuple[Any, DiLoCoState]]
    restart: Callable[[DiLoCoState], DiLoCoState]


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    *,
    every: int,
    algorithm: Any = None,
    axis_name: AxisName = "dp",
    delay: int = 0,
    overlap: bool = True,
    fragments: int = 1,
    mix: float = STREAMING_MIX,
    dense_dtype: Any = jnp.float32,
) -> DiLoCo:
    """DiLoCo: ``every`` local steps of ``inner``, then an outer step on the averaged change.

    Each rank applies ``inner`` (e.g. AdamW) to its own gradient at its own parameters, with
    no communication. Every ``every`` steps the pseudo-gradient ``Δ = θ_global − θ_local`` is
    averaged over ``axis_name`` by a jaxcomm allreduce (dense, or compressed with error
    feedback on Δ: any registered algorithm with a residual, e.g. ``jaxcomm.GTopK(0.01)``,
    ``jaxcomm.OneBit()``), ``outer`` (default: SGD, Nesterov momentum 0.9, lr 0.7, as in
    DiLoCo) takes the average as its gradient and updates θ_global, and every rank restarts
    from θ_global. Runs inside a jitted ``jax.shard_map`` (``check_vma=False``: the sums are
    identical on every rank but typed as varying).

    **Streaming** (``delay = τ > 0``, Streaming DiLoCo's overlapped outer step): the outer
    allreduce of the Δ taken at step t is applied at step t + τ; with ``overlap=True`` it is a
    detached collective (:func:`jaxcomm.start_allreduce`, CPU) that runs on jaxcomm's engine
    while the τ inner steps, separate jitted calls, compute; its handle is carried in the
    state. When it lands, each rank keeps ``mix`` of its own parameters and takes
    ``1 − mix`` of the new θ_global. ``overlap=False`` reduces at t, blocking, and applies
    the same average at t + τ: the same numbers, any platform. ``fragments = F`` syncs the
    parameters in F contiguous fragments of near-equal size, fragment f at the steps
    ``≡ f·every//F (mod every)``, which spreads the bytes over the period.

    **Why not an Optax transformation:** ``optax.apply_updates`` adds updates to the
    parameters, and ``θ_local + (θ_global − θ_local)`` is not ``θ_global`` in floating point
    (nor in bf16), so the ranks would not restart from one bit-identical θ_global, and the
    global parameters (what is evaluated and saved) are not any rank's parameters between
    syncs. ``step`` therefore returns the parameters: θ_global, identical on every rank,
    while each rank's own parameters live in the state (``local_params``).

    The identity the tests check: with ``every=1``, the dense algorithm and
    ``outer = optax.sgd(1.0)`` (no momentum), ``θ_{t+1} = θ_t − mean_r(θ_t − (θ_t + u_r)) =
    θ_t + mean_r(u_r)`` (up to float rounding), where ``u_r`` is the update ``inner``
    computes on rank r from its gradient at θ_t and *its own* inner state: DiLoCo then equals
    averaging the inner updates every step. For a stateless inner optimizer (SGD without
    momentum) that is averaging the gradients; for a stateful one (Adam, momentum) each rank's
    moments follow its own gradients, which is not the inner optimizer applied to the averaged
    gradient.

    Args:
      inner: the local optimizer, applied by every rank to its own gradient.
      outer: the optimizer of θ_global, given the averaged Δ as its gradient (float32);
        None: ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      every: H, inner steps between outer steps (>= 1).
      algorithm: ``None`` for the dense allreduce (in ``dense_dtype``), or a compressed
        algorithm's spec; error feedback on Δ is kept per rank in the state.
      axis_name: the data-parallel mesh axis (or axes).
      delay: τ, inner steps between an outer allreduce's start and its application
        (0 <= τ < every; 0: applied at once).
      overlap: with ``delay > 0``, run the outer allreduce detached on jaxcomm's engine
        (CPU); False: reduce at once and apply τ steps later.
      fragments: F, parameter fragments synced at staggered steps (1 <= F <= every).
      mix: with ``delay > 0``, the share of its own parameters a rank keeps when the outer
        step lands (0: restart from θ_global).
      dense_dtype: the dense algorithm's wire dtype (``jnp.float32`` or ``jnp.bfloat16``).

    Returns:
      A :class:`DiLoCo` (``init``, ``step``, ``local_params``); its state's per-rank
      leaves take ``P(axis_name)`` (:func:`partition_specs`).

    Example:
      >>> tx = jaxcomm.optax.diloco(optax.adamw(1e-3), every=50, algorithm=jaxcomm.GTopK(0.01))
      >>> specs = jaxcomm.optax.partition_specs(jax.eval_shape(tx.init, params), "dp")
      >>> state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs,
      ...                               check_vma=False))(params)
      >>> def train_step(params, state, x, y):
      ...     grads = jax.grad(loss)(tx.local_params(state), x, y)
      ...     return tx.step(grads, state, params)
    """
    every, delay, fragments = int(every), int(delay), int(fragments)
    if every < 1:
        raise ValueError(f"diloco: every must be >= 1 inner step, got {every}")
    if not 0 <= delay < every:
        raise ValueError(f"diloco: delay must be in [0, every={every}), got {delay}")
    if not 1 <= fragments <= every:
        raise ValueError(f"diloco: fragments must be in [1, every={every}], got {fragments}")
    if not 0.0 <= float(mix) <= 1.0:
        raise ValueError(f"diloco: mix must be in [0, 1], got {mix}")
    if jnp.dtype(dense_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"diloco: dense_dtype must be float32 or bfloat16, got {dense_dtype}")
    if algorithm is not None:
        _check_algorithm(algorithm)
    if outer is None:
        outer = optax.sgd(DILOCO_OUTER_LR, momentum=DILOCO_OUTER_MOMENTUM, nesterov=True)
    wire = jnp.dtype(dense_dtype) if algorithm is None else jnp.dtype(jnp.float32)
    cfg = Config(
        inner, outer, every, algorithm, axis_name, delay, overlap, fragments, float(mix), wire
    )
    return DiLoCo(
        functools.partial(_init, cfg),
        functools.partial(_step, cfg),
        _local_params,
        functools.partial(_flush, cfg),
        functools.partial(_restart, cfg),
    )


def _check_algorithm(algorithm: Any) -> None:
    """A TypeError unless ``algorithm`` is a flat compressor with error feedback."""
    record = algorithms.of(algorithm)  # TypeError naming the known specs
    if not record.residual:
        raise TypeError(
            f"diloco: {algorithm!r} keeps no error feedback; pass None for the dense "
            "allreduce or a compressed algorithm"
        )
    if record.leafwise is not None:
        raise TypeError(
            f"diloco: {algorithm!r} compresses gradient leaves by their shapes, and the "
            "outer allreduce is one flat vector; pass None for the dense allreduce or a "
            "flat compressor (e.g. jaxcomm.BlockQuant(8))"
        )


def _fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Splits leaves, in tree order, into ``fragments`` contiguous groups of near-equal size."""
    total = max(1, sum(sizes))
    groups: list[list[int]] = [[] for _ in range(fragments)]
    before = 0
    for i, n in enumerate(sizes):
        # The fragment holding the leaf's middle element.
        groups[min(fragments - 1, (2 * before + n) * fragments // (2 * total))].append(i)
        before += n
    empty = [f for f, g in enumerate(groups) if not g]
    if empty:
        raise ValueError(
            f"diloco: fragments={fragments} leaves fragment(s) {empty} without parameters "
            f"(the model has {len(sizes)} leaves of sizes {list(sizes)}); use fewer fragments"
        )
    return groups


def _layout(cfg: Config, params: Any) -> list[list[int]]:
    return _fragments([int(np.prod(jnp.shape(p))) for p in jax.tree.leaves(params)], cfg.fragments)


def _per_rank(tree: Any) -> Any:
    """Adds the per-rank leading axis of length 1 to every leaf (see :class:`DiLoCoState`)."""
    return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


def _of_rank(tree: Any) -> Any:
    """Removes the per-rank leading axis :func:`_per_rank` added."""
    return jax.tree.map(lambda x: x[0], tree)


def _local_params(state: DiLoCoState) -> Any:
    return _of_rank(state.local)


def _guarded(pred: jax.Array, fn: Callable[[Any], Any], operands: Any) -> Any:
    """``fn(operands)`` where ``pred`` holds (the same on every rank), else ``operands``.

    The ordering token is threaded through the ``lax.cond`` so that the branch's collectives
    stay chained with the step's other jaxcomm calls (as in :func:`allreduce_gradients`).
    """

    def run(token: jax.Array, ops: Any) -> tuple:
        _ordering.token_out(token)
        out = fn(ops)
        return _ordering.token_in(), out

    def skip(token: jax.Array, ops: Any) -> tuple:
        return token, ops

    token, out = lax.cond(pred, run, skip, _ordering.token_in(), operands)
    _ordering.token_out(token)
    return out


def _pending_results(cfg: Config, n: int) -> tuple:
    """The results of a fragment's detached outer allreduce of ``n`` elements, as
    :class:`jaxcomm.Pending` records them."""
    if cfg.algorithm is None:
        return (((n,), cfg.wire.name),)
    return (((n,), "float32"), ((n,), "float32"))


def _init(cfg: Config, params: Any) -> DiLoCoState:
    leaves = jax.tree.leaves(params)
    groups = _layout(cfg, params)
    sizes = [sum(int(np.prod(jnp.shape(leaves[i]))) for i in g) for g in groups]
    outer_states = tuple(
        cfg.outer.init([jnp.asarray(leaves[i], jnp.float32) for i in g]) for g in groups
    )
    residuals = None
    if cfg.algorithm is not None:
        residuals = tuple(jnp.zeros((1, n), jnp.float32) for n in sizes)
    pending = None
    if cfg.delay > 0 and cfg.overlap:
        pending = tuple(
            (
                handles.Pending(jnp.zeros((1, 2), jnp.int32), _pending_results(cfg, n)),
                jnp.zeros((1, n), jnp.float32),
            )
            for n in sizes
        )
    elif cfg.delay > 0:
        pending = tuple(jnp.zeros((1, n), jnp.float32) for n in sizes)
    return DiLoCoState(
        count=jnp.zeros((), jnp.int32),
        local=_per_rank(params),
        inner=_per_rank(cfg.inner.init(params)),
        outer=outer_states,
        residuals=residuals,
        pending=pending,
    )


def _schedule(cfg: Config, count: jax.Array, f: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(starts, lands, in flight after this step) of fragment f at inner step `count`.

    Fragment f syncs at the steps ≡ offsets[f] (mod every), the first one at least one step
    in (fragment 0: after `every` steps); a start lands `delay` steps later.
    """
    every, delay, offset = cfg.every, cfg.delay, cfg.offsets[f]
    first = offset or every
    phase = (count - offset) % every
    starts = (count >= first) & (phase == 0)
    lands = (count >= first + delay) & ((count - delay - offset) % every == 0)
    return starts, lands, (count >= first) & (phase < delay)


def _run_fragments(
    cfg: Config, state: DiLoCoState, params: Any, local: Any, count: jax.Array, how: str
) -> tuple:
    """Applies each fragment's due work; returns (params, local, outer, residuals, pending).

    how: "step" (land, then start, as scheduled), "flush" (land what is in flight).
    """
    g_leaves, treedef = jax.tree.flatten(params)
    l_leaves = jax.tree.leaves(local)
    outer_states = list(state.outer)
    residuals = [None] * cfg.fragments if state.residuals is None else list(state.residuals)
    pending = [None] * cfg.fragments if state.pending is None else list(state.pending)
    for f, group in enumerate(_layout(cfg, params)):
        starts, lands, in_flight = _schedule(cfg, count, f)
        g_part = [g_leaves[i] for i in group]
        l_part = [l_leaves[i] for i in group]
        if cfg.delay == 0 and how == "step":
            ops = (g_part, l_part, outer_states[f], residuals[f])
            ops = _guarded(starts, functools.partial(diloco_outer.sync, cfg), ops)
            g_part, l_part, outer_states[f], residuals[f] = ops
        elif cfg.delay > 0:
            ops = (g_part, l_part, outer_states[f], residuals[f], pending[f])
            land = functools.partial(diloco_outer.land, cfg)
            if how == "flush":
                ops = _guarded(in_flight, land, ops)
            else:
                # Landing first: with delay < every a step never lands and starts one
                # fragment, and a start always reads θ_global after the previous landing.
                ops = _guarded(lands, land, ops)
                ops = _guarded(
                    starts, functools.partial(diloco_outer.begin, cfg, DILOCO_STREAM + f), ops
                )
            g_part, l_part, outer_states[f], residuals[f], pending[f] = ops
        for j, i in enumerate(group):
            g_leaves[i], l_leaves[i] = g_part[j], l_part[j]
    return (
        jax.tree.unflatten(treedef, g_leaves),
        jax.tree.unflatten(treedef, l_leaves),
        tuple(outer_states),
        None if state.residuals is None else tuple(residuals),
        None if state.pending is None else tuple(pending),
    )


def _step(cfg: Config, grads: Any, state: DiLoCoState, params: Any) -> tuple[Any, DiLoCoState]:
    local = _of_rank(state.local)
    updates, inner_state = cfg.inner.update(grads, _of_rank(state.inner), local)
    local = optax.apply_updates(local, updates)
    count = optax.safe_int32_increment(state.count)
    params, local, outer_states, residuals, pending = _run_fragments(
        cfg, state, params, local, count, "step"
    )
    new_state = DiLoCoState(
        count, _per_rank(local), _per_rank(inner_state), outer_states, residuals, pending
    )
    return params, new_state


def _flush(cfg: Config, state: DiLoCoState, params: Any) -> tuple[Any, DiLoCoState]:
    params, local, outer_states, residuals, pending = _run_fragments(
        cfg, state, params, _of_rank(state.local), state.count, "flush"
    )
    return params, state._replace(
        local=_per_rank(local), outer=outer_states, residuals=residuals, pending=pending
    )


def _restart(cfg: Config, state: DiLoCoState) -> DiLoCoState:
    if cfg.delay == 0 or not cfg.overlap:
        return state
    residuals = [None] * cfg.fragments if state.residuals is None else list(state.residuals)
    pending = list(state.pending)
    for f in range(cfg.fragments):
        in_flight = _schedule(cfg, state.count, f)[2]
        resend = functools.partial(diloco_outer.resend, cfg, DILOCO_STREAM + f)
        residuals[f], pending[f] = _guarded(in_flight, resend, (residuals[f], pending[f]))
    return state._replace(pending=tuple(pending))
