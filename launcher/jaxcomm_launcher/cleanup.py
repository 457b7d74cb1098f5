"""Removes what a launcher killed outright (SIGKILL, OOM, a lost terminal) left behind.

The emulated backend creates network namespaces ``jcm<id>r<rank>``, veth pairs ``jcv<id>r<rank>``
and a bridge ``jcb<id>``, and removes them when the run ends. A launcher that is SIGKILLed
cannot; its ranks die with it (``PR_SET_PDEATHSIG``), but anything started inside a namespace
by another route, the namespaces and the links stay. Each emulated run therefore records its
owner (``<state dir>/emulated-<id>.pid``); a run whose owner is no longer alive is stale.
:func:`sweep` removes stale runs, and only those: every emulated launch calls it before it
creates its own namespaces. ``jaxcomm cleanup`` also removes runs without an owner record (made
by an older jaxcomm, or with another state directory) whose namespaces hold no process: a
run that still has a process inside is somebody's live run and is never touched.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess

from jaxcomm import config

STATE_DIR = pathlib.Path(config.get("JAXCOMM_STATE_DIR"))
_NAME = re.compile(r"^jc[mvb]([0-9a-f]+)(?:r\d+|p)?$")  # p: a partition fault's bridge


def _owner_file(run_id: str) -> pathlib.Path:
    return STATE_DIR / f"emulated-{run_id}.pid"


def claim(run_id: str) -> None:
    """Records this process as the owner of emulated run ``run_id``.

    Args:
      run_id: the run's id (the ``<id>`` in its namespace names).

    Returns:
      None.

    Example:
      >>> claim("a1b2")  # doctest: +SKIP
    """
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    _owner_file(run_id).write_text(str(os.getpid()))


def release(run_id: str) -> None:
    """Forgets the owner record of ``run_id`` (after its tear-down).

    Args:
      run_id: the run's id.

    Returns:
      None.

    Example:
      >>> release("a1b2")  # doctest: +SKIP
    """
    _owner_file(run_id).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_alive(run_id: str) -> bool:
    try:
        return _alive(int(_owner_file(run_id).read_text().strip()))
    except (OSError, ValueError):
        return False


def _lines(cmd: list[str]) -> list[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return done.stdout.splitlines() if done.returncode == 0 else []


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _lines(["ip", "netns", "list"]) if line.strip()]


def _links() -> list[str]:
    # "12: jcb1a2b: <BROADCAST,...>" or "13: jcv1a2br0@if12: ..."
    names = []
    for line in _lines(["ip", "-o", "link", "show"]):
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _run_id(name: str) -> str | None:
    match = _NAME.match(name)
    return match.group(1) if match else None


def sweep(dry_run: bool = False, unowned: bool = False) -> list[str]:
    """Removes the namespaces, links, processes and files of emulated runs whose launcher died.

    Args:
      dry_run: only report what would be removed.
      unowned: also remove runs that have no owner record and no process in any namespace.

    Returns:
      One line per thing removed (or that would be), e.g. ``"namespace jcm1a2br0"``.

    Example:
      >>> for line in sweep(dry_run=True):  # doctest: +SKIP
      ...     print(line)
    """
    done: list[str] = []
    stale: dict[str, bool] = {}
    namespaces = _namespaces()

    def is_stale(run_id: str) -> bool:
        if run_id not in stale:
            if _owner_file(run_id).exists():
                stale[run_id] = not _owner_alive(run_id)
            else:
                stale[run_id] = unowned and not any(
                    _lines(["ip", "netns", "pids", ns])
                    for ns in namespaces
                    if _run_id(ns) == run_id
                )
        return stale[run_id]

    for ns in namespaces:
        run_id = _run_id(ns)
        if run_id is None or not is_stale(run_id):
            continue
        # Processes still inside the namespace (ranks, or anything a rank started).
        for pid in _lines(["ip", "netns", "pids", ns]):
            done.append(f"process {pid.strip()} in namespace {ns}")
            if not dry_run:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        done.append(f"namespace {ns}")
        if not dry_run:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(pathlib.Path("/etc/netns") / ns, ignore_errors=True)
    for link in _links():
        run_id = _run_id(link)
        if run_id is None or not is_stale(run_id):
            continue
        done.append(f"link {link}")
        if not dry_run:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
    for run_id, dead in stale.items():
        if dead and _owner_file(run_id).exists():
            done.append(f"owner record {_owner_file(run_id)}")
            if not dry_run:
                release(run_id)
    return done
