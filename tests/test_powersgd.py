"""jaxcomm.PowerSGD in jaxcomm.optax.allreduce_gradients, against a NumPy reference of PyTorch's
``powerSGD_hook`` (tests/powersgd_reference.py), over 4 CPU devices.

The multi-device cases run in a subprocess (tests/powersgd_worker.py), because the device count
must be set before JAX initializes; the argument checks and the cost model run here.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from collectives_harness import worker_results
from powersgd_reference import Hook

import jaxcomm
from jaxcomm import algorithms, cost
from jaxcomm.cost.algorithm_costs import powersgd

WORKER = pathlib.Path(__file__).with_name("powersgd_worker.py")
DEVICES = 4
# The worker's settings (tests/powersgd_worker.py).
SHAPES = {"w1": (40, 30), "b1": (30,), "w2": (30, 7), "conv": (3, 3, 8, 16), "small": (6, 5)}
RANK, START, STEPS = 2, 2, 6
EPSILON = 0.5


@pytest.fixture(scope="session")
def worker(tmp_path_factory):
    # The unit worker compiles about a dozen steps; on the shared 2-core machine, loaded and
    # at nice 19, it took over 600 s.
    get = worker_results(tmp_path_factory, WORKER, timeout=1800)
    return lambda mode, *args: get(mode, "--mode", mode, "--devices", DEVICES, *args, name=mode)


@pytest.fixture(scope="session")
def unit(worker):
    """The unit worker's results, run during setup: pytest-timeout bounds test bodies only
    (timeout_func_only), so a slow run under load meets the worker's own bound, not the
    per-test one, and one failure is reported once for every test that needs it."""
    return worker("unit")


def _reference(arrays: dict, label: str, hook_dense_error: bool, out_dtype=np.float32, **settings):
    names = list(SHAPES)
    # The compressed leaves' first Q, from jaxcomm's initial state ((1,) for dense leaves).
    initial = {i: arrays[f"{label}_q0_{k}"] for i, k in enumerate(names)}
    initial = {i: q for i, q in initial.items() if q.ndim == 2}
    if settings.pop("fresh_qs", False):  # the Qs jaxcomm drew at each step
        settings["fresh_qs"] = lambda t: {i: arrays[f"{label}_fq{t}_{names[i]}"] for i in initial}
    hook = Hook(
        [SHAPES[k] for k in names],
        DEVICES,
        RANK,
        START,
        2.0,
        initial,
        hook_dense_error=hook_dense_error,
        out_dtype=out_dtype,
        **settings,
    )
    outs = []
    source = "bf16" if label == "bf16" else "f32"  # the other settings reuse f32's gradients
    for t in range(STEPS):
        grads = [
            [arrays[f"{source}_g{t}_{k}"][r].astype(out_dtype) for k in names]
            for r in range(DEVICES)
        ]
        outs.append(dict(zip(names, hook(grads), strict=True)))
    return hook, outs


@pytest.mark.parametrize("hook_dense_error", [True, False], ids=["hook", "no-dense-error"])
def test_matches_the_hooks_algorithm_over_several_steps(unit, hook_dense_error):
    # Warm-up, then compression with warm-started Q and error feedback: every step's average
    # equals the reference's within float32 rounding (another summation order), whether or not
    # the reference keeps the hook's error of the leaves sent dense (its mean over ranks is 0).
    arrays, info = unit
    assert info["f32_identical"] and info["f32_compilations"] == 1 and info["f32_count"] == STEPS
    hook, outs = _reference(arrays, "f32", hook_dense_error)
    assert [p is not None for p in hook.plans] == [True, False, True, True, False]
    for t in range(STEPS):
        for k in SHAPES:
            got, want = arrays[f"f32_out{t}_{k}"], outs[t][k]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5, err_msg=f"step {t} {k}")
    # The compressed steps are really low rank, and not the plain average.
    g = arrays[f"f32_g{STEPS - 1}_w1"].mean(axis=0)
    got = arrays[f"f32_out{STEPS - 1}_w1"]
    assert np.linalg.matrix_rank(got, tol=1e-4 * np.abs(got).max()) == RANK
    assert not np.allclose(got, g, atol=1e-2)
    # Each rank's error of the compressed leaves, as the hook keeps it.
    for k_index, k in enumerate(SHAPES):
        errors = arrays[f"f32_error_{k}"]  # stacked per rank
        if hook.plans[k_index] is None:
            assert not errors.any()  # dense leaves keep no error here
            continue
        for r in range(DEVICES):
            np.testing.assert_allclose(
                errors[r * SHAPES[k][0] : (r + 1) * SHAPES[k][0]],
                hook.errors[r][k_index],
                rtol=1e-4,
                atol=2e-5,
            )


@pytest.mark.parametrize(
    "label, settings",
    [
        ("noef", {"error_feedback": False}),
        ("nows", {"fresh_qs": True}),
        ("eps", {"epsilon": EPSILON}),
    ],
)
def test_the_hooks_other_settings_match_it(unit, label, settings):
    # use_error_feedback=False, warm_start=False (a new Q each step, the same on every rank)
    # and orthogonalization_epsilon, each against the reference run with the same setting, and
    # each different from the default settings' result.
    arrays, _ = unit
    _, outs = _reference(arrays, label, False, **settings)
    _, default = _reference(arrays, "f32", False)
    for t in range(STEPS):
        for k in SHAPES:
            got = arrays[f"{label}_out{t}_{k}"]
            np.testing.assert_allclose(got, outs[t][k], rtol=1e-4, atol=2e-5, err_msg=f"{t} {k}")
    last = arrays[f"{label}_out{STEPS - 1}_w1"]
    assert not np.allclose(last, default[STEPS - 1]["w1"], rtol=1e-3, atol=1e-4)
    if label == "noef":  # no error state: a (1,) placeholder per rank for every leaf
        assert all(tuple(arrays[f"noef_errorshape_{k}"]) == (DEVICES,) for k in SHAPES)


def test_warm_up_is_the_plain_average(unit):
    arrays, _ = unit
    for t in range(START):
        for k in SHAPES:
            mean = arrays[f"f32_g{t}_{k}"].mean(axis=0)
            np.testing.assert_allclose(arrays[f"f32_out{t}_{k}"], mean, rtol=1e-6, atol=1e-6)
    # The first compressed step is not.
    assert not np.allclose(arrays[f"f32_out{START}_w1"], arrays[f"f32_g{START}_w1"].mean(0))


def test_bf16_gradients_match_the_reference_in_bf16(unit):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    arrays, info = unit
    assert info["bf16_identical"] and info["bf16_compilations"] == 1
    _, outs = _reference(arrays, "bf16", False, out_dtype=ml_dtypes.bfloat16)
    for t in range(STEPS):
        for k in SHAPES:
            got = arrays[f"bf16_out{t}_{k}"]
            want = outs[t][k].astype(np.float32)
            # Rounded to bf16 on both sides: equal, but for a value whose float32 rounding
            # straddles a bf16 rounding boundary (one bf16 ulp).
            np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-3, err_msg=f"{t} {k}")
            assert np.mean(got == want) > 0.9, (t, k)


def test_p_and_q_of_all_leaves_travel_in_one_call_each(unit):
    # Compressed phase: one allreduce of every P, one of every Q, one of the dense leaves; the
    # warm-up branch adds its one dense call (both branches are in the compiled step).
    _, info = unit
    assert info["allreduce_calls_start0"] == 3
    assert info["allreduce_calls_start2"] == 4
    # ... and no other collective.
    assert info["all_custom_calls_start0"] == 3 and info["all_custom_calls_start2"] == 4


def test_bytes_are_the_models(unit):
    _, info = unit
    assert info["bytes_measured"] == info["bytes_model"]
    # P: w1 40x2 + w2 30x2 + conv 72x2; Q: 30x2 + 7x2 + 16x2; dense: b1 30 + small 30.
    assert info["sizes"] == [284, 106, 60]


def test_sum_instead_of_mean(unit):
    _, info = unit
    assert info["sum_is_devices_times_mean"]


def test_orbax_checkpoint_resumes_bit_identically(unit):
    _, info = unit
    assert info["restored_count"] == 3
    assert info["restored_error_nonzero"]  # the errors were really restored
    assert info["resume_bit_identical"]  # outputs, errors, Qs and count, three steps on


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_with_powersgd_lowers_the_loss(unit, optimizer, dtype):
    _, info = unit
    losses = info[f"{optimizer}_{dtype}_losses"]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.35 * losses[0], losses


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 20 epochs of two trainings in the test body
def test_digits_mlp_with_rank_4_is_close_to_dense(worker):
    _, info = worker("train", "--epochs", 20)
    dense, psgd = info["dense"], info["powersgd"]
    assert dense["test_accuracy"] > 0.93, dense
    assert psgd["test_accuracy"] >= dense["test_accuracy"] - 0.02, (psgd, dense)
    assert psgd["compilations"] == 1
    assert 0 < psgd["bytes_sent_per_step"] < dense["bytes_sent_per_step"]


# ---------------------------------------------------------------------------------------------
# In-process: arguments, the registry, the cost model, recipes.


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rank": 0}, ValueError, r"rank .*>= 1, got 0.*PowerSGD\(rank=4\)"),
        ({"rank": -2}, ValueError, r"PowerSGD\(rank=4\)"),
        ({"rank": 1.5}, TypeError, r"rank must be a Python int.*PowerSGD\(rank=4\)"),
        ({"rank": 2, "start_step": -1}, ValueError, "start_step.*0 compresses from the first"),
        ({"rank": 2, "min_compression_rate": 0.5}, ValueError, "min_compression_rate must be >= 1"),
        ({"rank": 2, "min_compression_rate": float("nan")}, ValueError, "finite"),
        ({"rank": 2, "layout": "flax"}, ValueError, "layout must be one of"),
        ({"rank": 2, "error_feedback": 1}, TypeError, "error_feedback must be True or False"),
        ({"rank": 2, "warm_start": "yes"}, TypeError, "warm_start must be True or False"),
        ({"rank": 2, "orthogonalization_epsilon": -1e-8}, ValueError, "epsilon must be >= 0"),
    ],
)
def test_bad_arguments_name_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxcomm.PowerSGD(**kwargs)


def test_a_0d_leaf_is_refused_naming_it():
    import jax.numpy as jnp

    tx = jaxcomm.optax.allreduce_gradients("dp", jaxcomm.PowerSGD(rank=2))
    with pytest.raises(ValueError, match=r"leaf \['temperature'\].*0-d.*shape \(1,\)"):
        tx.init({"w": jnp.zeros((8, 8)), "temperature": jnp.float32(1.0)})


def test_powersgd_refuses_what_does_not_apply():
    import jax.numpy as jnp

    spec = jaxcomm.PowerSGD(rank=2)
    with pytest.raises(ValueError, match="start_step"):
        jaxcomm.optax.allreduce_gradients("dp", spec, density_schedule={0: 0.1})
    with pytest.raises(TypeError, match="allreduce_gradients"):
        jaxcomm.compressed_allreduce(jnp.ones(4), jnp.zeros(4), "dp", spec)


def test_state_shapes_and_partition_specs():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    tx = jaxcomm.optax.allreduce_gradients("dp", jaxcomm.PowerSGD(rank=3, seed=1))
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state = tx.init(params)
    assert state.residuals["w1"].shape == (40, 30) and state.residuals["b1"].shape == (1,)
    assert state.shared["w1"].shape == (30, 3) and state.shared["conv"].shape == (16, 3)
    assert state.shared["small"].shape == (1,)
    # The first Q is seeded: the same for the same seed, another for another.
    again = tx.init(params)
    assert np.array_equal(state.shared["w1"], again.shared["w1"])
    other = jaxcomm.optax.allreduce_gradients("dp", jaxcomm.PowerSGD(rank=3)).init(params)
    assert not np.array_equal(state.shared["w1"], other.shared["w1"])
    specs = jaxcomm.optax.partition_specs(jax.eval_shape(tx.init, params), "dp")
    assert specs.residuals["w1"] == P("dp") and specs.shared["w1"] == P()


def test_leaf_plan_is_the_hooks_should_compress():
    spec = jaxcomm.PowerSGD(rank=4)
    assert spec.plan((4096, 4096)) == (4096, 4096, 4)
    assert spec.plan((4096,)) is None
    assert spec.plan((8, 8)) is None  # 64 elements, 2 * 16 * 4 of factors
    assert spec.plan((3, 40)) is None  # r = min(3, 40, 4) = 3: 120 <= 2 * 43 * 3
    assert jaxcomm.PowerSGD(rank=2).plan((5, 400)) == (5, 400, 2)  # 2000 > 2 * 405 * 2
    # Three or more dimensions: output features last (Flax's (H, W, in, out)), or first as
    # the hook views PyTorch's (out, in, H, W).
    assert spec.plan((3, 3, 8, 16)) == (72, 16, 4)
    assert spec.plan((3, 3, 1, 32)) is None  # 9 x 32: 288 <= 2 * 41 * 4
    torch = jaxcomm.PowerSGD(rank=4, layout="torch")
    assert torch.plan((16, 8, 3, 3)) == (16, 72, 4) and torch.plan((3, 3, 8, 16)) is None
    assert torch.plan((40, 30)) == spec.plan((40, 30))
    assert jaxcomm.PowerSGD(rank=4, min_compression_rate=1.0).plan((8, 9)) == (8, 9, 4)
    with pytest.raises(ValueError, match="0-d"):
        spec.plan(())


def test_registry_cost_model_and_recipes_know_it():
    record = algorithms.get("powersgd")
    assert record.spec is jaxcomm.PowerSGD and record.leafwise == "powersgd"
    assert "powersgd" in algorithms.names() and "powersgd" in cost.ALGORITHMS
    assert "powersgd" not in cost.AUTO_CHOICES  # not a per-bucket choice
    options = cost.Options(rank=2, start_step=10, min_compression_rate=3.0)
    assert algorithms.build("powersgd", options) == jaxcomm.PowerSGD(2, 10, 3.0)
    with pytest.raises(ValueError, match="rank"):
        cost.Options(rank=0)
    # The flat model: n elements as a near-square matrix, P and Q allreduced densely.
    world = cost.World(4, 1, "across_hosts")
    n = 25_000_000
    rows, columns = powersgd.matrix_of(n)
    want = sum(cost.dense_bytes(m, 4, 0, False) for m in (rows * 4, columns * 4))
    assert cost.bytes_sent("powersgd", n, world, cost.Options(), 0) == want
    fast = cost.predict("powersgd", n, world).seconds
    assert fast < cost.predict("dense", n, world).seconds
    assert cost.bytes_sent("powersgd", 16, world) == cost.bytes_sent("dense", 16, world)
    planned = cost.plan([n], world)
    assert "powersgd" in {p["algorithm"] for p in planned["predictions"]}
    # Listed, but picked only when allowed: its row models n as a near-square matrix.
    assert planned["pick"]["algorithm"] != "powersgd"
    assert cost.plan([n], world, allowed=["powersgd"])["pick"]["algorithm"] == "powersgd"


def test_examples_reduction_and_recipes_build_it():
    from jaxcomm.examples._loop import Reduction

    assert Reduction("powersgd", rank=2).reducer(50) is not None
    from jaxcomm_launcher.recipe import JaxcommSettings

    assert JaxcommSettings(algorithm="powersgd").display_label() == "powersgd"


def test_hierarchical_reaches_all_three_calls():
    # hierarchical=True: the P, Q and dense allreduces are each one hierarchical call over
    # (node, local) (lowered on a one-device mesh, not run).
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = ("node", "local")
    mesh = jax.make_mesh((1, 1), axes)
    params = {"w": jnp.ones((64, 32), jnp.float32), "b": jnp.ones((8,), jnp.float32)}
    texts = {}
    for hierarchical in (False, True):
        tx = jaxcomm.optax.allreduce_gradients(
            axes, jaxcomm.PowerSGD(rank=2, start_step=0), hierarchical=hierarchical
        )
        shapes = jax.eval_shape(tx.init, params)
        specs = jaxcomm.optax.partition_specs(shapes, axes)
        state = jax.tree.map(
            lambda s, spec: jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=NamedSharding(mesh, spec)
            ),
            shapes,
            specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        step = jax.shard_map(
            tx.update, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs), check_vma=False
        )
        texts[hierarchical] = jax.jit(step).lower(params, state).as_text()
    assert texts[True].count("@jaxcomm_hierarchical_allreduce(") == 3
    assert texts[False].count("@jaxcomm_allreduce(") == 3
    assert "hierarchical" not in texts[False]


@pytest.mark.parametrize("layout", ["jax", "torch"])
def test_layout_picks_the_matrix(layout):
    # A gradient of rank 1 in the layout's matrix view goes through rank-1 factors exactly
    # (one device; warm-up off).
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(3)
    if layout == "torch":  # PyTorch's conv weight (out, in, H, W), viewed as (out, in*H*W)
        shape, u, v = (16, 8, 3, 3), rng.standard_normal(16), rng.standard_normal(72)
    else:  # Flax's conv kernel (H, W, in, out), viewed as (H*W*in, out)
        shape, u, v = (3, 3, 8, 16), rng.standard_normal(72), rng.standard_normal(16)
    grad = {"k": jnp.asarray(np.outer(u, v).reshape(shape), jnp.float32)}
    mesh = jax.make_mesh((1,), ("dp",))
    for view in ("jax", "torch"):
        spec = jaxcomm.PowerSGD(rank=1, start_step=0, layout=view)
        if spec.plan(shape) is None:
            continue
        tx = jaxcomm.optax.allreduce_gradients("dp", spec)
        state = tx.init(grad)
        step = jax.jit(
            jax.shard_map(tx.update, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
        )
        out, _ = step(grad, state)
        exact = np.allclose(out["k"], grad["k"], rtol=1e-4, atol=1e-5)
        assert exact == (view == layout), (layout, view)
