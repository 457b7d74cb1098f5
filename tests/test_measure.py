"""auto without a profile measures the world it runs in (jaxcomm.cost.measure): its first
decision reads the measured link, every rank holds the same numbers and decides the same,
the decisions and measurements appear in jaxcomm.metrics() and the run's summary, a profile
from other hardware draws a one-line warning, and (emulated cluster, root) a 100 Mbit/s link
measures slower than a 1 Gbit/s one."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings

import pytest
from launcher_helpers import run_cli, write_recipe

from jaxcomm import cost

LINK = re.compile(r"digits auto: bucket of (\d+) elements -> (\w+) .*profile: (.*); link (\w+) "
                  r"alpha (\S+) s beta (\S+) s/B\)")  # fmt: skip


def _auto_run(tmp_path, backend="local", steps=3):
    """Trains the digits MLP with algorithm: auto and no profile on 2 processes; returns each
    rank's decisions (elements, choice, profile, link class, alpha, beta) and rank 0's result."""
    pytest.importorskip("sklearn")
    tmp_path.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(
        tmp_path / "auto.yaml",
        job="digits",
        world={"processes": 2, "devices_per_process": 1},
        backend=backend,
        jaxcomm={"algorithm": "auto"},
        train={"steps": steps, "eval_every": 10, "hidden": 256},
        timeout=600,
    )
    out = tmp_path / "run"
    done = run_cli("launch", str(recipe), "--out", str(out), "-q", cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = []
    for log in sorted(out.rglob("rank*.log")):
        found = [LINK.search(line) for line in log.read_text().splitlines()]
        ranks.append([m.groups() for m in found if m])
    (result,) = out.rglob("digits-mlp-auto.json")
    return ranks, json.loads(result.read_text())


@pytest.mark.slow  # two processes measure and train: CI runs it with `pytest -m slow`
def test_first_decision_reads_the_measured_link_the_same_on_every_rank(tmp_path):
    ranks, result = _auto_run(tmp_path)
    assert len(ranks) == 2 and ranks[0] and ranks[0] == ranks[1]  # same choices, same numbers
    elements, choice, source, link, alpha, beta = ranks[0][0]
    assert source.startswith("measured at start")
    measured = result["auto"]["measured"]["profile"]
    assert f"links.{link}" in measured["measured"]
    assert float(beta) == pytest.approx(measured["links"][link]["beta"], rel=1e-5)
    assert float(alpha) == pytest.approx(measured["links"][link]["alpha"], rel=1e-5, abs=1e-12)
    assert (float(alpha), float(beta)) != (
        cost.DEFAULT_PROFILE.links[link].alpha,
        cost.DEFAULT_PROFILE.links[link].beta,
    )
    # The run's summary holds the decisions and what they read, and the learner's arms.
    decisions = [d for d in result["auto"]["decisions"] if "choice" in d]
    assert decisions and all(d["profile"].startswith("measured at start") for d in decisions)
    assert result["auto"]["measured"]["seconds"]
    # The learner's start: its arms' programs compiled and timed, then its arms.
    events = [d["event"] for d in result["auto"]["learned"]]
    assert events[:3] == ["compiled", "timed", "arms"], events


def test_a_profile_from_other_hardware_is_warned_about_in_one_line():
    from jaxcomm.cost import measure

    here = measure.hardware()
    other = cost.Profile.from_json(
        {**cost.DEFAULT_PROFILE.to_json(), "source": "probe on a GPU box",
         "hardware": {**here, "platform": "gpu", "device_kind": "NVIDIA H100"}}
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measure.check_hardware(other)
        measure.check_hardware(other)  # once per profile
        same = dataclasses.replace(other, hardware=here, source="probe here")
        measure.check_hardware(same)  # this run's hardware: nothing to say
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "\n" not in text and "other hardware" in text and "NVIDIA H100" in text


@pytest.mark.parametrize("agreed, calls", [(1.0, 3 + 2), (0.0, 6 + 2)])
def test_the_timer_stops_early_on_the_ranks_mean_not_its_own_clock(monkeypatch, agreed, calls):
    # Each rank timing on its own clock stopped after a different number of calls, and the
    # ranks then sat in different collectives until the deadline. The stop reads the mean
    # over the ranks (faked here: long on every rank, or short), whatever this rank measured.
    from jaxcomm.cost import timing

    monkeypatch.setattr(timing, "agree", lambda times: {"t": agreed})
    timer = timing.Timer.__new__(timing.Timer)
    timer.ranks, timer._barrier = 2, lambda: None
    ran = []
    timer(lambda: ran.append(1), repeats=6)  # two untimed calls, then the timed ones
    assert len(ran) == calls


def test_profile_keeps_its_hardware_through_json(tmp_path):
    profile = cost.Profile.from_json(
        {**cost.DEFAULT_PROFILE.to_json(), "hardware": {"platform": "cpu", "device_kind": "cpu"}}
    )
    path = tmp_path / "p.json"
    profile.save(path)
    assert cost.Profile.load(path).hardware == {"platform": "cpu", "device_kind": "cpu"}


EMULATED = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the emulated backend needs root and iproute2",
)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@EMULATED
def test_a_100mbit_world_measures_slower_than_a_1gbit_one(tmp_path):
    betas = {}
    for rate in ("100mbit", "1gbit"):
        backend = {"kind": "emulated", "bandwidth": rate, "burst": "128kb", "ucx_tls": "tcp"}
        ranks, _ = _auto_run(tmp_path / rate, backend=backend, steps=2)
        assert ranks[0] == ranks[1]
        _, _, source, link, _, beta = ranks[0][0]
        assert source.startswith("measured at start") and link == "across_hosts"
        betas[rate] = float(beta)
    # Ten times the bandwidth: the measured seconds per byte differ by far more than noise.
    assert betas["100mbit"] > 3 * betas["1gbit"], betas


@pytest.mark.slow
def test_every_rank_learns_the_same(tmp_path):
    # A profile of a slow link makes the model propose compressors, so the run tries them in
    # windows and decides; each rank logs its trials and decision, which must agree.
    pytest.importorskip("sklearn")
    link = cost.Link(1e-4, 8e-8)
    slow = cost.Profile(
        links={c: link for c in cost.LINK_CLASSES},
        gamma=dict(cost.DEFAULT_PROFILE.gamma),
        psum=link,
        source="a slow link",
    )
    slow.save(tmp_path / "slow.json")
    recipe = write_recipe(
        tmp_path / "learn.yaml",
        job="digits",
        world={"processes": 2, "devices_per_process": 1},
        jaxcomm={"algorithm": "auto", "profile": str(tmp_path / "slow.json")},
        train={"steps": 3000, "eval_every": 500, "hidden": 256},
    )
    out = tmp_path / "run"
    done = run_cli("launch", str(recipe), "--out", str(out), "-q", cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logs = []
    for log in sorted(out.rglob("rank*.log")):
        lines = log.read_text().splitlines()
        logs.append(
            [
                ln.split("auto:", 1)[1]
                for ln in lines
                if any(f"auto: {word}" in ln for word in ("trials", "step", "compiled", "timed"))
            ]
        )
    # The same timed steps, windows and decisions, and the same compile seconds: the ranks
    # agree on them, which makes the faster compiler wait there, not in its first timed step.
    assert len(logs) == 2 and logs[0] == logs[1]
    compiles = [line for line in logs[0] if line.startswith(" compiled the programs of ")]
    timings = [line for line in logs[0] if line.startswith(" timed each arm's step in ")]
    trials = [line for line in logs[0] if line not in compiles + timings]
    assert len(compiles) == 1 and len(timings) == 1, logs[0]
    # The prior decides at once on the arms' timed steps; the trials open once a round of
    # them is cheap beside the run so far. (A trial cut short, when one is, is logged before
    # the decision, alike on both ranks.)
    assert trials[0].startswith(" trials of dense, ")
    assert " -> " in trials[1] and "on the prior" in trials[1], trials
    (result,) = out.rglob("digits-mlp-auto.json")
    run = json.loads(result.read_text())
    learned = run["auto"]["learned"]
    (timed,) = [d for d in learned if d["event"] == "timed"]
    prior = next(d for d in learned if d["event"] == "decision")
    assert prior["prior"] and prior["seconds_per_step"] == timed["seconds_per_step"]
    windows = [d for d in learned if d["event"] == "window"]
    assert windows and windows[0]["first_step"] == prior["explores_at"], learned
    assert len({w["arm"] for w in windows}) >= 2
    # A decision on the windows closes the first round (a re-check's windows may follow it
    # before the run ends, sooner when a trial was cut short).
    measured = [d for d in learned if d["event"] == "decision" and not d.get("prior")]
    assert measured and measured[0]["step"] > windows[0]["last_step"], learned
    # Every arm runs its own program: dense's (the first step), then each proposed arm's,
    # compiled before the trials.
    (compiled,) = [d for d in learned if d["event"] == "compiled"]
    assert {w["arm"] for w in windows} <= {"dense", *compiled["arms"]}
    assert run["compilations"] == 1 + len(compiled["arms"]), (run["compilations"], learned)
