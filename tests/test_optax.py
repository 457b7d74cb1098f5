"""jaxcomm.optax.allreduce_gradients and the digits example, over 4 CPU devices.

Multi-device cases run in a subprocess (tests/optax_worker.py), because the device count must
be set before JAX initializes; each worker mode runs once per session.
"""

from __future__ import annotations

import pathlib
import types

import numpy as np
import pytest
from collectives_harness import worker_results

WORKER = pathlib.Path(__file__).with_name("optax_worker.py")
DEVICES = 4
CONVERGENCE_EPOCHS = 20
ACCURACY_BOUND = 0.015  # compressed runs must end within 1.5 points of dense


@pytest.fixture(scope="session")
def worker(tmp_path_factory):
    get = worker_results(tmp_path_factory, WORKER, timeout=280)
    args = ("--devices", DEVICES, "--epochs", CONVERGENCE_EPOCHS)
    return lambda mode: get(mode, "--mode", mode, *args, name=mode)


@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
def test_dense_equals_pmean(worker, mean):
    arrays, info = worker("unit")
    keys = [k for k in arrays if k.startswith(f"dense/{mean}/") and k.endswith("/ours")]
    assert len(keys) == 3 * 4  # 3 steps x 4 leaves (one a scalar), over several buckets
    for key in keys:
        ours, ref = arrays[key], arrays[key[: -len("ours")] + "ref"]
        assert ours.shape == ref.shape and ours.dtype == np.float32
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7, err_msg=key)
    assert info[f"dense/{mean}/traces"] == 1
    assert info[f"dense/{mean}/count"] == 3


def test_auto_keeps_bf16_gradients_on_the_16_bit_wire(worker):
    _, info = worker("unit")
    assert info["bf16/none/hlo_has_bf16_wire"] and info["bf16/auto/hlo_has_bf16_wire"]
    assert info["bf16/auto_equals_dense"]
    assert info["bf16/auto_decision_bytes"] == [2]


def test_auto_bf16_density_schedule_mixes_the_16_bit_wire_and_compressors(worker):
    # The phases chose differently (the premise), and the switch returned bf16 in both.
    _, info = worker("unit")
    assert info["bf16_schedule/choices"] == ["dense", "gtopk"]
    assert info["bf16_schedule/dtypes"] == ["bfloat16"]
    assert all(info[f"bf16_schedule/{step}/finite"] for step in range(4))
    assert info["bf16_schedule/count"] == 4


def test_dense_dtype_puts_only_the_dense_buckets_on_the_16_bit_wire(worker):
    # float32 gradients, dense_dtype=bf16, auto with a dense phase and a gTop-k phase.
    _, info = worker("unit")
    assert info["wire/hlo_has_bf16_wire"]
    assert info["wire/dtypes"] == ["float32"]
    assert info["wire/dense_phase_equals_bf16_dense"]
    # The bucket dense in both phases first, outside the switch; then each phase's branch.
    assert info["wire/choices"] == [
        [31, "dense"], [210, "dense"], [1200, "dense"], [210, "gtopk"], [1200, "gtopk"],
    ]  # fmt: skip
    assert info["wire/sparse_phase_equals_float32_gtopk"]


def test_auto_drops_a_warmup_that_does_not_pay(worker):
    # One decision at trace time (warm-up dropped), then only the final density's choices.
    _, info = worker("unit")
    assert info["warmup/decisions"] == [False]
    assert info["warmup/choices"] == [[210, "gtopk"], [1200, "gtopk"], [31, "gtopk"]]
    assert info["warmup/first_step_is_final_density"]


def test_overlap_splits_compressed_buckets_only_with_a_core_to_spare(worker):
    # 3 buckets each: dense always splits them; gTop-k only off a one-core affinity.
    _, info = worker("unit")
    if info["overlap/cores"] > 1:
        assert info["overlap/dones_all_cores"] == [3, 3]
    assert info["overlap/dones_one_core"] == [3, 0]
    assert info["overlap/in_place_starts"] == [3, 0]


def test_a_schedule_whose_phases_choose_alike_compiles_no_switch(worker):
    _, info = worker("unit")
    assert info["schedule/switch"] == [False, True]


