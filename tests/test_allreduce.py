"""jaxcomm.allreduce (every schedule of ffi/allreduce.h) against lax.psum, in many world layouts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from collective_worker import UNSTAGED_SIZE
from collectives_harness import make_inputs
from conftest import UCX_ONLY, WORLD_CONFIGS


def check_against_psum(run, world: int, sizes) -> None:
    """jaxcomm.allreduce equals psum and the float64 sum, bit-identical on every rank."""
    for n in sizes:
        ours = run.rank_values(f"allreduce/{n}", "out")
        psum = run.rank_values(f"allreduce/{n}", "psum")
        expected = make_inputs(world, n, n).astype(np.float64).sum(axis=0)
        assert len(ours) == world
        for rank in range(world):
            np.testing.assert_allclose(ours[rank], psum[rank], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(ours[rank], expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(ours[rank], ours[0])


@pytest.mark.parametrize("processes,devices", WORLD_CONFIGS, ids=str)
@pytest.mark.parametrize("n", [1, 7, 1000, 65537, 786437])
def test_allreduce_matches_psum(world_run, processes, devices, n):
    check_against_psum(world_run(processes, devices), processes * devices, [n])


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


# Vectors of at most 32 KiB (8192 floats, JAXCOMM_SMALL_ALLREDUCE_BYTES' default) take the
# latency-optimal schedules of ffi/allreduce.h.
SMALL_SIZES, LARGE_SIZES = (1, 7, 1000), (65537, 786437)


def assert_schedules(run, small: str, large: str) -> None:
    """The schedule each size took, from the ranks' jaxcomm.metrics()."""
    for n in SMALL_SIZES + LARGE_SIZES:
        took = list(run.results[f"metrics/allreduce_algorithm/{n}"])
        assert took == [small if n in SMALL_SIZES else large], (n, took)


@pytest.mark.parametrize("processes,devices", [(1, 3), (2, 2), (3, 1)], ids=str)
def test_one_host_takes_the_shared_memory_path(world_run, processes, devices):
    # 1 x N (ranks share a process), N x 1 (processes of one host), N x D (both at once).
    run = world_run(processes, devices)
    assert_schedules(run, "dense_direct_oneshot", "dense_direct")


@pytest.mark.parametrize("processes,devices", [(1, 3), (2, 2), (3, 1)], ids=str)
@pytest.mark.parametrize("n", [1, 7, 1000, 65537, 786437])
def test_ring_through_ucx_matches_psum(world_run, processes, devices, n):
    # JAXCOMM_SHARED_MEMORY=0: the transport's schedules (recursive doubling, then the
    # pipelined ring), the path of groups that span hosts.
    run = world_run(processes, devices, env=UCX_ONLY)
    assert_schedules(run, "dense_doubling", "dense")
    check_against_psum(run, processes * devices, [n])


# Every schedule at every size: the threshold at 0 sends tiny vectors through the ring and the
# reduce-scatter + allgather, a threshold past every size sends 786437 floats through
# recursive doubling and the one-shot (2 x 2: also a vector past the staging area, read with
# process_vm_readv). P = 5 and 6 are not powers of two (doubling folds ranks in pairs).
@pytest.mark.parametrize(
    "processes,devices,env,schedules",
    [
        ((1, 5, {"JAXCOMM_SMALL_ALLREDUCE_BYTES": "0"}, ("dense_direct", "dense_direct"))),
        ((2, 2, {"JAXCOMM_SMALL_ALLREDUCE_BYTES": "0"}, ("dense_direct", "dense_direct"))),
        ((2, 2, {"JAXCOMM_SMALL_ALLREDUCE_BYTES": "1073741824"},
          ("dense_direct_oneshot", "dense_direct_oneshot"))),
        ((1, 6, {**UCX_ONLY, "JAXCOMM_SMALL_ALLREDUCE_BYTES": "1073741824"},
          ("dense_doubling", "dense_doubling"))),
        ((5, 1, {**UCX_ONLY, "JAXCOMM_SMALL_ALLREDUCE_BYTES": "1073741824"},
          ("dense_doubling", "dense_doubling"))),
        ((3, 1, {**UCX_ONLY, "JAXCOMM_SMALL_ALLREDUCE_BYTES": "0"}, ("dense", "dense"))),
    ],
    ids=["1x5-large", "2x2-large", "2x2-oneshot", "1x6-doubling", "5x1-doubling", "3x1-ring"],
)  # fmt: skip
def test_each_schedule_at_every_size_matches_psum(world_run, processes, devices, env, schedules):
    run = world_run(processes, devices, env=env)
    assert_schedules(run, *schedules)
    past_staging = (UNSTAGED_SIZE,) if processes > 1 and processes * devices <= 4 else ()
    check_against_psum(run, processes * devices, SMALL_SIZES + LARGE_SIZES + past_staging)


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


@pytest.mark.parametrize("devices", [4, 3])
def test_grad_and_vmap_match_psum(devices):
    # jax.grad (first and second order) and jax.vmap through jaxcomm.allreduce against
    # lax.psum, inside shard_map over several devices of one process (tests/psum_rules_worker.py).
    import pathlib

    from collectives_harness import run_script

    worker = pathlib.Path(__file__).with_name("psum_rules_worker.py")
    done = run_script(worker, devices, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count("\nok ") + done.stdout.startswith("ok ") == 22, done.stdout
    assert done.stdout.rstrip().endswith("done"), done.stdout
