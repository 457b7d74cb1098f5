"""Minimal reproducer (no jaxcomm): XLA:CPU makes a custom call wait for unrelated compute.

The backward pass of an L-layer tanh MLP hands each layer's gradients (weight and bias,
concatenated) to a host callback (``jax.pure_callback``, a custom call), the way a
communication library hands each gradient bucket to its collective. The callback of layer i
needs only layer i's gradients. XLA:CPU's thunk executor makes it wait for more: for later
layers' backward work too (the matmul that carries the error to layer i - 1, the elementwise
op after it, and so on). The callback returns a bucket-sized result, and buffer assignment
gives that result memory which backward work scheduled before the callback still reads; the
executor turns the reuse into an execution edge (write-after-read). With ``--scalar-result``
the callback returns a scalar instead (nothing large to place), and it waits for nothing
outside its data: the result buffer is the cause, not the concatenation.

Runs itself in a child process with the thunk executor's log on
(``TF_CPP_VMODULE=thunk_executor=6``) and XLA's HLO dumped, then prints, for every callback,
the thunks it waits for (transitively) that are not producers of its operands. Needs only
jax (seen with jax/jaxlib 0.10.2 on x86-64 Linux).

  python benchmarks/xla_cpu/xla_cpu_war_edges.py
  python benchmarks/xla_cpu/xla_cpu_war_edges.py --scalar-result   # the same step, a scalar result

See benchmarks/xla_cpu/README.md and docs/overlap.md.
"""

import glob
import os
import re
import subprocess
import sys
import tempfile

LAYERS, WIDTH, ROWS = 6, 512, 256


def child(scalar_result: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    def loss(params: list, x: jax.Array) -> jax.Array:
        for w, b in params:
            x = jnp.tanh(x @ w + b)
        return jnp.mean(x**2)

    def step(params: list, x: jax.Array) -> list:
        grads = jax.grad(loss)(params, x)
        sent = []
        for gw, gb in reversed(grads):  # in the order backward produces them
            bucket = jnp.concatenate([gw.ravel(), gb])
            if scalar_result:  # what it sent, as a token: nothing bucket-sized to place
                out = jax.ShapeDtypeStruct((), jnp.int32)
                sent.append(jax.pure_callback(lambda v: np.int32(v.size), out, bucket))
            else:
                out = jax.ShapeDtypeStruct(bucket.shape, bucket.dtype)
                sent.append(jax.pure_callback(lambda v: v, out, bucket))
        return sent

    rng = np.random.default_rng(0)
    scale = np.float32(1 / np.sqrt(WIDTH))
    params = [
        (rng.standard_normal((WIDTH, WIDTH), np.float32) * scale, np.zeros(WIDTH, np.float32))
        for _ in range(LAYERS)
    ]
    x = rng.standard_normal((ROWS, WIDTH), np.float32)
    jax.block_until_ready(jax.jit(step)(params, x))
    print("jax", jax.__version__)


def closure(name: str, edges: dict[str, list[str]]) -> set[str]:
    """Every node reachable from `name` through `edges` (node -> the nodes it depends on)."""
    seen, stack = set(), list(edges.get(name, []))
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(edges.get(n, []))
    return seen


def main() -> None:
    scalar_result = "--scalar-result" in sys.argv[1:]
    if "--child" in sys.argv[1:]:
        child(scalar_result)
        return
    with tempfile.TemporaryDirectory() as dump:
        env = dict(
            os.environ,
            TF_CPP_MIN_LOG_LEVEL="0",
            TF_CPP_VMODULE="thunk_executor=6",
            XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
        )
        run = subprocess.run(
            [sys.executable, __file__, "--child", *(["--scalar-result"] if scalar_result else [])],
            env=env,
            capture_output=True,
            text=True,
        )
        if run.returncode:
            sys.exit(run.stderr[-3000:])
        (hlo,) = glob.glob(f"{dump}/*jit_step*after_optimizations.txt")
        entry = open(hlo).read().split("\nENTRY ")[1]
    operands = {}  # instruction -> its operands (the data it needs)
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? [\w\-]+\((.*?)\)[,\s]", entry, re.M):
        operands[m.group(1)] = re.findall(r"%([\w.\-]+)", m.group(2))
    graphs = re.findall(r"ThunkExecutor: #thunks=\d+.*?(?=\n\S|\Z)", run.stderr, re.S)
    graph = max(graphs, key=len)
    deps, kinds = {}, {}
    for m in re.finditer(r"op_name=([^,]+), kind=([^,]+), dependencies=\[([^\]]*)\]", graph):
        deps[m.group(1)] = [d.strip() for d in m.group(3).split(",") if d.strip()]
        kinds[m.group(1)] = m.group(2)
    print(run.stdout.strip(), f"- {len(deps)} thunks")
    for name, kind in kinds.items():
        if kind != "custom-call":
            continue
        data = closure(name, operands)
        # Its own edges to work outside its data, and what that work waits for in turn
        # (not counting what it inherits through an earlier callback it is ordered after).
        direct = [d for d in deps[name] if d not in data and kinds.get(d) != "custom-call"]
        inherited = set().union(*(closure(d, deps) | {d} for d in direct)) if direct else set()
        unrelated = sorted(n for n in inherited - data if kinds.get(n) != "custom-call")
        print(f"{name}: waits for {len(unrelated)} compute thunk(s) outside its data {unrelated}")


if __name__ == "__main__":
    main()
