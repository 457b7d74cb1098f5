"""jaxcomm.optax.diloco and the detached collectives behind its streaming outer step.

The worlds run tests/diloco_worker.py (1x2, 2x1 and 2x2 processes x devices; the checkpoint,
bf16 and misuse cases on 1x2 and 2x1 only); each step there is its own jitted call,
dispatched without waiting. The identity checked on every world:

  with every=1, the dense algorithm and outer = sgd(1) (no momentum), every rank starts each
  step from θ_t, so the outer step is θ_t − mean_r(θ_t − (θ_t + u_r)) = θ_t + mean_r(u_r)
  (exact up to float rounding), u_r being the update the inner optimizer computes from rank
  r's gradient and rank r's own inner state. DiLoCo then equals averaging the inner *updates*
  every step. That is averaging gradients only for a stateless inner optimizer (SGD); with Adam
  each rank's moments follow its own gradients, which is not Adam on the averaged gradient
  (the test checks that difference too, so the identity is not vacuous).
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import optax
import pytest
from collectives_harness import run_world
from diloco_worker import SHAPES, grads_for

import jaxcomm
from jaxcomm.optax import _fragments, diloco

WORKER = pathlib.Path(__file__).with_name("diloco_worker.py")
# 1x2 runs in the default suite; the multi-process worlds are marked slow (CI runs both).
WORLDS = [
    (1, 2),
    pytest.param(2, 1, marks=pytest.mark.slow),
    pytest.param(2, 2, marks=pytest.mark.slow),
]
WORLD_TIMEOUT_S = 1200  # a world's worker, on a busy 2-core machine
TEST_TIMEOUT_S = 1500
_runs: dict = {}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    def get(processes: int, devices: int, mode: str | None = None):
        mode = mode or ("cases" if (processes, devices) == (1, 2) else "core")
        key = (processes, devices, mode)
        if key not in _runs:
            tmp = tmp_path_factory.mktemp(f"diloco-{processes}x{devices}-{mode}")
            run = run_world(
                processes,
                devices,
                tmp,
                mode=mode,
                timeout=WORLD_TIMEOUT_S,
                env={"JAXCOMM_TIMEOUT_S": "60"},
                worker=WORKER,
            )
            _runs[key] = (run, tmp)
        run, tmp = _runs[key]
        assert run.returncodes == [0] * processes, run.output_tails()
        return run, tmp

    return get


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", WORLDS)
def test_every_step_with_outer_sgd_1_averages_the_inner_updates(world, processes, devices):
    run, _ = world(processes, devices)
    r = run.results
    for name in ("sgd", "adam"):
        ours, ref = r[f"identity/{name}/ours"], r[f"identity/{name}/ref"]
        np.testing.assert_allclose(ours, ref, rtol=2e-6, atol=2e-6, err_msg=name)
    # SGD's update is linear in the gradient: the same as averaging gradients. Adam's is not.
    np.testing.assert_allclose(r["identity/sgd/ours"], r["identity/sgd/avg_grad"], atol=2e-6)
    assert np.abs(r["identity/adam/ours"] - r["identity/adam/avg_grad"]).max() > 1e-3


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", WORLDS)
def test_error_feedback_conserves_the_pseudo_gradient(world, processes, devices):
    run, _ = world(processes, devices)
    r = run.results
    ranks = processes * devices
    n = sum(int(np.prod(s)) for s in SHAPES.values())
    for name in ("gtopk", "onebit"):
        held_back = False
        for i in range(6):
            if (i + 1) % 2:  # the syncs are after steps 2, 4, 6 (i = 1, 3, 5)
                continue
            before = {
                k: r[f"ef/{name}/{i - 1}/{k}"].astype(np.float64)
                for k in ("global", "local", "residual")
            }
            after = {
                k: r[f"ef/{name}/{i}/{k}"].astype(np.float64)
                for k in ("global", "local", "residual")
            }
            g = grads_for(i, ranks)
            # Flattened as diloco flattens the parameters (jax.tree.leaves: a dict's leaves in
            # sorted key order), the order of the worker's global, local and residual vectors;
            # SHAPES' insertion order (w, b, s) would pair each Δ with another leaf's gradient.
            g_flat = np.concatenate([x.reshape(ranks, -1) for x in jax.tree.leaves(g)], axis=1)
            delta = before["global"][None, :] - (before["local"] - g_flat)  # inner: local -= g
            summed = ranks * (before["global"] - after["global"])  # outer: sgd(1)
            np.testing.assert_allclose(
                (delta + before["residual"]).sum(0),
                summed + after["residual"].sum(0),
                rtol=1e-5,
                atol=1e-5,
                err_msg=f"{name} step {i}",
            )
            assert after["residual"].shape == (ranks, n)
            held_back |= bool(np.any(after["residual"]))
            # Every rank restarts from θ_global.
            for rank in range(ranks):
                np.testing.assert_array_equal(after["local"][rank], after["global"])
        assert held_back, name  # compression kept something back


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", WORLDS)
def test_streaming_equals_delayed_blocking_outer_steps(world, processes, devices):
    run, _ = world(processes, devices)
    r = run.results
    keys = sorted(k for k in r if k.startswith("stream/") and "/True/" in k)
    assert len(keys) >= 2 * 5
    for key in keys:
        np.testing.assert_array_equal(r[key], r[key.replace("/True/", "/False/")], err_msg=key)
    assert int(r["open_handles"]) == 0  # flush() waited every one


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_checkpoint_resume_is_bit_exact(world):
    run, _ = world(1, 2)
    r = run.results
    for name in ("plain", "stream"):
        keys = [k for k in r if k.startswith(f"ckpt/{name}/") and k.endswith("/expected")]
        assert len(keys) >= 4
        for key in keys:
            np.testing.assert_array_equal(
                r[key.replace("/expected", "/resumed")], r[key], err_msg=key
            )


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_bf16_parameters_train(world):
    run, _ = world(1, 2)
    r = run.results
    for name in ("dense", "onebit_stream"):
        losses = r[f"bf16/{name}/losses"]
        assert np.all(np.isfinite(losses)), name
        assert losses[-1] < 0.5 * losses[0], (name, losses)
        assert r[f"bf16/{name}/dtypes_ok"].all(), name


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", [(1, 2), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_misused_handles_fail_clearly_and_no_rank_hangs(world, processes, devices):
    run, tmp = world(processes, devices, "misuse")
    for pid in range(processes):
        report = json.loads((tmp / f"misuse{pid}.json").read_text())
        assert report["first_wait"] is None and report["after_refusal"] is None
        assert report["own_process"] is None
        assert "was waited already" in report["waited_twice"]
        assert "was never waited" in report["started_again"]
        assert "stream 5" in report["started_again"]
        assert "started by another process" in report["another_process"]
        assert report["allreduce_after"] == report["expected_after"]
        # The handle left open is reported at exit.
        assert "were started and never waited" in run.outputs[pid], run.outputs[pid][-2000:]


def test_bad_arguments_are_refused():
    inner = optax.sgd(0.1)
    with pytest.raises(ValueError, match="every"):
        diloco(inner, every=0)
    with pytest.raises(ValueError, match="delay"):
        diloco(inner, every=4, delay=4)
    with pytest.raises(ValueError, match="fragments"):
        diloco(inner, every=2, fragments=3)
    with pytest.raises(ValueError, match="mix"):
        diloco(inner, every=2, delay=1, mix=1.5)
    with pytest.raises(TypeError, match="algorithm must be one of"):
        diloco(inner, every=2, algorithm="gtopk")
    with pytest.raises(TypeError, match="algorithm must be one of"):
        diloco(inner, every=2, algorithm=jaxcomm.TopK(0.1))  # a compressor, not an allreduce


def test_fragments_split_leaves_contiguously_and_evenly():
    assert _fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert _fragments([100, 1, 1, 100], 2) == [[0, 1], [2, 3]]
    assert _fragments([5], 1) == [[0]]
    with pytest.raises(ValueError, match="fewer fragments"):
        _fragments([100, 1], 3)
