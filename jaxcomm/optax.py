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
  backward. The engine runs the buckets, last layer first, while backward computes the earlier
  layers (measured in ``benchmarks/overlap.py``; docs/usage.md, "Overlap with the backward pass").
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

from jaxcomm import _ordering, cost
from jaxcomm.collectives import allreduce, compressed_allreduce

AxisName = str | tuple[str, ...]
DEFAULT_BUCKET_SIZE = 1 << 24  # elements (64 MiB of float32; docs/benchmarks.md)

# The paper's warm-up densities, one per epoch (Shi et al. 2019, §5).
GTOPK_WARMUP = (0.25, 0.0725, 0.015, 0.004)


class AllreduceGradientsState(NamedTuple):
    """State of :func:`allreduce_gradients`.

    Attributes:
      count: int32 scalar, the number of updates applied (selects the scheduled density).
      residuals: error-feedback residuals, a float32 tree of the gradient's structure and
        shapes (``(1,)`` for scalar leaves), different on every rank; ``None`` when dense.
    """

    count: jax.Array
    residuals: Any


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
      hierarchical: reduce within a node first, then across nodes (``axis_name`` must then
        be a ("node", "local") pair of mesh axes; see ``jaxcomm.allreduce``).
      mean: divide the sum by the number of ranks (else return the sum).
      density_schedule: ``{start step: density}`` (or pairs); the algorithm's density is
        replaced by the entry of the latest start step <= the update count. Each distinct
        density is compiled once, as a ``lax.switch`` branch. See
        :func:`gtopk_warmup_schedule`.
      bucket_size: most elements fused into one collective call.
      first_bucket_size: most elements of the first bucket (the last layers'), ``None``: as
        ``bucket_size``. A small first bucket starts communication earlier in backward.
      overlap: await every bucket but the last only after the last bucket's gradients exist,
        so that, inside a jitted step that also computes the gradients, each bucket's
        collective runs while backward computes the earlier layers (CPU; on GPU the dense
        allreduce, on jaxcomm's own CUDA stream, while the compressed collectives are awaited
        where they are issued). ``False`` awaits each bucket at once.
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
    """
    algorithm = _deprecated_compressor(algorithm, compressor)
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

    def init_fn(params: Any) -> AllreduceGradientsState:
        residuals = None
        if algorithm is not None:
            residuals = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p) or (1,), jnp.float32), params)
        return AllreduceGradientsState(count=jnp.zeros((), jnp.int32), residuals=residuals)

    def reduce_flat(algo: Any, xs: list[jax.Array], rs: list[jax.Array] | None) -> tuple:
        """One collective per bucket over flat float32 leaves; returns (sums, residuals)."""
        sums: list[jax.Array] = list(xs)
        new_rs: list[jax.Array] | None = None if rs is None else list(rs)
        groups = _buckets([x.size for x in xs], bucket_size, first_bucket_size)
        total = max(1, sum(x.size for x in xs))
        # Every bucket but the last is awaited only after the last bucket's gradients exist
        # (the first layers', which backward produces last): its collective runs while
        # backward computes them (``after``, see jaxcomm.allreduce).
        anchor = [xs[i] for i in groups[-1]] if overlap and len(groups) > 1 else None
        for b, group in enumerate(groups):
            x = jnp.concatenate([xs[i] for i in group]) if len(group) > 1 else xs[group[0]]
            if algo is not None:
                r = jnp.concatenate([rs[i] for i in group]) if len(group) > 1 else rs[group[0]]
            after = anchor if b + 1 < len(groups) else None
            # "auto" picks per bucket from the cost model (static: the same on every rank);
            # a bucket it sends dense keeps its (zero) residual.
            chosen = cost.auto_algorithm(
                algo, x.size, axis_name, hierarchical, x.size / total, x.dtype.itemsize
            )
            if chosen is None:
                summed = allreduce(x, axis_name, after=after, **extra)
            else:
                # Compressors quantize float32, as their residuals; the sum comes back in the
                # bucket's dtype, so every phase of a density schedule (auto may send a bucket
                # dense on the 16-bit wire in one phase and compressed in another) returns the
                # same dtypes, as lax.switch requires.
                wire = x.dtype
                summed, r = compressed_allreduce(
                    x.astype(jnp.float32), r, axis_name, chosen, after=after, **extra
                )
                summed = summed.astype(wire)
            offset = 0
            for i in group:
                n = xs[i].size
                sums[i] = summed[offset : offset + n]
                if algo is not None:
                    new_rs[i] = r[offset : offset + n]
                offset += n
        return sums, new_rs

    def update_fn(
        updates: Any, state: AllreduceGradientsState, params: Any = None
    ) -> tuple[Any, AllreduceGradientsState]:
        del params
        leaves, treedef = jax.tree.flatten(updates)
        # Dense buckets travel in the gradients' common dtype (an all-bf16 tree uses the 16-bit
        # wire of jaxcomm.allreduce, and "auto" weighs that wire against the compressors);
        # compressed ones in float32, the dtype of the residuals. The hierarchical allreduce
        # has no 16-bit wire.
        keeps_dtype = algorithm is None or (_is_auto(algorithm) and not hierarchical)
        wire = jnp.result_type(*leaves) if keeps_dtype and leaves else jnp.float32
        xs = [jnp.ravel(g).astype(wire) for g in leaves]
        rs = None
        if algorithm is not None:
            r_leaves = treedef.flatten_up_to(state.residuals)
            rs = [jnp.ravel(r) for r in r_leaves]
        if len(phases) == 1 or not any(x.size for x in xs):
            sums, new_rs = reduce_flat(phases[0], xs, rs)
        else:
            # One branch per density. The ordering token is threaded through the switch so
            # the branch's collectives stay chained with the step's other jaxcomm calls.
            def branch(algo: Any) -> Callable[..., Any]:
                def run(token: jax.Array, xs: list, rs: list) -> tuple:
                    _ordering.token_out(token)
                    out = reduce_flat(algo, xs, rs)
                    return _ordering.token_in(), out

                return run

            phase = jnp.searchsorted(jnp.asarray(starts), state.count, side="right") - 1
            token, (sums, new_rs) = lax.switch(
                phase, [branch(a) for a in phases], _ordering.token_in(), xs, rs
            )
            _ordering.token_out(token)
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


def partition_specs(state: Any, axis_name: AxisName) -> Any:
    """PartitionSpecs for an optimizer state that contains :class:`AllreduceGradientsState`.

    Residual leaves are per rank and get ``P(axis_name)`` (each rank's residual stacked along
    the first dimension); every other leaf is replicated, ``P()``.

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

    def visit(node: Any) -> Any:
        if isinstance(node, AllreduceGradientsState):
            return AllreduceGradientsState(
                count=PartitionSpec(),
                residuals=jax.tree.map(lambda _: PartitionSpec(axis_name), node.residuals),
            )
        return PartitionSpec()

    return jax.tree.map(visit, state, is_leaf=lambda x: isinstance(x, AllreduceGradientsState))


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
