"""The bucketed reduction of :func:`allreduce_gradients`: one collective per bucket, with
error feedback, overlapped with backward.

Design choices (measured on 2 CPU cores, 4 devices, see ``tests/test_optax.py``):

- **Overlap with backward** (``overlap=True``, CPU). Each bucket's collective depends only on
  its own leaves, so XLA starts it as soon as backward has produced them. Awaiting it where it
  is issued would still stall backward: XLA:CPU reuses a call's buffers for the ops after it,
  and those ops wait for the call. So each collective is split (``after`` of
  :func:`jaxcomm.allreduce`): the start queues it on jaxcomm's engine and returns, and the done
  that returns the sum takes the last bucket's gradients as an operand, which puts it after
  backward. Every start is issued before any done (a done between two starts let XLA hold
  the later start until the earlier bucket had finished on the wire). The engine runs the
  buckets, last layer first, while backward computes the earlier layers (docs/overlap.md;
  ``benchmarks/overlap_schedule.py`` shows what each start waits for).
- **Residuals per leaf.** The error-feedback residuals are stored with the gradient's tree
  structure and shapes (float32), and concatenated into bucket order around each call. The
  copy costs O(n) memory traffic, far below the collective itself, and in exchange the state
  does not depend on the bucket size, is readable leaf by leaf, and can be resharded.
- **Residuals are per rank.** Each rank keeps what *it* did not send, so the residual leaves
  differ across ranks: place them with ``P(axis_name)`` (see :func:`partition_specs`), never
  replicated; inside ``shard_map`` each rank sees the gradient's own shape (a scalar leaf's
  residual has shape ``(1,)``).
- **Density schedules without recompiling.** ``density`` fixes buffer sizes (k is a static
  attribute of the FFI call), so a schedule cannot be a traced value. The distinct densities
  become the branches of one ``lax.switch`` indexed by the step count in the state: the step
  is traced and compiled once, and only the selected branch runs (its collectives included).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm import _ordering, _validate, cost
from jaxcomm.collectives import _call, allreduce, compressed_allreduce
from jaxcomm.collectives._mesh import group_size
from jaxcomm.cost import measure
from jaxcomm.optax import leafwise
from jaxcomm.optax.plan import (
    DEFAULT_BUCKET_SIZE,
    F32,
    AxisName,
    Plan,
    Schedule,
    _buckets,
    cores,
    is_auto,
    make_plan,
)
from jaxcomm.optax.state import AllreduceGradientsState


def allreduce_gradients(
    axis_name: AxisName,
    algorithm: Any = None,
    *,
    hierarchical: bool = False,
    mean: bool = True,
    density_schedule: Schedule | None = None,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    first_bucket_size: int | None = None,
    overlap: bool = True,
    dense_dtype: Any = None,
) -> optax.GradientTransformation:
    """Averages (or sums) gradients over ``axis_name`` with jaxcomm's collectives.

    Must run inside ``jax.shard_map`` over a mesh of all devices, typically first in an
    ``optax.chain``. The outputs are bit-identical on every rank but typed as varying over
    ``axis_name``: build the step with ``jax.shard_map(..., check_vma=False)`` so replicated
    parameters can be returned with ``P()``. The residuals must be sharded over the axis
    (:func:`partition_specs`).

    Args:
      axis_name: the data-parallel mesh axis (or tuple of axes) to reduce over.
      algorithm: ``None`` for the dense ring allreduce, or an algorithm that
        ``jaxcomm.compressed_allreduce`` accepts, e.g. ``jaxcomm.GTopK(0.01)`` or
        ``jaxcomm.TopKAllgather(0.01)`` (error feedback is kept in the state), or ``"auto"``
        / ``jaxcomm.cost.Auto(allowed=("dense", "gtopk"), profile="profile.json")``: each
        bucket's algorithm is chosen at trace time by the cost model (:mod:`jaxcomm.cost`).
        A leaf-shaped algorithm, ``jaxcomm.PowerSGD(rank=4, start_step=100)``, works on the
        leaves' shapes instead of buckets: three allreduce calls per step (every leaf's P,
        every leaf's Q, the leaves sent dense), its errors in ``residuals`` and its
        warm-start Qs in ``shared``; ``bucket_size``, ``first_bucket_size`` and
        ``overlap`` do not apply to it.
      hierarchical: reduce within a node first, then across nodes (``axis_name`` must then
        be a ("node", "local") pair of mesh axes; see ``jaxcomm.allreduce``).
      mean: divide the sum by the number of ranks (else return the sum).
      density_schedule: ``{start step: density}`` (or pairs); the algorithm's density is
        replaced by the entry of the latest start step <= the update count. Each distinct
        density is compiled once, as a ``lax.switch`` branch. See
        :func:`gtopk_warmup_schedule`. ``"auto"`` given ``dense_steps`` and
        ``steps_factor_no_warmup`` (:class:`jaxcomm.cost.Auto`) decides whether the warm-up
        pays: without it, the last density applies from the first step.
      bucket_size: most elements fused into one collective call.
      first_bucket_size: most elements of the first bucket (the last layers'), ``None``: as
        ``bucket_size``. A small first bucket starts communication earlier in backward.
      overlap: await every bucket but the last only after the last bucket's gradients exist,
        so that, inside a jitted step that also computes the gradients, each bucket's
        collective runs while backward computes the earlier layers (CPU; on GPU the dense
        allreduce, on jaxcomm's own CUDA stream, while the compressed collectives are awaited
        where they are issued). A compressed bucket is split only when the process may run on
        more than one core: its selection or quantization runs on jaxcomm's engine thread,
        which on a single core would take the core from backward. ``False`` awaits each
        bucket at once.
      dense_dtype: the wire dtype of the buckets sent dense, e.g. ``jnp.bfloat16`` for the
        16-bit wire; ``None``: the gradients' common dtype. Compressed buckets take the float32
        gradients as they are, so with ``"auto"`` only the buckets it sends dense are cast
        (casting the whole tree to bf16 first costs a compressed bucket two casts per step).
        Each leaf comes back in its own dtype. The hierarchical allreduce has no 16-bit wire.

    Returns:
      An ``optax.GradientTransformation`` whose state is an :class:`AllreduceGradientsState`.

    Example:
      >>> tx = optax.chain(
      ...     jaxcomm.optax.allreduce_gradients("dp", jaxcomm.GTopK(0.01)),
      ...     optax.sgd(0.05, momentum=0.9))
      >>> specs = jaxcomm.optax.partition_specs(jax.eval_shape(tx.init, params), "dp")
      >>> state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
      ...                               out_specs=specs))(params)

      PowerSGD (the 8 x 4 weight as rank-1 factors, its Q 4 x 1; the bias goes dense):

      >>> tx = jaxcomm.optax.allreduce_gradients("dp", jaxcomm.PowerSGD(rank=1, start_step=10))
      >>> state = tx.init(params)
      >>> state.shared["layer0"]["w"].shape, state.shared["layer0"]["b"].shape
      ((4, 1), (1,))
    """
    module = leafwise.module_of(algorithm)
    if module is not None:
        if density_schedule is not None:
            raise ValueError(
                f"density_schedule needs an algorithm with a density; {algorithm!r} has none "
                "(PowerSGD's dense warm-up is PowerSGD(start_step=...))"
            )
        return leafwise.transformation(
            module, algorithm, axis_name, mean, hierarchical, dense_dtype
        )
    plan = make_plan(
        axis_name, algorithm, hierarchical, mean, density_schedule, bucket_size,
        first_bucket_size, overlap, dense_dtype,
    )  # fmt: skip
    return optax.GradientTransformation(
        functools.partial(_init, plan), functools.partial(_update, plan)
    )


def _init(plan: Plan, params: Any) -> AllreduceGradientsState:
    residuals = None
    if plan.algorithm is not None:
        residuals = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p) or (1,), jnp.float32), params)
    return AllreduceGradientsState(count=jnp.zeros((), jnp.int32), residuals=residuals)


class _Flat(NamedTuple):
    """One step's gradient as flat leaves, and what every bucket of it shares."""

    xs: list[jax.Array]  # the raveled gradient leaves
    rs: list[jax.Array] | None  # the raveled residuals (None: dense)
    count: jax.Array  # the state's update count
    total: int  # the step's elements (auto gives each bucket its share of the step's compute)
    wire: Any  # the step's dense wire dtype (Plan.dense_wire_of)