@pytest.mark.parametrize("algorithm", ["gtopk", "topk_allgather"])
def test_residuals_have_the_gradient_structure_and_no_retracing(worker, algorithm):
    _, info = worker("unit")
    assert info[f"{algorithm}/residual_tree_equal"]
    for leaf, d in info[f"{algorithm}/local_residual_shapes"].items():
        # Inside shard_map a rank's residual has the gradient's shape (scalars: (1,)).
        assert d["local_shape"] == (d["param_shape"] or [1]), leaf
        assert d["dtype"] == d["param_dtype"] == "float32", leaf
        assert d["spec"].startswith("P('dp'"), leaf  # per rank, never replicated
    # Five steps with fresh batches and evolving residuals: traced and compiled once.
    assert info[f"{algorithm}/traces"] == 1
    assert info[f"{algorithm}/cache_size"] == 1


@pytest.mark.parametrize("algorithm", ["gtopk", "topk_allgather"])
def test_error_feedback_conserves_the_gradient_sum(worker, algorithm):
    arrays, _ = worker("unit")
    for step in range(5):
        for leaf in ("w1", "b1", "w2", "scale"):
            k = f"{algorithm}/{step}/{leaf}"
            grads = arrays[f"{k}/grads"].astype(np.float64)  # (ranks, *shape)
            shape = grads.shape
            r_in = arrays[f"{k}/r_in"].reshape(shape).astype(np.float64)
            r_out = arrays[f"{k}/r_out"].reshape(shape).astype(np.float64)
            update = arrays[f"{k}/update"].reshape(shape[1:]).astype(np.float64)
            np.testing.assert_allclose(
                (grads + r_in).sum(0), update + r_out.sum(0), rtol=1e-5, atol=1e-6, err_msg=k
            )
            if step:  # something was held back and is carried to the next step
                assert np.any(arrays[f"{k}/r_in"]) or leaf == "scale"
        # w1 is a bucket of its own: k = ceil(0.05 * 1200) = 60 entries per rank at most.
        assert np.count_nonzero(arrays[f"{algorithm}/{step}/w1/update"]) <= DEVICES * 60


def test_density_schedule_switches_without_recompiling(worker):
    _, info = worker("unit")
    s = info["schedule"]
    assert s["traces"] == 1 and s["cache_size"] == 1
    n = s["n"]
    ks = [max(1, int(np.ceil(d * n))) for d in s["densities"]]
    # gTop-k keeps exactly the phase's k entries of the summed gradient.
    assert s["nnz"] == ks
    sent = s["bytes_sent"]
    assert sent[0] == sent[1] > sent[2] == sent[3] > sent[4] == sent[5] > 0


def test_checkpoint_round_trip_continues_bit_identically(worker):
    _, info = worker("unit")
    assert info["restored_count"] == 6
    assert info["restored_identical"]  # params, counts and every rank's residual shard
    assert "was saved as float32" in info["wrong_dtype_error"]
    assert info["checkpoint_residual_nonzero"]  # the residuals were really restored
    assert info["checkpoint_leaves"] > 4
    assert info["checkpoint_identical"]


@pytest.mark.parametrize("algorithm", ["gtopk", "topk_allgather", "adaptive"])
def test_digits_mlp_compressed_accuracy_is_close_to_dense(worker, algorithm):
    _, info = worker("convergence")
    dense = info["dense"]
    assert dense["test_accuracy"] > 0.93, dense
    run = info[algorithm]
    assert run["test_accuracy"] >= dense["test_accuracy"] - ACCURACY_BOUND, (run, dense)
    assert run["compilations"] == 1
    assert 0 < run["bytes_sent_per_step"] < dense["bytes_sent_per_step"], (run, dense)


