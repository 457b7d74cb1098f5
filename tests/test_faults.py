"""Restarts from checkpoint and injected faults (issue 28; docs/faults.md).

- a kill and restart on local 2x1 resumes to the uninterrupted run's exact parameters (dense
  and a compressor with error feedback);
- a checkpoint torn by a kill during its write is never taken for a complete one;
- bad ``faults:`` entries are refused with the field and the fix named;
- on the emulated cluster (root): a 3 s link drop is ridden out, a partition fails every rank
  with one short error naming its peer, and nothing stays behind; loss and delay need netem.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from jaxcomm_launcher.recipe import RecipeError, load_recipe
from launcher_helpers import run_cli, worker_pids, write_recipe

EMULATED = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the emulated backend needs root and iproute2",
)
# The emulated cluster of the fault runs: two nodes on 1 Gbit/s links.
EMULATED_1GBIT = {"kind": "emulated", "bandwidth": "1gbit"}


def _emulated_run(test):
    """Marks a launch on the emulated cluster: slow, up to 15 minutes, root and iproute2."""
    return pytest.mark.slow(pytest.mark.timeout(900)(EMULATED(test)))


def _has_netem() -> bool:
    """Whether this kernel can make a netem qdisc (probed in a scratch namespace)."""
    if os.geteuid() != 0 or shutil.which("tc") is None:
        return False
    ns = f"jcnetemprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode:
        return False
    try:
        cmd = ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        return subprocess.run(cmd, capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# --------------------------------------------------------------------------------------------
# Recipe errors


def _load(tmp_path: pathlib.Path, **fields) -> None:
    load_recipe(write_recipe(tmp_path / "r.yaml", **fields))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"faults": [{"kind": "flood", "node": 1, "at_s": 1}]}, ["faults[0].kind", "link_down"]),
        ({"faults": [{"kind": "kill", "node": 1}]}, ["exactly one trigger", "at_s"]),
        (
            {"faults": [{"kind": "kill", "node": 1, "at_s": 1, "at_step": 3}]},
            ["exactly one trigger"],
        ),
        (
            {"backend": "emulated", "faults": [{"kind": "link_down", "node": 1, "at_s": 1}]},
            ["link_down needs seconds", "seconds: 5"],
        ),
        ({"faults": [{"kind": "kill", "node": 2, "at_s": 1}]}, ["node 2 does not exist", "0..1"]),
        (
            {"faults": [{"kind": "link_down", "node": 1, "at_s": 1, "seconds": 3}]},
            ["only the emulated backend", "backend: emulated"],
        ),
        (
            {
                "backend": "emulated",
                "faults": [{"kind": "partition", "groups": [[0, 1], []], "at_s": 1, "seconds": 9}],
            },
            ["two non-empty lists"],
        ),
        (
            {
                "backend": "emulated",
                "faults": [{"kind": "link_down", "node": 1, "at_s": 1, "seconds": 3, "percent": 2}],
            },
            ["link_down does not take percent"],
        ),
        ({"faults": [{"kind": "kill", "node": 1, "at_s": 1, "when": 3}]}, ["when: unknown key"]),
        (
            {
                "backend": "emulated",
                "faults": [{"kind": "bandwidth", "node": 0, "at_s": 1, "bandwidth": "fast"}],
            },
            ["faults[0].bandwidth", "tc rate"],
        ),
        ({"max_restarts": -1}, ["max_restarts", ">= 0"]),
    ],
)
def test_bad_fault_entries_are_refused_by_name(tmp_path, fields, words):
    with pytest.raises(RecipeError) as err:
        _load(tmp_path, **fields)
    message = str(err.value)
    for word in words:
        assert word in message, message


def test_good_fault_entries_load_and_describe_themselves(tmp_path):
    path = write_recipe(
        tmp_path / "r.yaml",
        backend="emulated",
        max_restarts=2,
        faults=[
            {"kind": "link_down", "node": 1, "at_s": 30, "seconds": 5},
            {
                "kind": "delay",
                "node": 0,
                "at_step": 9,
                "seconds": 5,
                "delay_ms": 20,
                "jitter_ms": 5,
            },
            {"kind": "partition", "groups": [[0], [1]], "at_s": 1, "seconds": 9},
            {"kind": "straggler", "node": 0, "at_s": 1, "seconds": 9, "cpu": 0.5},
        ],
    )
    recipe = load_recipe(path)
    assert recipe.max_restarts == 2
    assert [f.describe() for f in recipe.faults] == [
        "link_down node 1 for 5 s",
        "delay node 0 +20 ms ±5 ms for 5 s",
        "partition groups [[0], [1]] for 9 s",
        "straggler node 0 at 0.5 CPU for 9 s",
    ]


def test_max_restarts_option_and_faults_show_in_the_dry_run(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        backend="emulated",
        faults=[{"kind": "link_down", "node": 1, "at_step": 30, "seconds": 3}],
    )
    res = run_cli(
        "launch", str(recipe), "--dry-run", "--max-restarts", "2", cwd=tmp_path, timeout=1800
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "# restarts: up to 2" in res.stdout
    assert "# fault at step 30: link_down node 1 for 3 s" in res.stdout
    # On Slurm the option becomes the script's restart loop.
    res = run_cli(
        "launch",
        str(recipe),
        "--dry-run",
        "--max-restarts",
        "2",
        "--set",
        "backend.kind=slurm",
        "--set",
        "faults=[]",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "until step" in res.stdout and '"$attempt" -ge 2' in res.stdout
    res = run_cli(
        "launch", str(recipe), "--dry-run", "--max-restarts", "-1", cwd=tmp_path, timeout=1800
    )
    assert res.returncode != 0 and "max-restarts" in (res.stdout + res.stderr)


# --------------------------------------------------------------------------------------------
# Atomic checkpoints

_TORN_WRITER = textwrap.dedent(
    """
    import sys, time
    import jax, numpy as np
    from jaxcomm import checkpoints

    directory = sys.argv[1]
    small = {"w": jax.numpy.arange(1000, dtype=jax.numpy.float32)}
    checkpoints.save(directory, 10, small, {"seconds": 1.0})
    real = checkpoints.save_state

    def save_then_hang(path, tree):
        print("writing", flush=True)
        real(path, tree)
        print("written", flush=True)
        time.sleep(600)  # killed here at the latest: before the commit (rename)

    checkpoints.save_state = save_then_hang
    big = {"w": jax.numpy.ones((4 << 20,), jax.numpy.float32)}
    checkpoints.save(directory, 20, big, {"seconds": 2.0})
    """
)


def test_checkpoint_torn_by_a_kill_is_ignored_and_removed(tmp_path):
    from jaxcomm import checkpoints

    directory = tmp_path / "ckpt"
    script = tmp_path / "writer.py"
    script.write_text(_TORN_WRITER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(directory)], stdout=subprocess.PIPE, text=True
    )
    try:
        # Kill as soon as the second write has begun (event-ordered: no sleeps). Wherever
        # the kill lands, inside Orbax's write or before the rename, step 20 is not complete.
        for line in proc.stdout:
            if line.strip() == "writing":
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert checkpoints.latest(directory) == 10

    import jax
    import numpy as np

    like = {"w": jax.numpy.zeros(1000, jax.numpy.float32)}
    tree, loop = checkpoints.restore(directory, 10, like)
    assert np.asarray(tree["w"]).tobytes() == np.arange(1000, dtype=np.float32).tobytes()
    assert loop == {"seconds": 1.0, "step": 10}
    checkpoints.prune(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000010"]


# --------------------------------------------------------------------------------------------
# Kill and restart, local 2x1


def _digits_recipe(path: pathlib.Path, algorithm: str, **fields) -> pathlib.Path:
    data = {
        "name": "r",
        "job": "digits",
        "world": {"processes": 2, "devices_per_process": 1},
        "jaxcomm": {"algorithm": algorithm},
        "train": {"steps": 200, "batch_size": 64, "eval_every": 50},
        "metrics": {"plots": False},
        "timeout": 1500,
    }
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    import yaml

    path.write_text(yaml.safe_dump(data))
    return path


def _result(run: pathlib.Path) -> dict:
    (path,) = run.glob("*/digits-mlp-*.json")
    return json.loads(path.read_text())


def _launch(
    recipe: pathlib.Path, out: pathlib.Path, *options: str, returncode: int = 0
) -> subprocess.CompletedProcess:
    """``jaxcomm launch RECIPE --out OUT -q OPTIONS`` in the recipe's folder, which must exit
    with ``returncode``."""
    res = run_cli(
        "launch", str(recipe), "--out", str(out), "-q", *options, cwd=recipe.parent, timeout=1800
    )
    assert res.returncode == returncode, res.stdout + res.stderr
    return res


def _timeline(out: pathlib.Path) -> list[dict]:
    """The events of the run's one entry, ``dense``."""
    return [json.loads(line) for line in (out / "dense" / "timeline.jsonl").open()]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two launches; generous for a loaded machine