def _update(
    plan: Plan, updates: Any, state: AllreduceGradientsState, params: Any = None
) -> tuple[Any, AllreduceGradientsState]:
    del params
    leaves, treedef = jax.tree.flatten(updates)
    xs = [jnp.ravel(g) for g in leaves]
    rs, r_leaves = None, None
    if plan.algorithm is not None:
        r_leaves = treedef.flatten_up_to(state.residuals)
        rs = [jnp.ravel(r) for r in r_leaves]
    groups = _buckets([x.size for x in xs], plan.bucket_size, plan.first_bucket_size)
    if is_auto(plan.algorithm):  # without a profile, auto first measures the world it runs in
        measure.prepare(plan.algorithm, [sum(xs[i].size for i in g) for g in groups])
    flat = _Flat(xs, rs, state.count, sum(x.size for x in xs), plan.dense_wire_of(xs))
    phases, fixed = plan.phases, []
    if len(phases) > 1 and is_auto(plan.algorithm) and groups:
        phases, fixed = cost.follow_schedule(
            phases,
            plan.starts,
            [sum(xs[i].size for i in g) for g in groups],
            group_size(plan.axis_name),
            jax.process_count(),
            jax.local_device_count(),
            plan.hierarchical,
            flat.wire.itemsize,
        )
    if len(phases) == 1 or not groups or len(fixed) == len(groups):
        sums, new_rs = _reduce_flat(plan, phases[-1], flat, groups)
    else:
        sums, new_rs = _reduce_scheduled(plan, phases, fixed, flat, groups)
    scale = 1.0 / group_size(plan.axis_name) if plan.mean else 1.0
    out = [
        (s * scale if plan.mean else s).reshape(jnp.shape(g)).astype(g.dtype)
        for s, g in zip(sums, leaves, strict=True)
    ]
    residuals = None
    if plan.algorithm is not None:
        residuals = treedef.unflatten(
            [r.reshape(old.shape) for r, old in zip(new_rs, r_leaves, strict=True)]
        )
    count = optax.safe_int32_increment(state.count)
    return treedef.unflatten(out), AllreduceGradientsState(count, residuals)


