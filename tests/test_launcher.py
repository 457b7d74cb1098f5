"""Launcher end to end with the local backend: runs, artifacts, bad recipes, faults."""

from __future__ import annotations

import json
import signal
import time

import pytest
from launcher_helpers import (
    ROOT,
    launch_bundled,
    run_cli,
    start_launch,
    worker_pids,
    write_recipe,
)

from jaxcomm import cost


@pytest.mark.parametrize("processes", [2, 4])
def test_local_launch_writes_metrics_summary_and_plots(tmp_path, processes):
    recipe = write_recipe(tmp_path / "r.yaml", world={"processes": processes})
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    # What jaxcomm.metrics() measured for each step of the smoke job's dense allreduce of
    # 4096 float32 per rank. The local backend's ranks share a host and the vector is small
    # (16 KiB), so the allreduce takes the one-shot shared-memory path: every peer reads all of
    # a rank's vector (its notices go through shared memory and count nothing).
    oneshot = (processes - 1) * 4096 * 4
    for rank in range(processes):
        want = cost.bytes_sent("dense", 4096, cost.World(processes), rank=rank)
        assert want == oneshot
        lines = (out / "dense" / f"rank{rank}.jsonl").read_text().splitlines()
        assert len(lines) == 3
        for step, line in enumerate(lines):
            rec = json.loads(line)
            assert rec["rank"] == rank and rec["step"] == step
            assert rec["bytes_sent"] == rec["bytes_received"] == want, rec
            assert rec["compression_ratio"] == 1.0  # dense: what it sent is the dense volume
            assert 0 < rec["collective_time_s"], rec
        assert f"[r{rank}]" in res.stdout  # rank-prefixed log streaming
    summary = json.loads((out / "summary.json").read_text())
    assert summary["variants"][0]["status"] == "ok"
    assert summary["variants"][0]["ranks_reporting"] == processes
    assert (out / "step_time.png").stat().st_size > 1000
    assert not worker_pids(str(out))


