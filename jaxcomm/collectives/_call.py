"""Common plumbing of a collective ffi_call: world, mesh layout, ordering token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm import _ffi, _jax_compat, _world
from jaxcomm.collectives import _mesh


class _Splits:
    """What each call made with one :class:`DeferDone` did (in call order): whether it was
    split, and which of its data operands it donated to its results."""

    def __init__(self) -> None:
        self.splits: list[bool] = []
        self.donated: list[frozenset[int]] = []

    def note(self, split: bool, aliases: dict[int, int] | None = None) -> None:
        self.splits.append(split)
        self.donated.append(frozenset(aliases or ()))


@jax.tree_util.register_pytree_node_class
class DeferDone:
    """An ``after`` that splits a collective but leaves its done to the caller.

    A collective called with ``after=DeferDone()`` queues its work (the start) and returns its
    results *unwritten* with its ticket as the ordering chain's head (``_ordering.token_in()``
    right after the call); the caller must hand them to :func:`emit_done` before reading
    them, with every data operand the engine reads as ``kept`` (all it passed the collective,
    a step operand included, but those the call donated to its results: ``donated``).
    ``allreduce_gradients`` issues every bucket's start first and emits the dones after
    the last start: a done emitted in between lets XLA schedule the next start after it, and
    buffer reuse then makes that start wait until the earlier bucket has finished on the wire
    (docs/overlap.md). ``splits`` records, per call, whether it was split (False: its
    results are already final, as for the GPU targets that do not split); ``donated``, the
    indices of the data operands whose buffers its results took. A pytree without
    leaves, so it passes through ``custom_vjp``/``custom_vmap`` like any ``after``.

    Example:
      >>> defer = DeferDone()
      >>> jax.tree.leaves(defer), defer.splits, defer.donated
      ([], [], [])
    """

    def __init__(self, record: _Splits | None = None, is_noted: bool = False) -> None:
        self.record = record if record is not None else _Splits()
        self.is_noted = is_noted

    def noted(self) -> DeferDone:
        """This ``after`` for a call its caller has already noted (:meth:`note`).

        A collective whose call is emitted inside a body that JAX may trace once for several
        calls (a ``custom_vmap``'s, cached by type in jax >= 0.11) is noted by its caller
        instead, outside that body, and passes this on."""
        return DeferDone(self.record, is_noted=True)

    @property
    def splits(self) -> list[bool]:
        return self.record.splits

    @property
    def donated(self) -> list[frozenset[int]]:
        return self.record.donated

    def note(self, split: bool, aliases: dict[int, int] | None = None) -> None:
        """Records one call made with this ``after`` (``aliases``: as for :func:`threaded_call`)."""
        self.record.note(split, aliases)

    def tree_flatten(self) -> tuple[tuple, tuple[_Splits, bool]]:
        return (), (self.record, self.is_noted)

    @classmethod
    def tree_unflatten(cls, aux: tuple[_Splits, bool], children: tuple) -> DeferDone:
        del children
        return cls(*aux)


def threaded_call(
    token: jax.Array,
    target: str,
    api: str,
    axis_name: str | Sequence[str],
    operands: Sequence[jax.Array],
    results: Sequence[tuple[tuple[int, ...], Any]],
    aliases: dict[int, int] | None = None,
    after: Any = None,
    detach: int = 0,
    **attributes: Any,
) -> tuple[list[jax.Array], jax.Array]:
    """Emits one ordered collective custom call; returns its data results and output token.

    The caller threads the ordering chain's token (jaxcomm/_ordering.py): usually
    ``_ordering.token_in()`` in and ``_ordering.token_out(token)`` after; inside a JAX
    transformation that traces its body separately (``jax.custom_vjp``,
    ``jax.custom_batching.custom_vmap``) the body's trace is not the caller's, so the token is
    passed through it.

    With ``after``, the call is split in two (ffi/engine.h, "Tickets"; on GPU
    ffi/cuda/gpu_collective.h, "Split calls", for the targets of ``_ffi.GPU_SPLIT_TARGETS``):
    the collective call itself only queues the work (on jaxcomm's engine thread, or on
    jaxcomm's own CUDA stream behind an event) and returns; a second call,
    ``jaxcomm_collective_done``, takes the ticket, the results, the data operands (so their
    buffers stay alive while the engine reads them) and ``after`` (so XLA schedules it after
    those values exist), and returns the results once the engine has written them. XLA runs
    whatever computes ``after`` while the collective is on the wire.

    Args:
      token: the ordering token the call consumes.
      target: registered FFI target name.
      api: public API name, for errors.
      axis_name: mesh axis (or axes) reduced over.
      operands: data operands (after the common coordinate and token operands).
      results: (shape, dtype) of each data result.
      aliases: data operand index -> data result index that may reuse its buffer (a donated
        residual is then updated in place instead of allocating a new array).
      after: a pytree of arrays to compute before the results are awaited (``None``: one
        call that XLA awaits where it is), or a :class:`DeferDone` (the caller emits the
        done). Ignored on GPU for targets that cannot split.
      detach: a stream id > 0 detaches the call (ffi/engine.h, "Handles"; CPU only): it
        stages its operands in memory the collective owns and returns, as its only result,
        the handle (int32, shape ()) that :func:`jaxcomm.wait` redeems, in this jitted call or
        a later one. ``aliases`` is then ignored. 0: an ordinary call.
      **attributes: extra FFI attributes.

    Returns:
      ``(data results, output token)``; with ``detach``, the token is also the handle.
    """
    defer = isinstance(after, DeferDone)
    layout = _mesh.resolve(axis_name, api)
    world = _world.world(layout.platform)
    if int(np.prod(layout.axis_sizes)) != world.world_size:
        raise ValueError(
            f"{api}: the shard_map mesh has {int(np.prod(layout.axis_sizes))} devices but "
            f"jax.devices() has {world.world_size}; jaxcomm collectives need a mesh over all "
            "devices (a manual shard_map over every mesh axis)"
        )
    like = operands[0]
    if detach:
        if layout.platform != "cpu" or after is not None:
            raise ValueError(f"{api}: a detached collective runs on CPU, without `after`")
        aliases = None  # its results are never read: the wait fills its own
    split = not detach and after is not None and splits_on(layout.platform, target)
    out_types = [_ffi.result_like(like, shape, dtype) for shape, dtype in results]
    out_types.append(_ffi.result_like(like, (), jnp.int32))
    # Data operands follow the two common operands (coordinates, token).
    io_aliases = {2 + i: o for i, o in (aliases or {}).items()}
    outputs = jax.ffi.ffi_call(
        target, out_types, has_side_effect=True, input_output_aliases=io_aliases
    )(
        layout.coordinates(),
        token,
        *operands,
        # One dictionary attribute, decoded once into the handlers' CollectiveAttrs.
        collective=_jax_compat.dict_attribute(
            world=np.int64(world.handle),
            world_devices=np.asarray(world.device_ids, np.int64),
            **layout.attributes(),
            split=np.bool_(split),
            detach=np.int64(detach),
        ),
        **attributes,
    )
    data = list(outputs[:-1])
    if defer and not after.is_noted:
        after.note(split, aliases)
    if not split or defer:
        return data, outputs[-1]
    return emit_done(outputs[-1], data, kept_operands(operands, aliases), after), outputs[-1]


def splits_on(platform: str, target: str) -> bool:
    """Whether a call of ``target`` on ``platform`` can run split (start, then done).

    Every CPU collective can; on GPU only the targets whose CUDA handler is registered as
    splittable (``_ffi.GPU_SPLIT_TARGETS``). The others run whole and ignore ``after``.
    """
    return platform == "cpu" or target in _ffi.GPU_SPLIT_TARGETS


def kept_operands(operands: Sequence[jax.Array], aliases: dict[int, int] | None) -> list:
    """The data operands a split call's done keeps alive: all but the donated ones (a donated
    operand shares its result's buffer, which done already takes)."""
    return [x for i, x in enumerate(operands) if i not in (aliases or {})]


def emit_done(
    ticket: jax.Array, data: Sequence[jax.Array], kept: Sequence[jax.Array], after: Any
) -> list[jax.Array]:
    """The ``jaxcomm_collective_done`` of a split call: its results, once the engine wrote them.

    Args:
      ticket: the start's token result (its ticket).
      data: the start's data results (returned aliased, now written).
      kept: the start's data operands to keep alive (:func:`kept_operands`).
      after: a pytree of arrays that must exist before the done is scheduled.

    Returns:
      The data results.
    """
    return list(
        jax.ffi.ffi_call(
            "jaxcomm_collective_done",
            [_ffi.result_like(r, r.shape, r.dtype) for r in data],
            has_side_effect=True,  # never dropped: the engine writes its buffers
            input_output_aliases={1 + i: i for i in range(len(data))},
        )(ticket, *data, *kept, *jax.tree.leaves(after))
    )
