"""Settings matrix for the XLA:CPU multi-device async-dispatch deadlock (benchmarks/xla_cpu/async-hang.md).

Plain JAX, no jaxcomm: the loop of ../shared/repro/xla_cpu_async_psum_hang.py (lax.psum over
NDEV CPU devices of one process, no per-step sync) with knobs. Prints one RESULT line when the
loop finishes; a hang ends in XLA's rendezvous abort (set short timeouts with
XLA_FLAGS="--xla_cpu_collective_call_warn_stuck_timeout_seconds=3
--xla_cpu_collective_call_terminate_timeout_seconds=6"), except with --gloo, where nothing
times out (run it under `timeout -k 5 60`).

Example:
    python benchmarks/xla_cpu/xla_cpu_async_hang_matrix.py 4 --k 32       # finishes
    python benchmarks/xla_cpu/xla_cpu_async_hang_matrix.py 4 --k 33       # hangs
    PJRT_NPROC=8 python benchmarks/xla_cpu/xla_cpu_async_hang_matrix.py 4 # finishes
"""

import argparse
import collections
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("ndev", type=int, help="CPU devices in this process")
ap.add_argument("--sync", action="store_true", help="block_until_ready after every step")
ap.add_argument("--k", type=int, default=0, help="block on step i-k before dispatching step i")
ap.add_argument("--reuse", action="store_true", help="transfer the input once, not every step")
ap.add_argument("--tiny", action="store_true", help="8x8 weights, 1 row per device")
ap.add_argument("--steps", type=int, default=600)
ap.add_argument(
    "--async-dispatch-off", action="store_true", help="jax_cpu_enable_async_dispatch=False"
)
ap.add_argument(
    "--gloo", action="store_true", help="1-process jax.distributed with Gloo collectives"
)
a = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_num_cpu_devices", a.ndev)
if a.async_dispatch_off:
    jax.config.update("jax_cpu_enable_async_dispatch", False)
if a.gloo:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize("localhost:23456", num_processes=1, process_id=0)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

width, rows = (8, 1) if a.tiny else (512, 256)
mesh = jax.make_mesh((a.ndev,), ("dp",))
sh = NamedSharding(mesh, P("dp"))


def step(w: jax.Array, x: jax.Array) -> jax.Array:
    """One data-parallel step: local "gradient", psum over devices, update.

    Args:
        w: this device's (1, width, width) weight block.
        x: this device's (rows, width) input block.

    Returns:
        The updated (1, width, width) weight block.
    """
    g = jnp.tanh(x @ w[0]) @ w[0].T  # compute that produces a "gradient"
    return (w[0] - 1e-3 * jax.lax.psum(g, "dp").mean())[None]


f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P("dp")))
w = jax.device_put(np.full((a.ndev, width, width), 0.01, np.float32), sh)
x0 = jax.device_put(np.full((a.ndev * rows, width), 1, np.float32), sh)
jax.block_until_ready(f(w, x0))  # compile outside the timed loop
t0 = time.perf_counter()
pending = collections.deque()  # outputs of the steps still in flight (for --k)
for i in range(a.steps):
    if a.k > 0 and len(pending) >= a.k:
        jax.block_until_ready(pending.popleft())
    x = x0 if a.reuse else jax.device_put(np.full((a.ndev * rows, width), i % 7, np.float32), sh)
    w = f(w, x)
    if a.k > 0:
        pending.append(w)
    if a.sync:
        jax.block_until_ready(w)
    if i % 10 == 0:
        print(f"dispatched {i}", file=sys.stderr, flush=True)
jax.block_until_ready(w)
print(
    f"RESULT ndev={a.ndev} {' '.join(sys.argv[2:])}: {a.steps} steps in {time.perf_counter() - t0:.1f} s"
)
