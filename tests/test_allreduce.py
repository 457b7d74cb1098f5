"""jaxcomm.allreduce (dense ring over UCX) against lax.psum, in many world layouts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from collective_worker import UNSTAGED_SIZE
from conftest import UCX_ONLY, WORLD_CONFIGS, make_inputs


@pytest.mark.parametrize("processes,devices", WORLD_CONFIGS, ids=str)
@pytest.mark.parametrize("n", [1, 7, 1000, 65537, 786437])
def test_allreduce_matches_psum(world_run, processes, devices, n):
    run = world_run(processes, devices)
    world = processes * devices
    ours = run.rank_values(f"allreduce/{n}", "out")
    psum = run.rank_values(f"allreduce/{n}", "psum")
    assert len(ours) == world
    expected = make_inputs(world, n, n).astype(np.float64).sum(axis=0)
    for rank in range(world):
        np.testing.assert_allclose(ours[rank], psum[rank], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ours[rank], expected, rtol=1e-5, atol=1e-5)
        # Bit-identical on every rank.
        np.testing.assert_array_equal(ours[rank], ours[0])


@pytest.mark.parametrize("processes,devices", [(2, 1), (2, 2), (4, 1)], ids=str)
def test_vectors_past_the_staging_area_match_psum(world_run, processes, devices):
    # Across processes the shared-memory path stages vectors up to 16 MiB through shared
    # areas; past that, ranks read each other's buffers with process_vm_readv. Both must agree
    # with psum and be bit-identical on every rank.
    run = world_run(processes, devices)
    world = processes * devices
    ours = run.rank_values(f"allreduce/{UNSTAGED_SIZE}", "out")
    psum = run.rank_values(f"allreduce/{UNSTAGED_SIZE}", "psum")
    assert len(ours) == world
    for rank in range(world):
        np.testing.assert_allclose(ours[rank], psum[rank], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(ours[rank], ours[0])


@pytest.mark.parametrize("processes,devices", [(1, 3), (2, 2), (3, 1)], ids=str)
def test_one_host_takes_the_shared_memory_path(world_run, processes, devices):
    # 1 x N (ranks share a process), N x 1 (processes of one host), N x D (both at once).
    run = world_run(processes, devices)
    assert list(run.results["metrics/allreduce_algorithms"]) == ["dense_direct"]


@pytest.mark.parametrize("processes,devices", [(1, 3), (2, 2), (3, 1)], ids=str)
@pytest.mark.parametrize("n", [1, 7, 1000, 65537, 786437])
def test_ring_through_ucx_matches_psum(world_run, processes, devices, n):
    # JAXCOMM_SHARED_MEMORY=0: the pipelined ring over UCX, the path of groups that span hosts.
    run = world_run(processes, devices, env=UCX_ONLY)
    assert list(run.results["metrics/allreduce_algorithms"]) == ["dense"]
    world = processes * devices
    ours = run.rank_values(f"allreduce/{n}", "out")
    psum = run.rank_values(f"allreduce/{n}", "psum")
    expected = make_inputs(world, n, n).astype(np.float64).sum(axis=0)
    for rank in range(world):
        np.testing.assert_allclose(ours[rank], psum[rank], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ours[rank], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(ours[rank], ours[0])


@pytest.mark.parametrize("processes,devices", [(1, 3), (2, 2)], ids=str)
def test_allreduce_of_a_matrix(world_run, processes, devices):
    run = world_run(processes, devices)
    world = processes * devices
    out = run.rank_values("allreduce/matrix", "out")
    expected = make_inputs(world, 6 * 35, 5).reshape(world, 6, 35).sum(axis=0)
    for rank in range(world):
        assert out[rank].shape == (6, 35)
        np.testing.assert_allclose(out[rank], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("processes,devices", [(1, 4), (2, 2), (3, 1)], ids=str)
def test_twenty_independent_collectives_run_in_order(world_run, processes, devices):
    run = world_run(processes, devices)
    world = processes * devices
    out = run.rank_values("ordering", "out")
    base = make_inputs(world, 257, 20).sum(axis=0)
    for rank in range(world):
        for i in range(20):
            np.testing.assert_allclose(out[rank][i], base * (i + 1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("processes,devices", [(1, 4), (2, 2)], ids=str)
def test_metrics_count_bytes_on_the_wire(world_run, processes, devices):
    run = world_run(processes, devices)
    assert int(run.results["metrics/calls"]) > 0
    assert int(run.results["metrics/bytes_sent"]) > 0


def test_allreduce_outside_shard_map_is_a_clear_error():
    import jaxcomm

    with pytest.raises(ValueError, match="inside jax.shard_map"):
        jaxcomm.allreduce(jax.numpy.ones(4), "dp")


def test_allreduce_rejects_unknown_axis_and_dtype():
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh = jax.make_mesh((1,), ("dp",))
    x = jax.device_put(jnp.ones((1, 4)), jax.sharding.NamedSharding(mesh, P("dp")))
    f = jax.jit(
        jax.shard_map(
            lambda v: jaxcomm.allreduce(v, "model"), mesh=mesh, in_specs=P("dp"), out_specs=P("dp")
        )
    )
    with pytest.raises(ValueError, match="unknown axis_name 'model'.*'dp'"):
        f(x)
    g = jax.jit(
        jax.shard_map(
            lambda v: jaxcomm.allreduce(v.astype(jnp.int32), "dp"),
            mesh=mesh,
            in_specs=P("dp"),
            out_specs=P("dp"),
        )
    )
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        g(x)
