"""Quantized allreduce (one-bit, threshold, adaptive) against a NumPy reference of the whole
scheme over all ranks (tests/reference.py quantized_allreduce), in 1 and 2 processes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from collective_worker import ADAPTIVE_BYTES_N, QUANTIZED_CASES, QUANTIZED_SIZES
from collectives_harness import make_inputs
from jax.sharding import PartitionSpec as P

import jaxcomm

# (processes, devices): P = 2, 3, 4 (two processes over UCX) and 6.
QUANTIZED_WORLDS = [(1, 2), (1, 3), (2, 2), (1, 6)]


def compressor(name: str):
    cls, params = QUANTIZED_CASES[name]
    return getattr(jaxcomm, cls)(**params)


@pytest.mark.parametrize("processes,devices", QUANTIZED_WORLDS, ids=str)
@pytest.mark.parametrize("name", sorted(QUANTIZED_CASES))
@pytest.mark.parametrize("n", QUANTIZED_SIZES)
def test_matches_reference_identical_and_conserves(world_run, processes, devices, name, n):
    run = world_run(processes, devices, mode="quantized")
    world = processes * devices
    case = f"quantized/{name}/{n}"
    summed = run.rank_values(case, "summed")
    residuals = run.rank_values(case, "residual")
    assert len(summed) == world
    xs = make_inputs(world, n, 11 * n + 1)
    rs = make_inputs(world, n, 11 * n + 2, scale=0.1)
    expected, expected_residuals, _ = reference.quantized_allreduce(
        list(xs), list(rs), compressor(name)
    )
    for rank in range(world):
        np.testing.assert_array_equal(summed[rank], summed[0])  # bit-identical on every rank
        np.testing.assert_allclose(summed[rank], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(residuals[rank], expected_residuals[rank], rtol=1e-5, atol=1e-5)
    # Conservation: sum(inputs + residuals_in) == result + sum(residuals_out).
    total_in = (xs.astype(np.float64) + rs).sum(axis=0)
    total_out = summed[0].astype(np.float64) + np.sum(residuals, axis=0, dtype=np.float64)
    np.testing.assert_allclose(total_out, total_in, rtol=1e-5, atol=1e-4)
    if n >= 1000:
        assert np.count_nonzero(summed[0]) > 0  # something was actually sent


def model_words(decoded: np.ndarray, unit: int, proportion: float) -> float:
    """The paper's model of one adaptive message: header, two means per column, and per
    column and sign 1/π of the values not of the other sign (reference.adaptive_keep)."""
    words = 1
    for begin in range(0, decoded.size, unit):
        col = decoded[begin : begin + unit]
        pos, neg = int(np.count_nonzero(col > 0)), int(np.count_nonzero(col < 0))
        zeros = col.size - pos - neg
        words += 2 + reference.adaptive_keep(pos, zeros, proportion)
        words += reference.adaptive_keep(neg, zeros, proportion)
    return words


@pytest.mark.parametrize("processes,devices", [(1, 3), (2, 2)], ids=str)
def test_adaptive_bytes_follow_the_model(world_run, processes, devices):
    """Adaptive(π) sends about 1/π of each sign's values per column: every rank's byte counter
    is within 25 % of the model, and the reported compression ratio is dense / actual."""
    run = world_run(processes, devices, mode="quantized")
    world = processes * devices
    c = jaxcomm.Adaptive(proportion=64)
    n = ADAPTIVE_BYTES_N
    xs = make_inputs(world, n, 3)
    _, _, info = reference.quantized_allreduce(list(xs), None, c)
    for rank in range(world):
        predicted = 0.0
        for s in range(world):
            b, e = reference.slice_range(n, world, s, c.column_size)
            acc = xs[rank][b:e]
            if s != rank:  # reduce-scatter: this rank's slice s goes to its owner
                predicted += model_words(np.where(acc != 0, acc, 0), c.column_size, c.proportion)
            if s != (rank + 1) % world:  # ring allgather forwards every sum but one
                predicted += model_words(info["sums"][s], c.column_size, c.proportion)
        sent = int(run.rank_values("quantized/adaptive_bytes", "bytes_sent")[rank])
        assert abs(sent - 4 * predicted) <= 0.25 * 4 * predicted, (rank, sent, 4 * predicted)
        dense = int(run.rank_values("quantized/adaptive_bytes", "dense_bytes_sent")[rank])
        assert dense == pytest.approx(4 * 2 * (world - 1) / world * n, rel=1e-3)
        ratio = float(run.rank_values("quantized/adaptive_bytes", "compression_ratio")[rank])
        assert ratio == pytest.approx(dense / sent)
        assert ratio > 16  # 2(P-1)/P dense vs about 1/64 per message


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: jaxcomm.Adaptive(proportion=0.5), "proportion"),
        (lambda: jaxcomm.Threshold(0.0), "tau"),
        (lambda: jaxcomm.Threshold(-1.0), "tau"),
        (lambda: jaxcomm.OneBit(column_size=48), "column_size"),
    ],
)
def test_bad_compressor_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def trace_in_mesh(fn, axes=("node", "local")):
    """Traces `fn` under a 1-device shard_map over `axes` (errors raise at trace time)."""
    mesh = jax.make_mesh((1,) * len(axes), axes)
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()))
    return jax.eval_shape(f, jnp.ones(8), jnp.zeros(8))


def test_unknown_axis_is_rejected():
    with pytest.raises(ValueError, match="unknown axis_name 'gpu'"):
        trace_in_mesh(lambda x, r: jaxcomm.compressed_allreduce(x, r, "gpu", jaxcomm.OneBit()))


def test_sample_free_reference_shapes():
    # The slices the reference uses are unit-aligned and cover the vector (kernels::SliceRange).
    for n, parts, unit in [(65537, 6, 64), (7, 4, 100), (1000, 3, 1)]:
        bounds = [reference.slice_range(n, parts, s, unit) for s in range(parts)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        assert all(b % unit == 0 or b == n for b, _ in bounds)
        assert math.isclose(sum(e - b for b, e in bounds), n)