def _reduce_scheduled(
    plan: Plan, phases: list[Any], fixed: list[int], flat: _Flat, groups: list[list[int]]
) -> tuple[list, list | None]:
    """A density schedule: the buckets every phase sends alike (``fixed``) first, outside the
    switch; then one ``lax.switch`` branch per phase over the other buckets' leaves only."""
    sums, new_rs = _reduce_flat(plan, phases[-1], flat, [groups[b] for b in fixed])
    switched = [g for b, g in enumerate(groups) if b not in fixed]
    inside = sorted(i for g in switched for i in g)
    where = {i: k for k, i in enumerate(inside)}
    local = [[where[i] for i in g] for g in switched]
    branches = [functools.partial(_branch, plan, algo, flat, local) for algo in phases]
    phase = jnp.searchsorted(jnp.asarray(plan.starts), flat.count, side="right") - 1
    sub_rs = None if flat.rs is None else [flat.rs[i] for i in inside]
    token, (sub_sums, sub_new_rs) = lax.switch(
        phase, branches, _ordering.token_in(), [flat.xs[i] for i in inside], sub_rs
    )
    _ordering.token_out(token)
    for k, i in enumerate(inside):
        sums[i] = sub_sums[k]
        if new_rs is not None:
            new_rs[i] = sub_new_rs[k]
    return sums, new_rs


def _branch(
    plan: Plan, algo: Any, flat: _Flat, groups: list[list[int]], token: jax.Array,
    xs: list, rs: list | None,
) -> tuple:  # fmt: skip
    """One phase's branch of the schedule's switch. The ordering token is threaded through
    the switch so the branch's collectives stay chained with the step's other jaxcomm calls."""
    _ordering.token_out(token)
    out = _reduce_flat(plan, algo, flat._replace(xs=xs, rs=rs), groups)
    return _ordering.token_in(), out


class _Started(NamedTuple):
    """A bucket whose collective is issued: what its done needs, and where its sum goes."""

    group: list[int]  # its leaves
    kept: list  # the operands a deferred done keeps alive
    results: list  # [sum] or [sum, residual]
    residual: jax.Array | None  # the bucket's residual (kept as it is when sent dense)
    ticket: jax.Array | None  # the ordering token after the start (deferred only)
    deferred: bool  # its done comes after every start