@pytest.mark.parametrize("algorithm", ["dense", "onebit"])
def test_kill_and_restart_resumes_bit_identically(tmp_path, algorithm):
    pytest.importorskip("sklearn")
    plain = _digits_recipe(tmp_path / "plain.yaml", algorithm)
    _launch(plain, tmp_path / "plain")

    every = 20
    killed = _digits_recipe(
        tmp_path / "kill.yaml",
        algorithm,
        train={"checkpoint_every": every},
        faults=[{"kind": "kill", "node": 1, "at_step": 50}],
    )
    out = tmp_path / "kill"
    res = _launch(killed, out, "--max-restarts", "1")
    assert "restart 1/1" in res.stdout

    summary = json.loads((out / "summary.json").read_text())
    (variant,) = summary["variants"]
    (restart,) = variant["restarts"]
    assert "rank 1" in restart["cause"] and "SIGKILL" in restart["cause"]
    assert restart["resumed_from"] > 0 and restart["resumed_from"] % every == 0
    # Lost: the steps since the checkpoint, plus at most the two queued ahead (max_in_flight).
    assert 0 <= restart["steps_lost"] <= every + 2
    assert variant["steps"] == 200 and variant["status"] == "ok"

    # The resumed run took exactly the uninterrupted run's steps: same bits.
    a, b = _result(tmp_path / "plain"), _result(out)
    assert b["resumed_from"] == restart["resumed_from"]
    assert a["params_sha256"] == b["params_sha256"]
    assert a["test_accuracy"] == b["test_accuracy"] and a["train_loss"] == b["train_loss"]

    events = [
        json.loads(line)["event"] for line in (out / variant["label"] / "timeline.jsonl").open()
    ]
    assert events.index("fault_applied") < events.index("attempt_failed") < events.index("restart")
    assert events[-1] == "attempt_ok" and events.count("attempt_start") == 2
    assert not worker_pids(str(out))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_failure_without_restarts_left_ends_the_run(tmp_path):
    pytest.importorskip("sklearn")
    recipe = _digits_recipe(
        tmp_path / "r.yaml",
        "dense",
        max_restarts=0,
        faults=[{"kind": "kill", "node": 0, "at_step": 30}],
    )
    res = _launch(recipe, tmp_path / "run", returncode=1)
    assert "rank 0" in res.stderr and "SIGKILL" in res.stderr
    assert not worker_pids(str(tmp_path / "run"))


