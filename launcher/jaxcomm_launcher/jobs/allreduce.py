"""``allreduce``: allreduce time and bandwidth over message sizes (the benchmark recipe).

``dense`` uses ``lax.psum``; other algorithms need ``jaxcomm.allreduce`` (not in this build
yet: the job then stops with a clear "not available" error).

Recipe ``args``: sizes (float32 elements per device, default 1Ki..1Mi), repeats (default 5).
One metrics line per (size, repeat): size_bytes, collective_time_s, bytes_sent, algbw_gbps.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import (
    AXIS,
    data_parallel_mesh,
    jaxcomm_module,
    ring_allreduce_bytes,
    shard_batch,
)

DEFAULT_SIZES = [1 << 10, 1 << 14, 1 << 17, 1 << 20]


def run(ctx: JobContext) -> None:
    """Times allreduces of each size ``repeats`` times after one warm-up call.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; one metrics line per measurement.

    Example:
        >>> # recipes/allreduce-sweep.yaml
    """
    if ctx.jaxcomm.algorithm != "dense":
        jaxcomm_module("allreduce", "allreduce", ctx.jaxcomm.algorithm)
        raise NotImplementedError(
            "the allreduce job measures lax.psum only; wiring jaxcomm.allreduce in is left to "
            "the collectives issue"
        )
    sizes = [int(s) for s in ctx.args.get("sizes", DEFAULT_SIZES)]
    repeats = int(ctx.args.get("repeats", 5))
    mesh = data_parallel_mesh()
    fn = jax.jit(
        jax.shard_map(lambda v: lax.psum(v, AXIS), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    )
    step = 0
    for size in sizes:
        local = np.ones(size * ctx.devices_per_process, np.float32)
        x = shard_batch(local, mesh)
        fn(x).block_until_ready()  # compile and warm up
        sent = ring_allreduce_bytes(size * 4, mesh.size) * ctx.devices_per_process
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(x).block_until_ready()
            dt = time.perf_counter() - t0
            times.append(dt)
            ctx.metrics.log(
                step,
                force=True,
                size_bytes=size * 4,
                step_time_s=dt,
                collective_time_s=dt,
                bytes_sent=sent,
                bytes_received=sent,
                algbw_gbps=size * 4 * 8 / dt / 1e9,
                compression_ratio=1.0,
            )
            step += 1
        if ctx.is_main:
            ctx.print(
                f"allreduce {size * 4:>10d} B: median {np.median(times) * 1e3:8.3f} ms, "
                f"algbw {size * 4 * 8 / np.median(times) / 1e9:7.3f} Gbit/s"
            )
