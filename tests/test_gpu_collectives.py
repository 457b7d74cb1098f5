"""GPU collectives (NCCL on XLA's stream, ffi/cuda/) against lax.psum and the NumPy references
of the whole algorithms (tests/reference.py), the same cases as the CPU collective suites.

Every test runs one process over all local GPUs (P = jax.device_count("gpu")): NCCL refuses two
ranks on one GPU, so a one-GPU machine checks P = 1 (the full code path: group discovery,
communicator, kernels, NCCL calls with one rank) and a multi-GPU machine checks the schedules.
Skipped without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from gpu_support import GPU_MARKS, GPUS, gpu_mesh, per_rank_data, run_sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

pytestmark = GPU_MARKS


# ---- dense ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 1000, 2**20 + 3])
def test_dense_allreduce_matches_psum(n):
    xs = per_rank_data(n, 10)
    (got,) = run_sharded(lambda v: jaxcomm.allreduce(v, "d"), xs)
    (want,) = run_sharded(lambda v: jax.lax.psum(v, "d"), xs)
    for g, w in zip(got, want, strict=True):
        # Both sum in float32 over the same ranks; the order may differ for > 2 ranks.
        np.testing.assert_allclose(g, w, rtol=1e-6 * len(GPUS), atol=1e-6)
    for g in got[1:]:
        np.testing.assert_array_equal(g, got[0])  # NCCL gives every rank the same bits


def test_dense_allreduce_records_metrics():
    jaxcomm.reset_metrics()
    run_sharded(lambda v: jaxcomm.allreduce(v, "d"), per_rank_data(4096, 1))
    rows = [r for r in jaxcomm.metrics()["totals"] if r["algorithm"] == "dense"]
    assert rows and all(r["calls"] >= 1 for r in rows)


# ---- sparse: TopK-allgather and gTop-k (ffi/cuda/topk_allgather.cc, ffi/cuda/gtopk.cc) -------
#
# The GPU kernels replay the CPU kernels' float operations in the CPU's order (TopKAbs, the ⊤
# merge, the scatter-adds and residual fix-ups), and the NumPy references replay the same
# operations (tests/reference.py), so results must match bit for bit, as the CPU handlers do.

SPARSE = {"topk_allgather": jaxcomm.TopKAllgather, "gtopk": jaxcomm.GTopK}
SPARSE_REFERENCE = {"topk_allgather": reference.topk_allgather, "gtopk": reference.gtopk}


def sparse_case(algorithm: str, n: int, density: float, seed: int):
    """(xs, residuals, k, got summed, got residuals, expected summed, expected residuals)."""
    xs = per_rank_data(n, seed)
    rs = [0.1 * r for r in per_rank_data(n, seed + 1)]
    algo = SPARSE[algorithm](density)
    summed, residuals = run_sharded(
        lambda v, r: jaxcomm.compressed_allreduce(v, r, "d", algo), xs, rs
    )
    k = algo.k(n)
    want_sum, want_res = SPARSE_REFERENCE[algorithm](list(xs), list(rs), k)
    return xs, rs, k, summed, residuals, want_sum, want_res


def check_sparse(algorithm, xs, rs, k, summed, residuals, want_sum, want_res):
    for rank in range(len(GPUS)):
        np.testing.assert_array_equal(summed[rank], summed[0])  # identical on all ranks
        np.testing.assert_array_equal(summed[rank], want_sum)
        np.testing.assert_array_equal(residuals[rank], want_res[rank])
    # Conservation: nothing is lost, only delayed.
    total_in = np.sum([x.astype(np.float64) + r for x, r in zip(xs, rs, strict=True)], axis=0)
    total_out = summed[0].astype(np.float64) + np.sum(residuals, axis=0, dtype=np.float64)
    np.testing.assert_allclose(total_out, total_in, rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(summed[0]) <= (k if algorithm == "gtopk" else k * len(GPUS))


@pytest.mark.parametrize("algorithm", sorted(SPARSE))
@pytest.mark.parametrize("n", [1, 7, 1000, 65537])
@pytest.mark.parametrize("density", [0.01, 0.3])
def test_sparse_matches_reference_and_conserves(algorithm, n, density):
    check_sparse(algorithm, *sparse_case(algorithm, n, density, seed=7 * n + 1))


@pytest.mark.parametrize("algorithm", sorted(SPARSE))
@pytest.mark.parametrize("n", [1, 5, 4099])
@pytest.mark.parametrize("density", [1e-9, 1.0], ids=["k=1", "k=n"])
def test_sparse_k_edges(algorithm, n, density):
    case = sparse_case(algorithm, n, density, seed=3 * n)
    assert case[2] == (1 if density < 1 else n)
    check_sparse(algorithm, *case)
    if density == 1.0:  # everything is sent: nothing stays behind
        for r in case[4]:
            np.testing.assert_array_equal(r, np.zeros_like(r))


@pytest.mark.parametrize("algorithm", sorted(SPARSE))
def test_sparse_ties_select_lowest_indices(algorithm):
    n = 500
    ones = [np.ones(n, np.float32) for _ in GPUS]
    zeros = [np.zeros(n, np.float32) for _ in GPUS]
    algo = SPARSE[algorithm](0.02)
    summed, _ = run_sharded(lambda v, r: jaxcomm.compressed_allreduce(v, r, "d", algo), ones, zeros)
    k = algo.k(n)
    for s in summed:
        np.testing.assert_array_equal(np.nonzero(s)[0], np.arange(k))
        np.testing.assert_array_equal(s[:k], np.float32(len(GPUS)))


@pytest.mark.parametrize("algorithm", sorted(SPARSE))
def test_sparse_donated_residual_and_two_steps(algorithm):
    """Two chained calls in one jit with the residual donated (updated in place) equal the
    reference applied twice, and the undonated run."""
    n, density = 3001, 0.05
    xs1, xs2 = per_rank_data(n, 31), per_rank_data(n, 32)
    rs = [0.1 * r for r in per_rank_data(n, 33)]
    algo = SPARSE[algorithm](density)

    def two_steps(g1, g2, r):
        s1, r = jaxcomm.compressed_allreduce(g1, r, "d", algo)
        s2, r = jaxcomm.compressed_allreduce(g2, r, "d", algo)
        return s1, s2, r

    mesh = gpu_mesh()
    spec = P(mesh.axis_names)
    body = jax.shard_map(
        two_steps, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3, check_vma=False
    )

    def put(values):
        return jax.device_put(np.concatenate(values), NamedSharding(mesh, spec))

    outs = {}
    for donate in (False, True):
        f = jax.jit(body, donate_argnums=(2,) if donate else ())
        args = [put(xs1), put(xs2), put(rs)]
        outs[donate] = [np.split(np.asarray(o), len(GPUS)) for o in f(*args)]
        if donate:
            assert args[2].is_deleted()
    k = algo.k(n)
    ref = SPARSE_REFERENCE[algorithm]
    want_s1, mid = ref(list(xs1), list(rs), k)
    want_s2, want_r = ref(list(xs2), mid, k)
    for donate, (s1, s2, r) in outs.items():
        for rank in range(len(GPUS)):
            np.testing.assert_array_equal(s1[rank], want_s1, err_msg=f"donate={donate}")
            np.testing.assert_array_equal(s2[rank], want_s2, err_msg=f"donate={donate}")
            np.testing.assert_array_equal(r[rank], want_r[rank], err_msg=f"donate={donate}")


@pytest.mark.parametrize("algorithm", sorted(SPARSE))
def test_sparse_records_metrics(algorithm):
    jaxcomm.reset_metrics()
    data = per_rank_data(4096, 2)
    algo = SPARSE[algorithm](0.01)
    run_sharded(lambda v, r: jaxcomm.compressed_allreduce(v, r, "d", algo), data, data)
    rows = [r for r in jaxcomm.metrics()["totals"] if r["algorithm"] == algorithm]
    assert rows and all(r["calls"] >= 1 for r in rows)


# ---- split (start/done) on jaxcomm's own stream (ffi/cuda/gpu_collective.h, "Split calls") ----


def _lowered_text(fn, *per_rank):
    mesh = gpu_mesh()
    spec = P("d")
    args = [jax.device_put(np.concatenate(v), NamedSharding(mesh, spec)) for v in per_rank]
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec))
    return f.lower(*args).as_text()


def test_split_allreduce_matches_psum_and_lowers_to_start_done():
    def split(v):
        later = jnp.tanh(v * 3.0).sum() * jnp.ones_like(v)  # what runs while NCCL works
        return jaxcomm.allreduce(v, "d", after=later), later

    xs = per_rank_data(2**20 + 3, 21)
    text = _lowered_text(split, xs)
    assert "jaxcomm_collective_done" in text  # the dense GPU allreduce splits
    got, later = run_sharded(split, xs)
    (want,) = run_sharded(lambda v: jax.lax.psum(v, "d"), xs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    for x, lt in zip(xs, later, strict=True):
        np.testing.assert_allclose(lt, np.tanh(x * 3.0).sum(), rtol=1e-5)


def test_compressed_after_is_accepted_unsplit_on_gpu():
    c = jaxcomm.TopKAllgather(0.01)
    xs = per_rank_data(4096, 22)
    rs = [np.zeros_like(x) for x in xs]

    def with_after(x, r):
        return jaxcomm.compressed_allreduce(x, r, "d", c, after=x * 2.0)

    assert "jaxcomm_collective_done" not in _lowered_text(with_after, xs, rs)
    got = run_sharded(with_after, xs, rs)
    want = run_sharded(lambda x, r: jaxcomm.compressed_allreduce(x, r, "d", c), xs, rs)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_array_equal(a, b)


def test_overlapped_training_loop_matches_unsplit_without_syncs():
    """allreduce_gradients(overlap=True) on GPU: every bucket but the last splits onto
    jaxcomm's stream. 20 steps dispatched without a sync between them (as users run) must give
    the same bits as overlap=False."""
    mesh = gpu_mesh()
    rng = np.random.default_rng(23)
    widths = [256, 512, 512, 256, 10]
    params = {
        f"w{i}": jnp.asarray(rng.standard_normal((a, b)).astype(np.float32) / np.sqrt(a))
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True))
    }
    batch = jnp.asarray(rng.standard_normal((len(GPUS) * 64, widths[0])).astype(np.float32))

    def loss(p, x):
        for i in range(len(widths) - 1):
            x = jnp.tanh(x @ p[f"w{i}"])
        return jnp.mean(x**2)

    def train(overlap):
        opt = optax.chain(
            jaxcomm.optax.allreduce_gradients("d", bucket_size=100_000, overlap=overlap),
            optax.sgd(0.05),
        )

        def step(p, s, x):
            g = jax.grad(loss)(p, x)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s

        sharded = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), P(), P("d")),
                out_specs=(P(), P()),
                check_vma=False,
            )
        )
        p, s = params, opt.init(params)
        text = sharded.lower(p, s, batch).as_text()
        for _ in range(20):
            p, s = sharded(p, s, batch)
        return jax.device_get(p), text

    split_params, split_text = train(True)
    plain_params, plain_text = train(False)
    assert split_text.count("jaxcomm_collective_done") >= 2  # several buckets in flight
    assert "jaxcomm_collective_done" not in plain_text
    for name in params:
        np.testing.assert_array_equal(split_params[name], plain_params[name])
        assert not np.array_equal(split_params[name], np.asarray(params[name]))
