"""Detached collectives: an allreduce started in one jitted call and awaited in a later one.

:func:`start_allreduce` queues a dense or compressed allreduce on jaxcomm's engine and returns a
:class:`Pending` (a pytree holding one int32 handle per rank) that the program carries, e.g. in
its training state, out of the jitted call. :func:`wait`, in the same or a later jitted call,
returns the results once the engine has finished. Between the two, the device computes
whatever the program runs, jitted calls included: Streaming DiLoCo's delayed outer step
(:func:`jaxcomm.optax.diloco` with ``delay``) uses it to hide the outer allreduce behind the
next inner steps.

A split call's ticket (``after=``) cannot do this: its done aliases buffers XLA frees when the
call returns. A detached start instead copies its operands into staging memory the collective
owns, and the wait copies the staged results out (two memcpys of the vector: ffi/engine.h,
"Handles"). Misuse fails with an error that says what happened, never a hang: a handle waited
twice, a handle restored from a checkpoint saved while it was in flight, a handle waited on
another device, or a new start on a ``stream`` whose last handle was never waited; handles
still open at exit are reported on stderr (:func:`open_handles` lists them). CPU only.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm import _ffi, _ordering, _validate, algorithms
from jaxcomm.algorithms import dense
from jaxcomm.collectives._call import threaded_call

_WAIT_TARGET = "jaxcomm_handle_wait"
_atexit_lock = threading.Lock()
_atexit_registered = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pending:
    """A started, not yet awaited detached allreduce (a pytree: carry it across jitted calls).

    Attributes:
      handle: int32 array of shape ``(1, 2)`` inside ``shard_map``: this process's epoch and
        the handle's number, one row per rank (place it with ``P(axis_name)`` outside, like an
        error-feedback residual). Valid in this process only (a wait in another process, e.g.
        after restoring a checkpoint, fails and says so), until :func:`wait` redeems it.
      results: static: ``(shape, dtype name)`` of each result :func:`wait` returns.
    """

    handle: jax.Array
    results: tuple[tuple[tuple[int, ...], str], ...] = dataclasses.field(metadata={"static": True})


def start_allreduce(
    x: jax.Array,
    axis_name: str | Sequence[str],
    algorithm: Any = None,
    residual: jax.Array | None = None,
    *,
    stream: int = 1,
) -> Pending:
    """Starts the allreduce of ``x`` over ``axis_name`` and returns at once, detached.

    Inside ``jax.shard_map`` on CPU. The collective is the one :func:`jaxcomm.allreduce`
    (``algorithm=None``) or :func:`jaxcomm.compressed_allreduce` runs, with the same bytes,
    metrics and ordering among the step's collectives; only its end is left to :func:`wait`.

    Args:
      x: float32 (or, dense, bfloat16/float16) array, same shape on every rank.
      axis_name: mesh axis (or axes) to reduce over.
      algorithm: ``None`` (dense) or a compressed algorithm's spec (``jaxcomm.GTopK(0.01)``,
        ``jaxcomm.OneBit()``, ... any registered one with error feedback).
      residual: float32 array of x's shape, this rank's error-feedback residual (compressed
        algorithms only; required there).
      stream: an id > 0 naming the sequence this start belongs to (e.g. one per parameter
        fragment): a start on a stream whose previous handle was never waited fails.

    Returns:
      A :class:`Pending`; :func:`wait` gives the sum (dense) or ``(summed, new_residual)``.

    Raises:
      ValueError: a bad stream, empty ``x``, a residual with the dense algorithm or none with a
        compressed one, or a non-CPU mesh.
      TypeError: an unknown algorithm.

    Example:
      >>> x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("dp")))  # a row block per rank
      >>> def begin(x):
      ...     return jaxcomm.start_allreduce(x, "dp")
      >>> pending = jax.jit(jax.shard_map(begin, mesh=mesh, in_specs=P("dp"),
      ...                                 out_specs=P("dp")))(x)
      >>> # ... other jitted calls run here while the allreduce is on the wire ...
      >>> total = jax.jit(jax.shard_map(jaxcomm.wait, mesh=mesh, in_specs=P("dp"),
      ...                               out_specs=P("dp"), check_vma=False))(pending)
      >>> total.shape == x.shape
      True
    """
    api = "jaxcomm.start_allreduce"
    if not isinstance(stream, int) or stream < 1:
        raise ValueError(f"{api}: stream must be an int >= 1, got {stream!r}")
    dtype = _validate.float_array(x, "x").dtype
    if x.size == 0:
        raise ValueError(f"{api}: x is empty; there is nothing to reduce")
    if algorithm is None:
        if residual is not None:
            raise ValueError(f"{api}: the dense allreduce keeps no residual; pass residual=None")
        targets = dense.ALGORITHM.targets
        target = targets["flat"] if dtype == jnp.float32 else targets[jnp.dtype(dtype).name]
        operands, results, attrs = [x], [(x.shape, dtype)], {}
    else:
        record = algorithms.of(algorithm)  # TypeError naming the known specs
        if not record.residual or "flat" not in record.targets:
            raise TypeError(f"{api}: algorithm {algorithm!r} is not a compressed allreduce")
        if residual is None:
            raise ValueError(f"{api}: {record.name} keeps error feedback; pass its residual")
        x32, residual = _validate.residual_like(x.astype(jnp.float32), residual)
        target = record.targets["flat"]
        attrs = dict(record.attributes(algorithm, x.size)) if record.attributes else {}
        operands = [x32, residual]
        results = [(x.shape, jnp.float32), (x.shape, jnp.float32)]
    # A detached call's output token is its handle; it also heads the ordering chain.
    _, handle = threaded_call(
        _ordering.token_in(), target, api, axis_name, operands, results, detach=stream, **attrs
    )
    _ordering.token_out(handle)
    _report_open_handles_at_exit()
    static = tuple((tuple(shape), jnp.dtype(d).name) for shape, d in results)
    epoch = jnp.full((), _ffi.library().jaxcomm_process_epoch(), jnp.int32)
    return Pending(jnp.stack([epoch, handle]).reshape(1, 2), static)


def wait(pending: Pending) -> Any:
    """The results of a detached allreduce, once the engine has finished it.

    Inside ``jax.shard_map`` on CPU, in the jitted call of the start or a later one, on the
    same devices. Each handle is waited exactly once.

    Args:
      pending: what :func:`start_allreduce` returned (possibly carried through jitted calls).

    Returns:
      The sum (dense), or ``(summed, new_residual)`` (compressed), as the ordinary collective
      returns them (the compressed sum in float32).

    Raises:
      jax.errors.JaxRuntimeError (when the step runs): the handle was waited already, was
        started by another process (restored from a checkpoint saved in flight), or belongs
        to another device; or the collective itself failed (a lost peer).

    Example:
      >>> x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("dp")))
      >>> r = jnp.zeros_like(x)
      >>> start = jax.jit(jax.shard_map(
      ...     lambda x, r: jaxcomm.start_allreduce(x, "dp", jaxcomm.GTopK(0.5), r, stream=2),
      ...     mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P("dp")))
      >>> wait = jax.jit(jax.shard_map(jaxcomm.wait, mesh=mesh, in_specs=P("dp"),
      ...                              out_specs=(P("dp"), P("dp")), check_vma=False))
      >>> summed, new_residual = wait(start(x, r))
      >>> # Error feedback: what every rank sent, summed, plus what each kept back, is their
      >>> # input (here one device, so that is x).
      >>> bool(jnp.allclose(summed + new_residual, x)) or jax.device_count() > 1
      True
    """
    if not isinstance(pending, Pending):
        raise TypeError(f"jaxcomm.wait: expected a jaxcomm.Pending, got {type(pending).__name__}")
    _ffi.register_all()
    outs = jax.ffi.ffi_call(
        _WAIT_TARGET,
        [jax.ShapeDtypeStruct(shape, jnp.dtype(d)) for shape, d in pending.results],
        has_side_effect=True,  # it consumes the handle
    )(pending.handle.astype(jnp.int32))
    outs = list(outs)
    return outs[0] if len(outs) == 1 else tuple(outs)


def open_handles() -> list[str]:
    """The detached collectives of this process started and not yet waited.

    Returns:
      One line per handle, e.g. ``"handle 3 (device 0, stream 1)"``.

    Example:
      >>> jaxcomm.collectives.handles.open_handles()
      []
    """
    text = _ffi.read_text("jaxcomm_open_handles")
    return text.splitlines() if text else []


def _report_open_handles_at_exit() -> None:
    global _atexit_registered
    with _atexit_lock:
        if not _atexit_registered:
            atexit.register(_report)
            _atexit_registered = True


def _report() -> None:
    try:
        lines = open_handles()
    except Exception:  # the library is gone at exit: nothing to report
        return
    if lines:
        print(
            f"jaxcomm: {len(lines)} detached collective(s) were started and never waited "
            f"(jaxcomm.wait): {'; '.join(lines)}",
            file=sys.stderr,
        )
