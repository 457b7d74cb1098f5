"""The slurm backend on a real (one-host) Slurm: docs/slurm.md's commands, a killed task, Ctrl-C.

The cluster (tests/slurm_cluster.py) needs root; it is installed through .ci/system-deps when
missing and torn down after the module, with every process it started.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import time

import pytest
from launcher_helpers import ROOT, jaxcomm_cmd, start_launch, worker_pids, write_recipe

# Every wait below is a bound on a state Slurm reaches, not a performance claim: they are
# generous (a busy 2-core machine trains the digits job in minutes), and the test timeout
# bounds them all.
pytestmark = [
    pytest.mark.slow,  # a Slurm cluster per module (`pytest -m slow`; CI runs it)
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="the Slurm tests start munged, slurmctld and slurmd (and may apt-get install "
        "them): they need root",
    ),
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    from slurm_cluster import SlurmCluster, ensure_installed

    ensure_installed()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield cluster
    finally:
        cluster.stop()
    # The namespace is gone: nothing of the cluster or its jobs may be left.
    assert not worker_pids(str(cluster.root)), "processes of the test cluster are left"


def launch(slurm, *args: str, cwd: pathlib.Path, timeout: float = 600):
    return subprocess.run(
        [*jaxcomm_cmd(), *args],
        cwd=cwd,
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def job_id_of(run_dir: pathlib.Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["slurm"]["job_id"]


def wait_for(predicate, timeout: float = 300, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def readme_slurm_commands() -> list[str]:
    """The first bash block of docs/slurm.md (the README links there)."""
    text = (ROOT / "docs" / "slurm.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "docs/slurm.md has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_slurm_section_runs_digits_with_two_tasks(slurm, tmp_path):
    """docs/slurm.md's Slurm commands, as written: the digits recipe (2 tasks) submitted and
    followed to a summary, submitted detached and reported, and printed as a script."""
    commands = readme_slurm_commands()
    assert len(commands) == 4 and all(
        c.startswith("jaxcomm launch") or "report" in c for c in commands
    )
    results = {}
    for command in commands:
        res = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=slurm.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, f"{command}\n{res.stdout}\n{res.stderr}"
        results[command] = res
    attached, detached, report, dry_run = (results[c] for c in commands)

    # Followed: state, rank logs, then the same artifacts as the local backend.
    out = tmp_path / "runs" / "digits-slurm"
    assert "RUNNING" in attached.stdout and "[r0]" in attached.stdout and "[r1]" in attached.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "slurm" and summary["slurm"]["state"] == "COMPLETED"
    (v,) = summary["variants"]
    assert v["status"] == "ok" and v["ranks_reporting"] == 2 and v["steps"] == 300
    assert v["final_test_accuracy"] > 0.8 and v["final_loss"] < 1.0
    assert (out / "loss.png").stat().st_size > 1000 and (out / "step_time.png").exists()
    assert "digits dense: test accuracy" in (out / "dense" / "rank0.log").read_text()
    for rank in (0, 1):
        status = json.loads((out / "dense" / f"rank{rank}.status.json").read_text())
        assert status["ok"] and status["host"]

    # Detached: submitted only; report works while it runs and after it ended.
    d_out = tmp_path / "runs" / "digits-detached"
    assert "submitted Slurm job" in detached.stdout and "jaxcomm report" in detached.stdout
    assert "slurm job" in report.stdout
    job = job_id_of(d_out)
    wait_for(lambda: slurm.job_state(job) == "COMPLETED", what=f"detached job {job}")
    res = launch(slurm, "report", str(d_out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "COMPLETED" in res.stdout
    summary = json.loads((d_out / "summary.json").read_text())
    assert summary["variants"][0]["status"] == "ok"
    assert summary["variants"][0]["final_test_accuracy"] > 0.8
    assert (d_out / "loss.png").exists()

    assert (
        dry_run.stdout.startswith("#!/bin/bash") and "srun --kill-on-bad-exit=1" in dry_run.stdout
    )
    assert len(list((tmp_path / "runs").iterdir())) == 2  # --dry-run wrote nothing
    assert not worker_pids(str(tmp_path))


def _rank_pid(run_dir: pathlib.Path, rank: int) -> int | None:
    for pid in worker_pids(str(run_dir)):
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"jaxcomm_launcher.worker" in cmdline and f"SLURM_PROCID={rank}".encode() in environ:
            if not os.path.basename(cmdline[0]).startswith(b"srun"):
                return pid
    return None


def test_killed_task_fails_the_job_and_names_rank_and_node(slurm, tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml", backend="slurm", train={"steps": 10000}, args={"sleep_s": 0.05}
    )
    out = tmp_path / "run"
    proc = start_launch(recipe, out, "-q", cwd=tmp_path, env=slurm.env)
    try:
        wait_for(lambda: (out / "dense" / "rank1.jsonl").exists(), what="rank 1's first step")
        pid = _rank_pid(out, 1)
        assert pid is not None, "rank 1's process not found"
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, stdout + stderr
    assert f"rank 1 on node {slurm.node} failed" in stderr and "Killed" in stderr, stderr
    summary = json.loads((out / "summary.json").read_text())
    v = summary["variants"][0]
    assert v["status"] == "failed" and v["failed_rank"] == 1 and v["failed_node"] == slurm.node
    assert summary["slurm"]["state"] == "FAILED"
    assert slurm.job_state(job_id_of(out)) == "FAILED"
    assert not worker_pids(str(out))


def test_ctrl_c_cancels_the_job_and_leaves_no_process(slurm, tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml", backend="slurm", train={"steps": 10000}, args={"sleep_s": 0.1}
    )
    out = tmp_path / "run"
    proc = start_launch(recipe, out, cwd=tmp_path, env=slurm.env)
    try:
        wait_for(lambda: (out / "dense" / "rank1.jsonl").exists(), what="rank 1's first step")
        assert len(worker_pids(str(out))) >= 2
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout + stderr
    assert "scancel" in stdout and "cancelled" in stderr
    job = job_id_of(out)
    assert slurm.job_state(job) == "CANCELLED"
    assert job not in slurm.jobs()
    assert not worker_pids(str(out))
    v = json.loads((out / "summary.json").read_text())["variants"][0]
    assert v["status"] == "interrupted" and v["steps"] > 0


def test_failed_step_restarts_inside_the_allocation(slurm, tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        backend="slurm",
        train={"steps": 8},
        max_restarts=1,
        args={"fail_rank": 1, "fail_at_step": 3, "fail_mode": "kill", "fail_once": True},
    )
    out = tmp_path / "run"
    res = launch(slurm, "launch", str(recipe), "--out", str(out), "-q", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((out / "summary.json").read_text())
    (v,) = summary["variants"]
    assert v["status"] == "ok" and v["steps"] == 8
    (restart,) = v["restarts"]
    assert restart["attempt"] == 1 and restart["steps_done"] >= 3
    assert "exited with" in restart["cause"] or "rank 1" in restart["cause"]
    # One job, two srun steps: the restart stayed inside the allocation.
    assert summary["slurm"]["state"] == "COMPLETED"
    # The first attempt's records were set aside (no checkpoints: the rerun starts at 0).
    assert restart["resumed_from"] == 0 and (out / "dense" / "attempt0-rank1.jsonl").exists()
    assert not worker_pids(str(out))
