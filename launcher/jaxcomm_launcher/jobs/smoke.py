"""``smoke``: a few ``lax.psum`` allreduces across all processes, to test a launch fast.

Recipe ``args`` (all optional):
  size: float32 elements per device (default 4096)
  fail_rank / fail_at_step: make that rank raise at that step (fault-handling tests)
  fail_mode: ``raise`` (default), ``exit`` (os._exit(3)) or ``kill`` (SIGKILL itself)
  sleep_s: seconds to sleep per step (to test timeouts and Ctrl-C)
"""

from __future__ import annotations

import os
import signal
import time

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import (
    AXIS,
    data_parallel_mesh,
    ring_allreduce_bytes,
    shard_batch,
)


def _maybe_fail(ctx: JobContext, step: int) -> None:
    if ctx.args.get("fail_rank") != ctx.rank or int(ctx.args.get("fail_at_step", 0)) != step:
        return
    mode = ctx.args.get("fail_mode", "raise")
    ctx.print(f"smoke: failing on purpose at step {step} (fail_mode={mode})")
    if mode == "exit":
        os._exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"rank {ctx.rank} failed on purpose at step {step}")


def run(ctx: JobContext) -> None:
    """Runs ``train.steps`` psum allreduces and logs step time and bytes per step.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; metrics go to ``ctx.metrics``.

    Example:
        >>> # recipe: {name: smoke, job: smoke, world: {processes: 2}, train: {steps: 5}}
    """
    mesh = data_parallel_mesh()
    n_dev = mesh.size
    size = int(ctx.args.get("size", 4096))
    sleep_s = float(ctx.args.get("sleep_s", 0.0))
    # Device d holds the value d + 1, so the psum must equal n(n+1)/2 everywhere.
    first = ctx.rank * ctx.devices_per_process
    local = np.repeat(
        np.arange(first + 1, first + ctx.devices_per_process + 1, dtype=np.float32), size
    )
    x = shard_batch(local, mesh)
    step_fn = jax.jit(
        jax.shard_map(lambda v: lax.psum(v, AXIS), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    )
    expected = n_dev * (n_dev + 1) / 2
    bytes_step = ring_allreduce_bytes(size * 4, n_dev) * ctx.devices_per_process
    ctx.print(f"smoke: rank {ctx.rank}/{ctx.world_size}, {n_dev} devices, {size} floats each")
    for step in range(ctx.train.steps):
        _maybe_fail(ctx, step)
        if sleep_s:
            time.sleep(sleep_s)
        t0 = time.perf_counter()
        out = step_fn(x)
        out.block_until_ready()
        dt = time.perf_counter() - t0
        got = float(np.asarray(out.addressable_data(0))[0])
        if got != expected:
            raise RuntimeError(f"psum gave {got}, expected {expected}: collectives are broken")
        ctx.metrics.log(
            step,
            force=step == ctx.train.steps - 1,
            loss=None,
            step_time_s=dt,
            collective_time_s=dt,
            bytes_sent=bytes_step,
            bytes_received=bytes_step,
            compression_ratio=1.0,
        )
    ctx.print(f"smoke: done, psum checked ({expected:g}) on every step")
