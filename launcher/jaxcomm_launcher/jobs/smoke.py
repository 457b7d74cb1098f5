"""``smoke``: a few ``jaxcomm.allreduce`` calls across all processes, to test a launch fast.

Each step checks the sum and logs what ``jaxcomm.metrics()`` measured for it: bytes sent and
received by this process's devices, the time inside the collective (mean over its devices)
and the compression ratio (1.0: dense).

Recipe ``args`` (all optional; declared in ``jobs/args.py``, :class:`SmokeArgs`):
  size: float32 elements per device (default 4096)
  fail_rank / fail_at_step: make that rank raise at that step (fault-handling tests)
  fail_mode: ``raise`` (default), ``exit`` (os._exit(3)) or ``kill`` (SIGKILL itself)
  fail_once: fail only in the first attempt of a run with restarts (a marker file in the run
    directory remembers it)
  sleep_s: seconds to sleep per step (to test timeouts and Ctrl-C)
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import AXIS, data_parallel_mesh, shard_batch
from jaxcomm_launcher.jobs.args import SmokeArgs

_MEASURED = ("bytes_sent", "bytes_received", "dense_bytes_sent", "seconds")


def _measured() -> dict[str, Any]:
    """This process's jaxcomm totals so far: each of :data:`_MEASURED`, summed, and ranks."""
    totals = [t for t in jaxcomm.metrics()["totals"] if t["calls"]]
    out: dict[str, Any] = {k: sum(t[k] for t in totals) for k in _MEASURED}
    out["ranks"] = max(1, len({t["world_rank"] for t in totals}))
    return out


def _maybe_fail(ctx: JobContext, args: SmokeArgs, step: int) -> None:
    if args.fail_rank != ctx.rank or args.fail_at_step != step:
        return
    mode = args.fail_mode
    if args.fail_once:
        marker = ctx.run_dir / f"smoke-failed-rank{ctx.rank}"
        if marker.exists():
            return
        marker.touch()
    ctx.print(f"smoke: failing on purpose at step {step} (fail_mode={mode})")
    if mode == "exit":
        os._exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"rank {ctx.rank} failed on purpose at step {step}")


def run(ctx: JobContext) -> None:
    """Runs ``train.steps`` jaxcomm allreduces and logs their measured time and bytes.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; metrics go to ``ctx.metrics``.

    Example:
        >>> # recipe: {name: smoke, job: smoke, world: {processes: 2}, train: {steps: 5}}
    """
    args = SmokeArgs.model_validate(ctx.args)
    mesh = data_parallel_mesh()
    n_dev = mesh.size
    size, sleep_s = args.size, args.sleep_s
    # Device d holds the value d + 1, so the sum must equal n(n+1)/2 everywhere.
    first = ctx.rank * ctx.devices_per_process
    local = np.repeat(
        np.arange(first + 1, first + ctx.devices_per_process + 1, dtype=np.float32), size
    )
    x = shard_batch(local, mesh)
    step_fn = jax.jit(
        jax.shard_map(
            lambda v: jaxcomm.allreduce(v, AXIS), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)
        )
    )
    expected = n_dev * (n_dev + 1) / 2
    # The cores this rank may run on: an emulated node's own (backend.cpus_per_node).
    affinity = sorted(os.sched_getaffinity(0))
    ctx.print(
        f"smoke: rank {ctx.rank}/{ctx.world_size}, {n_dev} devices, {size} floats each, "
        f"affinity {affinity}"
    )
    for step in range(ctx.train.steps):
        _maybe_fail(ctx, args, step)
        ctx.metrics.progress(step + 1)
        if sleep_s:
            time.sleep(sleep_s)
        before = _measured()
        t0 = time.perf_counter()
        out = step_fn(x)
        out.block_until_ready()
        dt = time.perf_counter() - t0
        got = float(np.asarray(out.addressable_data(0))[0])
        if got != expected:
            raise RuntimeError(f"allreduce gave {got}, expected {expected}: collectives are broken")
        after = _measured()
        step_metrics = {k: after[k] - before[k] for k in _MEASURED}
        sent = step_metrics["bytes_sent"]
        ctx.metrics.log(
            step,
            force=step == ctx.train.steps - 1,
            loss=None,
            step_time_s=dt,
            collective_time_s=step_metrics["seconds"] / after["ranks"],
            bytes_sent=sent,
            bytes_received=step_metrics["bytes_received"],
            compression_ratio=step_metrics["dense_bytes_sent"] / sent if sent else None,
        )
    ctx.print(f"smoke: done, allreduce checked ({expected:g}) on every step")
