"""GPU quantized and hierarchical allreduce (ffi/cuda/quantized_allreduce.cc, NCCL on XLA's
stream) against the NumPy references of the whole algorithms (tests/reference.py).

One process over all local GPUs (P = jax.device_count("gpu"); NCCL refuses two ranks on one
GPU), so a one-GPU machine checks P = 1 (the whole code path with one rank) and a multi-GPU
machine the schedules. Hierarchical meshes are (1, P) and (P, 1) over ("node", "local").
Skipped without a GPU.

Exactness. The GPU decodes and sums the P contributions with the CPU's float operations in the
CPU's order, so where the NumPy reference does the same operations the results are compared bit
for bit: Threshold always; OneBit with the reference's means replaced by the CPU's 8-lane
sequential double sums (`onebit_quantize_cpu_order`); Adaptive within a tolerance (the
reference's means use NumPy's pairwise summation). The hierarchical dense intra-node sums run
inside NCCL in its own order: with inputs on a coarse grid (multiples of 2**-8, below 2**6)
every such sum is exact, and the quantized results are again compared bit for bit.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import reference
from gpu_support import GPU_MARKS, GPUS, run_sharded

import jaxcomm

pytestmark = GPU_MARKS

CASES = {
    "onebit": lambda: jaxcomm.OneBit(column_size=64),
    "threshold": lambda: jaxcomm.Threshold(tau=0.5),
    "threshold_capped": lambda: jaxcomm.Threshold(tau=0.5, max_density=0.05),
    "adaptive": lambda: jaxcomm.Adaptive(proportion=4.0, column_size=100),
}
SIZES = [1, 7, 1000, 65537]


def onebit_quantize_cpu_order(acc: np.ndarray, column_size: int) -> np.ndarray:
    """reference.onebit_quantize with the means summed as kernels/onebit.cc sums them: lane l
    adds elements l, l + 8, ... of the first len - len % 8 in double, the 8 lanes are added in
    order to 0.0, then the tail one by one; mean = float32(sum / count)."""
    out = np.zeros_like(acc)
    for begin in range(0, acc.size, column_size):
        col = acc[begin : begin + column_size]
        len8 = col.size - col.size % 8
        means = []
        for take in (col >= 0, col < 0):
            values = np.where(take, col.astype(np.float64), 0.0)
            total = 0.0
            if len8:
                for lane in np.cumsum(values[:len8].reshape(-1, 8), axis=0)[-1]:
                    total += lane
            for v in values[len8:]:
                total += v
            count = int(np.count_nonzero(take))
            means.append(np.float32(total / count) if count else np.float32(0))
        out[begin : begin + column_size] = np.where(col >= 0, means[0], means[1])
    return out


@pytest.fixture
def cpu_order_onebit(monkeypatch):
    monkeypatch.setattr(reference, "onebit_quantize", onebit_quantize_cpu_order)


def make_inputs(n: int, seed: int, scale: float = 1.0, grid: bool = False) -> list[np.ndarray]:
    """One float32 vector per GPU rank; on `grid`, multiples of 2**-8 so any sum is exact."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(n) * scale for _ in GPUS]
    if grid:
        rows = [np.clip(np.round(r * 256) / 256, -8, 8) for r in rows]
    return [r.astype(np.float32) for r in rows]


def flat_mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(GPUS), ("d",))


def node_meshes() -> list[jax.sharding.Mesh]:
    p = len(GPUS)
    shapes = [(1, p)] if p == 1 else [(1, p), (p, 1)]
    return [jax.sharding.Mesh(np.array(GPUS).reshape(s), ("node", "local")) for s in shapes]


def check_conservation(xs, rs, summed, residuals):
    total_in = np.sum(np.stack(xs).astype(np.float64) + np.stack(rs), axis=0)
    total_out = summed.astype(np.float64) + np.sum(residuals, axis=0, dtype=np.float64)
    np.testing.assert_allclose(total_out, total_in, rtol=1e-5, atol=1e-4)