# --------------------------------------------------------------------------------------------
# Emulated cluster


def _left_behind(run_dir: pathlib.Path) -> list[str]:
    """This run's namespaces and links that still exist (other runs on the machine may own
    namespaces of their own: only this run's names, from its set-up log, count)."""
    setup = (run_dir / "emulated-setup.log").read_text()
    (run_id,) = set(re.findall(r"ip link add jcb([0-9a-f]+) type bridge", setup))
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line for line in (names + links).splitlines() if run_id in line]


def _emulated_recipe(tmp_path: pathlib.Path, **fields) -> pathlib.Path:
    """``<tmp_path>/r.yaml``: the smoke job on the emulated cluster, with `fields`."""
    return write_recipe(tmp_path / "r.yaml", backend=EMULATED_1GBIT, **fields)


def _ride_out(tmp_path: pathlib.Path, fault: dict) -> pathlib.Path:
    """Trains digits (dense) on the emulated cluster through `fault`, which the run must ride
    out (exit 0); returns the run directory."""
    pytest.importorskip("sklearn")
    recipe = _digits_recipe(tmp_path / "r.yaml", "dense", backend=EMULATED_1GBIT, faults=[fault])
    out = tmp_path / "run"
    _launch(recipe, out)
    return out


@_emulated_run
def test_emulated_three_second_link_drop_is_ridden_out(tmp_path):
    out = _ride_out(tmp_path, {"kind": "link_down", "node": 1, "at_step": 50, "seconds": 3})
    events = _timeline(out)
    names = [e["event"] for e in events]
    assert names.count("attempt_start") == 1 and "attempt_failed" not in names
    applied = names.index("fault_applied")
    assert applied < names.index("fault_reverted") < names.index("attempt_ok")
    assert events[applied]["steps"] < 200  # the link really went down mid-run
    assert not _left_behind(out)


