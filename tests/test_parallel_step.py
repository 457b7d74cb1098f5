"""jaxcomm.data_parallel_step and jaxcomm.data_parallel against the long form README documents
(allreduce_gradients in the chain, partition specs, placement and shard_map by hand): every
algorithm, "auto", PowerSGD, DiLoCo, bf16 and optax.MultiSteps give the same parameters, bit
for bit (the per-rank program is the same), and the mean of the ranks' losses.

The runs are in a subprocess (tests/parallel_step_worker.py): the device count must be set
before JAX initializes.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from collectives_harness import run_world, worker_results

# Minutes of training worlds: CI runs them with the slow tests (`pytest -m slow`).
pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).with_name("parallel_step_worker.py")
WORLD_WORKER = pathlib.Path(__file__).with_name("parallel_step_world_worker.py")
DEVICES = 2
CASES = [
    *(
        f"{name}/algorithm"
        for name in (
            "dense", "topk_allgather", "gtopk", "adaptive", "blockquant", "onebit",
            "threshold", "powersgd", "auto",
        )
    ),
    "auto/chain",
    "bf16-params", "bf16-wire",
    "multisteps/front", "multisteps/inside",
    "diloco/dense", "diloco/gtopk", "diloco/delay",
    "wrapper/auto",
    "inside-jit",
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    get = worker_results(tmp_path_factory, WORKER, timeout=900)
    return get("equal", "--mode", "equal", "--devices", DEVICES, name="equal")


def test_every_case_ran(results):
    _, info = results
    assert sorted(info["cases"]) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_same_parameters_bit_for_bit(results, case):
    arrays, _ = results
    keys = [k for k in arrays if k.startswith(f"{case}/ours/") and k.split("/")[-1][0] in "wb"]
    assert len(keys) == 3
    for key in keys:
        ours, ref = arrays[key], arrays[key.replace("/ours/", "/ref/")]
        assert np.array_equal(ours, ref), key
    # The parameters moved (the comparison is not of two untouched copies).
    assert not np.array_equal(arrays[f"{case}/ours/w1"], arrays["initial/w1"])


@pytest.mark.parametrize("case", CASES)
def test_loss_and_metrics_are_the_ranks_mean(results, case):
    arrays, _ = results
    for name in ("loss", "accuracy"):
        ours, ref = arrays[f"{case}/ours/{name}"], arrays[f"{case}/ref/{name}"]
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7, err_msg=f"{case} {name}")


def test_the_wrapped_step_compiles_once(results):
    _, info = results
    assert info["traces"] == 1


@pytest.mark.slow
def test_two_processes_from_host_params_agree_on_params_and_the_global_loss(tmp_path):
    run = run_world(2, 1, tmp_path, mode="train", worker=WORLD_WORKER, timeout=300)
    assert run.returncodes == [0, 0], "\n".join(out[-3000:] for out in run.outputs)
    r = run.results
    assert np.array_equal(r["w/0"], r["w/1"]) and np.array_equal(r["loss/0"], r["loss/1"])
    # The first step's loss is the mean of the two processes' own losses, not process 0's.
    np.testing.assert_allclose(r["loss/0"][0], (r["local0/0"] + r["local0/1"]) / 2, rtol=1e-5)
    assert r["local0/0"] != r["local0/1"]
