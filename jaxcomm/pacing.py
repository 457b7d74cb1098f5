"""Training loops without a synchronization per step, and short errors when a step fails.

JAX dispatches jitted steps asynchronously: the host queues step i + 1 while the devices still
run step i. With several CPU devices in one process, XLA:CPU can deadlock when the host runs
far ahead of steps that hold collectives, its own ``lax.psum`` and jaxcomm's alike (root cause
in ``benchmarks/xla_cpu/async-hang.md``): one thread pool, of max(cores, devices) threads, both
launches the devices' executions and runs them; a running execution holds its thread until its
collectives complete, and once a device has 32 executions in flight a launch holds its thread
waiting for a slot. With 2 cores and 2-8 devices, launches waiting for slots take the threads
that the other devices' executions need to reach the collective.

Two remedies, both applied:

- :func:`size_cpu_launch_pool` (``import jaxcomm`` calls it once JAX is imported) makes that
  pool large enough, 2 x devices + 2 threads, through ``PJRT_NPROC`` just before JAX creates
  its CPU client, so a plain loop of dependent steps no longer deadlocks. It cannot act when
  JAX's CPU client already exists (import jaxcomm before using JAX's devices), or when
  ``PJRT_NPROC`` is set.
- :func:`paced` keeps at most ``max_in_flight`` steps queued, waiting for the oldest one's
  outputs before returning from the next call, so no device ever has 32 executions in flight
  (the host still runs ahead of the devices, so dispatch overlaps compute). This is the
  supported way for any loop, and it turns a failure into one short error.

A failed step surfaces from XLA as a chain: every step dispatched behind it prefixes its own
``Error dispatching computation:``. :func:`paced` notices a failure within ``max_in_flight``
steps and raises :class:`CollectiveError` with the first failure's message, once.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import jax

from jaxcomm import _jax_compat
from jaxcomm._launch_pool import cpu_launch_threads, size_cpu_launch_pool  # noqa: F401 (re-exported)

# Steps a paced loop keeps in flight. Two keep the host one step ahead of the devices (dispatch
# hides behind compute) and stay far below XLA:CPU's per-device limit, where it deadlocks.
DEFAULT_MAX_IN_FLIGHT = 2


_CHAIN_PREFIX = re.compile(r"^(?:[A-Z_]+: )?(?:Error dispatching computation: )*")


class CollectiveError(RuntimeError):
    """A jaxcomm collective failed (a peer died, timed out or never started the collective).

    The message is the first failure's, without the chain of steps queued behind it.
    """


def short_message(error: BaseException) -> str:
    """The root message of an XLA runtime error, without the repeated dispatch prefixes.

    Args:
      error: an exception raised while dispatching or waiting for a jitted step.

    Returns:
      The message of the step that failed first, e.g. ``"jaxcomm.allreduce #25: device(s) 2 of
      this process never started it ..."``.

    Example:
      >>> short_message(RuntimeError("INTERNAL: Error dispatching computation: "
      ...                            "Error dispatching computation: peer rank 1 failed"))
      'peer rank 1 failed'
    """
    return _CHAIN_PREFIX.sub("", str(error)).strip()


def _is_collective_failure(message: str) -> bool:
    return message.startswith("jaxcomm.") or "(group rank " in message


class Paced:
    """A step function that keeps at most ``max_in_flight`` calls queued; see :func:`paced`."""

    def __init__(self, fn: Callable[..., Any], max_in_flight: int) -> None:
        if int(max_in_flight) < 0:
            raise ValueError(
                f"max_in_flight must be >= 0 steps (0 waits for every step), got {max_in_flight}"
            )
        self.fn = fn
        self.max_in_flight = int(max_in_flight)
        self._in_flight: collections.deque = collections.deque()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outputs = self._guard(lambda: self.fn(*args, **kwargs))
        self._in_flight.append(outputs)
        while len(self._in_flight) > self.max_in_flight:
            self._wait_oldest()
        return outputs

    def wait(self) -> None:
        """Waits for every queued step (e.g. before reading metrics or saving a checkpoint).

        Returns:
          None.
        """
        while self._in_flight:
            self._wait_oldest()

    @property
    def in_flight(self) -> int:
        """Steps queued and not yet waited for."""
        return len(self._in_flight)

    def _wait_oldest(self) -> None:
        oldest = self._in_flight.popleft()
        # Outputs donated to a later step are gone. If all of the oldest step's are, wait for
        # the first later step that still has live outputs: it ran after the oldest one.
        for outputs in (oldest, *self._in_flight):
            live = [x for x in jax.tree.leaves(outputs) if not _is_deleted(x)]
            if live and self._waited(live):
                return

    def _waited(self, live: list) -> bool:
        """Waits for ``live``; False when one of them was donated after all. A caller may have
        passed a step's output on through an alias (``jax.device_put`` onto the sharding it
        already has returns a new array over the same buffer), so the array itself does not
        know its buffer is gone; a later step's outputs are then waited for instead."""
        try:
            self._guard(lambda: jax.block_until_ready(live))
        except jax.errors.JaxRuntimeError as error:
            if "deleted or donated" not in str(error):
                raise
            return False
        return True

    def _guard(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except jax.errors.JaxRuntimeError as error:
            message = short_message(error)
            if _is_collective_failure(message):
                self._in_flight.clear()
                _jax_compat.forget_runtime_tokens()  # else JAX re-raises the chain at exit
                raise CollectiveError(message) from None
            raise


def _is_deleted(x: Any) -> bool:
    is_deleted = getattr(x, "is_deleted", None)
    return bool(is_deleted()) if callable(is_deleted) else False


def paced(fn: Callable[..., Any], max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> Paced:
    """Wraps a jitted training step so a loop never queues more than ``max_in_flight`` steps.

    Use it for every loop that does not synchronize each step when a process drives several
    devices (one process per GPU host, or ``jax_num_cpu_devices > 1``). Results are the same,
    bit for bit, as a loop that waits for every step: pacing changes when the host waits, not
    what the devices compute.

    Args:
      fn: the step, usually ``jax.jit(jax.shard_map(...))``. Its outputs are waited for in call
        order; outputs donated to a later step are skipped.
      max_in_flight: steps that may be queued beyond the one being waited for; 0 waits for
        every step.

    Returns:
      A callable with ``fn``'s signature and results, plus ``wait()`` (drain the queue) and
      ``in_flight``. A failed collective raises :class:`CollectiveError` with one short
      message, within ``max_in_flight`` calls of the failure.

    Example:
      >>> step = jaxcomm.paced(jax.jit(lambda w, g: w - 0.1 * g))  # in training: jit(shard_map)
      >>> w = jnp.ones(3)
      >>> for _ in range(5):  # no wait per step: at most two queued
      ...     w = step(w, jnp.ones(3))
      >>> step.wait()
      >>> step.in_flight, [round(v, 4) for v in w.tolist()]
      (0, [0.5, 0.5, 0.5])
    """
    return Paced(fn, max_in_flight)
