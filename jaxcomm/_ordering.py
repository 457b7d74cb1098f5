"""Program-order chaining of collective custom calls.

XLA:CPU may run independent custom calls of one device program concurrently and in a
different order on each device, even with has_side_effect=True; two collectives running in
different orders on two ranks deadlock (or, untagged, mix their messages). Every jaxcomm
collective therefore takes an int32 token operand and returns a new one, and the next
collective traced in the same JAX trace consumes it: a data dependency XLA must respect.

The chain is kept per trace (the body of one jit / shard_map / scan), keyed weakly by the
trace object, so a token never leaks into another trace. Collectives in *different* traces
(e.g. one inside a lax.scan body and one after the scan) are ordered by the data flow of
their operands only; the transport's tags carry a per-rank sequence number, so a violated
order fails with a timeout error naming the collective instead of mixing data.
"""

from __future__ import annotations

import threading
import weakref

import jax
import jax.numpy as jnp

from jaxcomm import _jax_compat

_lock = threading.Lock()
_tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_in() -> jax.Array:
    """The token produced by the previous collective of the current trace (or a fresh one)."""
    trace = _jax_compat.current_trace()
    with _lock:
        token = _tokens.get(trace)
    if token is None:
        token = jnp.zeros((), jnp.int32)
    return token


def token_out(token: jax.Array) -> None:
    """Records `token` (a collective's output token) as the current trace's chain head."""
    trace = _jax_compat.current_trace()
    with _lock:
        _tokens[trace] = token
