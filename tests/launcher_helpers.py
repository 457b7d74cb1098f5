"""Shared helpers for the launcher tests: run the installed `jaxcomm` CLI, find stray ranks."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def jaxcomm_cmd() -> list[str]:
    # The `jaxcomm` script of this interpreter's environment: one found on PATH may belong to
    # another installation (e.g. a pyenv shim) and test that one instead.
    script = pathlib.Path(sys.executable).with_name("jaxcomm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "jaxcomm_launcher"]


def write_recipe(path: pathlib.Path, **fields) -> pathlib.Path:
    data = {"name": "t", "job": "smoke", "world": {"processes": 2}, "train": {"steps": 3}}
    data.update(fields)
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(*args: str, cwd: pathlib.Path, timeout: float = 240) -> subprocess.CompletedProcess:
    # Run outside the repository root so `jaxcomm` imports the installed package.
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run(
        [*jaxcomm_cmd(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def run_probe(
    recipe: pathlib.Path, out: pathlib.Path, tmp_path: pathlib.Path, *options: str
) -> subprocess.CompletedProcess:
    """Runs ``jaxcomm probe <recipe> --out <out> --run-dir <tmp_path>/run <options> -q`` in
    `tmp_path` (:func:`run_cli`) and returns the finished process."""
    run_dir = str(tmp_path / "run")
    return run_cli(
        "probe", str(recipe), "--out", str(out), "--run-dir", run_dir, *options, "-q", cwd=tmp_path
    )


def launch_bundled(recipe: str, tmp_path: pathlib.Path, *settings: str) -> pathlib.Path:
    """Runs ``jaxcomm launch recipes/<recipe>.yaml --out <tmp_path>/run -q --set <setting> ...``
    (the bundled recipes train the digits example: skipped without scikit-learn), checks that
    it succeeded and returns the run directory."""
    pytest.importorskip("sklearn")
    out = tmp_path / "run"
    overrides = [arg for setting in settings for arg in ("--set", setting)]
    recipe_path = str(ROOT / "recipes" / f"{recipe}.yaml")
    res = run_cli("launch", recipe_path, "--out", str(out), "-q", *overrides, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_launch(
    recipe: pathlib.Path,
    out: pathlib.Path,
    *args: str,
    cwd: pathlib.Path,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Starts ``jaxcomm launch <recipe> --out <out> <args>`` without waiting (pipes as text).

    The launcher starts with Ctrl-C's default disposition, as from a terminal, whatever the
    suite inherited: a shell's background job starts with SIGINT ignored, and the Ctrl-C test
    depends on the disposition being the default one.
    """
    return subprocess.Popen(
        [*jaxcomm_cmd(), "launch", str(recipe), "--out", str(out), *args],
        cwd=cwd,
        env=env,
        preexec_fn=_default_sigint,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def worker_pids(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions `marker` (e.g. the run dir)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            state = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            out.append(int(entry))
    return out
