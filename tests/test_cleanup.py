"""`jaxcomm cleanup`: what a SIGKILLed emulated launch leaves behind is removed; live runs stay.

Live runs are: an owner record naming a live process, or (without a record) a process inside.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

import pytest
from launcher_helpers import jaxcomm_cmd

pytestmark = [
    pytest.mark.slow,  # creates network namespaces (`pytest -m slow`; CI runs it)
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="network namespaces need root and iproute2",
    ),
]


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.timeout(120)
def test_cleanup_removes_stale_runs_and_keeps_live_ones(tmp_path):
    stale, live, orphan, busy = (secrets.token_hex(3) for _ in range(4))
    stale_ns, live_ns, bridge = f"jcm{stale}r0", f"jcm{live}r0", f"jcb{stale}"
    orphan_ns, busy_ns = f"jcm{orphan}r0", f"jcm{busy}r0"  # no owner record: empty / in use
    env = dict(os.environ, JAXCOMM_STATE_DIR=str(tmp_path))
    sleeper = busy_sleeper = None
    try:
        for ns in (stale_ns, live_ns, orphan_ns, busy_ns):
            assert ip("netns", "add", ns).returncode == 0
        assert ip("link", "add", bridge, "type", "bridge").returncode == 0
        # A process left running inside the stale namespace, as a killed launch leaves it.
        sleeper = subprocess.Popen(
            ["ip", "netns", "exec", stale_ns, "sleep", "300"], start_new_session=True
        )
        busy_sleeper = subprocess.Popen(
            ["ip", "netns", "exec", busy_ns, "sleep", "300"], start_new_session=True
        )
        (tmp_path / f"emulated-{stale}.pid").write_text(str(dead_pid()))
        (tmp_path / f"emulated-{live}.pid").write_text(str(os.getpid()))

        dry = subprocess.run(
            [*jaxcomm_cmd(), "cleanup", "--dry-run"], capture_output=True, text=True, env=env
        )
        assert dry.returncode == 0, dry.stderr
        assert f"would remove namespace {stale_ns}" in dry.stdout, dry.stdout
        assert stale_ns in ip("netns", "list").stdout  # a dry run removes nothing

        done = subprocess.run([*jaxcomm_cmd(), "cleanup"], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        assert f"removed namespace {stale_ns}" in done.stdout, done.stdout
        assert f"removed link {bridge}" in done.stdout, done.stdout
        assert f"removed namespace {orphan_ns}" in done.stdout, done.stdout
        assert live_ns not in done.stdout and busy_ns not in done.stdout
        namespaces = ip("netns", "list").stdout
        assert stale_ns not in namespaces and orphan_ns not in namespaces
        assert live_ns in namespaces and busy_ns in namespaces
        assert busy_sleeper.poll() is None  # somebody's live run: untouched
        assert ip("link", "show", bridge).returncode != 0
        assert sleeper.wait(timeout=10) != 0  # killed
        assert not (tmp_path / f"emulated-{stale}.pid").exists()
        assert (tmp_path / f"emulated-{live}.pid").exists()
    finally:
        for proc in (sleeper, busy_sleeper):
            if proc is not None and proc.poll() is None:
                proc.kill()
        for ns in (stale_ns, live_ns, orphan_ns, busy_ns):
            ip("netns", "del", ns)
        ip("link", "del", bridge)
