"""Where emulated nodes run: each pinned to cores of its own, and the oversubscription notice
when a world needs more cores than the host has (launcher/jaxcomm_launcher/placement.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from jaxcomm_launcher.placement import emulated_placement, local_placement
from jaxcomm_launcher.recipe import Recipe
from launcher_helpers import run_cli, write_recipe


def test_two_nodes_on_two_cores_get_one_core_each():
    p = emulated_placement(2, None, cpus=[0, 1])
    assert p.node_cpus == ((0,), (1,)) and p.oversubscribed is None
    assert p.to_json()["node_cpus"] == [[0], [1]]


def test_four_nodes_on_two_cores_wrap_round_and_say_so():
    p = emulated_placement(4, 1, cpus=[2, 3])
    assert p.node_cpus == ((2,), (3,), (2,), (3,))
    assert p.oversubscribed == "oversubscribed: 4 nodes on 2 cores"
    assert p.describe().endswith("oversubscribed: 4 nodes on 2 cores")


def test_cores_per_node_and_unpinned_worlds():
    p = emulated_placement(2, 2, cpus=[0, 1, 2, 3])
    assert p.node_cpus == ((0, 1), (2, 3)) and p.oversubscribed is None
    unpinned = emulated_placement(3, 1, pin=False, cpus=[0, 1])
    assert unpinned.node_cpus is None
    assert unpinned.oversubscribed == "oversubscribed: 3 nodes on 2 cores"
    assert (
        local_placement(4, cpus=[0, 1]).oversubscribed == "oversubscribed: 4 processes on 2 cores"
    )
    with pytest.raises(ValueError, match="nodes"):
        emulated_placement(0, 1, cpus=[0])


def test_rank_command_pins_each_node(tmp_path):
    from jaxcomm_launcher.backends.emulated import EmulatedBackendRunner

    recipe = Recipe(
        name="e",
        job="smoke",
        world={"processes": 2},
        backend={"kind": "emulated", "cpus_per_node": 1},
    )
    runner = EmulatedBackendRunner(recipe, tmp_path)
    cores = [c[0] for c in runner.placement().node_cpus]
    for rank in range(2):
        cmd = runner.rank_command(rank, tmp_path / "spec.json")
        i = cmd.index("taskset")
        assert cmd[i : i + 3] == ["taskset", "-c", str(cores[rank])]
    assert cores[0] != cores[1] or len(os.sched_getaffinity(0)) == 1


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("taskset") is None,
    reason="the emulated backend needs root, iproute2 and taskset",
)
def test_emulated_launch_reports_each_nodes_cores(tmp_path):
    """A 2-node emulated launch: each rank runs on its node's core (the rank reads its own
    affinity), summary.json and the table report the cores, and 4 nodes on fewer cores are
    reported as oversubscribed."""
    recipe = write_recipe(
        tmp_path / "r.yaml", backend={"kind": "emulated", "bandwidth": "1gbit"}, args={}
    )
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((out / "summary.json").read_text())
    expected = [list(c) for c in emulated_placement(2, None).node_cpus]
    assert summary["placement"]["node_cpus"] == expected
    assert "cores " + " | ".join(",".join(map(str, c)) for c in expected) in res.stdout
    for rank in range(2):
        log = (out / summary["variants"][0]["label"] / f"rank{rank}.log").read_text()
        assert f"affinity {expected[rank]}" in log
    cores = len(os.sched_getaffinity(0))
    over = write_recipe(
        tmp_path / "over.yaml",
        world={"processes": cores + 1},
        backend={"kind": "emulated", "bandwidth": "1gbit", "cpus_per_node": 1},
        args={},
    )
    res = run_cli("launch", str(over), "--out", str(tmp_path / "over"), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "over" / "summary.json").read_text())
    notice = f"oversubscribed: {cores + 1} nodes on {cores} cores"
    assert summary["oversubscribed"] == notice and notice in res.stdout
