"""jaxcomm.optax.diloco over sites: an outer axis between sites, an inner axis of a site's
devices (data-parallel or with sharded parameters), each device exchanging its own share.

The worlds run tests/diloco_sites_worker.py on 4 CPU devices (1 process x 4 devices, and 2
processes x 2 devices where a process is a site), viewed as 2 sites x 2 devices and as one
site of 4. The references are recomputed here from the worker's per-device gradients.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from collectives_harness import world_once
from diloco_sites_worker import FSDP_SHAPES, SHAPES, grads_for, initial_params

from jaxcomm.cost import ledger
from jaxcomm.optax import diloco

WORKER = pathlib.Path(__file__).with_name("diloco_sites_worker.py")
# Both worlds train for minutes: CI runs them with `pytest -m slow`.
WORLDS = [pytest.param(1, 4, marks=pytest.mark.slow), pytest.param(2, 2, marks=pytest.mark.slow)]
SITES, LOCAL = 2, 2
DEVICES = SITES * LOCAL
N = sum(int(np.prod(s)) for s in SHAPES.values())
WORLD_TIMEOUT_S = 1200  # a world's worker, on a busy 2-core machine
TEST_TIMEOUT_S = 1500
_runs: dict = {}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    def get(processes: int, devices: int):
        env = {"JAXCOMM_TIMEOUT_S": "60", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}
        options = {"mode": "sites", "timeout": WORLD_TIMEOUT_S, "env": env, "worker": WORKER}
        name = f"diloco-sites-{processes}x{devices}"
        key = (processes, devices)
        return world_once(_runs, key, tmp_path_factory, name, processes, devices, **options).results

    return get


def flat_tree(tree: dict) -> np.ndarray:
    """Leaves in tree order (a dict's keys sorted), as diloco flattens them."""
    return np.concatenate([np.ravel(np.asarray(tree[k])) for k in sorted(tree)])


def rows(g: dict) -> np.ndarray:
    """Per-device gradients as (devices, N), leaves in tree order."""
    return np.concatenate([g[k].reshape(g[k].shape[0], -1) for k in sorted(g)], axis=1)


def site_mean(g: dict, site: int, local: int = LOCAL) -> dict:
    return {k: jnp.asarray(v[site * local : (site + 1) * local].mean(0)) for k, v in g.items()}


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", WORLDS)
def test_one_site_is_data_parallel_training_with_the_inner_optimizer(world, processes, devices):
    r = world(processes, devices)
    inner = optax.adam(0.05)
    theta = {k: jnp.asarray(v) for k, v in initial_params().items()}
    state = inner.init(theta)
    for i in range(6):
        u, state = inner.update(site_mean(grads_for(i, DEVICES), 0, DEVICES), state)
        theta = optax.apply_updates(theta, u)
    np.testing.assert_allclose(r["one_site/global"], flat_tree(theta), rtol=1e-5, atol=1e-5)
    for device in range(DEVICES):  # the site's θ_local is one, on each of its devices
        np.testing.assert_array_equal(r["one_site/local"][device], r["one_site/global"])


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", WORLDS)
def test_every_step_with_outer_sgd_1_is_data_parallel_over_all_devices(world, processes, devices):
    r = world(processes, devices)
    # SGD: θ − lr · (mean over sites of each site's mean gradient) = data-parallel over all.
    theta = flat_tree(initial_params()).astype(np.float64)
    for i in range(4):
        theta = theta - 0.1 * rows(grads_for(i, DEVICES)).mean(0)
    np.testing.assert_allclose(r["identity/sgd/global"], theta, rtol=2e-6, atol=2e-6)
    # Adam: each site's moments follow its own mean gradient; the outer step averages the
    # sites' updates.
    inner = optax.adam(0.05)
    theta = {k: jnp.asarray(v) for k, v in initial_params().items()}
    states = [inner.init(theta) for _ in range(SITES)]
    for i in range(4):
        ups = []
        for s in range(SITES):
            u, states[s] = inner.update(site_mean(grads_for(i, DEVICES), s), states[s])
            ups.append(u)
        theta = {k: theta[k] + sum(u[k] for u in ups) / SITES for k in theta}
    np.testing.assert_allclose(r["identity/adam/global"], flat_tree(theta), rtol=2e-6, atol=2e-6)
    for name in ("sgd", "adam"):  # θ_global is bit-identical on every device of every site
        per_device = r[f"identity/{name}/per_device"]
        for device in range(DEVICES):
            np.testing.assert_array_equal(per_device[device], r[f"identity/{name}/global"])


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", WORLDS)
def test_each_device_sends_its_share_of_delta_as_the_ledger_counts(world, processes, devices):
    r = world(processes, devices)
    labels = json.loads(str(r["bytes/labels"]))
    assert len(labels) == 1 and labels[0].startswith("dense"), labels
    shared_memory = labels[0].endswith(("direct", "oneshot"))
    share = N // LOCAL
    calls = r["bytes/calls"]
    exchanges = calls[calls[:, 2] == share]
    gathers = calls[calls[:, 2] == LOCAL * share]  # inside a site, over "local"
    assert len(calls) == len(exchanges) + len(gathers)
    # 4 outer steps, one exchange and one gather per device each (those of this process).
    assert len(exchanges) == len(gathers) == 4 * DEVICES // processes
    assert set(gathers[:, 1]) == {LOCAL}
    for world_rank, group_size, elements, sent in exchanges:
        assert group_size == SITES and elements == share
        group_rank = world_rank // LOCAL
        assert sent == ledger.dense_bytes(share, SITES, group_rank, shared_memory)
        # L devices each sending 1/L: the slow link carries one Δ per site, not L.
        whole = ledger.dense_bytes(N, SITES, group_rank, shared_memory)
        assert LOCAL * sent == whole


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", WORLDS)
def test_error_feedback_is_conserved_per_share_and_theta_global_is_bit_identical(
    world, processes, devices
):
    r = world(processes, devices)
    share = N // LOCAL
    held_back = False
    for i in (1, 3, 5):  # the syncs, after steps 2, 4, 6
        g = rows(grads_for(i, DEVICES)).astype(np.float64)
        before_g = r[f"ef/{i - 1}/global"].astype(np.float64)
        before_l = r[f"ef/{i - 1}/local"].astype(np.float64)
        res_in = r[f"ef/{i - 1}/residual"].astype(np.float64)
        res_out = r[f"ef/{i}/residual"].astype(np.float64)
        after_g = r[f"ef/{i}/global"].astype(np.float64)
        assert res_out.shape == (DEVICES, share)
        summed = SITES * (before_g - after_g)  # outer sgd(1) on the mean over sites
        for device in range(LOCAL):  # share `device`: sent by device `device` of each site
            cols = slice(device * share, (device + 1) * share)
            sent = 0.0
            for s in range(SITES):
                row = s * LOCAL + device
                local = before_l[row] - g[s * LOCAL : (s + 1) * LOCAL].mean(0)  # scale(-1)
                sent = sent + (before_g - local)[cols] + res_in[row]
            kept = sum(res_out[s * LOCAL + device] for s in range(SITES))
            np.testing.assert_allclose(sent, summed[cols] + kept, rtol=1e-5, atol=1e-5)
        held_back |= bool(np.any(res_out))
        for device in range(DEVICES):
            np.testing.assert_array_equal(r[f"ef/{i}/per_device"][device], r[f"ef/{i}/global"])
            np.testing.assert_array_equal(r[f"ef/{i}/local"][device], r[f"ef/{i}/global"])
    assert held_back  # gTop-k kept something back
    for i in (0, 2, 4):  # between syncs: each site's θ_local is identical on its devices
        local = r[f"ef/{i}/local"]
        for s in range(SITES):
            np.testing.assert_array_equal(local[s * LOCAL], local[s * LOCAL + 1])


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", WORLDS)
def test_sharded_parameters_train_as_the_data_parallel_site(world, processes, devices):
    r = world(processes, devices)
    # Δ's shares: the data-parallel site exchanges 20 of its 40 elements per device and
    # gathers the 40 in the site; the sharded one exchanges its 20 and gathers nothing.
    n = sum(int(np.prod(s)) for s in FSDP_SHAPES.values())
    assert {tuple(c) for c in r["fsdp/False/calls"]} == {(SITES, n // LOCAL), (LOCAL, n)}
    assert {tuple(c) for c in r["fsdp/True/calls"]} == {(SITES, n // LOCAL)}
    np.testing.assert_allclose(r["fsdp/True/global"], r["fsdp/False/global"], rtol=1e-4, atol=1e-5)
    losses = r["fsdp/True/losses"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
    per_device = r["fsdp/True/per_device"]  # each device's shard of θ_global, by site
    for device in range(LOCAL):
        for s in range(1, SITES):
            np.testing.assert_array_equal(per_device[s * LOCAL + device], per_device[device])


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("processes,devices", WORLDS)
def test_checkpoint_resume_with_a_share_in_flight_is_bit_exact(world, processes, devices):
    r = world(processes, devices)
    keys = [k for k in r if k.startswith("ckpt/") and k.endswith("/expected")]
    assert len(keys) >= 5
    for key in keys:
        np.testing.assert_array_equal(r[key.replace("/expected", "/resumed")], r[key], err_msg=key)
    assert int(r["open_handles"]) == 0


def test_bad_axis_names_are_refused_naming_the_argument():
    inner = optax.sgd(0.1)
    with pytest.raises(ValueError, match="inner_axis 'node' is also in axis_name"):
        diloco(inner, every=2, axis_name="node", inner_axis="node")
    with pytest.raises(TypeError, match="inner_axis must be one mesh axis name"):
        diloco(inner, every=2, axis_name="node", inner_axis=("a", "b"))
    with pytest.raises(ValueError, match="params_sharded=True needs inner_axis"):
        diloco(inner, every=2, params_sharded=True)
    with pytest.raises(ValueError, match="inner_allreduce must be one of"):
        diloco(inner, every=2, axis_name="node", inner_axis="local", inner_allreduce="nccl")
    # A streamed exchange's state without a mesh to size the shares: the fix is named.
    tx = diloco(inner, every=2, delay=1, axis_name="node", inner_axis="local")
    with pytest.raises(ValueError, match="jax.set_mesh"):
        jax.eval_shape(tx.init, {"w": jnp.zeros((3,))})
    # Inside the shard_map: an axis the mesh lacks, named with its argument.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("node", "local"))
    params = {"w": jnp.zeros((3,))}
    for kw, argument in (
        ({"axis_name": "node", "inner_axis": "site"}, "inner_axis='site'"),
        ({"axis_name": "nodes", "inner_axis": "local"}, "axis_name='nodes'"),
    ):
        tx = diloco(inner, every=2, **kw)
        init = jax.shard_map(
            tx.init,
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec(),
            out_specs=jax.sharding.PartitionSpec(),
            check_vma=False,
        )
        with pytest.raises(ValueError, match=f"{argument} is not a manual axis"):
            jax.eval_shape(init, params)