def _lowered_update(tx, mesh_axes: tuple[str, ...]) -> str:
    """The StableHLO of ``tx.update`` in a jitted shard_map over a one-device mesh: what the
    transform asks XLA to run, without running it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh = jax.make_mesh((1,) * len(mesh_axes), mesh_axes)
    params = {"w": jnp.ones((64,), jnp.float32), "b": jnp.ones((8,), jnp.float32)}
    shapes = jax.eval_shape(tx.init, params)
    specs = jaxcomm.optax.partition_specs(shapes, mesh_axes)
    state = jax.tree.map(
        lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
        shapes,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )
    step = jax.shard_map(
        tx.update, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs), check_vma=False
    )
    return jax.jit(step).lower(params, state, params).as_text()


def test_hierarchical_is_passed_on():
    """hierarchical=True reaches the collectives: the lowered update carries the (node, local)
    hierarchy attribute for the dense and the quantized reduction, and only then."""
    import jaxcomm
    from jaxcomm.optax import allreduce_gradients

    axes = ("node", "local")
    for algorithm in (None, jaxcomm.Adaptive(64)):
        flat = _lowered_update(allreduce_gradients(axes, algorithm), axes)
        hier = _lowered_update(allreduce_gradients(axes, algorithm, hierarchical=True), axes)
        assert "hierarchy" in hier and "hierarchy" not in flat, algorithm
    with pytest.raises(ValueError, match="needs an algorithm"):
        allreduce_gradients(axes, None, hierarchical=True, density_schedule={0: 0.1})
    # gTop-k has no hierarchical form: the step refuses it when traced, naming the compressor.
    with pytest.raises(ValueError, match="hierarchical=True supports .* not GTopK"):
        _lowered_update(allreduce_gradients(axes, jaxcomm.GTopK(0.01), hierarchical=True), axes)


def test_compressor_keyword_is_gone():
    # The deprecated alias of `algorithm` was removed; the keyword is an ordinary TypeError.
    import jaxcomm
    from jaxcomm.optax import allreduce_gradients

    with pytest.raises(TypeError, match="compressor"):
        allreduce_gradients("dp", compressor=jaxcomm.GTopK(0.01))


def test_bad_schedules_are_refused():
    import jaxcomm
    from jaxcomm.optax import allreduce_gradients

    with pytest.raises(ValueError, match="needs an algorithm"):
        allreduce_gradients("dp", None, density_schedule={0: 0.1})
    with pytest.raises(ValueError, match="with a density"):
        allreduce_gradients("dp", jaxcomm.Adaptive(), density_schedule={0: 0.1})
    with pytest.raises(ValueError, match="distinct"):
        allreduce_gradients("dp", jaxcomm.GTopK(0.01), density_schedule=[(0, 0.1), (0, 0.2)])
    with pytest.raises(ValueError, match="density must be in"):
        allreduce_gradients("dp", jaxcomm.GTopK(0.01), density_schedule={0: 1.5})
    with pytest.raises(ValueError, match="bucket_size"):
        allreduce_gradients("dp", None, bucket_size=0)


def test_auto_follows_the_density_schedule():
    """auto's sparse candidates warm up as explicit ones do: one Auto per phase, each with
    that phase's density (a dense phase may then pick another algorithm)."""
    from jaxcomm import cost
    from jaxcomm.optax import _normalize_schedule

    auto = cost.Auto(allowed=("dense", "gtopk"), options=cost.Options(density=0.01))
    starts, phases = _normalize_schedule({5: 0.25, 10: 0.01}, auto)
    assert list(starts) == [0, 5, 10]
    assert [p.options.density for p in phases] == [0.01, 0.25, 0.01]
    assert all(p.allowed == ("dense", "gtopk") for p in phases)
    _, (first,) = _normalize_schedule({0: 0.1}, "auto")
    assert first.options.density == 0.1 and first.allowed == cost.DEFAULT_ALLOWED
    # A 25 % warm-up density makes gTop-k's call dearer than dense's on a big gradient.
    world = cost.World(2, 1, "across_hosts")
    picks = [cost.choose(4_000_000, world, p.allowed, options=p.options) for p in phases]
    assert picks[1] == "dense" and picks[2] == "gtopk"


def test_warmup_schedule_and_buckets():
    from jaxcomm.optax import _buckets, gtopk_warmup_schedule

    assert gtopk_warmup_schedule(23, 0.001) == {
        0: 0.25,
        23: 0.0725,
        46: 0.015,
        69: 0.004,
        92: 0.001,
    }
    assert gtopk_warmup_schedule(10, 0.01) == {0: 0.25, 10: 0.0725, 20: 0.015, 30: 0.01}
    # Consecutive leaves fill a bucket; a leaf larger than a bucket stands alone; empty
    # leaves need no collective.
    # Last leaf first (backward order), tree order inside a bucket.
    assert _buckets([3, 4, 0, 10, 2, 2], 8) == [[4, 5], [3], [0, 1]]
    # A small first bucket (the last layers', on the wire first), then bucket_size again.
    assert _buckets([3, 4, 0, 10, 2, 2], 8, first_bucket_size=2) == [[5], [4], [3], [0, 1]]