def _reduce_flat(
    plan: Plan, algo: Any, flat: _Flat, groups: list[list[int]]
) -> tuple[list, list | None]:
    """One collective per bucket over flat leaves; returns (sums, residuals).

    ``groups``: the buckets (leaf indices into ``flat.xs``) to reduce; a leaf in none keeps
    its value.
    """
    # One dtype for every sum, whatever each bucket's wire: every phase of a density
    # schedule (auto may send a bucket dense on the 16-bit wire in one phase and compressed in
    # another) must return the same dtypes, as lax.switch requires.
    sum_dtype = flat.wire if plan.dense_dtype is None else F32
    sums: list[jax.Array] = list(flat.xs)
    new_rs: list[jax.Array] | None = None if flat.rs is None else list(flat.rs)
    flat = flat._replace(total=max(1, flat.total))
    split = plan.overlap and len(groups) > 1
    # Overlap: every bucket's collective is split (``DeferDone``), and all the dones come
    # after the last start, each also waiting for the last bucket's gradients (the first
    # layers', which backward produces last): the collectives run while backward computes the
    # earlier layers. A done placed between two starts would let XLA schedule the later start
    # after it, and buffer reuse would then hold that start until the earlier bucket had
    # finished on the wire (docs/overlap.md).
    defer = _call.DeferDone() if split else None
    # A compressor's selection or quantization runs on jaxcomm's engine thread: on a process
    # with one core it takes that core from backward, so splitting it hides nothing and costs
    # the hand-off (docs/overlap.md). It is split only where a core is to spare.
    spare_core = cores() > 1
    # A deferred done must keep alive every operand the engine reads (emit_done's `kept`):
    # the bucket and, for a compressor, the step operand, made here so it is the one passed.
    step = _validate.step_operand(flat.count, "jaxcomm.optax.allreduce_gradients")
    started = [_start(plan, algo, flat, g, defer, spare_core, step) for g in groups]
    anchor = None
    if split:
        # The chain's head after the last start: every bucket's gradients exist by then (each
        # start consumed its own). The leaves themselves would be a later read of a bucket
        # that a start summed in place, which XLA would copy.
        anchor = _ordering.token_in()
        if len(defer.splits) != sum(1 for s in started if s.deferred):
            raise AssertionError("allreduce_gradients: a bucket's collective was not issued")
    splits = iter(defer.splits if split else ())
    for s in started:
        results = s.results
        if s.deferred and next(splits):
            results = _call.emit_done(s.ticket, results, s.kept, anchor)
        summed = results[0]
        r = results[1] if len(results) > 1 else s.residual
        offset = 0
        for i in s.group:
            n = flat.xs[i].size
            sums[i] = summed[offset : offset + n].astype(sum_dtype)
            if algo is not None:
                new_rs[i] = r[offset : offset + n]
            offset += n
    return sums, new_rs


def _start(
    plan: Plan, algo: Any, flat: _Flat, group: list[int], defer: Any,
    spare_core: bool, step: jax.Array,
) -> _Started:  # fmt: skip
    """Issues one bucket's collective: deferred (its done after every start) when ``defer``
    is given and, for a compressor, a core is to spare."""
    xs, rs = flat.xs, flat.rs
    n = sum(xs[i].size for i in group)
    # "auto" picks per bucket from the cost model (static: the same on every rank); a bucket
    # it sends dense keeps its (zero) residual.
    chosen = cost.auto_algorithm(
        algo, n, plan.axis_name, plan.hierarchical, n / flat.total, flat.wire.itemsize
    )
    # A dense bucket travels in the dense wire's dtype; compressors quantize float32, as their
    # residuals. Each leaf is cast as it is concatenated (one pass), so a compressed bucket of
    # float32 gradients is never cast at all.
    dtype = flat.wire if chosen is None else F32
    parts = [xs[i].astype(dtype) for i in group]
    x = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    r = None
    if algo is not None:
        r = jnp.concatenate([rs[i] for i in group]) if len(group) > 1 else rs[group[0]]
    deferred = defer is not None and (chosen is None or spare_core)
    after = defer if deferred else None
    if chosen is None:
        summed = allreduce(x, plan.axis_name, after=after, **plan.extra)
        # A split dense call may sum in place (x then is the result, which the done takes
        # anyway); keeping x as well would make XLA copy it before the start.
        in_place = deferred and 0 in defer.donated[-1]
        results, kept = [summed], [] if in_place else [x]
    else:
        # The update count is the step of a stochastic rounding (BlockQuant).
        summed, r = compressed_allreduce(
            x, r, plan.axis_name, chosen, after=after, step=step, **plan.extra
        )
        # The engine reads the bucket and the step; r is aliased to the new residual.
        results, kept = [summed, r], [x, step]
    ticket = _ordering.token_in() if deferred else None
    return _Started(group, kept, results, r, ticket, deferred)
