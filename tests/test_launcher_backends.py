"""Launcher backends: mpirun with 2 ranks, slurm script rendering (golden), emulated cluster."""

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
        assert "psum checked" in (out / "dense" / f"rank{rank}.log").read_text()
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

    assert route_tagged_line("[1,0]<stdout>:psum checked") == [(0, "psum checked")]
    assert route_tagged_line("[1,0]<stdout>: spaced") == [(0, "spaced")]  # OpenMPI 5
    assert route_tagged_line("[1,0]<stdout>:") == [(0, "")]
    assert route_tagged_line("[1,0]<stdout>:half[1,1]<stdout>:other rank") == [
        (0, "half"),
        (1, "other rank"),
    ]
    assert route_tagged_line("[1,0]<stdout>:text[1,1]<stderr>:") == [(0, "text")]
    assert route_tagged_line("mpirun noticed something") == [(None, "mpirun noticed something")]
