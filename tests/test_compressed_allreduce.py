"""TopK-allgather and gTop-k allreduce against NumPy references of the whole algorithm."""

from __future__ import annotations

import numpy as np
import pytest
import reference
from collectives_harness import make_inputs
from conftest import WORLD_CONFIGS

import jaxcomm

ALGORITHMS = {"topk_allgather": reference.topk_allgather, "gtopk": reference.gtopk}


@pytest.mark.parametrize("processes,devices", WORLD_CONFIGS, ids=str)
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("n", [1, 7, 1000, 65537])
@pytest.mark.parametrize("density", [0.01, 0.3])
def test_matches_reference_and_conserves(world_run, processes, devices, algorithm, n, density):
    run = world_run(processes, devices)
    world = processes * devices
    case = f"{algorithm}/{n}/{density}"
    summed = run.rank_values(case, "summed")
    residuals = run.rank_values(case, "residual")
    xs = make_inputs(world, n, 7 * n + 1)
    rs = make_inputs(world, n, 7 * n + 2, scale=0.1)
    k = jaxcomm.TopK(density).k(n)
    expected_sum, expected_residuals = ALGORITHMS[algorithm](list(xs), list(rs), k)
    for rank in range(world):
        np.testing.assert_array_equal(summed[rank], summed[0])  # identical on all ranks
        np.testing.assert_allclose(summed[rank], expected_sum, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(residuals[rank], expected_residuals[rank], rtol=1e-6, atol=1e-6)
    # Conservation: nothing is lost, only delayed.
    total_in = (xs.astype(np.float64) + rs).sum(axis=0)
    total_out = summed[0].astype(np.float64) + np.sum(residuals, axis=0, dtype=np.float64)
    np.testing.assert_allclose(total_out, total_in, rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(summed[0]) <= (k if algorithm == "gtopk" else k * world)


@pytest.mark.parametrize("processes,devices", [(1, 3), (2, 2), (1, 8)], ids=str)
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_ties_select_lowest_indices(world_run, processes, devices, algorithm):
    run = world_run(processes, devices)
    world = processes * devices
    summed = run.rank_values(f"{algorithm}/ties", "summed")[0]
    k = jaxcomm.TopK(0.02).k(500)
    np.testing.assert_array_equal(np.nonzero(summed)[0], np.arange(k))
    np.testing.assert_allclose(summed[:k], world)


@pytest.mark.parametrize("density", [0.0, 1.5, -1.0])
def test_bad_density_is_rejected(density):
    with pytest.raises(ValueError, match="density"):
        jaxcomm.GTopK(density)
    with pytest.raises(ValueError, match="density"):
        jaxcomm.TopKAllgather(density)


def test_unknown_algorithm_is_rejected():
    import jax.numpy as jnp

    with pytest.raises(TypeError, match="algorithm must be"):
        jaxcomm.compressed_allreduce(jnp.ones(4), jnp.zeros(4), "dp", jaxcomm.TopK(0.1))
