"""Hierarchical allreduce over a ("node", "local") mesh: a process is a node, its devices are
its local ranks. 2 processes x 2 devices, and 1 process x 4 devices viewed as 2 x 2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from collective_worker import HIER_SPANNING_SIZES, QUANTIZED_CASES, QUANTIZED_SIZES
from collectives_harness import make_inputs
from conftest import UCX_ONLY
from jax.sharding import PartitionSpec as P

import jaxcomm

WORLDS = [(2, 2), (1, 4)]
SCHEMES = ["multi_leader", "leader"]
# Intra-node paths: shared memory (the default: local rank l owns slice l) and the ring over
# UCX (JAXCOMM_SHARED_MEMORY=0: local rank l owns chunk l + 1).
PATHS = {"shared_memory": ({}, 0), "ucx": (UCX_ONLY, 1)}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("processes,devices", WORLDS, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("n", QUANTIZED_SIZES)
def test_dense_equals_psum_over_both_axes(world_run, path, processes, devices, scheme, n):
    run = world_run(processes, devices, mode="quantized", env=PATHS[path][0])
    check_dense(run, f"hierarchical/{scheme}/{n}", make_inputs(4, n, 13 * n + 1))


def check_dense(run, case: str, xs: np.ndarray) -> None:
    """The 4 ranks' "out" of `case`: bit-identical, equal to their "psum" and to the sum."""
    ours = run.rank_values(case, "out")
    psum = run.rank_values(case, "psum")
    assert len(ours) == 4
    expected = xs.astype(np.float64).sum(axis=0)
    for rank in range(4):
        np.testing.assert_array_equal(ours[rank], ours[0])
        np.testing.assert_allclose(ours[rank], psum[rank], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ours[rank], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("n", HIER_SPANNING_SIZES)
def test_dense_with_a_node_across_processes(world_run, scheme, n):
    # 4 processes x 1 device as 2 x 2: a node's local ranks live in two processes, so the
    # single leader's broadcast crosses processes (through the leader's staging area; past
    # 16 MiB with process_vm_readv).
    run = world_run(4, 1, mode="hier_spanning")
    check_dense(run, f"hier_spanning/{scheme}/{n}", make_inputs(4, n, 19 * n + 1))


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("processes,devices", WORLDS, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", sorted(QUANTIZED_CASES))
@pytest.mark.parametrize("n", [7, 65537])
def test_quantized_matches_reference_and_conserves(
    world_run, path, processes, devices, scheme, name, n
):
    env, owner_shift = PATHS[path]
    run = world_run(processes, devices, mode="quantized", env=env)
    case = f"hierarchical_q/{scheme}/{name}/{n}"
    summed = run.rank_values(case, "summed")
    residuals = run.rank_values(case, "residual")
    xs = make_inputs(4, n, 17 * n + 1)
    rs = make_inputs(4, n, 17 * n + 2, scale=0.1)
    cls, params = QUANTIZED_CASES[name]
    c = getattr(jaxcomm, cls)(**params)
    expected, expected_residuals = reference.hierarchical_quantized(
        list(xs), list(rs), c, 2, 2, scheme, owner_shift
    )
    for rank in range(4):
        np.testing.assert_array_equal(summed[rank], summed[0])
        np.testing.assert_allclose(summed[rank], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(residuals[rank], expected_residuals[rank], rtol=1e-5, atol=1e-5)
    total_in = (xs.astype(np.float64) + rs).sum(axis=0)
    total_out = summed[0].astype(np.float64) + np.sum(residuals, axis=0, dtype=np.float64)
    np.testing.assert_allclose(total_out, total_in, rtol=1e-5, atol=1e-4)


def trace(fn, axes=("node", "local")):
    """Traces `fn` under a 1-device shard_map over `axes`; argument errors raise at trace time."""
    mesh = jax.make_mesh((1,) * len(axes), axes)
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    return jax.eval_shape(f, jnp.ones(8), jnp.zeros(8))


def test_hierarchical_over_one_axis_is_rejected():
    with pytest.raises(ValueError, match="axis_name"):
        trace(lambda x, r: jaxcomm.allreduce(x, "node", hierarchical=True))
    with pytest.raises(ValueError, match="axis_name"):
        trace(lambda x, r: jaxcomm.allreduce(x, ("node",), hierarchical=True))
    with pytest.raises(ValueError, match="axis_name"):
        trace(
            lambda x, r: jaxcomm.compressed_allreduce(
                x, r, "local", jaxcomm.Adaptive(64), hierarchical=True
            )[0]
        )


def test_unknown_axes_are_rejected():
    with pytest.raises(ValueError, match="unknown axis_name 'gpu'"):
        trace(lambda x, r: jaxcomm.allreduce(x, ("node", "gpu"), hierarchical=True))
    with pytest.raises(ValueError, match="unknown axis_name 'rack'"):
        trace(
            lambda x, r: jaxcomm.compressed_allreduce(
                x, r, ("rack", "local"), jaxcomm.OneBit(), hierarchical=True
            )[0]
        )


def test_bad_scheme_and_sparse_algorithm_are_rejected():
    with pytest.raises(ValueError, match="hierarchical_scheme"):
        trace(
            lambda x, r: jaxcomm.allreduce(
                x, ("node", "local"), hierarchical=True, hierarchical_scheme="tree"
            )
        )
    with pytest.raises(ValueError, match="hierarchical=True supports"):
        trace(
            lambda x, r: jaxcomm.compressed_allreduce(
                x, r, ("node", "local"), jaxcomm.GTopK(0.01), hierarchical=True
            )[0]
        )
