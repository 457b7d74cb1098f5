"""Worlds of 2 and 4 processes on one GPU, launched by `jaxcomm launch` (world.platform gpu,
processes_per_gpu = P): every collective against the NumPy references, and bit-equal to a CPU
world of as many ranks on the same inputs (the same schedule over UCX).

Ranks sharing a GPU need jaxcomm's GPU collectives over UCX (JAXCOMM_TRANSPORT=ucx): NCCL
refuses two ranks on one GPU. Skipped without a GPU; .ci/gpu-check runs this module in a
pytest process of its own (one that holds no GPU memory while the ranks run).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import reference
from collectives_harness import make_inputs
from conftest import UCX_ONLY
from gpu_world_job import CASES, N
from jaxcomm_launcher.placement import visible_gpus
from launcher_helpers import run_cli, write_recipe

import jaxcomm

TESTS = pathlib.Path(__file__).parent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not visible_gpus(), reason="needs a CUDA GPU (no /dev/nvidia*)"),
]


def _world(tmp_path: pathlib.Path, processes: int, platform: str) -> dict[str, np.ndarray]:
    """Launches gpu_world_job in one world and returns its results, every rank's merged."""
    world = {"processes": processes, "platform": platform}
    if platform == "gpu":
        world["processes_per_gpu"] = processes
    recipe = write_recipe(
        tmp_path / f"{platform}{processes}.yaml",
        name=f"{platform}{processes}",
        job="gpu_world_job:run",
        world=world,
        pythonpath=[str(TESTS)],
        # One schedule in both worlds: every byte through the transport, none through the
        # CPU world's shared-memory fast path.
        env=dict(UCX_ONLY),
    )
    out = tmp_path / f"run-{platform}{processes}"
    res = run_cli("launch", str(recipe), "--out", str(out), "-q", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    merged: dict[str, np.ndarray] = {}
    for rank in range(processes):
        with np.load(out / "dense" / f"rank{rank}.npz") as data:
            merged.update({k: data[k] for k in data.files})
    return merged


@pytest.mark.parametrize("processes", [2, 4])
def test_world_on_one_gpu_matches_references_and_the_cpu_world(tmp_path, processes):
    gpu = _world(tmp_path, processes, "gpu")
    cpu = _world(tmp_path, processes, "cpu")
    assert sorted(gpu) == sorted(cpu)
    for key in gpu:
        np.testing.assert_array_equal(gpu[key], cpu[key], err_msg=key)  # bit-identical
    xs, rs = make_inputs(processes, N, 1), make_inputs(processes, N, 2, scale=0.1)
    for rank in range(processes):
        np.testing.assert_allclose(gpu[f"dense/{rank}/summed"], xs.sum(0), rtol=1e-5, atol=1e-5)
    for case, spec in CASES.items():
        if spec is None:
            continue
        algorithm = getattr(jaxcomm, spec[0])(**spec[1])
        if case in ("topk_allgather", "gtopk"):
            ref = reference.topk_allgather if case == "topk_allgather" else reference.gtopk
            expected, expected_r = ref(list(xs), list(rs), algorithm.k(N))
        else:
            expected, expected_r, _ = reference.quantized_allreduce(list(xs), list(rs), algorithm)
        for rank in range(processes):
            summed, residual = gpu[f"{case}/{rank}/summed"], gpu[f"{case}/{rank}/residual"]
            np.testing.assert_allclose(summed, expected, rtol=0, atol=1e-6, err_msg=case)
            np.testing.assert_allclose(residual, expected_r[rank], rtol=1e-5, atol=1e-5)
