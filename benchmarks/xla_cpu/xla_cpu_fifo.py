"""Minimal reproducer (no jaxcomm): on one executor thread, XLA:CPU runs a ready custom call
only after the compute that was queued before it (first in, first out).

The backward pass of an L-layer tanh MLP hands each layer's weight gradient to a host callback
(``jax.pure_callback``, a custom call) that returns a scalar, the way a communication library
hands a gradient bucket to its collective's start. A scalar result places nothing where it
could add a write-after-read edge (``benchmarks/xla_cpu/xla_cpu_war_edges.py``), so each callback depends on
its gradient only. But when layer i's error exists, the matmuls of its weight gradient and of
its input gradient become ready together; the weight gradient runs first and makes the
callback ready, and the callback is queued *behind* the input-gradient matmul, which carries
the error to layer i - 1 and which the callback does not need. XLA:CPU's ``ThunkExecutor`` pops
its ready queue in FIFO order (``ReadyQueueType::kFifo``, the default; a priority queue exists
but no flag of jaxlib 0.10.2 selects it), so with one thread the callback starts a matmul late.

The script pins itself to one core (so XLA sizes its pool at one thread), traces one step with
``jax.profiler`` (the executor records every thunk's start and end), reads the thunk graph from
the executor's log (``TF_CPP_VMODULE=thunk_executor=6``) and prints, for every callback, when
its last dependency ended, when it started, and the thunks that ran in between although the
callback does not depend on them. Needs only jax (seen with jax/jaxlib 0.10.2, x86-64 Linux).

  python benchmarks/xla_cpu/xla_cpu_fifo.py
  python benchmarks/xla_cpu/xla_cpu_fifo.py --threads 2   # XLA's NPROC: two executor threads on the one core

See benchmarks/xla_cpu/README.md and docs/overlap.md.
"""

import json
import os
import re
import subprocess
import sys

LAYERS, WIDTH, ROWS = 6, 1024, 512


def child() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, before jax sizes pools
    import glob
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    def loss(params: list, x: jax.Array) -> jax.Array:
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    def step(params: list, x: jax.Array) -> list:
        grads = jax.grad(loss)(params, x)
        out = jax.ShapeDtypeStruct((), jnp.int32)
        return [jax.pure_callback(lambda g: np.int32(g.size), out, g) for g in reversed(grads)]

    rng = np.random.default_rng(0)
    params = [
        rng.standard_normal((WIDTH, WIDTH), np.float32) / np.sqrt(WIDTH) for _ in range(LAYERS)
    ]
    x = rng.standard_normal((ROWS, WIDTH), np.float32)
    run = jax.jit(step)
    jax.block_until_ready(run(params, x))  # compile and warm up outside the trace
    trace = tempfile.mkdtemp()
    with jax.profiler.trace(trace):
        jax.block_until_ready(run(params, x))
    (pb,) = glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)
    events = []  # (thunk, start ms, end ms) of the one traced step
    for plane in jax.profiler.ProfileData.from_file(pb).planes:
        for line in plane.lines:
            for e in line.events:
                if not e.name.startswith(("end: ", "$")):
                    events.append((e.name, e.start_ns / 1e6, (e.start_ns + e.duration_ns) / 1e6))
    print(json.dumps({"jax": jax.__version__, "events": events}))


def main() -> None:
    if "--child" in sys.argv[1:]:
        child()
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="thunk_executor=6")
    if "--threads" in sys.argv[1:]:
        env["NPROC"] = sys.argv[sys.argv.index("--threads") + 1]
    run = subprocess.run(
        [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True
    )
    if run.returncode:
        sys.exit(run.stderr[-3000:])
    result = json.loads(run.stdout.strip().splitlines()[-1])
    graphs = re.findall(r"ThunkExecutor: #thunks=\d+.*?(?=\n\S|\Z)", run.stderr, re.S)
    deps, kinds = {}, {}
    for m in re.finditer(
        r"op_name=([^,]+), kind=([^,]+), dependencies=\[([^\]]*)\]", max(graphs, key=len)
    ):
        deps[m.group(1)] = [d.strip() for d in m.group(3).split(",") if d.strip()]
        kinds[m.group(1)] = m.group(2)
    sequential = re.findall(
        r"Constructed ThunkExecutor with (\d+) thunks.*?is_sequential=(\w+)", run.stderr
    )
    ran = {name: (start, end) for name, start, end in result["events"] if name in deps}
    t0 = min(start for start, _ in ran.values())
    print(
        f"jax {result['jax']}, {len(deps)} thunks, executor threads: {env.get('NPROC', 1)} on one"
        f" core, sequential executors: {[n for n, s in sequential if s == 'true'] or 'none'}"
    )
    late = 0.0
    for name in sorted((n for n in deps if kinds[n] == "custom-call"), key=lambda n: ran[n][0]):
        ready = max(ran[d][1] for d in deps[name])
        start = ran[name][0]
        ahead = sorted((s, n) for n, (s, _) in ran.items() if ready <= s < start and n != name)
        late += start - ready
        # Each thunk run in between, how long it ran and how long before the callback it was
        # ready: queued ahead of it.
        what = (
            ", ".join(
                f"{n} ({ran[n][1] - ran[n][0]:.1f} ms, ready {ready - max(ran[d][1] for d in deps[n]):.1f}"
                " ms before it)"
                for _, n in ahead
            )
            or "nothing"
        )
        print(
            f"{name}: ready at {ready - t0:6.1f} ms, started at {start - t0:6.1f} ms"
            f" (+{start - ready:.1f} ms), after {what}"
        )
    print(
        f"callbacks started {late:.1f} ms in all after they were ready; the step took "
        f"{max(e for _, e in ran.values()) - t0:.1f} ms"
    )


if __name__ == "__main__":
    main()
