"""GPU worlds in the launcher, checked without a GPU: the recipe's platform and GPUs per rank,
each rank's CUDA_VISIBLE_DEVICES (local, emulated), the rule mpirun and Slurm ranks apply
themselves, the sbatch script's --gres, and ranks sharing one GPU (UCX only, no preallocation).
The GPU run itself is in .ci/gpu-check."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from jaxcomm_launcher.placement import assign_gpus, gpu_slots, gpus_needed, visible_gpus
from jaxcomm_launcher.recipe import Recipe, RecipeError, load_recipe
from launcher_helpers import ROOT, run_cli, write_recipe

GPU_RECIPE = ROOT / "recipes" / "digits-gpu.yaml"
_NO_SHARING = ["world.processes_per_gpu=1"]


def _gpu_recipe(**world) -> Recipe:
    return Recipe(name="g", job="smoke", world={"platform": "gpu", "processes": 4, **world})


def test_each_rank_takes_its_gpus_and_shares_them_by_processes_per_gpu():
    assert gpu_slots(4, 1, 1) == [(0,), (1,), (2,), (3,)]
    assert gpu_slots(4, 1, 2) == [(0,), (0,), (1,), (1,)]
    assert gpu_slots(2, 2, 1) == [(0, 1), (2, 3)]
    assert [gpus_needed(4, 1, k) for k in (1, 2, 3, 4)] == [4, 2, 2, 1]
    # The GPUs are named as CUDA_VISIBLE_DEVICES names them (indices or UUIDs), in order.
    assert assign_gpus(["3", "5"], 4, 1, 2) == ["3", "3", "5", "5"]
    assert assign_gpus(["GPU-a", "GPU-b"], 1, 2, 1) == ["GPU-a,GPU-b"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    with pytest.raises(ValueError, match="need 2 GPUs per node; this node shows 1"):
        assign_gpus(["0"], 2, 1, 1)


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"world": {"processes": 2, "processes_per_gpu": 2}}, "world.processes_per_gpu"),
        (
            {"world": {"platform": "gpu", "processes_per_gpu": 2, "devices_per_process": 2}},
            "world.devices_per_process must be 1",
        ),
        ({"world": {"platform": "tpu"}}, "world.platform"),
        (
            {"world": {"platform": "gpu", "processes": 2, "processes_per_gpu": 4}},
            "world.processes_per_gpu=4 is more than world.processes=2",
        ),
        (
            {
                "world": {"platform": "gpu", "processes_per_gpu": 2},
                "env": {"JAXCOMM_TRANSPORT": "nccl"},
            },
            "env.JAXCOMM_TRANSPORT='nccl'",
        ),
        (
            {
                "world": {"platform": "gpu", "processes_per_gpu": 2},
                "env": {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
            },
            "env.XLA_PYTHON_CLIENT_PREALLOCATE",
        ),
        (
            {
                "world": {"platform": "gpu", "processes_per_gpu": 2},
                "sweep": [{"algorithm": "dense"}, {"algorithm": "psum"}],
            },
            "sweep[1].algorithm: psum",
        ),
    ],
)
def test_bad_gpu_world_is_refused_naming_the_key(tmp_path, fields, key):
    path = write_recipe(tmp_path / "r.yaml", **fields)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert key in str(err.value)
    assert "{" not in str(err.value).split("\n", 1)[1]  # the message, not the section's dict


def test_shared_gpu_recipe_exits_2_before_any_rank_starts(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        world={"processes": 2, "platform": "gpu", "processes_per_gpu": 2},
        env={"JAXCOMM_TRANSPORT": "nccl"},
    )
    res = run_cli("launch", str(recipe), "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "env.JAXCOMM_TRANSPORT" in res.stderr and "ucx" in res.stderr
    assert not (tmp_path / "run").exists()


def test_bundled_gpu_recipe_dry_run_without_a_gpu(tmp_path):
    res = run_cli("launch", "digits-gpu", "--dry-run", "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    ranks = [line for line in res.stdout.splitlines() if "jaxcomm_launcher.worker" in line]
    assert len(ranks) == 4  # 2 ranks x 2 sweep entries
    for line in ranks:
        assert "JAXCOMM_TRANSPORT=ucx" in line and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in line
    assert [line.split("CUDA_VISIBLE_DEVICES=")[1].split()[0] for line in ranks[:2]] == ["0", "0"]
    assert "# world: 2 processes × 1 GPU (2 per GPU)" in res.stdout
    assert "shared GPUs: 2 ranks per GPU over transport ucx, no preallocation" in res.stdout
    assert "pick: psum" not in res.stdout  # XLA's NCCL psum cannot run on a shared GPU
    assert not (tmp_path / "run").exists()
    # One GPU per rank: no sharing, no transport forced.
    res = run_cli(
        "launch", "digits-gpu", "--dry-run", "--set", "world.processes_per_gpu=1", cwd=tmp_path
    )
    ranks = [line for line in res.stdout.splitlines() if "jaxcomm_launcher.worker" in line]
    assert [line.split("CUDA_VISIBLE_DEVICES=")[1].split()[0] for line in ranks[:2]] == ["0", "1"]
    assert "JAXCOMM_TRANSPORT" not in res.stdout and "shared GPUs" not in res.stdout


def test_gpu_launch_without_the_gpus_fails_before_starting_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever the machine has
    res = run_cli("launch", str(GPU_RECIPE), "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "need 1 GPUs per node; this node shows 0" in res.stderr
    assert "world.processes_per_gpu" in res.stderr
    assert not list((tmp_path / "run").glob("*/rank0.log"))


def test_slurm_asks_each_node_for_its_gpus(tmp_path):
    from jaxcomm_launcher.backends.slurm import SlurmBackendRunner

    own = load_recipe(
        GPU_RECIPE,
        ["backend.kind=slurm", "backend.nodes=2", "world.processes=8", "world.processes_per_gpu=1"],
    )
    script = SlurmBackendRunner(own, tmp_path).render()
    assert "#SBATCH --gres=gpu:4\n" in script and "#SBATCH --ntasks-per-node=4\n" in script
    assert script.count("srun --kill-on-bad-exit=1 --ntasks=8 --gres=gpu:4 ") == 2
    assert "SLURM_LOCALID" in script and "JAXCOMM_TRANSPORT" not in script
    shared = load_recipe(GPU_RECIPE, ["backend.kind=slurm", "world.processes=4"])
    script = SlurmBackendRunner(shared, tmp_path).render()
    assert "#SBATCH --gres=gpu:2\n" in script
    assert "export JAXCOMM_TRANSPORT=ucx\n" in script
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE=false\n" in script
    cpu = load_recipe(
        GPU_RECIPE, ["backend.kind=slurm", "world.platform=cpu", "world.processes_per_gpu=1"]
    )
    assert "gres" not in SlurmBackendRunner(cpu, tmp_path).render()


def test_mpirun_exports_the_shared_gpu_settings(tmp_path):
    from jaxcomm_launcher.backends.mpirun import MpirunBackendRunner

    recipe = load_recipe(GPU_RECIPE, ["backend.kind=mpirun", "world.processes=4"])
    lines = MpirunBackendRunner(recipe, tmp_path).describe(tmp_path / "spec.json")
    cmd = lines[0].split()
    for name in ("JAXCOMM_TRANSPORT", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        assert cmd[cmd.index(name) - 1] == "-x", name
    assert lines[1] == (
        "# GPUs: local rank L (OMPI_COMM_WORLD_LOCAL_RANK) takes its node's visible GPU L // 2"
    )


def test_ranks_under_mpirun_and_slurm_take_their_gpus_by_local_rank():
    from jaxcomm_launcher.worker import local_gpus

    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert local_gpus(env, 1, 1) == "7"
    assert local_gpus(env, 1, 2) == "5"
    assert local_gpus({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2, 1) == "2,3"
    with pytest.raises(RuntimeError, match="needs GPU 3 of its node, which shows 2"):
        local_gpus({"SLURM_LOCALID": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, 1, 1)
    with pytest.raises(RuntimeError, match="SLURM_LOCALID"):
        local_gpus({"CUDA_VISIBLE_DEVICES": "0"}, 1, 1)


def test_emulated_gpu_nodes_send_over_the_shaped_links(tmp_path):
    from jaxcomm_launcher.backends.emulated import EmulatedBackendRunner

    recipe = load_recipe(GPU_RECIPE, ["backend.kind=emulated"])
    runner = EmulatedBackendRunner(recipe, tmp_path)
    (_, env0), (_, env1) = runner.rank_launches(tmp_path / "spec.json", dry_run=True)
    assert env0["CUDA_VISIBLE_DEVICES"] == env1["CUDA_VISIBLE_DEVICES"] == "0"
    assert env0["UCX_TLS"] == "tcp,cuda_copy" and env0["UCX_NET_DEVICES"] == "eth0"
    assert env0["NCCL_P2P_DISABLE"] == env0["NCCL_SHM_DISABLE"] == "1"
    assert runner.placement(dry_run=True).to_json()["gpus"] == ["0", "0"]
    cpu = load_recipe(GPU_RECIPE, ["backend.kind=emulated", "world.platform=cpu"] + _NO_SHARING)
    (_, env0), _ = EmulatedBackendRunner(cpu, tmp_path).rank_launches(tmp_path / "s", dry_run=True)
    assert env0["UCX_TLS"] == "tcp" and "NCCL_P2P_DISABLE" not in env0
    assert "CUDA_VISIBLE_DEVICES" not in env0


_PLATFORM = textwrap.dedent(
    """
    import sys
    from jaxcomm_launcher.recipe import Recipe
    from jaxcomm_launcher.worker import _check_devices, _setup_jax
    world = {"platform": sys.argv[1], "devices_per_process": int(sys.argv[2])}
    recipe = Recipe(name="p", job="smoke", world=world)
    jax = _setup_jax(recipe)
    try:
        _check_devices(jax, recipe)
    except RuntimeError as exc:
        print("error:", exc)
    else:
        print(jax.devices()[0].platform, len(jax.devices()))
    """
)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_worker_runs_on_the_recipes_platform(tmp_path, platform):
    """A cpu rank gets its CPU devices even where a GPU is; a gpu rank gets CUDA or fails,
    never falling back to the CPU."""
    res = subprocess.run(
        [sys.executable, "-c", _PLATFORM, platform, "3" if platform == "cpu" else "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},  # one GPU, where there is one
    )
    assert res.returncode == 0, res.stderr
    if platform == "cpu":
        assert res.stdout.strip() == "cpu 3"
    else:
        out = res.stdout.strip()
        assert out == "gpu 1" or "world.platform is gpu but JAX found no CUDA GPU" in out, out


def test_bundled_gpu_recipe_is_listed(tmp_path):
    res = run_cli("recipes", cwd=tmp_path)
    assert res.returncode == 0 and "digits-gpu" in res.stdout
    assert pathlib.Path(GPU_RECIPE).exists()


def test_the_results_table_names_each_ranks_gpu():
    from jaxcomm_launcher.results import print_table
    from rich.console import Console

    console = Console(record=True, width=300)
    notice = "shared GPUs: 2 ranks per GPU over transport ucx, no preallocation"
    summary = {
        "recipe": "g",
        "backend": "local",
        "world": {"processes": 2, "devices_per_process": 1, "platform": "gpu"},
        "placement": {"node_cpus": None, "gpus": ["0", "0"], "shared_gpus": notice},
        "variants": [],
    }
    print_table(summary, console)
    text = " ".join(console.export_text().split())  # the title wraps at the table's width
    assert "2 processes × 1 GPUs · GPUs 0 | 0 · " + notice in text
