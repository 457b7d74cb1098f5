"""Optax gradient transformation that averages gradients with jaxcomm's collectives.

``allreduce_gradients`` goes first in an ``optax.chain`` inside a jitted, shard_mapped
training step: it sums every rank's gradient over the data-parallel axis with a dense UCX ring
(``algorithm=None``) or a compressed allreduce with error feedback, divides by the number of
ranks, and hands the average to the rest of the chain.

Design choices (measured on 2 CPU cores, 4 devices, see ``tests/test_optax.py``):

- **Buckets, in the order backward produces them.** Leaves are raveled and concatenated into
  float32 buckets (dense reduction: the leaves' common dtype, so an all-bf16 tree uses the
  16-bit wire) of at most ``bucket_size`` elements (a larger leaf is a bucket of its own),
  walking the leaves in *reverse* tree order: backward computes the last layer's gradient first,
  and a model's tree lists layers first to last (PyTorch DDP buckets in reverse parameter order
  for the same reason). A small model is a single bucket, so gTop-k selects the k largest
  entries of the whole model, as in the paper.
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

import dataclasses
import importlib
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec

from jaxcomm import _ordering, _validate, algorithms, cost
from jaxcomm.collectives import _call, allreduce, compressed_allreduce
from jaxcomm.cost import measure

AxisName = str | tuple[str, ...]
DEFAULT_BUCKET_SIZE = 1 << 24  # elements (64 MiB of float32; docs/benchmarks.md)

# The paper's warm-up densities, one per epoch (Shi et al. 2019, §5).
GTOPK_WARMUP = (0.25, 0.0725, 0.015, 0.004)


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


def _cores() -> int:
    """Cores this process may run on (its affinity: 1 on a node pinned to one core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _axis_size(axis_name: AxisName) -> int:
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    return math.prod(lax.axis_size(n) for n in names)


def _normalize_schedule(
    schedule: Mapping[int, float] | Sequence[tuple[int, float]], algorithm: Any
) -> tuple[np.ndarray, list[Any]]:
    """Returns (start steps, algorithm per phase) of a density schedule.

    ``auto`` takes the schedule too: each phase chooses per bucket with that phase's density
    for its sparse candidates (in a dense warm-up phase a sparse algorithm is expensive, and
    auto may pick another), so its sparse choices follow the same warm-up as explicit ones.
    """
    if _is_auto(algorithm):
        auto = cost.Auto() if isinstance(algorithm, str) else algorithm

        def at(density: float) -> Any:
            return dataclasses.replace(
                auto, options=dataclasses.replace(auto.options, density=density)
            )
    elif hasattr(algorithm, "density") and dataclasses.is_dataclass(algorithm):

        def at(density: float) -> Any:
            return dataclasses.replace(algorithm, density=density)
    else:
        raise ValueError(
            f"density_schedule needs an algorithm with a density (GTopK, TopKAllgather) or "
            f"'auto', got {algorithm!r}"
        )
    items = sorted(dict(schedule).items() if isinstance(schedule, Mapping) else schedule)
    if not items:
        raise ValueError("density_schedule is empty; pass None for a constant density")
    starts = [int(s) for s, _ in items]
    if len(set(starts)) != len(starts) or starts[0] < 0:
        raise ValueError(f"density_schedule steps must be distinct and >= 0, got {starts}")
    phases = [at(float(d)) for _, d in items]
    if starts[0] > 0:  # before the first scheduled step the algorithm's own density applies
        starts.insert(0, 0)
        phases.insert(0, algorithm)
    return np.asarray(starts, np.int32), phases


def _buckets(
    sizes: Sequence[int], bucket_size: int, first_bucket_size: int | None = None
) -> list[list[int]]:
    """Groups leaf indices, last leaf first, so that each group holds <= bucket_size elements.

    Leaves keep tree order inside a bucket (a model that fits one bucket is concatenated as
    before); the buckets come last leaf first. Reverse tree order approximates the order
    backward produces the gradients (last layer first), so the first bucket is ready, and on
    the wire, while backward still runs. The first bucket holds at most ``first_bucket_size``
    (default: ``bucket_size``) elements: a small one goes on the wire sooner.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes))):
        n = sizes[i]
        if n == 0:
            continue
        cap = bucket_size if groups or first_bucket_size is None else first_bucket_size
        if current and filled + n > cap:
            groups.append(sorted(current))
            current, filled = [], 0
        current.append(i)
        filled += n
    if current:
        groups.append(sorted(current))
    return groups


_UNSET: Any = object()


def _is_auto(algorithm: Any) -> bool:
    return isinstance(algorithm, (str, cost.Auto))


def _deprecated_compressor(algorithm: Any, compressor: Any) -> Any:
    """``algorithm``, or the value of the old ``compressor=`` keyword (with a warning)."""
    if compressor is _UNSET:
        return algorithm
    if algorithm is not None:
        raise TypeError(
            "allreduce_gradients: pass the algorithm once, as `algorithm=` (`compressor=` is "
            "its deprecated name)"
        )
    warnings.warn(
        "allreduce_gradients(compressor=...) is deprecated: the argument is called "
        "`algorithm`, as in jaxcomm.compressed_allreduce (e.g. algorithm=jaxcomm.GTopK(0.01))",
        DeprecationWarning,
        stacklevel=3,
    )
    return compressor


def gtopk_warmup_schedule(
    steps_per_epoch: int, density: float, warmup: Sequence[float] = GTOPK_WARMUP
) -> dict[int, float]:
    """The gTop-k paper's warm-up: one density per epoch, then ``density`` for good.

    Densities of the warm-up that are not above ``density`` are dropped.

    Args:
      steps_per_epoch: optimizer steps per epoch.
      density: the density after the warm-up.
      warmup: densities of the first epochs (default 0.25, 0.0725, 0.015, 0.004).

    Returns:
      A ``{start step: density}`` mapping for ``density_schedule``.

    Example:
      >>> gtopk_warmup_schedule(10, 0.01)
      {0: 0.25, 10: 0.0725, 20: 0.015, 30: 0.01}
    """
    phases = [d for d in warmup if d > density] + [density]
    return {i * int(steps_per_epoch): float(d) for i, d in enumerate(phases)}


def allreduce_gradients(
    axis_name: AxisName,
    algorithm: Any = None,
    *,
    hierarchical: bool = False,
    mean: bool = True,
    density_schedule: Mapping[int, float] | Sequence[tuple[int, float]] | None = None,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    first_bucket_size: int | None = None,
    overlap: bool = True,
    dense_dtype: Any = None,
    compressor: Any = _UNSET,
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
      compressor: deprecated name of ``algorithm`` (a DeprecationWarning; passing both is a
        TypeError).

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
    algorithm = _deprecated_compressor(algorithm, compressor)
    leafwise = _leafwise(algorithm)
    if leafwise is not None:
        if density_schedule is not None:
            raise ValueError(
                f"density_schedule needs an algorithm with a density; {algorithm!r} has none "
                "(PowerSGD's dense warm-up is PowerSGD(start_step=...))"
            )
        inner = _leafwise_transformation(leafwise, algorithm, axis_name, mean, hierarchical)
        if dense_dtype is None:
            return inner

        # PowerSGD's dense leaves travel in the tree's dtype: the tree is cast first (its
        # factors are float32 either way); the state keeps its type.
        def cast_update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
            updates = jax.tree.map(lambda g: g.astype(dense_dtype), updates)
            return inner.update(updates, state, params)

        return optax.GradientTransformation(inner.init, cast_update)
    if int(bucket_size) < 1:
        raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
    bucket_size = int(bucket_size)
    if first_bucket_size is not None and int(first_bucket_size) < 1:
        raise ValueError(f"first_bucket_size must be >= 1 element or None, got {first_bucket_size}")
    extra: dict[str, Any] = {}
    if hierarchical:
        extra["hierarchical"] = True
    if density_schedule is not None:
        if algorithm is None:
            raise ValueError(
                "density_schedule needs an algorithm; the dense allreduce has no density"
            )
        starts, phases = _normalize_schedule(density_schedule, algorithm)
    else:
        starts, phases = np.zeros(1, np.int32), [algorithm]

    # Dense buckets travel in dense_dtype, else the gradients' common dtype (an all-bf16 tree
    # uses the 16-bit wire of jaxcomm.allreduce, and "auto" weighs that wire against the
    # compressors); compressed ones in float32, the dtype of the residuals. The hierarchical
    # allreduce under a compressor or auto has no 16-bit wire.
    f32 = jnp.dtype(jnp.float32)
    keeps_dtype = algorithm is None or (_is_auto(algorithm) and not hierarchical)
    if dense_dtype is not None:
        if jnp.dtype(dense_dtype) not in (f32, jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise ValueError(
                f"dense_dtype must be float32, bfloat16, float16 or None, got {dense_dtype}"
            )
        if hierarchical and algorithm is not None and jnp.dtype(dense_dtype) != f32:
            raise ValueError(
                f"dense_dtype={jnp.dtype(dense_dtype).name}: the hierarchical allreduce has no "
                "16-bit wire here; pass dense_dtype=None or jnp.float32"
            )

    def dense_wire_of(leaves: list[Any]) -> Any:
        if dense_dtype is not None:
            return jnp.dtype(dense_dtype)
        return jnp.dtype(jnp.result_type(*leaves)) if keeps_dtype and leaves else f32

    def init_fn(params: Any) -> AllreduceGradientsState:
        residuals = None
        if algorithm is not None:
            residuals = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p) or (1,), jnp.float32), params)
        return AllreduceGradientsState(count=jnp.zeros((), jnp.int32), residuals=residuals)

    def reduce_flat(
        algo: Any,
        xs: list[jax.Array],
        rs: list[jax.Array] | None,
        count: jax.Array,
        groups: list[list[int]],
        total: int,
        dense_wire: Any,
    ) -> tuple:
        """One collective per bucket over flat leaves; returns (sums, residuals).

        ``groups``: the buckets (leaf indices into ``xs``) to reduce; a leaf in none keeps its
        value. ``total``: the step's elements (auto gives each bucket its share of the step's
        compute). ``dense_wire``: the whole step's dense wire dtype (``dense_wire_of``)."""
        # One dtype for every sum, whatever each bucket's wire: every phase of a density
        # schedule (auto may send a bucket dense on the 16-bit wire in one phase and
        # compressed in another) must return the same dtypes, as lax.switch requires.
        sum_dtype = dense_wire if dense_dtype is None else f32
        sums: list[jax.Array] = list(xs)
        new_rs: list[jax.Array] | None = None if rs is None else list(rs)
        total = max(1, total)
        split = overlap and len(groups) > 1
        # Overlap: every bucket's collective is split (``DeferDone``), and all the dones come
        # after the last start, each also waiting for the last bucket's gradients (the first
        # layers', which backward produces last): the collectives run while backward computes
        # the earlier layers. A done placed between two starts would let XLA schedule the later
        # start after it, and buffer reuse would then hold that start until the earlier
        # bucket had finished on the wire (docs/overlap.md).
        defer = _call.DeferDone() if split else None
        # A compressor's selection or quantization runs on jaxcomm's engine thread: on a
        # process with one core it takes that core from backward, so splitting it hides
        # nothing and costs the hand-off (gTop-k: 3-10 % slower split on 1-core nodes,
        # docs/overlap.md). It is split only where a core is to spare.
        spare_core = _cores() > 1
        # A deferred done must keep alive every operand the engine reads (emit_done's `kept`):
        # the bucket and, for a compressor, the step operand, made here so it is the one passed.
        step = _validate.step_operand(count, "jaxcomm.optax.allreduce_gradients")
        started = []
        for group in groups:
            n = sum(xs[i].size for i in group)
            # "auto" picks per bucket from the cost model (static: the same on every rank);
            # a bucket it sends dense keeps its (zero) residual.
            chosen = cost.auto_algorithm(
                algo, n, axis_name, hierarchical, n / total, dense_wire.itemsize
            )
            # A dense bucket travels in the dense wire's dtype; compressors quantize float32,
            # as their residuals. Each leaf is cast as it is concatenated (one pass), so a
            # compressed bucket of float32 gradients is never cast at all.
            dtype = dense_wire if chosen is None else jnp.dtype(jnp.float32)
            parts = [xs[i].astype(dtype) for i in group]
            x = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
            r = None
            if algo is not None:
                r = jnp.concatenate([rs[i] for i in group]) if len(group) > 1 else rs[group[0]]
            deferred = split and (chosen is None or spare_core)
            after = defer if deferred else None
            if chosen is None:
                summed = allreduce(x, axis_name, after=after, **extra)
                # A split dense call may sum in place (x then is the result, which the done
                # takes anyway); keeping x as well would make XLA copy it before the start.
                in_place = deferred and 0 in defer.donated[-1]
                results, kept = [summed], [] if in_place else [x]
            else:
                # The update count is the step of a stochastic rounding (BlockQuant).
                summed, r = compressed_allreduce(
                    x, r, axis_name, chosen, after=after, step=step, **extra
                )
                # The engine reads the bucket and the step; r is aliased to the new residual.
                results, kept = [summed, r], [x, step]
            # A bucket sent dense keeps its (zero) residual r; a compressor returns a new one.
            ticket = _ordering.token_in() if deferred else None
            started.append((group, kept, results, r, ticket, deferred))
        if split:
            # The chain's head after the last start: every bucket's gradients exist by then
            # (each start consumed its own). The leaves themselves would be a later read of
            # a bucket that a start summed in place, which XLA would copy.
            anchor = _ordering.token_in()
            if len(defer.splits) != sum(1 for *_, deferred in started if deferred):
                raise AssertionError("allreduce_gradients: a bucket's collective was not issued")
        splits = iter(defer.splits if split else ())
        for group, kept, results, r, ticket, deferred in started:
            if deferred and next(splits):
                results = _call.emit_done(ticket, results, kept, anchor)
            summed = results[0]
            r = results[1] if len(results) > 1 else r
            offset = 0
            for i in group:
                n = xs[i].size
                sums[i] = summed[offset : offset + n].astype(sum_dtype)
                if algo is not None:
                    new_rs[i] = r[offset : offset + n]
                offset += n
        return sums, new_rs

    def _auto_phases(
        phases: list[Any],
        starts: np.ndarray,
        groups: list[list[int]],
        xs: list[jax.Array],
        wire: Any,
    ) -> tuple[list[Any], list[int]]:
        """The phases auto follows, and the buckets (indices into ``groups``) that choose the
        same density-free algorithm in every one of them (``wire``: the step's dense wire
        dtype, whose width auto weighs).

        The phases are the schedule, or its last phase from the first step when the cost
        model predicts the target sooner without the warm-up (:func:`jaxcomm.cost.warmup_pays`;
        static, the same on every rank). A bucket whose choice never changes is reduced
        outside the schedule's ``lax.switch``: the switch's operands are copied in and out of
        its branches, so a gradient inside it costs even when every branch sends it alike
        (lbann-mlp on one host, all dense: 0.38-0.40 s per step inside the switch, 0.25 s
        without; docs/e2e.md)."""
        sizes = [sum(xs[i].size for i in g) for g in groups]
        autos = [cost.Auto() if isinstance(p, str) else p for p in phases]  # "auto": defaults
        auto = autos[-1]
        decision = cost.warmup_pays(
            auto,
            sizes,
            [int(s) for s in starts],
            [a.options.density for a in autos],
            _axis_size(axis_name),
            jax.process_count(),
            jax.local_device_count(),
            hierarchical,
            wire.itemsize,
        )
        if not decision["warmup"]:
            # Without the warm-up the choices weigh the steps they need without it.
            return [dataclasses.replace(auto, steps_factor=auto.steps_factor_no_warmup)], []
        choices = decision["choices"]
        fixed = [
            b
            for b in range(len(groups))
            if len({names[b] for names in choices}) == 1
            and not algorithms.get(choices[-1][b]).uses_density
        ]
        return phases, fixed

    def update_fn(
        updates: Any, state: AllreduceGradientsState, params: Any = None
    ) -> tuple[Any, AllreduceGradientsState]:
        del params
        leaves, treedef = jax.tree.flatten(updates)
        xs = [jnp.ravel(g) for g in leaves]
        rs = None
        if algorithm is not None:
            r_leaves = treedef.flatten_up_to(state.residuals)
            rs = [jnp.ravel(r) for r in r_leaves]
        groups = _buckets([x.size for x in xs], bucket_size, first_bucket_size)
        total, wire = sum(x.size for x in xs), dense_wire_of(xs)
        if _is_auto(algorithm):  # without a profile, auto first measures the world it runs in
            measure.prepare(algorithm, [sum(xs[i].size for i in g) for g in groups])
        followed, fixed = phases, []
        if len(phases) > 1 and _is_auto(algorithm) and groups:
            followed, fixed = _auto_phases(phases, starts, groups, xs, wire)
        if len(followed) == 1 or not groups or len(fixed) == len(groups):
            sums, new_rs = reduce_flat(followed[-1], xs, rs, state.count, groups, total, wire)
        else:
            # The buckets that every phase sends alike go first, outside the switch.
            sums, new_rs = reduce_flat(
                followed[-1], xs, rs, state.count, [groups[b] for b in fixed], total, wire
            )
            switched = [g for b, g in enumerate(groups) if b not in fixed]
            inside = sorted(i for g in switched for i in g)
            where = {i: k for k, i in enumerate(inside)}
            local = [[where[i] for i in g] for g in switched]

            # One branch per density, over the other buckets' leaves only. The ordering
            # token is threaded through the switch so the branch's collectives stay chained
            # with the step's other jaxcomm calls.
            def branch(algo: Any) -> Callable[..., Any]:
                def run(token: jax.Array, xs: list, rs: list | None) -> tuple:
                    _ordering.token_out(token)
                    out = reduce_flat(algo, xs, rs, state.count, local, total, wire)
                    return _ordering.token_in(), out

                return run

            phase = jnp.searchsorted(jnp.asarray(starts), state.count, side="right") - 1
            sub_rs = None if rs is None else [rs[i] for i in inside]
            token, (sub_sums, sub_new_rs) = lax.switch(
                phase,
                [branch(a) for a in phases],
                _ordering.token_in(),
                [xs[i] for i in inside],
                sub_rs,
            )
            _ordering.token_out(token)
            for k, i in enumerate(inside):
                sums[i] = sub_sums[k]
                if new_rs is not None:
                    new_rs[i] = sub_new_rs[k]
        scale = 1.0 / _axis_size(axis_name) if mean else 1.0
        out = [
            (s * scale if mean else s).reshape(jnp.shape(g)).astype(g.dtype)
            for s, g in zip(sums, leaves, strict=True)
        ]
        residuals = None
        if algorithm is not None:
            residuals = treedef.unflatten(
                [r.reshape(old.shape) for r, old in zip(new_rs, r_leaves, strict=True)]
            )
        count = optax.safe_int32_increment(state.count)
        return treedef.unflatten(out), AllreduceGradientsState(count, residuals)

    return optax.GradientTransformation(init_fn, update_fn)


