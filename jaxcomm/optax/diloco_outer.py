"""The outer step of one DiLoCo fragment: average the pseudo-gradient Δ over the axis (now,
or detached on jaxcomm's engine and awaited ``delay`` steps later), and apply the outer
optimizer to θ_global.

Each function takes the fragment's operands as one tuple, as the ``lax.cond`` of
:mod:`jaxcomm.optax.diloco_steps` passes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm.collectives import allreduce, compressed_allreduce, handles
from jaxcomm.collectives._mesh import group_size
from jaxcomm.optax.plan import AxisName


@dataclasses.dataclass(frozen=True)
class Config:
    """The arguments of one :func:`jaxcomm.optax.diloco`, checked (see its docstring)."""

    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    every: int
    algorithm: Any
    axis_name: AxisName
    delay: int
    overlap: bool
    fragments: int
    mix: float
    wire: Any  # the outer allreduce's dtype

    @property
    def offsets(self) -> list[int]:
        """The step (mod ``every``) at which each fragment syncs."""
        return [f * self.every // self.fragments for f in range(self.fragments)]


def flat(leaves: list) -> jax.Array:
    """The leaves raveled into one float32 vector, in order."""
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])


def reduce_now(cfg: Config, delta: jax.Array, residual: jax.Array | None) -> tuple:
    """The blocking average of Δ over the axis, and the new residual."""
    size = group_size(cfg.axis_name)
    if cfg.algorithm is None:
        summed = allreduce(delta.astype(cfg.wire), cfg.axis_name).astype(jnp.float32)
        return summed / size, None
    summed, residual = compressed_allreduce(delta, residual[0], cfg.axis_name, cfg.algorithm)
    return summed / size, residual[None]


def apply_outer(cfg: Config, avg: jax.Array, g_part: list, l_part: list, o_state: Any) -> tuple:
    """θ_global += outer(mean Δ) on one fragment; each rank restarts from it (delayed: keeps
    ``mix`` of its own parameters)."""
    g32 = [x.astype(jnp.float32) for x in g_part]
    pieces, offset = [], 0
    for x in g32:
        pieces.append(avg[offset : offset + x.size].reshape(x.shape))
        offset += x.size
    updates, o_state = cfg.outer.update(pieces, o_state, g32)
    new_g = [(x + u).astype(x0.dtype) for x, u, x0 in zip(g32, updates, g_part, strict=True)]
    mix = cfg.mix
    if cfg.delay == 0 or mix == 0.0:
        return new_g, list(new_g), o_state
    new_l = [
        (mix * lo.astype(jnp.float32) + (1.0 - mix) * ng.astype(jnp.float32)).astype(lo.dtype)
        for lo, ng in zip(l_part, new_g, strict=True)
    ]
    return new_g, new_l, o_state


def sync(cfg: Config, ops: tuple) -> tuple:
    """delay == 0: average Δ now and apply it."""
    g_p, l_p, o_state, res = ops
    avg, res = reduce_now(cfg, flat(g_p) - flat(l_p), res)
    new_g, new_l, o_state = apply_outer(cfg, avg, g_p, l_p, o_state)
    return new_g, new_l, o_state, res


def land(cfg: Config, ops: tuple) -> tuple:
    """delay > 0: the outer gradient started `delay` steps ago is applied."""
    g_p, l_p, o_state, res, pend = ops
    if cfg.overlap:
        out = handles.wait(pend[0])
        summed, res = (out, res) if cfg.algorithm is None else (out[0], out[1][None])
        avg = summed.astype(jnp.float32) / group_size(cfg.axis_name)
    else:
        avg = pend[0]
    new_g, new_l, o_state = apply_outer(cfg, avg, g_p, l_p, o_state)
    return new_g, new_l, o_state, res, pend


def send(cfg: Config, delta: jax.Array, res: jax.Array | None, stream: int) -> Any:
    """Starts the detached average of Δ; the pending entry keeps Δ for restart()."""
    r = None if res is None else res[0]
    started = handles.start_allreduce(
        delta.astype(cfg.wire), cfg.axis_name, cfg.algorithm, r, stream=stream
    )
    return started, delta[None]


def begin(cfg: Config, stream: int, ops: tuple) -> tuple:
    """delay > 0: start averaging Δ (detached) or average it now and keep it."""
    g_p, l_p, o_state, res, pend = ops
    delta = flat(g_p) - flat(l_p)
    if cfg.overlap:
        pend = send(cfg, delta, res, stream)
    else:
        avg, res = reduce_now(cfg, delta, res)
        pend = avg[None]
    return g_p, l_p, o_state, res, pend


def resend(cfg: Config, stream: int, ops: tuple) -> tuple:
    """restart(): starts the kept Δ again in this process (the same residual as before)."""
    res, pend = ops
    return res, send(cfg, pend[1][0], res, stream)
