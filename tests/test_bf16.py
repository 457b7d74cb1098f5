"""bfloat16 / float16 gradients: the dense 16-bit allreduce against the float32 sum rounded once
(and lax.psum), every compressed allreduce against tests/reference.py run on the widened
inputs (residual conservation included), the single-device ops, and the Optax transform on a
mixed-precision tree. One worker process per device count (tests/bf16_worker.py)."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import reference
from bf16_worker import ALGORITHMS, COMPRESSED_SIZES, DENSE_SIZES, DTYPES
from collective_worker import half_sizes
from collectives_harness import make_inputs, worker_results
from conftest import UCX_ONLY

import jaxcomm
from jaxcomm import cost

WORKER = pathlib.Path(__file__).with_name("bf16_worker.py")
DEVICE_COUNTS = (3, 4)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    get = worker_results(tmp_path_factory, WORKER, timeout=240)
    return lambda devices: get(devices, "--devices", devices, name="bf16")


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` (nearest even) and widened back exactly."""
    return np.asarray(jnp.asarray(values, jnp.float32).astype(dtype).astype(jnp.float32))


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", DENSE_SIZES)
def test_dense_is_float32_sum_rounded_once(run, devices, dtype, n):
    arrays, info = run(devices)
    case = f"dense/{dtype}/{n}"
    summed = arrays[f"{case}/summed"]
    assert arrays[f"{case}/dtype_ok"]
    xs = rounded(make_inputs(devices, n, n), dtype)  # what each rank passed, widened
    expected = rounded(xs.sum(axis=0, dtype=np.float32), dtype)
    for rank in range(devices):
        np.testing.assert_array_equal(summed[rank], expected)
    # lax.psum in 16 bits rounds at every step: same sum within a few 16-bit ulps.
    eps = float(jnp.finfo(dtype).eps)
    scale = np.abs(xs).sum(axis=0)
    assert np.all(np.abs(arrays[f"{case}/psum"][0] - expected) <= 2 * devices * eps * scale + 1e-6)
    # 2 bytes per element: each rank sends every chunk but its own twice (here read from it
    # through shared memory: the ranks share a process).
    assert info[case]["algorithms"] == [f"{label(dtype)}_direct"]
    assert max(info[case]["bytes_sent"]) <= 2 * 2 * n * (devices - 1) / devices + 2 * 2
    assert sum(info[case]["bytes_sent"]) == 2 * 2 * n * (devices - 1)


def label(dtype: str) -> str:
    """The metric label of the 16-bit dense allreduce of `dtype` over UCX."""
    return f"dense_{'bf16' if dtype == 'bfloat16' else 'f16'}"


# 1 x N (ranks share a process), N x 1 (processes of one host: staged up to 16 MiB), N x D.
HALF_WORLDS = [(1, 3), (2, 1), (2, 2), (3, 1)]