def _leafwise(algorithm: Any) -> Any:
    """The module of jaxcomm.collectives that runs a leaf-shaped algorithm (PowerSGD), else None.

    Everything else (None, "auto", a flat compressor, or a wrong type, which the bucket path
    rejects with its own message) goes through the buckets.
    """
    if algorithm is None or isinstance(algorithm, (str, cost.Auto)):
        return None
    try:
        record = algorithms.of(algorithm)
    except TypeError:
        return None
    if record.leafwise is None:
        return None
    return importlib.import_module(f"jaxcomm.collectives.{record.leafwise}")


def _leafwise_transformation(
    module: Any, spec: Any, axis_name: AxisName, mean: bool, hierarchical: bool
) -> optax.GradientTransformation:
    """``allreduce_gradients`` for a leaf-shaped algorithm: ``module.init`` and
    ``module.reduce`` see the whole tree, leaf by leaf, instead of flat buckets."""

    def flatten(tree: Any) -> tuple[list, list[str], Any]:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
        names = [jax.tree_util.keystr(path) for path, _ in pairs]
        return [leaf for _, leaf in pairs], names, treedef

    def init_fn(params: Any) -> AllreduceGradientsState:
        leaves, names, treedef = flatten(params)
        residuals, shared = module.init(leaves, spec, names)
        return AllreduceGradientsState(
            count=jnp.zeros((), jnp.int32),
            residuals=treedef.unflatten(residuals),
            shared=treedef.unflatten(shared),
        )

    def update_fn(
        updates: Any, state: AllreduceGradientsState, params: Any = None
    ) -> tuple[Any, AllreduceGradientsState]:
        del params
        leaves, names, treedef = flatten(updates)
        outs, residuals, shared = module.reduce(
            leaves,
            treedef.flatten_up_to(state.residuals),
            treedef.flatten_up_to(state.shared),
            state.count,
            axis_name,
            spec,
            names=names,
            mean=mean,
            hierarchical=hierarchical,
        )
        count = optax.safe_int32_increment(state.count)
        new_state = AllreduceGradientsState(
            count, treedef.unflatten(residuals), treedef.unflatten(shared)
        )
        return treedef.unflatten(outs), new_state

    return optax.GradientTransformation(init_fn, update_fn)


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
      >>> tx = allreduce_gradients("dp", jaxcomm.GTopK(0.01))
      >>> specs = partition_specs(jax.eval_shape(tx.init, params), "dp")
      >>> specs.residuals["layer0"]["w"] == P("dp")
      True
    """

    def split(tree: Any) -> Any:
        return jax.tree.map(lambda _: PartitionSpec(axis_name), tree)

    def visit(node: Any) -> Any:
        if isinstance(node, AllreduceGradientsState):
            return AllreduceGradientsState(
                count=PartitionSpec(),
                residuals=split(node.residuals),
                shared=jax.tree.map(lambda _: PartitionSpec(), node.shared),
            )
        if isinstance(node, DiLoCoState):
            return DiLoCoState(
                count=PartitionSpec(),
                local=split(node.local),
                inner=split(node.inner),
                outer=jax.tree.map(lambda _: PartitionSpec(), node.outer),
                residuals=split(node.residuals),
                pending=split(node.pending),
            )
        return PartitionSpec()

    kinds = (AllreduceGradientsState, DiLoCoState)
    return jax.tree.map(visit, state, is_leaf=lambda x: isinstance(x, kinds))


def _checkpointer() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            "jaxcomm.optax.save_state/restore_state use Orbax: python -m pip install "
            "'jaxcomm[checkpoint]' (or orbax-checkpoint)"
        ) from e
    return ocp.StandardCheckpointer()


def save_state(path: str | os.PathLike, tree: Any) -> None:
    """Saves a tree of (possibly sharded) jax.Arrays with Orbax, every shard bit-exact.

    Each rank's error-feedback residual is a shard of an array sharded over the data-parallel
    axis (:func:`partition_specs`), so it is saved as it is, and :func:`restore_state` gives
    every rank back its own residual: training resumes bit for bit where it stopped (the
    residuals are not reset on load, unlike DeepSpeed's 1-bit Adam). Every process must call
    it (Orbax writes its addressable shards and meets the others); it returns once the
    checkpoint is on disk.

    Args:
      path: the checkpoint directory (replaced if it exists).
      tree: a pytree of jax.Arrays (e.g. ``(params, opt_state)``).

    Returns:
      None.

    Raises:
      ImportError: Orbax is not installed (the ``checkpoint`` extra).

    Example:
      >>> import tempfile
      >>> save_state(tempfile.mkdtemp() + "/step100", params)
    """
    checkpointer = _checkpointer()
    checkpointer.save(os.path.abspath(path), tree, force=True)
    checkpointer.wait_until_finished()


def restore_state(path: str | os.PathLike, like: Any) -> Any:
    """Restores what :func:`save_state` wrote, with the shardings of ``like``.

    Args:
      path: the directory given to ``save_state``.
      like: a tree of the same structure whose leaves have ``.shape``, ``.dtype`` and
        ``.sharding`` (e.g. the freshly initialized state, or ``jax.ShapeDtypeStruct``).

    Returns:
      The restored tree of jax.Arrays, bit-identical to what was saved.

    Raises:
      ValueError: a leaf of ``like`` whose dtype or shape differs from the saved one (Orbax
        would cast it), or that the checkpoint lacks.
      ImportError: Orbax is not installed (the ``checkpoint`` extra).

    Example:
      >>> import tempfile
      >>> path = tempfile.mkdtemp() + "/step100"
      >>> save_state(path, params)
      >>> restored = restore_state(path, params)
      >>> bool((restored["layer0"]["w"] == params["layer0"]["w"]).all())
      True
    """
    checkpointer = _checkpointer()
    path = os.path.abspath(path)
    metadata = checkpointer.metadata(path)
    saved = {m.name: m for m in jax.tree.leaves(getattr(metadata, "item_metadata", metadata))}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(like)[0]:
        name = ".".join(_key_name(k) for k in keys)
        if name not in saved:
            raise ValueError(f"restore_state: {path} has no leaf {name!r}; saved: {sorted(saved)}")
        m = saved[name]
        if np.dtype(m.dtype) != np.dtype(leaf.dtype) or tuple(m.shape) != tuple(leaf.shape):
            raise ValueError(
                f"restore_state: leaf {name!r} was saved as {np.dtype(m.dtype)}{list(m.shape)}, "
                f"`like` has {np.dtype(leaf.dtype)}{list(leaf.shape)}"
            )
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    return checkpointer.restore(path, abstract)


def _key_name(key: Any) -> str:
    """One part of a leaf's name in Orbax's metadata (``1.0.count``)."""
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


# ---- DiLoCo: H local steps, then an outer step on the averaged pseudo-gradient -----------------

DILOCO_OUTER_LR = 0.7
"""The outer learning rate of DiLoCo (Douillard et al. 2023), :func:`diloco`'s default."""
DILOCO_OUTER_MOMENTUM = 0.9
"""The outer Nesterov momentum of DiLoCo, :func:`diloco`'s default."""
STREAMING_MIX = 0.5
"""Streaming DiLoCo's alpha: how much of its own parameters a rank keeps when a delayed outer
step lands (Douillard et al. 2025, §2.3)."""
DILOCO_STREAM = 1 << 20
"""Stream id of fragment 0's detached outer allreduce (fragment f: ``DILOCO_STREAM + f``)."""


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
    from jaxcomm.collectives import handles

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
        from jaxcomm import algorithms

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
    if outer is None:
        outer = optax.sgd(DILOCO_OUTER_LR, momentum=DILOCO_OUTER_MOMENTUM, nesterov=True)
    mix = float(mix)
    offsets = [f * every // fragments for f in range(fragments)]
    wire = jnp.dtype(dense_dtype) if algorithm is None else jnp.dtype(jnp.float32)

    def layout(params: Any) -> list[list[int]]:
        return _fragments([int(np.prod(jnp.shape(p))) for p in jax.tree.leaves(params)], fragments)

    def flat(leaves: list) -> jax.Array:
        return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])

    def pending_results(n: int) -> tuple:
        if algorithm is None:
            return (((n,), wire.name),)
        return (((n,), "float32"), ((n,), "float32"))

    def init_fn(params: Any) -> DiLoCoState:
        leaves = jax.tree.leaves(params)
        groups = layout(params)
        sizes = [sum(int(np.prod(jnp.shape(leaves[i]))) for i in g) for g in groups]
        outer_states = tuple(
            outer.init([jnp.asarray(leaves[i], jnp.float32) for i in g]) for g in groups
        )
        residuals = None
        if algorithm is not None:
            residuals = tuple(jnp.zeros((1, n), jnp.float32) for n in sizes)
        pending = None
        if delay > 0:
            if overlap:
                pending = tuple(
                    (
                        handles.Pending(jnp.zeros((1, 2), jnp.int32), pending_results(n)),
                        jnp.zeros((1, n), jnp.float32),
                    )
                    for n in sizes
                )
            else:
                pending = tuple(jnp.zeros((1, n), jnp.float32) for n in sizes)
        return DiLoCoState(
            count=jnp.zeros((), jnp.int32),
            local=_per_rank(params),
            inner=_per_rank(inner.init(params)),
            outer=outer_states,
            residuals=residuals,
            pending=pending,
        )

    def reduce_now(delta: jax.Array, residual: jax.Array | None) -> tuple:
        """The blocking average of Δ over the axis, and the new residual."""
        size = _axis_size(axis_name)
        if algorithm is None:
            summed = allreduce(delta.astype(wire), axis_name).astype(jnp.float32)
            return summed / size, None
        summed, residual = compressed_allreduce(delta, residual[0], axis_name, algorithm)
        return summed / size, residual[None]

    def local_params(state: DiLoCoState) -> Any:
        return _of_rank(state.local)

    def apply_outer(avg: jax.Array, g_part: list, l_part: list, o_state: Any) -> tuple:
        """θ_global += outer(mean Δ) on one fragment; each rank restarts from it (delayed:
        keeps ``mix`` of its own parameters)."""
        g32 = [x.astype(jnp.float32) for x in g_part]
        pieces, offset = [], 0
        for x in g32:
            pieces.append(avg[offset : offset + x.size].reshape(x.shape))
            offset += x.size
        updates, o_state = outer.update(pieces, o_state, g32)
        new_g = [(x + u).astype(x0.dtype) for x, u, x0 in zip(g32, updates, g_part, strict=True)]
        if delay == 0 or mix == 0.0:
            return new_g, list(new_g), o_state
        new_l = [
            (mix * lo.astype(jnp.float32) + (1.0 - mix) * ng.astype(jnp.float32)).astype(lo.dtype)
            for lo, ng in zip(l_part, new_g, strict=True)
        ]
        return new_g, new_l, o_state

    def sync(ops: tuple) -> tuple:
        """delay == 0: average Δ now and apply it."""
        g_p, l_p, o_state, res = ops
        avg, res = reduce_now(flat(g_p) - flat(l_p), res)
        new_g, new_l, o_state = apply_outer(avg, g_p, l_p, o_state)
        return new_g, new_l, o_state, res

    def land(ops: tuple) -> tuple:
        """delay > 0: the outer gradient started `delay` steps ago is applied."""
        g_p, l_p, o_state, res, pend = ops
        if overlap:
            out = handles.wait(pend[0])
            summed, res = (out, res) if algorithm is None else (out[0], out[1][None])
            avg = summed.astype(jnp.float32) / _axis_size(axis_name)
        else:
            avg = pend[0]
        new_g, new_l, o_state = apply_outer(avg, g_p, l_p, o_state)
        return new_g, new_l, o_state, res, pend

    def send(delta: jax.Array, res: jax.Array | None, stream: int) -> Any:
        """Starts the detached average of Δ; the pending entry keeps Δ for restart()."""
        r = None if res is None else res[0]
        started = handles.start_allreduce(
            delta.astype(wire), axis_name, algorithm, r, stream=stream
        )
        return started, delta[None]

    def begin(stream: int) -> Callable[[tuple], tuple]:
        """delay > 0: start averaging Δ (detached) or average it now and keep it."""

        def run(ops: tuple) -> tuple:
            g_p, l_p, o_state, res, pend = ops
            delta = flat(g_p) - flat(l_p)
            if overlap:
                pend = send(delta, res, stream)
            else:
                avg, res = reduce_now(delta, res)
                pend = avg[None]
            return g_p, l_p, o_state, res, pend

        return run

    def resend(stream: int) -> Callable[[tuple], tuple]:
        """restart(): starts the kept Δ again in this process (the same residual as before)."""

        def run(ops: tuple) -> tuple:
            res, pend = ops
            return res, send(pend[1][0], res, stream)

        return run

    def schedule(count: jax.Array, f: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(starts, lands, in flight after this step) of fragment f at inner step `count`.

        Fragment f syncs at the steps ≡ offsets[f] (mod every), the first one at least one
        step in (fragment 0: after `every` steps); a start lands `delay` steps later.
        """
        first = offsets[f] or every
        phase = (count - offsets[f]) % every
        starts = (count >= first) & (phase == 0)
        lands = (count >= first + delay) & ((count - delay - offsets[f]) % every == 0)
        return starts, lands, (count >= first) & (phase < delay)

    def run_fragments(state: DiLoCoState, params: Any, local: Any, count: jax.Array, how: str):
        """Applies each fragment's due work; returns (params, local, outer, residuals, pending).

        how: "step" (land, then start, as scheduled), "flush" (land what is in flight).
        """
        g_leaves, treedef = jax.tree.flatten(params)
        l_leaves = jax.tree.leaves(local)
        outer_states = list(state.outer)
        residuals = [None] * fragments if state.residuals is None else list(state.residuals)
        pending = [None] * fragments if state.pending is None else list(state.pending)
        for f, group in enumerate(layout(params)):
            starts, lands, in_flight = schedule(count, f)
            g_part = [g_leaves[i] for i in group]
            l_part = [l_leaves[i] for i in group]
            if delay == 0 and how == "step":
                ops = (g_part, l_part, outer_states[f], residuals[f])
                g_part, l_part, outer_states[f], residuals[f] = _guarded(starts, sync, ops)
            elif delay > 0:
                ops = (g_part, l_part, outer_states[f], residuals[f], pending[f])
                if how == "flush":
                    ops = _guarded(in_flight, land, ops)
                else:
                    # Landing first: with delay < every a step never lands and starts one
                    # fragment, and a start always reads θ_global after the previous landing.
                    ops = _guarded(lands, land, ops)
                    ops = _guarded(starts, begin(DILOCO_STREAM + f), ops)
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

    def step_fn(grads: Any, state: DiLoCoState, params: Any) -> tuple[Any, DiLoCoState]:
        local = _of_rank(state.local)
        updates, inner_state = inner.update(grads, _of_rank(state.inner), local)
        local = optax.apply_updates(local, updates)
        count = optax.safe_int32_increment(state.count)
        params, local, outer_states, residuals, pending = run_fragments(
            state, params, local, count, "step"
        )
        new_state = DiLoCoState(
            count, _per_rank(local), _per_rank(inner_state), outer_states, residuals, pending
        )
        return params, new_state

    def flush_fn(state: DiLoCoState, params: Any) -> tuple[Any, DiLoCoState]:
        params, local, outer_states, residuals, pending = run_fragments(
            state, params, _of_rank(state.local), state.count, "flush"
        )
        return params, state._replace(
            local=_per_rank(local), outer=outer_states, residuals=residuals, pending=pending
        )

    def restart_fn(state: DiLoCoState) -> DiLoCoState:
        if delay == 0 or not overlap:
            return state
        residuals = [None] * fragments if state.residuals is None else list(state.residuals)
        pending = list(state.pending)
        for f in range(fragments):
            in_flight = schedule(state.count, f)[2]
            residuals[f], pending[f] = _guarded(
                in_flight, resend(DILOCO_STREAM + f), (residuals[f], pending[f])
            )
        return state._replace(pending=tuple(pending))

    return DiLoCo(init_fn, step_fn, local_params, flush_fn, restart_fn)


def _per_rank(tree: Any) -> Any:
    """Adds the per-rank leading axis of length 1 to every leaf (see :class:`DiLoCoState`)."""
    return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


def _of_rank(tree: Any) -> Any:
    """Removes the per-rank leading axis :func:`_per_rank` added."""
    return jax.tree.map(lambda x: x[0], tree)