def assert_matches_reference(name, xs, rs, summed, residuals, expected, expected_residuals):
    """Every rank's result is bit-identical to rank 0's and equals the reference (bit for bit,
    Adaptive within 1e-5: see the module docstring); conservation holds."""
    for rank in range(len(GPUS)):
        np.testing.assert_array_equal(summed[rank], summed[0])
        if name == "adaptive":
            np.testing.assert_allclose(summed[rank], expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(
                residuals[rank], expected_residuals[rank], rtol=1e-5, atol=1e-5
            )
        else:
            np.testing.assert_array_equal(summed[rank], expected)
            np.testing.assert_array_equal(residuals[rank], expected_residuals[rank])
    check_conservation(xs, rs, summed[0], residuals)


# ---- flat quantized allreduce ---------------------------------------------------------------


@pytest.mark.usefixtures("cpu_order_onebit")
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("n", SIZES)
def test_quantized_matches_reference(name, n):
    c = CASES[name]()
    xs = make_inputs(n, 11 * n + 1)
    rs = make_inputs(n, 11 * n + 2, scale=0.1)
    summed, residuals = run_sharded(
        lambda x, r: jaxcomm.compressed_allreduce(x, r, "d", c), xs, rs, mesh=flat_mesh()
    )
    expected, expected_residuals, _ = reference.quantized_allreduce(list(xs), list(rs), c)
    assert_matches_reference(name, xs, rs, summed, residuals, expected, expected_residuals)
    if name.startswith("threshold") and len(GPUS) == 1:
        # One rank: every sent entry reaches the owner as exactly +-tau, which the strict
        # requantization (acc > tau, as in the paper) drops back into the residual. Nothing is
        # ever sent; the whole acc stays in the residual (found on a one-GPU machine).
        assert np.count_nonzero(summed[0]) == 0
        acc = (xs[0] + rs[0]).astype(np.float32)
        np.testing.assert_allclose(residuals[0], acc, rtol=1e-6, atol=1e-6)
    elif n >= 1000:
        assert np.count_nonzero(summed[0]) > 0


def test_quantized_records_metrics():
    jaxcomm.reset_metrics()
    xs = make_inputs(4096, 5)
    rs = [np.zeros_like(x) for x in xs]
    run_sharded(
        lambda x, r: jaxcomm.compressed_allreduce(x, r, "d", jaxcomm.OneBit()),
        xs,
        rs,
        mesh=flat_mesh(),
    )
    rows = [r for r in jaxcomm.metrics()["totals"] if r["algorithm"] == "onebit"]
    assert rows and all(r["calls"] >= 1 for r in rows)


def test_nonfinite_input_poisons_the_result():
    """The CPU raises on a NaN in x + residual; the GPU cannot (no synchronization) and makes
    the result of the affected slice NaN instead."""
    xs = make_inputs(256, 9)
    xs[0][3] = np.nan
    rs = [np.zeros_like(x) for x in xs]
    summed, _ = run_sharded(
        lambda x, r: jaxcomm.compressed_allreduce(x, r, "d", jaxcomm.OneBit(column_size=64)),
        xs,
        rs,
        mesh=flat_mesh(),
    )
    assert np.isnan(summed[0]).any()


# ---- hierarchical -------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["multi_leader", "leader"])
@pytest.mark.parametrize("n", [1, 7, 1000, 65537])
def test_hierarchical_dense_matches_psum(scheme, n):
    xs = make_inputs(n, 3 * n + 5)
    for mesh in node_meshes():
        (got,) = run_sharded(
            lambda v: jaxcomm.allreduce(
                v, ("node", "local"), hierarchical=True, hierarchical_scheme=scheme
            ),
            xs,
            mesh=mesh,
        )
        (want,) = run_sharded(lambda v: jax.lax.psum(v, ("node", "local")), xs, mesh=mesh)
        expected = np.sum(np.stack(xs), axis=0, dtype=np.float32)
        for rank in range(len(GPUS)):
            np.testing.assert_array_equal(got[rank], got[0])
            # NCCL and XLA sum in their own orders: float32 rounding only.
            np.testing.assert_allclose(got[rank], want[rank], rtol=1e-5 * len(GPUS), atol=1e-5)
            np.testing.assert_allclose(got[rank], expected, rtol=1e-5 * len(GPUS), atol=1e-5)


@pytest.mark.usefixtures("cpu_order_onebit")
@pytest.mark.parametrize("scheme", ["multi_leader", "leader"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("n", [1, 7, 1000, 65537])
def test_hierarchical_quantized_matches_reference(scheme, name, n):
    c = CASES[name]()
    xs = make_inputs(n, 7 * n + 1, grid=True)  # exact dense sums in any order
    rs = make_inputs(n, 7 * n + 2, scale=0.1, grid=True)
    for mesh in node_meshes():
        nodes, local = mesh.devices.shape
        summed, residuals = run_sharded(
            lambda x, r: jaxcomm.compressed_allreduce(
                x, r, ("node", "local"), c, hierarchical=True, hierarchical_scheme=scheme
            ),
            xs,
            rs,
            mesh=mesh,
        )
        expected, expected_residuals = reference.hierarchical_quantized(
            list(xs), list(rs), c, nodes, local, scheme
        )
        assert_matches_reference(name, xs, rs, summed, residuals, expected, expected_residuals)
