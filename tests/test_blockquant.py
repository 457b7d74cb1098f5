"""BlockQuant (block-wise int8/int4 quantization): the spec's checks, the single-device kernels
against an exact NumPy reference (tests/reference.py blockquant_quantize), and the quantized
allreduce in 4-rank worlds 1 x 4, 2 x 2 and 4 x 1 (tests/blockquant_worker.py): bit-identical
on every rank, equal to the reference bit for bit, error feedback conserved, bfloat16 inputs,
hierarchical, allreduce_gradients with SGD-style updates and AdamW."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from blockquant_worker import FLAT_CASES, FLAT_SIZES, HIER_CASES, HIER_SIZES, STEP
from collectives_harness import make_inputs
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm import algorithms, cost
from jaxcomm.ops import blockquant

WORKER = pathlib.Path(__file__).with_name("blockquant_worker.py")
WORLDS = [(1, 4), (2, 2), (4, 1)]
_runs: dict = {}


@pytest.fixture(scope="module")
def bq_run(tmp_path_factory):
    from collectives_harness import world_once

    def get(processes: int, devices: int):
        name = f"blockquant-{processes}x{devices}"
        options = {"mode": "blockquant", "worker": WORKER, "timeout": 600}
        return world_once(
            _runs, (processes, devices), tmp_path_factory, name, processes, devices, **options
        )

    return get


# ---- the spec ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"bits": 2}, ValueError, r"bits must be 8 or 4, got 2; e.g. BlockQuant\(bits=8\)"),
        ({"bits": 16}, ValueError, "bits must be 8 or 4"),
        ({"block": 0}, ValueError, r"block must be >= 1 .*e.g. BlockQuant\(block=256\)"),
        ({"block": -5}, ValueError, "block must be >= 1"),
        ({"block": 2.5}, TypeError, "block must be a Python int"),
        ({"rounding": "up"}, ValueError, "rounding must be 'nearest' or 'stochastic'"),
        ({"error_feedback": 1}, TypeError, "error_feedback must be True or False"),
        ({"seed": -1}, ValueError, "seed must be in"),
    ],
)
def test_bad_arguments_name_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxcomm.BlockQuant(**kwargs)


def test_bytes_per_element_and_registry():
    n = 1 << 20
    assert jaxcomm.BlockQuant(bits=8, block=256).packed_words(n) * 4 == 1 + n + 4 * n // 256 + 3
    assert jaxcomm.BlockQuant(bits=4, block=256).packed_words(n) * 4 == 4 + n // 2 + 4 * n // 256
    record = algorithms.of(jaxcomm.BlockQuant())
    assert record.name == "blockquant" and record.stepped and record.residual
    assert algorithms.build("blockquant", cost.Options(bits=4, block=32)) == jaxcomm.BlockQuant(
        bits=4, block=32
    )
    assert "blockquant" in cost.AUTO_CHOICES and "blockquant" in algorithms.names()
    # The cost model's bytes: 1 byte (int8) or half a byte (int4) per element plus the scales.
    world = cost.World(processes=4, devices_per_process=1)
    int8 = cost.predict("blockquant", 25_000_000, world, options=cost.Options(bits=8))
    int4 = cost.predict("blockquant", 25_000_000, world, options=cost.Options(bits=4))
    sent = 2 * 3 / 4 * 25_000_000  # elements a rank sends: 2 (P-1)/P of the vector
    assert int8.bytes_sent_per_rank == pytest.approx(sent * (1 + 4 / 256), rel=1e-3)
    assert int4.bytes_sent_per_rank == pytest.approx(sent * (0.5 + 4 / 256), rel=1e-3)


def test_recipe_and_cost_options_validate():
    with pytest.raises(ValueError, match="bits"):
        cost.Options(bits=3)
    from jaxcomm_launcher import recipe

    assert "blockquant" in recipe.ALGORITHM_NAMES
    assert recipe.JaxcommSettings(algorithm="blockquant").algorithm == "blockquant"


def test_benchmark_variant_rows_parse():
    from jaxcomm_launcher.jobs.allreduce import parse_variant

    assert parse_variant("blockquant:bits=4,block=64") == ("blockquant", {"bits": 4, "block": 64})
    assert parse_variant("dense:dtype=bfloat16") == ("dense", {"dtype": "bfloat16"})
    assert parse_variant("hier_blockquant") == ("hier_blockquant", {})
    with pytest.raises(ValueError, match="keys"):
        parse_variant("blockquant:bitz=4")
    with pytest.raises(ValueError, match="only psum and dense"):
        parse_variant("blockquant:dtype=bfloat16")
    with pytest.raises(ValueError, match="unknown"):
        parse_variant("blockquantt")
    # The inner average of DiLoCo over sites: a sum over each process's devices alone.
    assert parse_variant("dense:axis=local,dtype=bfloat16") == (
        "dense",
        {"axis": "local", "dtype": "bfloat16"},
    )
    with pytest.raises(ValueError, match="axis=local"):
        parse_variant("gtopk:axis=local")
    with pytest.raises(ValueError, match="axis=local"):
        parse_variant("psum:axis=node")


# ---- single-device kernels against the reference -----------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("block", [1, 37, 256])
def test_compress_equals_numpy_reference(bits, rounding, block):
    rng = np.random.default_rng(block)
    x = rng.standard_normal(5003).astype(np.float32)
    r = (rng.standard_normal(5003) * 0.1).astype(np.float32)
    c = jaxcomm.BlockQuant(bits=bits, block=block, rounding=rounding, seed=3)
    packed, new_r = jax.jit(blockquant.compress, static_argnums=(2, 3))(x, r, c, 7)
    decoded = np.asarray(jaxcomm.ops.decompress(packed, c, 5003))
    key = reference.blockquant_key(3, 7, 0)
    expected = reference.blockquant_quantize(x + r, bits, block, rounding == "stochastic", key)
    np.testing.assert_array_equal(decoded, expected)
    np.testing.assert_array_equal(np.asarray(new_r), (x + r) - expected)
    assert packed.shape == (c.packed_words(5003),)


def test_stochastic_rounding_is_deterministic_given_seed_and_step():
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    zero = np.zeros_like(x)

    def packed(seed, step):
        c = jaxcomm.BlockQuant(bits=4, block=64, rounding="stochastic", seed=seed)
        return np.asarray(blockquant.compress(x, zero, c, step)[0])

    np.testing.assert_array_equal(packed(1, 5), packed(1, 5))
    assert not np.array_equal(packed(1, 5), packed(1, 6))  # another step, other roundings
    assert not np.array_equal(packed(1, 5), packed(2, 5))  # another seed
    # Stochastic rounding is unbiased: over many steps the mean decodes to x.
    c = jaxcomm.BlockQuant(bits=4, block=64, rounding="stochastic", seed=1)
    mean = np.mean(
        [np.asarray(jaxcomm.ops.decompress(packed(1, s), c, 4096)) for s in range(200)], axis=0
    )
    scale = np.abs(x).reshape(-1, 64).max(axis=1).repeat(64) / 7
    assert np.mean(np.abs(mean - x) / scale) < 0.1


def test_bf16_input_is_widened_exactly():
    x = jnp.asarray(np.random.default_rng(2).standard_normal(999), jnp.bfloat16)
    c = jaxcomm.BlockQuant(bits=8, block=50)
    packed, r = blockquant.compress(x, jnp.zeros(999, jnp.float32), c)
    x32 = np.asarray(x.astype(jnp.float32))
    expected = reference.blockquant_quantize(x32, 8, 50)
    np.testing.assert_array_equal(np.asarray(jaxcomm.ops.decompress(packed, c, 999)), expected)
    np.testing.assert_array_equal(np.asarray(r), x32 - expected)


def test_non_finite_and_bad_packed_fail_clearly():
    x = np.ones(100, np.float32)
    x[42] = np.nan
    with pytest.raises(Exception, match="flat index 42"):
        jax.block_until_ready(
            blockquant.compress(x, np.zeros(100, np.float32), jaxcomm.BlockQuant())
        )
    c = jaxcomm.BlockQuant(block=10)
    packed, _ = blockquant.compress(np.ones(100, np.float32), np.zeros(100, np.float32), c)
    bad = packed.at[1].set(np.float32(np.inf).view(np.uint32))
    with pytest.raises(Exception, match="scale"):
        jax.block_until_ready(jaxcomm.ops.decompress(bad, c, 100))
    with pytest.raises(ValueError, match="words"):
        jaxcomm.ops.decompress(packed, jaxcomm.BlockQuant(block=20), 100)


def test_step_must_be_an_integer_scalar():
    mesh = jax.make_mesh((1,), ("dp",))
    f = jax.shard_map(
        lambda x, r: jaxcomm.compressed_allreduce(x, r, "dp", jaxcomm.BlockQuant(), step=1.5),
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=(P(), P()),
    )
    with pytest.raises(TypeError, match="step must be an integer scalar"):
        jax.eval_shape(f, jnp.ones(8), jnp.zeros(8))


# ---- the quantized allreduce over 4 ranks ------------------------------------------------


def check_case(summed, residuals, xs, rs, expected, expected_residuals, feedback=True):
    world = len(xs)
    assert len(summed) == world
    for rank in range(world):
        np.testing.assert_array_equal(summed[rank], summed[0])  # bit-identical everywhere
    np.testing.assert_array_equal(summed[0], expected)  # the exact NumPy reference
    for rank in range(world):
        np.testing.assert_array_equal(residuals[rank], expected_residuals[rank])
    if feedback:  # conservation: sum(x + r_in) == summed + sum(r_out) up to float rounding
        total_in = (xs.astype(np.float64) + rs).sum(axis=0)
        total_out = summed[0].astype(np.float64) + np.sum(residuals, axis=0, dtype=np.float64)
        np.testing.assert_allclose(total_out, total_in, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("processes,devices", WORLDS, ids=str)
@pytest.mark.parametrize("name", sorted(FLAT_CASES))
@pytest.mark.parametrize("n", FLAT_SIZES)
def test_flat_is_identical_exact_and_conserves(bq_run, processes, devices, name, n):
    run = bq_run(processes, devices)
    case = f"flat/{name}/{n}"
    xs = make_inputs(4, n, 23 * n + 1)
    rs = make_inputs(4, n, 23 * n + 2, scale=0.1)
    c = jaxcomm.BlockQuant(**FLAT_CASES[name])
    feedback = c.error_feedback
    expected, expected_r, _ = reference.quantized_allreduce(
        list(xs), list(rs) if feedback else None, c, STEP
    )
    if not feedback:
        expected_r = [np.zeros(n, np.float32)] * 4
    check_case(
        run.rank_values(case, "summed"),
        run.rank_values(case, "residual"),
        xs,
        rs,
        expected,
        expected_r,
        feedback,
    )


@pytest.mark.parametrize("processes,devices", WORLDS, ids=str)
@pytest.mark.parametrize("n", FLAT_SIZES)
def test_bf16_inputs(bq_run, processes, devices, n):
    run = bq_run(processes, devices)
    xs = make_inputs(4, n, 29 * n + 1)
    xs = np.asarray(jnp.asarray(xs, jnp.bfloat16).astype(jnp.float32))
    rs = make_inputs(4, n, 29 * n + 2, scale=0.1)
    expected, expected_r, _ = reference.quantized_allreduce(
        list(xs), list(rs), jaxcomm.BlockQuant(bits=8, block=64), STEP
    )
    bits = run.rank_values(f"bf16/{n}", "summed")
    for rank in range(4):
        np.testing.assert_array_equal(bits[rank], bits[0])
    summed = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(bits[0]), jnp.bfloat16))
    rounded = np.asarray(jnp.asarray(expected).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(summed.astype(np.float32), rounded)
    # The 16-bit rounding is error-fed: every rank keeps 1/4 of it.
    residuals = run.rank_values(f"bf16/{n}", "residual")
    for rank in range(4):
        np.testing.assert_allclose(
            residuals[rank], expected_r[rank] + (expected - rounded) / 4, rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize("processes,devices", WORLDS, ids=str)
@pytest.mark.parametrize("scheme", ["multi_leader", "leader"])
@pytest.mark.parametrize("name", HIER_CASES)
@pytest.mark.parametrize("n", HIER_SIZES)
def test_hierarchical_compresses_across_nodes_only(bq_run, processes, devices, scheme, name, n):
    run = bq_run(processes, devices)
    nodes = max(2, processes)
    local = 4 // nodes
    xs = make_inputs(4, n, 31 * n + 1)
    rs = make_inputs(4, n, 31 * n + 2, scale=0.1)
    c = jaxcomm.BlockQuant(**FLAT_CASES[name])
    # A node's local ranks share memory in every world here, so local rank l owns chunk l
    # (owner_shift 0; tests/test_hierarchical.py PATHS).
    expected, expected_r = reference.hierarchical_quantized(
        list(xs), list(rs), c, nodes, local, scheme, 0, STEP
    )
    # Node sums of two float32 values are exact in either order: the reference is exact.
    check_case(
        run.rank_values(f"hier/{scheme}/{name}/{n}", "summed"),
        run.rank_values(f"hier/{scheme}/{name}/{n}", "residual"),
        xs,
        rs,
        expected,
        expected_r,
    )


@pytest.mark.parametrize("processes,devices", WORLDS, ids=str)
@pytest.mark.parametrize("name", ["int8", "int4_stochastic"])
def test_allreduce_gradients_counts_steps(bq_run, processes, devices, name):
    run = bq_run(processes, devices)
    c = jaxcomm.BlockQuant(**FLAT_CASES[name])
    shapes = {"b": (20,), "w": (30, 20)}
    residuals = None
    for t in range(2):
        grads = {
            k: make_inputs(4, int(np.prod(s)), 37 * t + 3 + i)
            for i, (k, s) in enumerate(sorted(shapes.items()))
        }
        # One bucket: the leaves in tree order (b, w), flattened.
        xs = [np.concatenate([grads["b"][q], grads["w"][q]]) for q in range(4)]
        expected, residuals, _ = reference.quantized_allreduce(xs, residuals, c, step=t)
        for rank in range(4):
            got = np.concatenate(
                [run.rank_values(f"optax/{name}/{t}", k)[rank].ravel() for k in ("b", "w")]
            )
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("processes,devices", WORLDS, ids=str)
def test_adamw_params_stay_identical(bq_run, processes, devices):
    seen = bq_run(processes, devices).rank_values("adamw", "params")
    assert np.isfinite(seen[0]).all()
    for rank in range(4):
        np.testing.assert_array_equal(seen[rank], seen[0])


@pytest.mark.parametrize("processes,devices", WORLDS, ids=str)
def test_metrics_label_and_bytes_follow_the_model(bq_run, processes, devices):
    run = bq_run(processes, devices)
    n = FLAT_SIZES[-1]
    world = cost.World(processes=processes, devices_per_process=devices)
    options = cost.Options(bits=8, block=64)
    record = algorithms.get("blockquant")
    assert record.metric_labels == ("blockquant",)
    for rank in range(4):
        assert str(run.rank_values("metrics", "algorithm")[rank]) == "blockquant"
        sent = int(run.rank_values("metrics", "bytes_sent")[rank])
        assert sent == cost.algorithm_costs.get("blockquant").bytes_sent(n, world, options, rank)
