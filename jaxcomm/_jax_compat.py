"""Every private JAX API jaxcomm uses, in one place (jax>=0.10,<0.13).

When JAX moves one of these, this module is the only one to change.
"""

from __future__ import annotations

from typing import Any


def current_trace() -> object:
    """The trace JAX is tracing into now (the body of one jit, shard_map, scan, ...)."""
    from jax._src import core

    return core.trace_ctx.trace


def distributed_client() -> Any:
    """The jax.distributed key-value store client, or None before jax.distributed.initialize."""
    from jax._src import distributed

    return distributed.global_state.client


def forget_runtime_tokens() -> None:
    """Drops JAX's per-device runtime tokens of side-effecting computations.

    After a step failed, every later step failed behind it, and JAX would wait for (and raise
    the whole chain of) those tokens again at interpreter exit. The failure was already
    reported once; nothing is left to wait for.
    """
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()