def test_report_redraws(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    out = tmp_path / "run"
    assert run_cli("launch", str(recipe), "--out", str(out), "-q", cwd=tmp_path).returncode == 0
    (out / "summary.json").unlink()
    (out / "step_time.png").unlink()
    res = run_cli("report", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (out / "summary.json").exists() and (out / "step_time.png").exists()
    assert "dense" in res.stdout


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"wrold": {"processes": 2}}, ["wrold", "unknown key", "allowed:", "world"]),
        ({"world": {"processes": "two"}}, ["world.processes", "'two'"]),
        ({"world": {"processes": -1}}, ["world.processes", "-1", ">= 1"]),
        ({"job": None}, ["job"]),
        ({"backend": "cloud"}, ["backend", "local, emulated, mpirun, slurm"]),
        ({"jaxcomm": {"algorithm": "fast"}}, ["jaxcomm.algorithm", "'fast'", "'dense'"]),
        ({"sweep": [{"algorithm": "dense", "densty": 0.1}]}, ["sweep[0].densty", "unknown key"]),
        ({"sweep": [{"density": 0}]}, ["sweep[0].density", "> 0"]),
        ({"jaxcomm": {"steps_factor": {"gtopk": 0}}}, ["jaxcomm.steps_factor.gtopk", "> 0"]),
        ({"jaxcomm": {"steps_factor": {"psum": 2}}}, ["jaxcomm.steps_factor", "'psum'"]),
    ],
)
def test_bad_recipe_exits_2_naming_the_field(tmp_path, fields, expected):
    recipe = write_recipe(tmp_path / "r.yaml", **fields)
    if fields.get("job", "x") is None:  # a missing job, not a null one
        text = recipe.read_text().replace("job: null\n", "")
        recipe.write_text(text)
        expected = ["job", "required field is missing"]
    res = run_cli("launch", str(recipe), "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    for word in expected:
        assert word in res.stderr, (word, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "run").exists()


def test_bad_set_override_exits_2(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    res = run_cli("launch", str(recipe), "--set", "world.processes=0", cwd=tmp_path)
    assert res.returncode == 2 and "world.processes" in res.stderr
    res = run_cli("launch", str(recipe), "--set", "novalue", cwd=tmp_path)
    assert res.returncode == 2 and "dotted.key=value" in res.stderr


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failing_rank_stops_the_others_and_is_named(tmp_path, mode):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        world={"processes": 3},
        train={"steps": 400},
        args={"fail_rank": 1, "fail_at_step": 2, "fail_mode": mode, "sleep_s": 0.05},
    )
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rank 1 failed" in res.stderr
    assert "error: " in res.stderr and "[bold red]" not in res.stderr  # text, not markup
    # The others were stopped, not waited for (400 steps): none logged a step past the one
    # rank 1 never joined (an order of events, not a wall-clock bound).
    for rank in (0, 2):
        lines = [x for log in out.glob(f"*/rank{rank}.jsonl") for x in log.read_text().splitlines()]
        steps = [json.loads(line)["step"] for line in lines]
        assert all(step < 2 for step in steps), (rank, steps)
    if mode == "raise":
        assert "failed on purpose" in res.stderr  # its last log lines are shown
    else:
        assert "SIGKILL" in res.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["variants"][0]["failed_rank"] == 1
    assert not worker_pids(str(out))


def test_user_job_module_function_that_raises(tmp_path):
    (tmp_path / "myjobs").mkdir()
    (tmp_path / "myjobs" / "boom.py").write_text(
        "def train(ctx):\n"
        "    ctx.metrics.log(0, loss=1.0)\n"
        "    if ctx.rank == 1:\n"
        "        raise ValueError('bad batch on rank one')\n"
    )
    recipe = write_recipe(tmp_path / "r.yaml", job="boom:train", pythonpath=["myjobs"])
    res = run_cli("launch", str(recipe), "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert res.returncode == 1
    assert "rank 1" in res.stderr and "ValueError: bad batch on rank one" in res.stderr


def test_timeout_stops_every_rank(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", train={"steps": 10000}, args={"sleep_s": 0.1})
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), "--timeout", "8", cwd=tmp_path)
    assert res.returncode == 124, res.stdout + res.stderr
    assert "timeout" in res.stderr
    assert not worker_pids(str(out))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_rank(tmp_path, signum):
    recipe = write_recipe(tmp_path / "r.yaml", train={"steps": 10000}, args={"sleep_s": 0.1})
    out = tmp_path / "run"
    proc = start_launch(recipe, out, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out / "dense" / "rank1.jsonl").exists():
        time.sleep(0.2)
    assert len(worker_pids(str(out))) >= 2
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not worker_pids(str(out))
    run = json.loads((out / "run.json").read_text())
    assert run["variants"][0]["label"] == "dense"  # the run was saved on the way out


def test_gtopk_digits_run_sends_fewer_bytes_than_dense(tmp_path):
    out = launch_bundled(
        "digits-dense",
        tmp_path,
        "train.steps=30",
        "train.eval_every=10",
        "jaxcomm.algorithm=gtopk",
        "jaxcomm.density=0.01",
    )
    (result_file,) = out.rglob("digits-mlp-gtopk.json")
    result = json.loads(result_file.read_text())
    assert 0 < result["bytes_sent_per_step"] < result["dense_bytes_per_step"]
    assert result["test_accuracy"] > 0.5


def test_recipes_and_version(tmp_path):
    res = run_cli("recipes", cwd=tmp_path)
    assert res.returncode == 0
    for name in ("digits-dense", "digits-compare", "allreduce-sweep", "emulated-1gbit"):
        assert name in res.stdout
    res = run_cli("--version", cwd=tmp_path)
    assert res.returncode == 0 and "jaxcomm" in res.stdout


def test_a_sweep_entry_takes_every_jaxcomm_setting_as_declared_once():
    # JaxcommOverride is derived from JaxcommSettings: the same fields, descriptions and
    # constraints, each optional (None: not overridden).
    from jaxcomm_launcher.recipe import JaxcommOverride, JaxcommSettings, Recipe

    settings, override = JaxcommSettings.model_fields, JaxcommOverride.model_fields
    assert list(override) == list(settings)
    for name, info in override.items():
        assert info.default is None and info.description == settings[name].description, name
    assert JaxcommOverride().model_dump(exclude_none=True) == {}
    recipe = Recipe(name="x", job="digits", sweep=[{"compute_seconds": 0.5, "dense_steps": 3}])
    assert (recipe.variants()[0].compute_seconds, recipe.variants()[0].dense_steps) == (0.5, 3)
    for bad in ({"compute_seconds": -1.0}, {"dense_steps": 0}, {"steps_factor": {"gtopk": 0}}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            JaxcommOverride(**bad)


def test_bundled_recipes_validate():
    from jaxcomm_launcher.recipe import load_recipe

    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        recipe = load_recipe(path)
        assert recipe.name == path.stem


def test_digits_dense_short(tmp_path):
    out = launch_bundled("digits-dense", tmp_path, "train.steps=60", "train.eval_every=20")
    summary = json.loads((out / "summary.json").read_text())
    v = summary["variants"][0]
    assert v["final_test_accuracy"] > 0.7 and v["final_loss"] < 1.0
    assert (out / "loss.png").exists() and (out / "step_time.png").exists()


@pytest.mark.slow  # a launch per algorithm: CI runs it with `pytest -m slow`
def test_compare_sweep_runs_every_algorithm(tmp_path):
    out = launch_bundled(
        "digits-compare",
        tmp_path,
        "train.steps=10",
        "train.eval_every=5",
        "world.devices_per_process=1",
    )
    variants = json.loads((out / "summary.json").read_text())["variants"]
    statuses = {v["label"]: v["status"] for v in variants}
    assert set(statuses) >= {
        "psum",
        "dense",
        "gtopk-d0.01",
        "gtopk-d0.001",
        "topk_allgather-d0.01",
        "adaptive",
    }
    assert all(status == "ok" for status in statuses.values()), statuses
    # Training runs fill the table's collective time from jaxcomm.metrics(); psum has none.
    coll = {v["label"]: v["median_collective_time_s"] for v in variants}
    assert coll["psum"] is None
    assert all(t is not None and t > 0 for label, t in coll.items() if label != "psum"), coll


def test_overlap_job_records_times_and_a_timeline(tmp_path):
    """The overlap benchmark's job (benchmarks/overlap_job.py), tiny: every measurement is logged, and the timeline holds
    each bucket's collective (engine start <= finish) and every layer's gradient mark."""
    layers, width = 3, 32
    buckets = [width * width + width, 0]  # one layer per bucket, and one bucket
    recipe = write_recipe(
        tmp_path / "r.yaml",
        job="overlap_job:run",
        pythonpath=[str(ROOT / "benchmarks")],
        args={
            "layers": layers,
            "width": width,
            "batch": 4,
            "bucket_sizes": buckets,
            "in_flight_bucket": buckets[0],
            "max_in_flight": [0, 2],
            "repeats": 3,
        },
    )
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), "-q", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    records = [
        json.loads(line) for line in (out / "dense" / "rank0.jsonl").read_text().splitlines()
    ]
    times = [r for r in records if r["kind"] == "time"]
    assert sum(r["what"] == "compute" and r.get("algorithm") is None for r in times) == 3
    for algorithm in ("dense", "gtopk"):
        for bucket in buckets:
            # What the hidden fraction combines is timed in rounds of one step each.
            whats = ["compute", "forward", "comm", "step"]
            if bucket:
                whats.append("step_no_overlap")
            mine = [
                r["what"]
                for r in times
                if r.get("algorithm") == algorithm
                and r.get("bucket_size") == bucket
                and r["what"] != "paced"
            ]
            assert sorted(mine) == sorted(whats * 3), (algorithm, bucket)
            rounds = [mine[i : i + len(whats)] for i in range(0, len(mine), len(whats))]
            assert all(sorted(r) == sorted(whats) for r in rounds), rounds
            assert rounds[0][0] != rounds[1][0]  # the first of a round rotates
        paced = {
            r["max_in_flight"]
            for r in times
            if r["what"] == "paced" and r["algorithm"] == algorithm
        }
        assert paced == {0, 2}
    timelines = {
        (r["what"], r.get("algorithm")): r["timeline"] for r in records if r["kind"] == "timeline"
    }
    kinds = [("compute", None)] + [(w, c) for c in ("dense", "gtopk") for w in ("comm", "step")]
    assert set(timelines) == set(kinds)
    for (what, _), timeline in timelines.items():
        rank0 = timeline["0"]
        labels = {m["label"] for m in rank0["marks"]}
        if what != "comm":
            assert labels == {"start"} | {f"grad/l{i:02d}" for i in range(layers)}, labels
        collectives = rank0["collectives"]
        assert len(collectives) == (0 if what == "compute" else layers)
        assert all(c["started"] <= c["finished"] for c in collectives)


def test_the_run_log_says_each_learner_event_once():
    # print_auto's line per learner event (jaxcomm.metrics()["auto"]["learned"]), the safe arm
    # left out before it ran among them, with the seconds that ruled it out.
    from jaxcomm_launcher.jobs._common import print_auto

    class Log:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def print(self, *parts: object) -> None:
            self.lines.append(" ".join(map(str, parts)))

    ruled = {"step": 21, "arm": "blockquant", "seconds_per_step": 0.048, "cheapest": 0.0058}
    learned = [
        {"event": "arms", "step": 1, "arms": ["dense", "blockquant", "gtopk"], "prior_steps": 1.3},
        {"event": "skipped", "step": 1, "predicted_s": {"dense": 0.09}},
        {"event": "outpaced", **ruled, "arms": ["blockquant"]},
        {"event": "unbracketed", **ruled, "step": 60},
        {"event": "pruned", "step": 60, "arms": ["onebit"]},
        {"event": "decision", "step": 60, "choice": "gtopk",
         "seconds_per_dense_step": {"gtopk": 0.0145}},
        {"event": "timed", "step": 1, "seconds_per_step": {"dense": 0.09, "gtopk": 0.005},
         "seconds": 0.4},
        {"event": "decision", "step": 1, "choice": "gtopk", "prior": True, "explores_at": 900,
         "seconds_per_dense_step": {"dense": 0.09, "gtopk": 0.0142}},
    ]  # fmt: skip
    log = Log()
    print_auto(log, {"auto": {"learned": learned}}, "digits")
    assert len(log.lines) == len(learned)
    assert log.lines[0].endswith("from step 1, a compressor's prior 1.3x dense's steps")
    assert log.lines[2] == (
        "digits auto: step 21 runs no more trials without blockquant (48 ms a step against "
        "5.8 ms: it could not win)"
    )
    assert "step 60 closes the round without blockquant" in log.lines[3]
    assert log.lines[-3].endswith("-> gtopk (expected s per dense step: gtopk 14.5 ms)")
    assert log.lines[-2] == (
        "digits auto: timed each arm's step in 0.4 s before step 1: dense 90 ms, gtopk 5 ms"
    )
    assert log.lines[-1].endswith(
        "-> gtopk (on the prior, expected s per dense step: dense 90 ms, gtopk 14.2 ms; "
        "trials from step 900)"
    )
