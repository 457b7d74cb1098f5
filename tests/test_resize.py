"""A checkpoint saved by P ranks restores onto P' ranks (jaxcomm.resharding): the per-rank
leaves start from the mean of the saved ranks' values (residuals keep the update the ranks
still owe), integer ones from the first rank's, with one warning; the run goes on.

tests/resize_worker.py saves with 2 devices, then restores with 3 (more ranks) and with 1
(fewer), each in its own process (the device count is fixed when JAX starts).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from collectives_harness import run_script

# Minutes of training worlds: CI runs them with the slow tests (`pytest -m slow`).
pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).with_name("resize_worker.py")
SAVED = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("resize")
    out = {}
    for mode, devices in (("save", SAVED), ("restore", 3), ("restore", 1)):
        run = run_script(
            WORKER, "--mode", mode, "--devices", devices, "--dir", directory, timeout=600
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        with np.load(directory / f"{mode}-{devices}.npz") as data:
            arrays = {k: data[k] for k in data.files}
        out[mode, devices] = arrays, json.loads((directory / f"{mode}-{devices}.json").read_text())
    return out


def leaves(arrays: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}


@pytest.mark.parametrize("devices", [3, 1])
@pytest.mark.parametrize("name", ["gtopk", "diloco"])
def test_restore_onto_another_world_size(runs, name, devices):
    saved = leaves(runs["save", SAVED][0], f"{name}/end/")
    arrays, info = runs["restore", devices]
    restored = leaves(arrays, f"{name}/start/")
    assert saved.keys() == restored.keys()
    resized = 0
    for key, before in saved.items():
        after = restored[key]
        if before.shape == after.shape:  # replicated: as saved, bit for bit
            assert np.array_equal(before, after), key
            continue
        resized += 1
        rows = after.shape[0] // devices
        per_rank = before.reshape((SAVED, rows) + before.shape[1:])
        if np.issubdtype(before.dtype, np.floating):
            expected = per_rank.astype(np.float32).mean(0).astype(before.dtype)
        else:
            expected = per_rank[0]
        for rank in range(devices):
            np.testing.assert_allclose(
                after[rank * rows : (rank + 1) * rows], expected, err_msg=key
            )
    assert resized > 0  # the state had per-rank leaves to resize
    (message,) = info["warnings"][name]  # one warning, saying what is lost
    assert f"saved by {SAVED} ranks and is restored onto {devices}" in message
    assert "lost" in message
    losses = arrays[f"{name}/losses"]
    assert losses.shape == (2,) and np.isfinite(losses).all()