@_emulated_run
def test_emulated_partition_fails_every_rank_with_one_short_error(tmp_path):
    recipe = _emulated_recipe(
        tmp_path,
        train={"steps": 1000000},
        env={"JAXCOMM_TIMEOUT_S": "5"},
        faults=[{"kind": "partition", "groups": [[0], [1]], "at_step": 20, "seconds": 600}],
        timeout=300,
    )
    out = tmp_path / "run"
    _launch(recipe, out, returncode=1)
    # Each rank wrote one short error naming the peer it lost.
    for rank, peer in ((0, 1), (1, 0)):
        status = json.loads((out / "dense" / f"rank{rank}.status.json").read_text())
        assert not status["ok"]
        error = status["error"]
        assert f"rank {peer}" in error and len(error.splitlines()) == 1 and len(error) < 400
    events = [e["event"] for e in _timeline(out)]
    assert events.index("fault_applied") < events.index("attempt_failed")
    assert "fault_reverted" in events  # healed when the run ended
    assert not _left_behind(out)
    assert not worker_pids(str(out))


@_emulated_run
@pytest.mark.skipif(not _has_netem(), reason="this kernel has no netem qdisc (sch_netem)")
def test_emulated_one_percent_loss_is_ridden_out(tmp_path):
    _ride_out(tmp_path, {"kind": "loss", "node": 1, "at_step": 50, "seconds": 5, "percent": 1})


@EMULATED
@pytest.mark.skipif(_has_netem(), reason="this kernel has netem: nothing to refuse")
def test_loss_and_delay_are_refused_without_netem(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        backend="emulated",
        faults=[{"kind": "delay", "node": 1, "at_s": 1, "seconds": 5, "delay_ms": 20}],
    )
    res = run_cli("launch", str(recipe), "--out", str(tmp_path / "run"), cwd=tmp_path, timeout=1800)
    assert res.returncode == 1
    assert "netem" in res.stderr and "CONFIG_NET_SCH_NETEM" in res.stderr
    assert not list((tmp_path / "run").rglob("rank*.log"))  # refused before any rank started
    assert not _left_behind(tmp_path / "run")


# --------------------------------------------------------------------------------------------
# Restarts of the other supervised backends, and the remaining kinds


def _smoke_failing_once(path: pathlib.Path, **fields) -> pathlib.Path:
    return write_recipe(
        path,
        train={"steps": 8},
        max_restarts=1,
        args={"fail_rank": 1, "fail_at_step": 3, "fail_once": True},
        **fields,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["local", "mpirun"])
def test_a_failed_rank_is_restarted(tmp_path, backend):
    if backend == "mpirun" and shutil.which("mpirun") is None:
        pytest.skip("OpenMPI's mpirun is not installed")
    recipe = _smoke_failing_once(tmp_path / "r.yaml", backend=backend)
    out = tmp_path / "run"
    _launch(recipe, out)
    (variant,) = json.loads((out / "summary.json").read_text())["variants"]
    (restart,) = variant["restarts"]
    assert restart["failed_rank"] == 1 and "failed on purpose" in restart["cause"]
    assert variant["status"] == "ok" and variant["steps"] == 8
    # Each rank's metrics hold every step once: the failed attempt's went aside.
    for rank in (0, 1):
        steps = [json.loads(x)["step"] for x in (out / "dense" / f"rank{rank}.jsonl").open()]
        assert steps == list(range(8))
    assert not worker_pids(str(out))


@_emulated_run
def test_emulated_bandwidth_and_straggler_are_applied_and_reverted(tmp_path):
    recipe = _emulated_recipe(
        tmp_path,
        train={"steps": 400},
        args={"sleep_s": 0.01},
        faults=[
            {"kind": "bandwidth", "node": 1, "at_step": 20, "seconds": 1, "bandwidth": "10mbit"},
            {"kind": "straggler", "node": 0, "at_step": 60, "seconds": 1, "cpu": 0.5},
        ],
    )
    out = tmp_path / "run"
    _launch(recipe, out)
    events = _timeline(out)
    for fault in (0, 1):
        mine = [e["event"] for e in events if e.get("fault") == fault]
        assert mine == ["fault_applied", "fault_reverted"], events
    (variant,) = json.loads((out / "summary.json").read_text())["variants"]
    assert [f["kind"] for f in variant["faults"]] == ["bandwidth", "straggler"]
    assert not _left_behind(out)
