"""Process supervision: start rank processes, stream their logs, stop them all on any fault.

Each started process gets its own session (so its whole process group can be signalled
without touching the launcher) and ``PR_SET_PDEATHSIG`` (so it dies if the launcher is
killed outright). Stopping sends SIGTERM to every group and every descendant found in
/proc, waits a grace period, then sends SIGKILL: launch engines such as mpirun may move
their children to other process groups, the /proc walk catches those.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from rich.console import Console
from rich.markup import escape

RANK_COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
TAIL_LINES = 40


class Interrupted(Exception):
    """The launcher received Ctrl-C or SIGTERM."""


def _set_pdeathsig() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGKILL it when the
    # launcher (its parent thread) dies, so `kill -9 jaxcomm` leaves no ranks behind.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def descendants(pid: int) -> list[int]:
    """Returns the pids of all live descendants of `pid` (Linux /proc walk).

    Args:
        pid: The ancestor.

    Returns:
        Descendant pids, parents before children.

    Example:
        >>> descendants(os.getpid())  # doctest: +SKIP
        []
    """
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # The command name (field 2) may contain spaces and parentheses; fields after the
        # last ')' are fixed: state, ppid, ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2:
            children[int(fields[1])].append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _signal_tree(pid: int, pgid: int | None, sig: int) -> None:
    targets = descendants(pid)
    if pgid is not None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in [pid, *targets]:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclasses.dataclass
class Proc:
    """One supervised process (a rank, or a launch engine such as mpirun)."""

    name: str
    rank: int | None
    popen: subprocess.Popen[bytes]
    pgid: int | None
    reader: threading.Thread | None = None


@dataclasses.dataclass
class Outcome:
    """How a supervised run ended.

    Attributes:
        ok: True when every process exited 0.
        reason: ``ok``, ``failed``, ``timeout`` or ``interrupted``.
        failed_rank: The rank that failed first (None when unknown or not a failure).
        detail: A human-readable sentence about the failure.
        returncode: The failing process's exit status (negative: killed by that signal).
        detected_at: ``time.monotonic()`` when the supervisor saw the failure (before it
            stopped the other processes).
    """

    ok: bool
    reason: str
    failed_rank: int | None = None
    detail: str = ""
    returncode: int | None = None
    detected_at: float | None = None


LineRouter = Callable[[str], list[tuple[int | None, str]]]


def describe_returncode(code: int) -> str:
    """Returns ``exit code N`` or ``killed by SIGNAME`` for a Popen return code.

    Args:
        code: ``Popen.returncode``.

    Returns:
        A short phrase.

    Example:
        >>> describe_returncode(-9)
        'killed by SIGKILL'
    """
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class RankEcho:
    """Prints output lines with a colored rank prefix and keeps each rank's last lines.

    Supervised backends feed it the lines they read from their processes' pipes; the slurm
    backend feeds it the lines it reads from the rank log files that ``srun`` writes.

    Args:
        console: Where lines are printed.
        quiet: Keep the tails, print nothing.

    Example:
        >>> echo = RankEcho(Console(), quiet=True)
        >>> echo.line(1, "hello")
        >>> list(echo.tails[1])
        ['hello']
    """

    def __init__(self, console: Console, quiet: bool = False) -> None:
        self.console = console
        self.quiet = quiet
        self.tails: dict[int | None, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES)
        )

    def line(self, rank: int | None, text: str, name: str = "launcher") -> None:
        """Records one line of `rank` (None: a launch engine called `name`) and prints it.

        Args:
            rank: The rank the line came from, or None for an engine's own output.
            text: The line, without its newline.
            name: Prefix shown for engine lines (``mpirun``, ``srun``, ...).

        Returns:
            None.

        Example:
            >>> RankEcho(Console()).line(0, "step 3")  # prints "[r0] step 3"  # doctest: +SKIP
        """
        self.tails[rank].append(text)
        if self.quiet:
            return
        label = f"r{rank}" if rank is not None else name
        color = RANK_COLORS[rank % len(RANK_COLORS)] if rank is not None else "white"
        self.console.print(
            f"[{color}]\\[{label}][/] {escape(text)}", highlight=False, soft_wrap=True
        )


class Supervisor:
    """Starts processes, prefixes and files their output per rank, and stops them together.

    Args:
        console: Where rank-prefixed lines are printed.
        log_dir: Directory receiving ``rank<R>.log`` (and ``<name>.log`` for engines).
        quiet: Only file the logs, print nothing.

    Example:
        >>> import sys, tempfile
        >>> sup = Supervisor(Console(), pathlib.Path(tempfile.mkdtemp()), quiet=True)
        >>> sup.start([sys.executable, "-c", "print(1)"], env=dict(os.environ), rank=0).rank
        0
        >>> sup.wait(timeout=60).ok
        True
    """

    def __init__(self, console: Console, log_dir: pathlib.Path, quiet: bool = False) -> None:
        self.console = console
        self.log_dir = log_dir
        self.quiet = quiet
        self.procs: list[Proc] = []
        self.echo = RankEcho(console, quiet)
        self.tails = self.echo.tails
        self._files: dict[str, IO[str]] = {}
        self._lock = threading.Lock()

    # -- starting -------------------------------------------------------------------------

    def start(
        self,
        cmd: Sequence[str],
        env: dict[str, str],
        rank: int | None,
        name: str | None = None,
        router: LineRouter | None = None,
        cwd: str | None = None,
    ) -> Proc:
        """Starts `cmd` in its own session and streams its output.

        Args:
            cmd: The command line.
            env: Its full environment.
            rank: The rank it runs (None for a launch engine that runs several).
            name: Display name; defaults to ``rank <R>``.
            router: Maps an output line to (rank, text) pieces for engines that multiplex ranks.
            cwd: Working directory.

        Returns:
            The supervised process.

        Example:
            >>> sup.start([sys.executable, "-c", "pass"], dict(os.environ), rank=0)  # doctest: +SKIP
        """
        name = name or f"rank {rank}"
        popen = subprocess.Popen(
            list(cmd),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_set_pdeathsig,
        )
        proc = Proc(name=name, rank=rank, popen=popen, pgid=popen.pid)
        proc.reader = threading.Thread(
            target=self._pump, args=(proc, router), name=f"log-{name}", daemon=True
        )
        proc.reader.start()
        self.procs.append(proc)
        return proc

    def _file_for(self, rank: int | None, name: str) -> IO[str]:
        key = f"rank{rank}" if rank is not None else re.sub(r"\W+", "_", name)
        f = self._files.get(key)
        if f is None:
            f = open(self.log_dir / f"{key}.log", "a", buffering=1)
            self._files[key] = f
        return f

    def _pump(self, proc: Proc, router: LineRouter | None) -> None:
        assert proc.popen.stdout is not None
        for raw in iter(proc.popen.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            for rank, text in router(line) if router else [(proc.rank, line)]:
                with self._lock:
                    self._file_for(rank, proc.name).write(text + "\n")
                    self.echo.line(rank, text, proc.name)

    # -- waiting and stopping -------------------------------------------------------------

    def wait(
        self,
        timeout: float | None,
        on_tick: Callable[[float], None] | None = None,
        poll_s: float = 0.1,
    ) -> Outcome:
        """Waits until all processes exit, one fails, the timeout passes or Ctrl-C.

        On anything but success every remaining process is stopped before returning.

        Args:
            timeout: Seconds from now, or None.
            on_tick: Called about once a second with the elapsed seconds (progress display).
            poll_s: Polling interval.

        Returns:
            The :class:`Outcome`.

        Example:
            >>> outcome = sup.wait(timeout=600)  # doctest: +SKIP
        """
        t0 = time.monotonic()
        last_tick = 0.0
        try:
            while True:
                for p in self.procs:
                    if p.popen.poll() is None:
                        continue
                    if p.popen.returncode != 0:
                        detected_at = time.monotonic()
                        p = self._culprit(p)
                        self.stop_all()
                        return Outcome(
                            ok=False,
                            reason="failed",
                            failed_rank=p.rank,
                            detail=f"{p.name} ended with {describe_returncode(p.popen.returncode)}",
                            returncode=p.popen.returncode,
                            detected_at=detected_at,
                        )
                if all(p.popen.poll() is not None for p in self.procs):
                    self._join_readers()
                    return Outcome(ok=True, reason="ok")
                elapsed = time.monotonic() - t0
                if timeout is not None and elapsed > timeout:
                    self.stop_all()
                    return Outcome(
                        ok=False,
                        reason="timeout",
                        detail=f"the run exceeded its {timeout:g} s timeout",
                    )
                if on_tick and elapsed - last_tick >= 1.0:
                    last_tick = elapsed
                    on_tick(elapsed)
                time.sleep(poll_s)
        except (KeyboardInterrupt, Interrupted):
            self.stop_all()
            return Outcome(ok=False, reason="interrupted", detail="interrupted (Ctrl-C / SIGTERM)")

    def _culprit(self, first: Proc, settle_s: float = 0.5) -> Proc:
        # A rank killed by a signal takes its peers down a moment later (they see the
        # connection close and exit with an error); the poll loop may reap a peer first.
        # Let the exits settle briefly, then blame a signal death over a peer's error exit.
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            if any((p.popen.poll() or 0) < 0 for p in self.procs):
                break
            time.sleep(0.02)
        for p in self.procs:
            if (p.popen.poll() or 0) < 0:
                return p
        return first

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process tree, then SIGKILL whatever is left after `grace_s`.

        Args:
            grace_s: Seconds between SIGTERM and SIGKILL.

        Returns:
            None; returns once every started process has been reaped.

        Example:
            >>> sup.stop_all()  # doctest: +SKIP
        """
        # Ignore further Ctrl-C while cleaning up: an interrupted cleanup leaves orphans.
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if _main_thread() else None
        try:
            alive = [p for p in self.procs if p.popen.poll() is None]
            for p in self.procs:
                _signal_tree(p.popen.pid, p.pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(p.popen.poll() is None for p in alive):
                time.sleep(0.05)
            for p in self.procs:
                _signal_tree(p.popen.pid, p.pgid, signal.SIGKILL)
            for p in self.procs:
                try:
                    p.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self._join_readers()
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)

    def _join_readers(self) -> None:
        for p in self.procs:
            if p.reader is not None:
                p.reader.join(timeout=5)
        with self._lock:
            for f in self._files.values():
                f.flush()

    def close(self) -> None:
        """Closes the log files."""
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
