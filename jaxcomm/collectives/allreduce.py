"""Dense allreduce over UCX: ring reduce-scatter + allgather (C++ in ffi/allreduce.cc), and the
hierarchical variant over a (node, local) mesh (ffi/quantized_allreduce.cc)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm import _ordering, _validate
from jaxcomm.algorithms import dense
from jaxcomm.collectives import _attributes, _call, _mesh
from jaxcomm.collectives._call import DeferDone, threaded_call

# The dense algorithm's targets (jaxcomm/algorithms/dense.py); its 16-bit wire
# (ffi/allreduce_half.cc) is CPU only: GPU meshes widen to float32 and use NCCL.
_TARGETS = dense.ALGORITHM.targets


def allreduce(
    x: jax.Array,
    axis_name: str | Sequence[str],
    hierarchical: bool = False,
    hierarchical_scheme: str = "multi_leader",
    after: Any = None,
) -> jax.Array:
    """Sums ``x`` over the devices of ``axis_name``, like ``lax.psum``, over jaxcomm's UCX ring.

    Must be called inside ``jax.shard_map`` whose mesh spans all ``jax.devices()``. The sum
    is bit-identical on every rank; it may differ from ``lax.psum`` by float rounding (another
    summation order).

    bfloat16 and float16 inputs travel as 16-bit words (half the bytes of float32) and are
    summed in float32: each rank sends its 16-bit chunk straight to the chunk's owner, which
    adds the P contributions in float32 and rounds once, then a ring allgather shares the
    rounded chunks. The result has ``x``'s dtype and is the float32 sum rounded once (a
    16-bit ``lax.psum`` may round at every step). ``hierarchical=True`` and GPU meshes widen
    16-bit inputs to float32 for the transfer and round the result back.

    A drop-in for ``lax.psum`` under transformations: ``jax.grad`` (any order) sums the
    cotangents over the same axes with jaxcomm, and ``jax.vmap`` reduces the whole batch in
    one call. The result is typed varying over ``axis_name`` (every rank holds its own copy),
    so it is ``lax.psum`` as JAX defines it without the varying-axes check (psum followed by a
    broadcast, whose transpose is a psum), i.e. ``lax.pcast(lax.psum(x, a), a, to="varying")``
    with the check on. Both give the same gradients wherever the sum feeds per-device values
    (a data-parallel loss); a loss computed from the sum alone counts once per rank here.
    Forward-mode ``jax.jvp`` is not supported.

    Args:
      x: float32, bfloat16 or float16 array of any shape (the same on every rank).
      axis_name: mesh axis name, or a tuple of names reduced jointly. With
        ``hierarchical=True``: ``(node_axis, local_axis)``, e.g. ``("node", "local")``.
      hierarchical: reduce inside each node over ``local_axis`` first, allreduce across nodes
        over ``node_axis``, then share the result inside the node (on CPU a process is a node
        and its devices are its local ranks).
      hierarchical_scheme: ``"multi_leader"`` (default: every local rank allreduces 1/L of the
        vector across nodes, after an intra-node reduce-scatter) or ``"leader"`` (local rank 0
        alone talks to the other nodes, then sends the sum to its node).
      after: arrays (any pytree) to compute while the allreduce is on the wire. The call is
        then split in two: the first half starts the allreduce on jaxcomm's engine and
        returns, the second waits for it and is scheduled after ``after`` exists, so XLA runs
        the computation of ``after`` in between. In a training step, pass the gradient that
        backward produces last (``jaxcomm.optax.allreduce_gradients`` does this for its
        buckets). On CPU a split flat call sums in place: the result takes ``x``'s buffer (XLA
        copies ``x`` first if the program reads it again), so the start allocates nothing
        that XLA:CPU could place behind unrelated work (docs/overlap.md). On GPU meshes the
        start runs NCCL on jaxcomm's own CUDA stream behind an event and the done makes XLA's
        stream wait for it; the hierarchical GPU allreduce is not split (``after`` is then
        ignored).

    Returns:
      The sum over the group, with ``x``'s shape.

    Raises:
      ValueError: an axis the mesh does not have, or ``hierarchical=True`` with other than two
        axes.

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("dp",))
      >>> f = jax.jit(jax.shard_map(lambda v: jaxcomm.allreduce(v, "dp"), mesh=mesh,
      ...                           in_specs=P("dp"), out_specs=P("dp")))
      >>> v = jax.device_put(jnp.ones(jax.device_count()), jax.sharding.NamedSharding(mesh, P("dp")))
      >>> f(v).tolist() == [float(jax.device_count())] * jax.device_count()
      True

      Overlapping the last layer's gradient allreduce with the rest of backward (``g_last``
      and ``g_first`` from one ``jax.grad``):

      >>> g_last = jaxcomm.allreduce(g_last, "dp", after=g_first)  # doctest: +SKIP
    """
    x = _validate.float_array(x, "x")
    if hierarchical:  # bad axes or scheme fail here, named, before anything is traced
        _attributes.hierarchical_attributes(axis_name, hierarchical_scheme, "jaxcomm.allreduce")
    if x.size == 0:
        return x
    names = axis_name if isinstance(axis_name, str) else tuple(axis_name)
    if isinstance(after, DeferDone):
        # Noted here, not where the call is emitted: JAX may trace the rules' body once for
        # several calls of one type (jax >= 0.11 caches custom_vmap's trace), so a note made
        # inside it would be lost for every bucket after the first of its shape.
        plan = _plan(x.dtype, _mesh.resolve(names, "jaxcomm.allreduce").platform, hierarchical)
        after.note(plan.split, plan.in_place)
        after = after.noted() if plan.split else None
    rules = _with_rules(names, bool(hierarchical), hierarchical_scheme)
    # The ordering token goes through the rules' body explicitly: custom_vjp and custom_vmap
    # trace their body apart from the caller's trace, which keys the chain (_ordering.py).
    out, token = rules(x, after, _ordering.token_in())
    _ordering.token_out(token)
    return out


@functools.cache
def _with_rules(
    axis_name: str | tuple[str, ...], hierarchical: bool, scheme: str
) -> Callable[[jax.Array, Any, jax.Array], tuple[jax.Array, jax.Array]]:
    """The allreduce over ``axis_name`` with lax.psum's differentiation and batching rules.

    A sum over devices is linear, and summing is its own transpose here: the cotangent of
    each rank's input is the sum of every rank's output cotangent (the result is typed as
    varying over the axis, like ``pvary(psum(x))``, whose transpose is itself). Batching: a
    vmapped axis is summed element by element, so the batched call is one call on the
    stacked array (the batch axis first), as ``lax.psum`` batches.
    """

    def call(x: jax.Array, after: Any, token: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _emit(x, axis_name, hierarchical, scheme, after, token)

    batched = jax.custom_batching.custom_vmap(call)

    @batched.def_vmap
    def _vmap_rule(
        axis_size: int, in_batched: Any, x: jax.Array, after: Any, token: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], tuple[bool, bool]]:
        del axis_size
        x_batched, _, token_batched = in_batched
        if token_batched:  # the chain is per program, never per vmapped element
            raise ValueError("jaxcomm.allreduce: the ordering token cannot be batched")
        # custom_vmap moved the batch axis to the front; the sum does not care where it is.
        return call(x, after, token), (bool(x_batched), False)

    differentiable = jax.custom_vjp(batched)

    def fwd(x: jax.Array, after: Any, token: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
        # Through the rules again, so that a gradient of this gradient has them too.
        return differentiable(x, after, token), None

    def bwd(_: None, cotangents: tuple[jax.Array, Any]) -> tuple[jax.Array, None, None]:
        ct, _ = cotangents
        # Transposed in the caller's trace: this call joins that trace's ordering chain.
        summed, token = differentiable(ct, None, _ordering.token_in())
        _ordering.token_out(token)
        return summed, None, None  # `after` and the token get no cotangent

    differentiable.defvjp(fwd, bwd)
    return differentiable


class _Plan(NamedTuple):
    """How one allreduce is emitted: its target key in ``_TARGETS``, whether it is widened to
    float32 first, whether a call with ``after`` splits, and the data operand it sums in place."""

    target: str
    widen: bool
    split: bool
    in_place: dict[int, int] | None


def _plan(dtype: Any, platform: str, hierarchical: bool) -> _Plan:
    """The :class:`_Plan` of an allreduce of ``dtype`` on ``platform`` called with ``after``.

    A split call on CPU sums in place: its result takes x's buffer. A result of its own is
    memory XLA:CPU's buffer assignment may take from values that backward work scheduled
    before the start still reads, and the thunk executor then holds the start until that work
    is done (a write-after-read edge): the bucket went on the wire a layer late
    (docs/overlap.md). The flat ring, the 16-bit schedule and their shared-memory forms all sum
    in place. A 16-bit input on GPU or in the hierarchical form is widened to float32, and the
    cast back reads the sum, so that call does not split.
    """
    cpu = platform == "cpu"
    if jnp.dtype(dtype) != jnp.float32 and (hierarchical or not cpu):
        return _Plan("hierarchical" if hierarchical else "flat", True, False, None)
    target = "hierarchical" if hierarchical else "flat"
    if jnp.dtype(dtype) != jnp.float32:
        target = jnp.dtype(dtype).name  # "bfloat16" or "float16"
    split = _call.splits_on(platform, _TARGETS[target])
    in_place = {0: 0} if cpu and split and not hierarchical else None
    return _Plan(target, False, split, in_place)


def _emit(
    x: jax.Array,
    axis_name: str | tuple[str, ...],
    hierarchical: bool,
    scheme: str,
    after: Any,
    token: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The custom call(s) of one allreduce of non-empty ``x`` (checked), threading ``token``.

    A :class:`DeferDone` ``after`` arrives already noted by :func:`allreduce` (``noted()``);
    nothing here records anything, so the body may be traced once for many calls."""
    api = "jaxcomm.allreduce"
    plan = _plan(x.dtype, _mesh.resolve(axis_name, api).platform, hierarchical)
    if plan.widen:
        wide, token = _emit(x.astype(jnp.float32), axis_name, hierarchical, scheme, None, token)
        return wide.astype(x.dtype), token
    in_place = plan.in_place if after is not None else None
    attrs = {}
    if hierarchical:
        attrs = _attributes.hierarchical_attributes(axis_name, scheme, api)
    (out,), token = threaded_call(
        token,
        _TARGETS[plan.target],
        api,
        axis_name,
        [x],
        [(x.shape, x.dtype if plan.target in ("bfloat16", "float16") else jnp.float32)],
        after=after,
        aliases=in_place,
        **attrs,
    )
    return out, token