@pytest.mark.parametrize("processes,devices", HALF_WORLDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_memory_path_gives_the_rings_bits(world_run, processes, devices, dtype):
    # The shared-memory path (every rank on this host) against the UCX ring
    # (JAXCOMM_SHARED_MEMORY=0) and the float32 sum rounded once, compared as 16-bit words.
    direct = world_run(processes, devices, mode="half")
    ring = world_run(processes, devices, mode="half", env=UCX_ONLY)
    world = processes * devices
    for name in [*map(str, half_sizes(processes)), "zeros"]:
        case = f"half/{dtype}/{name}"
        bits = direct.rank_values(case, "bits")
        assert len(bits) == world
        for rank, (mine, theirs) in enumerate(
            zip(bits, ring.rank_values(case, "bits"), strict=True)
        ):
            np.testing.assert_array_equal(mine, bits[0], err_msg=f"{case} rank {rank}")
            np.testing.assert_array_equal(mine, theirs, err_msg=f"{case} rank {rank}")
        assert [str(a) for a in direct.rank_values(case, "algorithm")] == [
            f"{label(dtype)}_direct"
        ] * world
        assert [str(a) for a in ring.rank_values(case, "algorithm")] == [label(dtype)] * world
        if name == "zeros":
            assert not bits[0].any(), "-0 on every rank sums to +0, as the ring's sum from +0"
            continue
        n = int(name)
        xs = rounded(make_inputs(world, n, n), dtype)
        expected = rounded(xs.sum(axis=0, dtype=np.float32), dtype)
        got = bits[0].view(jnp.dtype(dtype)).astype(np.float32)
        np.testing.assert_array_equal(got, expected, err_msg=case)
        sent = direct.rank_values(case, "bytes_sent")
        assert [int(b) for b in sent] == [
            cost.direct_bytes(n, world, rank, element_bytes=2) for rank in range(world)
        ]


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("n", COMPRESSED_SIZES)
def test_compressed_matches_reference_and_conserves(run, devices, dtype, name, n):
    arrays, _ = run(devices)
    case = f"compressed/{name}/{dtype}/{n}"
    assert arrays[f"{case}/dtype_ok"]
    summed, residuals = arrays[f"{case}/summed"], arrays[f"{case}/residual"]
    xs = rounded(make_inputs(devices, n, 3 * n + 1), dtype)
    rs = make_inputs(devices, n, 3 * n + 2, scale=0.1)
    cls, params = ALGORITHMS[name]
    algorithm = getattr(jaxcomm, cls)(**params)
    if name in ("topk_allgather", "gtopk"):
        ref = reference.topk_allgather if name == "topk_allgather" else reference.gtopk
        expected32, expected_r = ref(list(xs), list(rs), algorithm.k(n))
    else:
        expected32, expected_r, _ = reference.quantized_allreduce(list(xs), list(rs), algorithm)
    expected = rounded(expected32, dtype)
    lost = (expected32 - expected) / np.float32(devices)  # rounding, fed back on every rank
    for rank in range(devices):
        np.testing.assert_array_equal(summed[rank], summed[0])
        np.testing.assert_allclose(summed[rank], expected, rtol=0, atol=1e-6)
        np.testing.assert_allclose(residuals[rank], expected_r[rank] + lost, rtol=1e-5, atol=1e-5)
    total_in = (xs.astype(np.float64) + rs).sum(axis=0)
    total_out = summed[0].astype(np.float64) + residuals.astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(total_out, total_in, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["topk", "onebit", "threshold", "adaptive"])
def test_ops_compress_16bit_equals_its_float32_value(run, dtype, name):
    arrays, _ = run(DEVICE_COUNTS[0])
    assert arrays[f"ops/{name}/{dtype}/same"]


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_optax_mixed_precision_tree(run, devices):
    arrays, _ = run(devices)
    for key in ("a", "b", "c"):
        grads = arrays[f"optax/grads/{key}"]
        dtype = {"a": "bfloat16", "b": "float32", "c": "float16"}[key]
        for label in ("dense", "adaptive"):
            assert arrays[f"optax/{label}/{key}/dtype_ok"], (label, key)
        # Dense: leaves travel in the tree's common dtype (float32 for this mixed tree), and
        # the mean is rounded to the leaf's dtype once.
        expected = rounded(grads.sum(axis=0, dtype=np.float32) / devices, dtype)
        np.testing.assert_allclose(arrays[f"optax/dense/{key}/update"][0], expected, rtol=1e-6)
        # Compressed: mean of the applied sum; sum(grads) == P * update + sum(residuals).
        update = arrays[f"optax/adaptive/{key}/update"][0].astype(np.float64)
        residual = arrays[f"optax/adaptive/{key}/residual"].astype(np.float64)
        np.testing.assert_allclose(
            devices * update + residual.sum(axis=0),
            grads.astype(np.float64).sum(axis=0),
            rtol=2e-2 if dtype != "float32" else 1e-5,
            atol=1e-2 if dtype != "float32" else 1e-5,
        )


def test_16bit_residual_is_rejected():
    x = jnp.ones(10, jnp.bfloat16)
    with pytest.raises(TypeError, match="residual must be float32"):
        jaxcomm.ops.compress(x, jnp.zeros(10, jnp.bfloat16), jaxcomm.OneBit(32))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        jaxcomm.ops.compress(x.astype(jnp.int32), jnp.zeros(10, jnp.float32), jaxcomm.OneBit(32))
