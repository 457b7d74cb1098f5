"""Where XLA:CPU puts each bucket's start and done in an overlapped training step.

Compiles the step of ``benchmarks/overlap.py`` (``overlap_job.py``'s MLP, gradient ->
``allreduce_gradients(overlap=True)`` -> SGD) in one process with one CPU device, with
XLA's after-optimizations HLO dumped (``--xla_dump_to``) and the thunk executor's dependency
graph logged (``TF_CPP_VMODULE=thunk_executor=6``). The thunk graph is what XLA:CPU runs: a
thunk starts when every thunk it depends on has finished. Its edges are the data flow *plus*
the edges XLA adds where buffer assignment reuses memory (a thunk that writes a buffer waits
for the earlier readers and writers of the same bytes, in the order of XLA's sequential
schedule).

For every bucket, prints the thunks its start waits for (transitively) that are not part of
its data: the backward work and the collectives a start cannot overlap with, because XLA
ordered it after them. No communication is needed to see this (the program is the same for
any world size), so it runs anywhere in seconds.

Usage:
  nice -n 19 python benchmarks/overlap_schedule.py                     # the benchmark's MLP
  nice -n 19 python benchmarks/overlap_schedule.py --layers 6 --width 512 --bucket-size 262656
  nice -n 19 python benchmarks/overlap_schedule.py --algorithm dense \
    --json benchmarks/results/overlap-schedule-dense-25x1000-4m.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

# The reproducer (jax alone) owns the walk of a thunk graph; this lab version of its analysis
# walks the same graphs.
from xla_cpu.xla_cpu_war_edges import closure

DONE = "jaxcomm_collective_done"
MARK = "jaxcomm_mark"
# Thunk kinds that are compute (the backward pass, the optimizer), not bookkeeping.
COMPUTE_KINDS = ("kernel", "dot", "ynn-fusion", "xnn-fusion", "onednn", "sort", "reduce", "conv")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_THUNK = re.compile(
    r"thunk #(\d+): op_name=([^,]+), kind=([^,]+), dependencies=\[([^\]]*)\].*priority=(-?\d+)"
)


def parse_entry(hlo_text: str) -> dict[str, dict[str, Any]]:
    """The ENTRY computation of an after-optimizations HLO dump, in schedule order.

    Args:
      hlo_text: the ``*.cpu_after_optimizations.txt`` dump (``is_scheduled=true``).

    Returns:
      ``{name: {"index", "opcode", "target", "operands", "shape"}}``, index = position in
      XLA's sequential schedule.

    Example:
      >>> e = parse_entry("ENTRY %m () -> f32[] {\\n  ROOT %c = f32[] constant(0)\\n}")
      >>> e["c"]["opcode"]
      'constant'
    """
    entry: dict[str, dict[str, Any]] = {}
    inside = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside and line.startswith("}"):
            break
        m = _INSTRUCTION.match(line) if inside else None
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        # Operands end at the first ")" that closes the call (attributes follow it).
        depth, close = 1, len(rest)
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                close = i
                break
        operands = re.findall(r"%([\w.\-]+)", rest[:close])
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        entry[name] = {
            "rest": rest,
            "index": len(entry),
            "opcode": opcode,
            "target": target.group(1) if target else None,
            "operands": operands,
            "shape": shape,
        }
    return entry


def parse_thunks(log: str) -> list[dict[str, Any]]:
    """The largest thunk graph the executor logged (the step's; small helpers come first).

    Args:
      log: stderr of a run with ``TF_CPP_VMODULE=thunk_executor=6``.

    Returns:
      ``[{"id", "name", "kind", "deps", "priority"}, ...]`` in thunk-sequence order.

    Example:
      >>> parse_thunks(" thunk #00000: op_name=dot, kind=dot, dependencies=[], source=true, "
      ...              "sink=true, priority=0")[0]["kind"]
      'dot'
    """
    graphs: list[list[dict[str, Any]]] = []
    for line in log.splitlines():
        m = _THUNK.search(line)
        if not m:
            continue
        tid, name, kind, deps, priority = m.groups()
        if int(tid) == 0:
            graphs.append([])
        deps_list = [d.strip() for d in deps.split(",") if d.strip()]
        graphs[-1].append(
            {
                "id": int(tid),
                "name": name,
                "kind": kind,
                "deps": deps_list,
                "priority": int(priority),
            }
        )
    return max(graphs, key=len) if graphs else []


_VALUE = re.compile(r"value: <\d+ ([\w.\-]+)(\{[\d,]*\})? @0> \(size=(\d+),offset=(\d+)\)")
_ALLOCATION = re.compile(r"^allocation (\d+):")
# Instructions that run no thunk: their result is (part of) an operand's buffer.
_NO_THUNK = ("parameter", "constant", "get-tuple-element", "bitcast", "tuple")


def parse_buffers(assignment_text: str) -> dict[str, list[tuple[int, int, int]]]:
    """Where each HLO value lives: ``{"name" or "name{i}": [(allocation, offset, size)]}``.

    Args:
      assignment_text: the ``*-buffer-assignment.txt`` dump.

    Returns:
      The slices of every value XLA assigned (tuple elements keyed ``name{i}``).

    Example:
      >>> parse_buffers("allocation 3: size 8\n value: <7 dot @0> (size=8,offset=0): f32[2]")
      {'dot': [(3, 0, 8)]}
    """
    slices: dict[str, list[tuple[int, int, int]]] = {}
    allocation = -1
    for line in assignment_text.splitlines():
        a = _ALLOCATION.match(line)
        if a:
            allocation = int(a.group(1))
            continue
        v = _VALUE.search(line)
        if v and allocation >= 0:
            name, index, size, offset = v.groups()
            key = name + (index if index and index != "{}" else "")
            slices.setdefault(key, []).append((allocation, int(offset), int(size)))
    return slices


def reconstruct_thunks(
    entry: dict[str, dict[str, Any]], slices: dict[str, list[tuple[int, int, int]]]
) -> list[dict[str, Any]]:
    """The thunk graph as XLA:CPU builds it, from the schedule and the buffer assignment.

    Every instruction but parameters, constants, tuples, bitcasts and tuple elements is a
    thunk, in schedule order. It reads its operands' slices and writes its own; a thunk
    depends on every earlier thunk that touches an overlapping slice when either writes
    (read-after-write, write-after-read, write-after-write), as XLA's ExecutionGraph does.
    The executor logs the same graph (``parse_thunks``), but its log line is cut at ~15 kB.

    Args:
      entry: :func:`parse_entry` of the step.
      slices: :func:`parse_buffers` of its buffer assignment.

    Returns:
      Like :func:`parse_thunks` (kind: ``custom-call``, ``dot``, ``kernel`` for fusions...).

    Example:
      >>> reconstruct_thunks({}, {})
      []
    """

    def value_slices(name: str) -> list[tuple[int, int, int]]:
        ins = entry.get(name)
        if ins and ins["opcode"] == "bitcast":
            return value_slices(ins["operands"][0])
        if ins and ins["opcode"] == "get-tuple-element":
            idx = re.search(r"index=(\d+)", ins["rest"])
            key = f"{ins['operands'][0]}{{{idx.group(1) if idx else 0}}}"
            return slices.get(key, []) or value_slices(ins["operands"][0])
        if ins and ins["opcode"] == "tuple":
            return [s for o in ins["operands"] for s in value_slices(o)]
        found = slices.get(name, [])
        found += [s for k, v in slices.items() if k.startswith(name + "{") for s in v]
        return found

    def overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
        return a[0] == b[0] and a[1] < b[1] + b[2] and b[1] < a[1] + a[2]

    thunks: list[dict[str, Any]] = []
    uses: list[tuple[str, list, list]] = []  # (name, reads, writes) of earlier thunks
    for name, ins in sorted(entry.items(), key=lambda kv: kv[1]["index"]):
        if ins["opcode"] in _NO_THUNK:
            continue
        reads = [s for o in ins["operands"] for s in value_slices(o)]
        writes = value_slices(name)
        deps = []
        for other, o_reads, o_writes in uses:
            if any(overlap(w, x) for w in writes for x in o_reads + o_writes) or any(
                overlap(r, w) for r in reads for w in o_writes
            ):
                deps.append(other)
        kind = {"dot": "dot", "custom-call": "custom-call", "copy": "copy"}.get(
            ins["opcode"], "kernel"
        )
        thunks.append({"id": len(thunks), "name": name, "kind": kind, "deps": deps, "priority": 0})
        uses.append((name, reads, writes))
    return thunks


def analyze(entry: dict[str, dict[str, Any]], thunks: list[dict[str, Any]]) -> list[dict]:
    """Per collective call of the step: what its thunk waits for beyond its own data.

    A thunk's data ancestors are the HLO operands, transitively (through bitcasts and tuple
    elements, which have no thunk). ``waits_unrelated`` is every thunk it waits for in the
    thunk graph, transitively, that is not a data ancestor: work XLA ordered before it
    through buffer reuse. ``backward_thunks_unrelated`` is the compute among them that
    itself needs a computed value (the rest, e.g. copies of the optimizer state, needs only
    the step's inputs and runs at the top of the step, before any gradient exists, so
    waiting for it costs nothing): the backward work a start cannot overlap with.

    Args:
      entry: :func:`parse_entry` of the step's HLO.
      thunks: :func:`parse_thunks` of the step's thunk graph.

    Returns:
      One dict per jaxcomm collective thunk (starts and dones, in thunk order).

    Example:
      >>> analyze({}, [])
      []
    """
    data_edges = {name: ins["operands"] for name, ins in entry.items()}
    graph_edges = {t["name"]: t["deps"] for t in thunks}
    kind = {t["name"]: t["kind"] for t in thunks}
    order = {t["name"]: t["id"] for t in thunks}
    thunk_names = set(order)
    rows = []
    starts = 0
    for t in thunks:
        ins = entry.get(t["name"])
        if not ins or not (ins["target"] or "").startswith("jaxcomm_") or ins["target"] == MARK:
            continue
        role = "done" if ins["target"] == DONE else "start"
        data = closure(t["name"], data_edges)
        waits = closure(t["name"], graph_edges)
        unrelated = sorted(waits - data, key=lambda n: order.get(n, -1))
        compute = [
            n
            for n in unrelated
            if kind.get(n, "").startswith(COMPUTE_KINDS) and closure(n, data_edges) & thunk_names
        ]
        collectives = [
            n for n in unrelated if (entry.get(n, {}).get("target") or "").startswith("jaxcomm_")
        ]
        rows.append(
            {
                "thunk": t["id"],
                "name": t["name"],
                "role": role,
                "target": ins["target"],
                "bucket": starts if role == "start" else None,
                "schedule_index": ins["index"],
                "direct_deps": t["deps"],
                "waits_unrelated": unrelated,
                "backward_thunks_unrelated": compute,
                "collectives_unrelated": [n for n in collectives if entry[n]["target"] != MARK],
            }
        )
        starts += role == "start"
    return rows


def _child(args: argparse.Namespace) -> None:
    """Compiles and runs the step once (in a process whose XLA dumps and logs)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from overlap_job import init_params, mlp_loss, reducer

    from jaxcomm.optax import partition_specs

    mesh = jax.make_mesh((1,), ("dp",))
    params = init_params(args.layers, args.width)
    tx = reducer(args.algorithm, args.density, args.bucket_size, args.first_bucket_size)
    specs = partition_specs(jax.eval_shape(tx.init, params), "dp")

    def local(p: Any, s: Any, x: jax.Array, y: jax.Array) -> Any:
        g = jax.grad(mlp_loss)(p, x, y)
        u, s = tx.update(g, s)
        return jax.tree.map(lambda a, b: a - 1e-4 * b, p, u), s

    smap = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), specs, P("dp"), P("dp")), out_specs=(P(), specs),
        check_vma=False,
    )  # fmt: skip
    step = jax.jit(smap, donate_argnums=(0, 1))
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    state = init(params)
    x = jax.device_put(np.ones((args.batch, args.width), np.float32), NamedSharding(mesh, P("dp")))
    jax.block_until_ready(step(params, state, x, x))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compiles the step in a child process and analyzes its dump and thunk graph."""
    with tempfile.TemporaryDirectory() as tmp:
        dump = pathlib.Path(tmp)
        env = dict(
            os.environ,
            XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
            + os.environ.get("XLA_FLAGS", ""),
            TF_CPP_MIN_LOG_LEVEL="0",
            TF_CPP_VMODULE="thunk_executor=6",
        )
        argv = [sys.executable, __file__, "--child", *sys.argv[1:]]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"child failed:\n{proc.stderr[-4000:]}")
        texts = sorted(dump.glob("*jit_local*after_optimizations.txt"))
        if not texts:
            raise RuntimeError(f"no after-optimizations dump in {dump}")
        hlo = texts[-1].read_text()
        assignment = texts[-1].with_name(texts[-1].stem + "-buffer-assignment.txt").read_text()
    entry = parse_entry(hlo)
    logged = parse_thunks(proc.stderr)
    thunks = reconstruct_thunks(entry, parse_buffers(assignment))
    # Where the executor's own log is complete, it must agree with the reconstruction.
    complete = len(logged) == len(thunks)
    if complete:
        rebuilt = {
            t["name"]: closure(t["name"], {u["name"]: u["deps"] for u in thunks}) for t in thunks
        }
        ours = {
            t["name"]: closure(t["name"], {u["name"]: u["deps"] for u in logged}) for t in logged
        }
        mismatch = sorted(n for n in ours if ours[n] != rebuilt.get(n))
    else:
        mismatch = None
    return {
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "algorithm": args.algorithm,
        "density": args.density if args.algorithm != "dense" else None,
        "bucket_size": args.bucket_size,
        "first_bucket_size": args.first_bucket_size,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "thunks": len(thunks),
        "executor_log_complete": complete,
        "closure_mismatches": mismatch,
        "collectives": analyze(entry, thunks),
        "thunk_graph": thunks,
    }


def report(result: dict[str, Any]) -> None:
    print(
        f"{result['algorithm']} step, {result['layers']} layers x {result['width']}, bucket "
        f"{result['bucket_size']}: {result['thunks']} thunks"
    )
    for r in result["collectives"]:
        label = f"bucket {r['bucket']} start" if r["role"] == "start" else "done"
        print(
            f"  thunk {r['thunk']:4d} {label:15s} {r['name']:14s} waits for "
            f"{len(r['backward_thunks_unrelated'])} unrelated backward thunk(s)"
            + (f" {r['backward_thunks_unrelated']}" if r["backward_thunks_unrelated"] else "")
            + (
                f" and collective(s) {r['collectives_unrelated']}"
                if r["collectives_unrelated"]
                else ""
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=25)
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--algorithm", default="dense", choices=["dense", "gtopk"])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--bucket-size", type=int, default=1 << 22)
    parser.add_argument("--first-bucket-size", type=int, default=None)
    parser.add_argument("--json", type=pathlib.Path, help="also write the analysis here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    result = run(args)
    result["command"] = " ".join(["python", "benchmarks/overlap_schedule.py", *sys.argv[1:]])
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print("wrote", args.json)


if __name__ == "__main__":
    main()
