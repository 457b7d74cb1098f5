"""Faults on schedule (a recipe's ``faults:``), the run's timeline, and restart bookkeeping.

:class:`Timeline` appends one JSON line per event to ``<entry>/timeline.jsonl`` (attempts,
faults applied and reverted, failures, restarts, the resumed run passing its checkpoint).
:class:`FaultInjector` is a thread that fires each fault once, when its trigger is met
(``at_s`` after the first attempt started, or ``at_step`` steps dispatched by rank 0), reverts
it after ``seconds``, and reverts whatever is still active when the entry ends, so no link
stays down and no rank stays stopped. How each kind is made, from what every kernel has
(docs/faults.md):

- ``link_down``: ``ip link set <host-side veth> down`` / ``up``; the node's peers lose it and
  TCP/UCX retransmit once it is back.
- ``bandwidth``: ``tc qdisc change ... tbf rate <new>`` on both ends of the node's link.
- ``partition``: the second group's veths move to a bridge of their own (``jcb<id>p``), so
  each side still reaches its own members but not the other side; healing moves them back.
- ``straggler``: the node's processes are stopped and continued (SIGSTOP/SIGCONT) with a
  100 ms period, running ``cpu`` of it.
- ``kill``: SIGKILL of the node's rank process and its children.
- ``loss`` / ``delay``: ``tc qdisc replace ... netem loss P% | delay D J rate <bandwidth>``
  on both ends, then the tbf again. They need the kernel's ``netem`` qdisc
  (``CONFIG_NET_SCH_NETEM``, module ``sch_netem``); :func:`check_netem` probes for it and a
  recipe that needs it is refused on a kernel without it.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import threading
import time
from typing import Any

from jaxcomm_launcher.context import read_progress
from jaxcomm_launcher.procs import Supervisor, descendants
from jaxcomm_launcher.recipe import NETEM_FAULTS, Fault, Recipe

STRAGGLER_PERIOD_S = 0.1
POLL_S = 0.05


class FaultError(RuntimeError):
    """A fault cannot be made here (e.g. the kernel lacks netem); the message says why."""


class Timeline:
    """Appends events to ``timeline.jsonl``: ``{"t": seconds since the entry began, "time":
    wall clock, "event": name, ...}``; thread-safe.

    Args:
        path: The file (appended to).

    Example:
        >>> tl = Timeline(pathlib.Path("/tmp/timeline.jsonl"))
        >>> tl.event("attempt_start", attempt=0)["event"]
        'attempt_start'
    """

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self._lock = threading.Lock()

    def event(self, name: str, at: float | None = None, **fields: Any) -> dict[str, Any]:
        """Records one event (at monotonic time `at`, default now) and returns it.

        Args:
            name: The event, e.g. ``fault_applied``.
            at: ``time.monotonic()`` of the event (default: now).
            **fields: JSON-serializable details.

        Returns:
            The record written.
        """
        at = time.monotonic() if at is None else at
        record = {
            "t": round(at - self.t0, 4),
            "time": time.time() - (time.monotonic() - at),
            "event": name,
            **fields,
        }
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return record


def read_timeline(path: pathlib.Path) -> list[dict[str, Any]]:
    """Returns the events of a ``timeline.jsonl`` (empty when there is none).

    Example:
        >>> read_timeline(pathlib.Path("/nonexistent"))
        []
    """
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def check_netem(namespace: str) -> None:
    """Raises :class:`FaultError` unless the kernel can make a ``netem`` qdisc.

    Probes by adding (and removing) a netem qdisc on the loopback of `namespace`, one of the
    run's own namespaces, so nothing outside the run is touched.

    Args:
        namespace: A network namespace of the emulated run.

    Returns:
        None.

    Example:
        >>> check_netem("jcm1a2br0")  # doctest: +SKIP
    """
    probe = _run(
        ["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
    )
    if probe.returncode == 0:
        _run(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"])
        return
    raise FaultError(
        "the loss and delay faults need the kernel's netem qdisc (CONFIG_NET_SCH_NETEM, module "
        f"sch_netem), which this kernel lacks (`tc qdisc add ... netem`: "
        f"{probe.stderr.strip() or probe.returncode}); remove those faults or run on a kernel "
        "with netem (modprobe sch_netem)"
    )


def _signal_tree(pid: int, sig: int) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


class _Straggler(threading.Thread):
    """Stops and continues a process tree: runs `cpu` of every period until told to end."""

    def __init__(self, pid: int, cpu: float) -> None:
        super().__init__(name=f"straggler-{pid}", daemon=True)
        self.pid, self.cpu = pid, cpu
        self.done = threading.Event()

    def run(self) -> None:
        run_s = STRAGGLER_PERIOD_S * self.cpu
        try:
            while not self.done.is_set():
                _signal_tree(self.pid, signal.SIGSTOP)
                if self.done.wait(STRAGGLER_PERIOD_S - run_s):
                    break
                _signal_tree(self.pid, signal.SIGCONT)
                self.done.wait(run_s)
        finally:
            _signal_tree(self.pid, signal.SIGCONT)

    def end(self) -> None:
        self.done.set()
        self.join(timeout=5)
        _signal_tree(self.pid, signal.SIGCONT)


class FaultInjector:
    """Fires a recipe's faults on schedule against one sweep entry's ranks; see the module.

    Args:
        recipe: The recipe (its ``faults``).
        backend: The running backend (the emulated one for network faults: its namespaces,
            veths and bridge).
        variant_dir: The entry's directory (rank progress files).
        timeline: Where events go.

    Example:
        >>> inj = FaultInjector(recipe, backend, variant_dir, timeline)  # doctest: +SKIP
        >>> inj.prepare(); inj.attach(supervisor); inj.close()  # doctest: +SKIP
    """

    def __init__(self, recipe: Recipe, backend: Any, variant_dir: pathlib.Path, timeline: Timeline):
        self.recipe = recipe
        self.backend = backend
        self.variant_dir = variant_dir
        self.timeline = timeline
        self.pending: list[tuple[int, Fault]] = list(enumerate(recipe.faults))
        self.active: list[tuple[int, Fault, float | None, Any]] = []  # (index, fault, until, undo)
        self.applied: list[dict[str, Any]] = []
        self.supervisor: Supervisor | None = None
        self.t_start: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch_progress: int | None = None  # stepping_again after this count
        self._watch_t: float | None = None
        self._partition_bridge: str | None = None

    # -- life cycle -----------------------------------------------------------------------

    def prepare(self) -> None:
        """Checks that every fault can be made here (netem) before any rank starts."""
        if any(f.kind in NETEM_FAULTS for f in self.recipe.faults):
            check_netem(self.backend.namespaces[0])

    def attach(self, supervisor: Supervisor) -> None:
        """Points kill and straggler faults at a new attempt's processes; starts the clock and
        the thread on the first call."""
        with self._lock:
            self.supervisor = supervisor
        if self._thread is None:
            self.t_start = time.monotonic()
            self._thread = threading.Thread(target=self._loop, name="faults", daemon=True)
            self._thread.start()

    def detach(self) -> None:
        """The attempt's processes are gone: stragglers end, kills have nothing to hit."""
        with self._lock:
            self.supervisor = None
            for item in list(self.active):
                if item[1].kind == "straggler":
                    self._revert(item, reason="the attempt ended")

    def close(self) -> None:
        """Stops the thread and reverts every active fault (links up, bridges healed, rates
        back); records the faults that never fired."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for item in list(self.active):
                self._revert(item, reason="the run ended")
            for index, fault in self.pending:
                self.timeline.event(
                    "fault_not_applied",
                    fault=index,
                    what=fault.describe(),
                    reason="the run ended first",
                )
            self.pending.clear()
        if self._partition_bridge is not None:
            _run(["ip", "link", "del", self._partition_bridge])
            self._partition_bridge = None

    # -- the thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - a bug here must not stop the reverts
                self.timeline.event("injector_error", error=f"{type(exc).__name__}: {exc}")

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            for item in list(self.active):
                if item[2] is not None and now >= item[2]:
                    self._revert(item, reason="its time is up")
            steps = read_progress(self.variant_dir, 0)
            for index, fault in list(self.pending):
                due = (fault.at_s is not None and now - (self.t_start or now) >= fault.at_s) or (
                    fault.at_step is not None and steps is not None and steps >= fault.at_step
                )
                if due:
                    self.pending.remove((index, fault))
                    self._apply(index, fault)
            if self._watch_progress is not None and steps is not None:
                if steps > self._watch_progress:
                    self.timeline.event(
                        "stepping_again",
                        steps=steps,
                        since_t=round(self._watch_t - self.timeline.t0, 4),
                    )
                    self._watch_progress = None

    def _apply(self, index: int, fault: Fault) -> None:
        try:
            undo = self._make(fault)
        except (FaultError, OSError, subprocess.SubprocessError) as exc:
            self.timeline.event("fault_failed", fault=index, what=fault.describe(), error=str(exc))
            return
        at = time.monotonic()
        record = self.timeline.event(
            "fault_applied",
            at=at,
            fault=index,
            kind=fault.kind,
            what=fault.describe(),
            steps=read_progress(self.variant_dir, 0),
        )
        self.applied.append(record)
        if undo is None:  # kill: nothing to revert
            return
        until = at + fault.seconds if fault.seconds is not None else None
        self.active.append((index, fault, until, undo))

    def _revert(self, item: tuple[int, Fault, float | None, Any], reason: str) -> None:
        index, fault, _, undo = item
        self.active.remove(item)
        try:
            undo()
        except (OSError, subprocess.SubprocessError) as exc:
            self.timeline.event("fault_revert_failed", fault=index, error=str(exc))
        self.timeline.event("fault_reverted", fault=index, kind=fault.kind, reason=reason)
        self._watch_progress = read_progress(self.variant_dir, 0) or 0
        self._watch_t = time.monotonic()

    # -- the kinds ------------------------------------------------------------------------

    def _pid(self, node: int) -> int:
        sup = self.supervisor
        procs = [p for p in (sup.procs if sup else []) if p.rank == node and p.popen.poll() is None]
        if not procs:
            raise FaultError(f"no running process of node {node} (between attempts)")
        return procs[0].popen.pid

    def _sh(self, *cmd: str) -> None:
        res = _run(list(cmd))
        if res.returncode != 0:
            raise FaultError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")

    def _tbf(self, rate: str) -> list[str]:
        return ["tbf", "rate", rate, "burst", self.backend.opts.burst, "latency", "50ms"]

    def _both_ends(self, node: int, verb: str, qdisc: list[str]) -> None:
        self._sh("tc", "qdisc", verb, "dev", self.backend.veths[node], "root", *qdisc)
        self._sh(
            "tc", "-n", self.backend.namespaces[node], "qdisc", verb, "dev", "eth0", "root", *qdisc
        )

    def _make(self, fault: Fault) -> Any:
        """Applies `fault`; returns the function that reverts it (None for a kill)."""
        kind, node = fault.kind, fault.node
        if kind == "kill":
            assert node is not None
            _signal_tree(self._pid(node), signal.SIGKILL)
            return None
        if kind == "straggler":
            assert node is not None
            thread = _Straggler(self._pid(node), fault.cpu)
            thread.start()
            return thread.end
        b = self.backend
        if kind == "link_down":
            assert node is not None
            self._sh("ip", "link", "set", b.veths[node], "down")
            return lambda: self._sh("ip", "link", "set", b.veths[node], "up")
        if kind == "bandwidth":
            assert node is not None and fault.bandwidth is not None
            self._both_ends(node, "change", self._tbf(fault.bandwidth))
            return lambda: self._both_ends(node, "change", self._tbf(b.opts.bandwidth))
        if kind in NETEM_FAULTS:
            assert node is not None
            if kind == "loss":
                netem = ["netem", "loss", f"{fault.percent:g}%"]
            else:
                netem = ["netem", "delay", f"{fault.delay_ms:g}ms"]
                if fault.jitter_ms:
                    netem.append(f"{fault.jitter_ms:g}ms")
            self._both_ends(node, "replace", [*netem, "rate", b.opts.bandwidth])
            return lambda: self._both_ends(node, "replace", self._tbf(b.opts.bandwidth))
        if kind == "partition":
            assert fault.groups is not None
            bridge = f"{b.bridge}p"
            if self._partition_bridge is None:
                self._sh("ip", "link", "add", bridge, "type", "bridge")
                self._partition_bridge = bridge
                self._sh("ip", "link", "set", bridge, "up")
            moved = [b.veths[n] for n in fault.groups[1]]
            for veth in moved:
                self._sh("ip", "link", "set", veth, "master", bridge)

            def heal() -> None:
                for veth in moved:
                    self._sh("ip", "link", "set", veth, "master", b.bridge)

            return heal
        raise FaultError(f"unknown fault kind {kind!r}")

    # -- restarts -------------------------------------------------------------------------

    def watch_resume(self, past: int) -> None:
        """Records ``stepping_again`` once rank 0 has dispatched more than `past` steps."""
        with self._lock:
            self._watch_progress = past
            self._watch_t = time.monotonic()


def steps_done(variant_dir: pathlib.Path, processes: int) -> int:
    """The most steps any rank reported dispatching (its ``rank<R>.progress``; 0: none)."""
    counts = [read_progress(variant_dir, r) for r in range(processes)]
    return max([c for c in counts if c is not None], default=0)


RESTARTS_FILE = "restarts.jsonl"


def record_restart(
    variant_dir: pathlib.Path,
    attempt: int,
    processes: int,
    cause: str,
    checkpoint_dir: pathlib.Path,
    failed_rank: int | None = None,
    t: float | None = None,
) -> dict[str, Any]:
    """Records that attempt `attempt` - 1 failed and attempt `attempt` is about to start.

    Counts the steps lost (the most any rank dispatched, less the newest complete checkpoint's),
    sets the failed attempt's files aside (:func:`archive_attempt`) and appends the record to
    ``restarts.jsonl`` (the Slurm job's restarts reach ``run.json`` from there).

    Args:
        variant_dir: The entry's directory.
        attempt: The attempt about to start (1: the first restart).
        processes: Ranks in the world.
        cause: Why the previous attempt failed, one line.
        checkpoint_dir: Where the job checkpoints.
        failed_rank: The rank blamed, if known.
        t: Seconds since the entry began, when known.

    Returns:
        ``{"attempt", "cause", "failed_rank", "t", "steps_done", "resumed_from",
        "steps_lost"}``.
    """
    done = steps_done(variant_dir, processes)
    resume = _checkpoints().latest(checkpoint_dir) or 0
    record = {
        "attempt": attempt,
        "cause": cause,
        "failed_rank": failed_rank,
        "t": t,
        "steps_done": done,
        "resumed_from": resume,
        "steps_lost": max(0, done - resume),
    }
    archive_attempt(variant_dir, attempt - 1, resume)
    with open(variant_dir / RESTARTS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def read_restarts(variant_dir: pathlib.Path) -> list[dict[str, Any]]:
    """Returns the records of :func:`record_restart` of one entry (oldest first)."""
    return read_timeline(variant_dir / RESTARTS_FILE)


def _checkpoints() -> Any:
    from jaxcomm import checkpoints

    return checkpoints


def archive_attempt(variant_dir: pathlib.Path, attempt: int, resume_step: int) -> None:
    """Sets a failed attempt's per-rank files aside before the world is relaunched.

    Metric records of steps the resumed run repeats (``step >= resume_step``) move to
    ``attempt<K>-rank<R>.jsonl``, so ``rank<R>.jsonl`` continues without duplicates; the
    attempt's status files become ``attempt<K>-rank<R>.status.json``.

    Args:
        variant_dir: The entry's directory.
        attempt: The failed attempt's number (0: the first).
        resume_step: Steps done by the checkpoint the next attempt resumes from.

    Returns:
        None.
    """
    for path in sorted(variant_dir.glob("rank*.jsonl")):
        kept, lost = [], []
        for line in path.read_text().splitlines():
            try:
                step = json.loads(line).get("step", 0)
            except json.JSONDecodeError:
                continue  # a line torn by the kill
            (kept if step < resume_step else lost).append(line)
        if lost:
            (variant_dir / f"attempt{attempt}-{path.name}").write_text("\n".join(lost) + "\n")
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    for path in variant_dir.glob("rank*.status.json"):
        os.replace(path, variant_dir / f"attempt{attempt}-{path.name}")
    for path in variant_dir.glob("rank*.progress"):
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m jaxcomm_launcher.faults restart DIR --attempt K --processes N --exit-code RC``:
    what the Slurm job script runs between two attempts of a step (:func:`record_restart`)."""
    import argparse

    from jaxcomm_launcher import rundir

    parser = argparse.ArgumentParser(prog="jaxcomm_launcher.faults")
    sub = parser.add_subparsers(dest="command", required=True)
    restart = sub.add_parser("restart", help="record a restart of one sweep entry")
    restart.add_argument("variant_dir", type=pathlib.Path)
    restart.add_argument("--attempt", type=int, required=True)
    restart.add_argument("--processes", type=int, required=True)
    restart.add_argument("--exit-code", type=int, required=True)
    restart.add_argument("--checkpoint-dir", type=pathlib.Path, default=None)
    ns = parser.parse_args(argv)
    vdir = ns.variant_dir
    rank = rundir.first_error_rank(vdir)
    error = rundir.status_error(vdir, rank)
    cause = f"rank {rank}: {error}" if error else f"the srun step exited with {ns.exit_code}"
    record = record_restart(
        vdir, ns.attempt, ns.processes, cause, ns.checkpoint_dir or vdir / "checkpoints", rank
    )
    print(
        f"restart {ns.attempt}: {cause}; relaunching from step {record['resumed_from']} "
        f"({record['steps_lost']} steps lost)",
        flush=True,
    )


if __name__ == "__main__":
    main()
