"""Launcher backends: mpirun with 2 ranks, slurm script (golden) and result reading, emulated
cluster. The slurm backend on a real Slurm: tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest
from launcher_helpers import ROOT, run_cli, worker_pids, write_recipe

GOLDEN = pathlib.Path(__file__).with_name("golden") / "slurm_digits_compare.sbatch"


@pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="mpirun not installed (Debian: apt-get install openmpi-bin)",
)
def test_mpirun_backend_two_ranks(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", backend={"kind": "mpirun"})
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[r0]" in res.stdout and "[r1]" in res.stdout
    for rank in (0, 1):
        assert (out / "dense" / f"rank{rank}.jsonl").read_text().count("\n") == 3
        assert "allreduce checked" in (out / "dense" / f"rank{rank}.log").read_text()
    assert json.loads((out / "summary.json").read_text())["variants"][0]["status"] == "ok"
    assert not worker_pids(str(out))


@pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="mpirun not installed (Debian: apt-get install openmpi-bin)",
)
def test_mpirun_failing_rank_is_named(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        backend={"kind": "mpirun"},
        train={"steps": 400},
        args={"fail_rank": 1, "fail_at_step": 1, "sleep_s": 0.05},
    )
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rank 1 failed" in res.stderr and "failed on purpose" in res.stderr
    assert not worker_pids(str(out))


def render_golden_recipe() -> str:
    from jaxcomm_launcher.backends.slurm import SlurmBackendRunner
    from jaxcomm_launcher.recipe import load_recipe

    recipe = load_recipe(
        ROOT / "recipes" / "digits-compare.yaml",
        [
            "backend.kind=slurm",
            "backend.nodes=2",
            "backend.partition=cpu",
            "backend.setup=['module load python/3.11', 'source ~/venv/bin/activate']",
            "world.processes=4",
            "env.XLA_FLAGS=--xla_cpu_multi_thread_eigen=false",
        ],
    )
    return SlurmBackendRunner(recipe, pathlib.Path("/scratch/runs/cmp")).render()


def test_slurm_script_matches_golden():
    rendered = render_golden_recipe()
    if os.environ.get("JAXCOMM_UPDATE_GOLDEN"):
        GOLDEN.write_text(rendered)
    assert rendered == GOLDEN.read_text()


def test_slurm_dry_run_prints_script_and_launch_needs_sbatch(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", backend="slurm")
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--dry-run", "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0
    assert res.stdout.startswith("#!/bin/bash") and "srun --kill-on-bad-exit=1" in res.stdout
    assert f"--spec {out}/dense/spec.json" in res.stdout
    assert not out.exists()
    if shutil.which("sbatch") is None:
        res = run_cli("launch", str(recipe), "--out", str(out), cwd=tmp_path)
        assert res.returncode == 1 and "sbatch" in res.stderr and "not on PATH" in res.stderr


def test_dry_run_of_other_backends_starts_nothing(tmp_path):
    for backend in ("local", "mpirun", "emulated"):
        recipe = write_recipe(tmp_path / "r.yaml", backend=backend)
        res = run_cli(
            "launch", str(recipe), "--dry-run", "--out", str(tmp_path / "x"), cwd=tmp_path
        )
        assert res.returncode == 0, res.stderr
        assert "jaxcomm_launcher.worker" in res.stdout
        assert not (tmp_path / "x").exists()


def test_emulated_backend_requires_root(tmp_path, monkeypatch):
    from jaxcomm_launcher.backends import BackendError
    from jaxcomm_launcher.backends.emulated import EmulatedBackendRunner
    from jaxcomm_launcher.recipe import Recipe

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    recipe = Recipe(name="e", job="smoke", backend="emulated")
    with pytest.raises(BackendError, match="needs root"):
        with EmulatedBackendRunner(recipe, tmp_path):
            pass


def _namespaces() -> set[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in res.stdout.splitlines() if line.strip()}


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="the emulated backend needs root and iproute2",
)
def test_emulated_backend_creates_and_removes_two_namespaces(tmp_path):
    before = _namespaces()
    recipe = write_recipe(
        tmp_path / "r.yaml",
        backend={"kind": "emulated", "bandwidth": "1gbit"},
        args={"size": 262144},
    )
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    setup = (out / "emulated-setup.log").read_text()
    assert setup.count("ip netns add") == 2 and "tbf rate 1gbit burst 128kb" in setup
    assert _namespaces() == before
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert "jcb" not in links and "jcv" not in links

    # A failing rank must also leave nothing behind.
    recipe = write_recipe(
        tmp_path / "r2.yaml",
        backend="emulated",
        train={"steps": 100},
        args={"fail_rank": 0, "fail_at_step": 1},
    )
    res = run_cli("launch", str(recipe), "--out", str(tmp_path / "run2"), cwd=tmp_path)
    assert res.returncode == 1 and "rank 0 failed" in res.stderr
    assert _namespaces() == before
    assert not worker_pids(str(tmp_path / "run2"))


def test_mpirun_output_of_two_ranks_glued_in_one_line_is_split():
    """OpenMPI can glue another rank's tagged chunk to a chunk without a newline (seen once in
    CI: rank 1's line ended up in rank 0's log and rank 0's next line was lost from it)."""
    from jaxcomm_launcher.backends.mpirun import route_tagged_line

    assert route_tagged_line("[1,0]<stdout>:allreduce checked") == [(0, "allreduce checked")]
    assert route_tagged_line("[1,0]<stdout>: spaced") == [(0, "spaced")]  # OpenMPI 5
    assert route_tagged_line("[1,0]<stdout>:") == [(0, "")]
    assert route_tagged_line("[1,0]<stdout>:half[1,1]<stdout>:other rank") == [
        (0, "half"),
        (1, "other rank"),
    ]
    assert route_tagged_line("[1,0]<stdout>:text[1,1]<stderr>:") == [(0, "text")]
    assert route_tagged_line("mpirun noticed something") == [(None, "mpirun noticed something")]