def test_digits_config_from_a_recipe_entry():
    # The launcher adapts to the library: a recipe entry becomes the keyword arguments of
    # jaxcomm.examples.digits.train (launcher/jaxcomm_launcher/jobs/_common.py).
    from jaxcomm_launcher.jobs._common import example_settings

    from jaxcomm.examples import _loop
    from jaxcomm.examples.digits import DigitsConfig

    ctx = types.SimpleNamespace(
        train=types.SimpleNamespace(
            steps=40,
            batch_size=32,
            learning_rate=0.1,
            momentum=0.0,
            hidden=16,
            eval_every=5,
            seed=3,
            target=0.97,
            time_cap_s=None,
        ),
        jaxcomm=types.SimpleNamespace(
            algorithm="topk_allgather",
            density=0.005,
            grad_dtype="float32",
            allowed=["dense", "gtopk"],
            profile=None,
            compute_seconds=0.25,
            steps_factor={"gtopk": 2.5},
            dense_steps=120,
            steps_factor_no_warmup={"gtopk": 3.0},
            diloco=None,  # every jaxcomm field of the recipe is read (example_settings)
        ),
        args={"model": "cnn"},
    )
    settings = example_settings(ctx)
    assert "profile" not in settings and settings["allowed"] == ("dense", "gtopk")
    cfg = _loop.make_config(DigitsConfig, {**settings, "warmup": False}, "digits")
    assert (cfg.algorithm, cfg.density, cfg.model, cfg.steps, cfg.batch_size) == (
        "topk_allgather",
        0.005,
        "cnn",
        40,
        32,
    )
    assert cfg.warmup is False and cfg.seed == 3 and cfg.allowed == ("dense", "gtopk")
    # The stopping rule and auto's compute step reach the example too; an unset cap does not.
    assert cfg.target == 0.97 and cfg.compute_seconds == 0.25 and "time_cap_s" not in settings
    assert cfg.steps_factor == {"gtopk": 2.5}  # measured steps factors reach auto's Auto
    # and what lets auto decide the warm-up
    assert cfg.dense_steps == 120 and cfg.steps_factor_no_warmup == {"gtopk": 3.0}
    assert _loop.Reduction("auto", steps_factor=cfg.steps_factor).reducer(10) is not None
    with pytest.raises(TypeError, match="unknown digits settings"):
        _loop.make_config(DigitsConfig, {"epoch": 3}, "digits")


def test_examples_command_line_parses_every_config_field():
    """`python -m jaxcomm.examples.digits --allowed dense,gtopk --warmup 0 --grad-dtype
    bfloat16`: every field gets a parser of its own type (tuples and optional strings were
    parsed as int before)."""
    import dataclasses

    from jaxcomm import cost
    from jaxcomm.examples import _loop
    from jaxcomm.examples.bytes_lm import BytesLMConfig
    from jaxcomm.examples.digits import DigitsConfig

    for config in (DigitsConfig, BytesLMConfig):
        fields = {f.name: _loop._option_parser(f) for f in dataclasses.fields(config)}
        assert fields["allowed"]("dense, gtopk") == ("dense", "gtopk")
        assert fields["profile"]("p.json") == "p.json"
        assert fields["grad_dtype"]("bfloat16") == "bfloat16"
        assert fields["warmup"]("0") is False and fields["warmup"]("true") is True
        assert fields["bucket_size"]("4096") == 4096
        assert fields["steps_factor"]("gtopk=2, adaptive=5.5") == {"gtopk": 2.0, "adaptive": 5.5}
        with pytest.raises(ValueError, match="name=value"):
            fields["steps_factor"]("gtopk")
        with pytest.raises(ValueError, match="0/1"):
            fields["warmup"]("maybe")
        # auto's settings come from cost.Auto's fields, with Auto's annotations
        assert fields["steps_factor_no_warmup"]("gtopk=3") == {"gtopk": 3.0}
        assert fields["dense_steps"]("120") == 120 and fields["compute_seconds"]("0.5") == 0.5
    auto = {f.name for f in dataclasses.fields(cost.Auto)} - {"options"}
    assert set(_loop.AUTO_SETTINGS) == auto
    assert auto <= {f.name for f in dataclasses.fields(_loop.Reduction)}
