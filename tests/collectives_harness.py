"""Starts P CPU rank-processes of tests/collective_worker.py and collects their results."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest
from jaxcomm_launcher.backends import reserve_port

WORKER = pathlib.Path(__file__).with_name("collective_worker.py")


def parse_worker_args(modes: list[str]) -> argparse.Namespace:
    """The command line run_world gives a worker (processes, process id, devices, ...)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", default=modes[0], choices=modes)
    return parser.parse_args()


def start_worker(modes: list[str]) -> argparse.Namespace:
    """A worker's start: its command line (:func:`parse_worker_args`), then JAX as run_world
    asked, before anything else uses it: ``args.devices`` CPU devices and, with several
    processes, the distributed runtime joined at the coordinator."""
    args = parse_worker_args(modes)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.processes > 1:
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
    return args


def make_inputs(world: int, n: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """The global inputs of a case, float32 [world, n]: row r is rank r's, the same in every
    process (seeded by ``seed`` and r)."""
    rows = [np.random.default_rng(seed * 1000 + r).standard_normal(n) * scale for r in range(world)]
    return np.stack(rows).astype(np.float32)


class RankResults(dict):
    """A worker's results, keyed "<case>/<world rank>/<output>" (:meth:`WorldRun.rank_values`)."""

    def __init__(self, mesh) -> None:
        super().__init__()
        # World rank of each device: its place in the ("dp",) mesh.
        self.rank_of = {d.id: i for i, d in enumerate(mesh.devices.flat)}

    def save(self, case: str, name: str, value) -> None:
        """Keeps each of this process's shards of `value` (one row per device) under its rank."""
        for s in value.addressable_shards:
            self[f"{case}/{self.rank_of[s.device.id]}/{name}"] = np.asarray(s.data)[0]

    def write(self, args: argparse.Namespace) -> None:
        """Writes ``<out>/process<i>.npz`` (run_world merges them) and says the worker is done."""
        np.savez(os.path.join(args.out, f"process{args.process_id}.npz"), **self)
        print("WORKER DONE", flush=True)


@dataclasses.dataclass
class WorldRun:
    returncodes: list[int]
    outputs: list[str]
    results: dict[str, np.ndarray]
    seconds: float

    def output_tails(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of each process's output, headed by its number."""
        return "\n".join(
            f"--- process {i} ---\n{out[-chars:]}" for i, out in enumerate(self.outputs)
        )

    def rank_values(self, case: str, name: str) -> list[np.ndarray]:
        """One array per world rank (rank order)."""
        found = {}
        for key, value in self.results.items():
            if key.count("/") < 2:
                continue
            c, rank, n = key.rsplit("/", 2)
            if c == case and n == name:
                found[int(rank)] = value
        return [found[r] for r in sorted(found)]


def run_script(
    script: pathlib.Path, *args: object, timeout: float, cwd: pathlib.Path | None = None
) -> subprocess.CompletedProcess:
    """Runs `script` with this interpreter, capturing its output as text.

    XLA_FLAGS is dropped (each worker sets its own CPU device count) and output is unbuffered.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def run_device_worker(modes: dict) -> None:
    """The ``main()`` of a one-process worker of N CPU devices (:func:`worker_results` runs it):
    ``--devices`` CPU devices set before JAX initializes, then ``modes[--mode](args)``'s
    ``(arrays, info)`` written where :func:`load_output` reads them.

    Args:
      modes: mode name -> function of the parsed arguments (``devices``, ``epochs``, ``out``)
        returning ``(arrays, info)``.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--mode", choices=list(modes), required=True)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    arrays, info = modes[args.mode](args)
    np.savez(os.path.join(args.out, f"{args.mode}.npz"), **arrays)
    with open(os.path.join(args.out, f"{args.mode}.json"), "w") as f:
        json.dump(info, f, indent=2)
    print("WORKER DONE", flush=True)


def digits_runs(runs: dict[str, dict]) -> Callable[[argparse.Namespace], tuple[dict, dict]]:
    """A :func:`run_device_worker` mode that trains the digits example once per entry of
    `runs` (name -> ``jaxcomm.examples.digits.train`` keywords) for ``--epochs`` epochs from
    seed 0: no arrays, and each name's training result as the info."""

    def train(args: argparse.Namespace) -> tuple[dict, dict]:
        from jaxcomm.examples import digits

        info = {name: digits.train(epochs=args.epochs, seed=0, **kw) for name, kw in runs.items()}
        return {}, info

    return train


def rank_update_step(tx, mesh, specs, traced: list | None = None):
    """``tx.update`` under ``jax.jit(jax.shard_map(...))`` over the mesh axis "dp": rank i's
    gradients are row i of each stacked input leaf (``P("dp")``), its updates come back
    stacked the same way, and the optimizer state has the partition specs `specs`. Each trace
    appends to `traced` (a count of compilations)."""
    import jax
    from jax.sharding import PartitionSpec as P

    def local(g, s):
        if traced is not None:
            traced.append(1)
        u, s = tx.update(jax.tree.map(lambda a: a[0], g), s)
        return jax.tree.map(lambda a: a[None], u), s

    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P("dp"), specs),
            out_specs=(P("dp"), specs),
            check_vma=False,
        )
    )