def test_worker_takes_its_coordinator_from_slurm():
    from jaxcomm_launcher.worker import coordinator_address, first_host

    assert first_host("node[07-09,12],gpu3") == "node07"
    assert first_host("a,b") == "a" and first_host("n[1-2]-ib") == "n1-ib"
    assert first_host("solo") == "solo"
    slurm = {"SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "n[3-4]", "SLURM_STEP_ID": "2"}
    assert coordinator_address({**slurm, "JAXCOMM_COORDINATOR_PORT": "29500"}) == "n3:29502"
    assert (
        coordinator_address({**slurm, "SLURM_STEP_NODELIST": "n4", "JAXCOMM_COORDINATOR_PORT": "1"})
        == "n4:3"
    )
    assert coordinator_address({**slurm, "JAXCOMM_COORDINATOR": "h:5"}) == "h:5"
    with pytest.raises(RuntimeError, match="JAXCOMM_COORDINATOR_PORT"):
        coordinator_address(slurm)
    with pytest.raises(RuntimeError, match="not a Slurm step"):
        coordinator_address({})


def _slurm_step(vdir: pathlib.Path, exit_code: int, srun_log: str, statuses: dict) -> None:
    (vdir / "step.json").write_text(
        json.dumps({"exit_code": exit_code, "started": 100.0, "ended": 112.5})
    )
    (vdir / "srun.log").write_text(srun_log)
    for rank in (0, 1):
        (vdir / f"rank{rank}.log").write_text(f"rank {rank} log line\n")
    for rank, status in statuses.items():
        (vdir / f"rank{rank}.status.json").write_text(json.dumps({"rank": rank, **status}))


def test_slurm_collect_names_the_failed_rank_and_node(tmp_path):
    """srun may notice the peer that lost its connection before the killed task; the killed
    task is blamed, and srun's later SIGTERM of the others never is."""
    from jaxcomm_launcher.backends.slurm import JobState, SlurmBackendRunner, collect
    from jaxcomm_launcher.recipe import Recipe

    recipe = Recipe(
        name="s",
        job="smoke",
        backend="slurm",
        sweep=[
            {"label": "killed"},
            {"label": "raised"},
            {"label": "fine"},
            {"label": "cut"},
            {"label": "later"},
        ],
    )
    SlurmBackendRunner(recipe, tmp_path).write()
    _slurm_step(
        tmp_path / "killed",
        137,
        "srun: error: n1: task 0: Exited with exit code 1\n"
        "srun: launch/slurm: _step_signal: Terminating StepId=7.0\n"
        "srun: error: n2: task 1: Killed\n",
        {0: {"ok": False, "host": "n1", "error": "JaxRuntimeError: Connection closed by peer"}},
    )
    _slurm_step(
        tmp_path / "raised",
        1,
        "srun: error: n2: task 1: Exited with exit code 1\nsrun: error: n1: task 0: Terminated\n",
        {1: {"ok": False, "host": "n2", "error": "RuntimeError: bad batch"}},
    )
    _slurm_step(tmp_path / "fine", 0, "", {0: {"ok": True}, 1: {"ok": True}})
    (tmp_path / "cut" / "rank0.log").write_text("started\n")  # no step.json: cancelled
    run = collect(tmp_path, JobState("CANCELLED", nodes="n[1-2]"))
    by = {v["label"]: v for v in run["variants"]}
    assert by["killed"]["status"] == "failed"
    assert (by["killed"]["failed_rank"], by["killed"]["failed_node"]) == (1, "n2")
    assert by["killed"]["reason"] == "rank 1 on node n2 failed (srun: task 1: Killed)"
    assert (by["raised"]["failed_rank"], by["raised"]["failed_node"]) == (1, "n2")
    assert by["raised"]["error"] == "RuntimeError: bad batch"
    assert by["fine"]["status"] == "ok" and by["fine"]["wall_s"] == 12.5
    assert by["cut"]["status"] == "interrupted" and by["later"]["status"] == "not run"
    assert json.loads((tmp_path / "run.json").read_text())["slurm"]["state"] == "CANCELLED"

    run = collect(tmp_path, JobState("RUNNING", nodes="n[1-2]"))
    by = {v["label"]: v for v in run["variants"]}
    assert by["cut"]["status"] == "running" and by["later"]["status"] == "waiting"

    # Slurm cannot tell (no scontrol here): an entry without step.json is not guessed at.
    run = collect(tmp_path, None)
    by = {v["label"]: v for v in run["variants"]}
    assert by["cut"]["status"] == "unknown" and by["killed"]["failed_rank"] == 1