def load_output(out: pathlib.Path, name: str) -> tuple[dict, dict]:
    """A worker's results: the arrays of ``<out>/<name>.npz`` and the JSON of ``<name>.json``."""
    with np.load(out / f"{name}.npz") as data:
        arrays = {k: data[k] for k in data.files}
    return arrays, json.loads((out / f"{name}.json").read_text())


def worker_results(tmp_path_factory, script: pathlib.Path, timeout: float):
    """Runs `script` once per key and caches its results (``load_output``), or its failure.

    Args:
      tmp_path_factory: pytest's factory (output directories).
      script: the worker; it gets the call's arguments and ``--out DIR``.
      timeout: seconds per run.

    Returns:
      ``get(key, *args, name=...)``: the results of ``script *args --out DIR`` (files
      ``DIR/<name>.npz`` and ``.json``); a failed run fails every test that asks for it.
    """
    cache: dict = {}

    def get(key: object, *args: object, name: str) -> tuple[dict, dict]:
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{script.stem}-{key}")
            proc = run_script(script, *args, "--out", out, timeout=timeout)
            ok = proc.returncode == 0
            cache[key] = load_output(out, name) if ok else proc.stdout[-4000:] + proc.stderr[-6000:]
        if isinstance(cache[key], str):
            pytest.fail(f"{script.name} ({key}) failed:\n{cache[key]}")
        return cache[key]

    return get


def run_world(
    processes: int,
    devices: int,
    tmp: pathlib.Path,
    *,
    mode: str = "cases",
    timeout: float = 240,
    env: dict[str, str] | None = None,
    worker: pathlib.Path = WORKER,
) -> WorldRun:
    """Runs `worker` in `processes` processes with `devices` CPU devices each.

    Every child is killed (process group) when this returns, whatever happened. The
    coordinator's port stays reserved until then (:func:`reserve_port`), so no other process
    can take it between our choosing it and process 0's coordinator binding it.
    """
    port = reserve_port()
    coordinator = f"127.0.0.1:{port.getsockname()[1]}"
    child_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    child_env.pop("XLA_FLAGS", None)
    procs = []
    logs = []
    start = time.monotonic()
    try:
        for pid in range(processes):
            log = open(tmp / f"process{pid}.log", "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(worker),
                        "--processes",
                        str(processes),
                        "--process-id",
                        str(pid),
                        "--devices",
                        str(devices),
                        "--coordinator",
                        coordinator,
                        "--out",
                        str(tmp),
                        "--mode",
                        mode,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=child_env,
                    start_new_session=True,
                )
            )
        deadline = start + timeout
        for p in procs:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                p.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        port.close()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    results: dict[str, np.ndarray] = {}
    for pid in range(processes):
        path = tmp / f"process{pid}.npz"
        if path.exists():
            with np.load(path) as data:
                results.update({k: data[k] for k in data.files})
    return WorldRun([p.returncode for p in procs], outputs, results, time.monotonic() - start)


def world_once(
    runs: dict, key: tuple, tmp_path_factory, name: str, processes: int, devices: int, **options
) -> WorldRun:
    """:func:`run_world` of `processes` x `devices` (`options` passed on, in a new temporary
    folder `name`) the first time a test asks for `key`, the same run from `runs` after that.
    Fails the test, naming `key` and with each process's output tail, if any process failed."""
    if key not in runs:
        runs[key] = run_world(processes, devices, tmp_path_factory.mktemp(name), **options)
    run = runs[key]
    if any(code != 0 for code in run.returncodes):
        pytest.fail(
            f"world {key} failed: return codes {run.returncodes}\n" + run.output_tails(4000)
        )
    return run
