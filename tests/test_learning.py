"""auto learns what each compressor costs in steps from the run (jaxcomm.cost.learn,
jaxcomm.learning): the learner's schedule and decisions, the guard that keeps dense unless a
compressor beats it, identical decisions from identical inputs, and error feedback conserved
across every switch between the arms' programs (tests/learning_worker.py, 2 CPU devices)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics

import pytest
from collectives_harness import run_script

from jaxcomm.cost import DEFAULT_PROFILE, Link, Options, World, learn

HERE = pathlib.Path(__file__).resolve().parent


def _explored(
    decrease: dict[str, float],
    seconds: dict[str, float],
    window: int = 10,
    first: int = 0,
    **more,
) -> learn.Learner:
    """A learner over the arms of `decrease` (in its order), ``Learning(window, **more)``,
    after every planned window of its first exploration (:func:`_run_windows`)."""
    learner = learn.Learner(list(decrease), learn.Learning(window=window, **more), first=first)
    _run_windows(learner, 0, decrease, seconds)
    assert learner.chosen is not None
    return learner


def _close(
    learner: learn.Learner,
    step: int,
    per_step: float,
    seconds: float = 1.0,
    error: float = 0.0,
    flushed: float | None = None,
) -> int:
    """Closes the window that opens at `step`: its arm's steps lowered the probe `per_step`
    each (± `error`), its flush steps `flushed` each (None: as much), at `seconds` a step of
    its arm; returns the step after it."""
    first, last, _ = learner.window_at(step)
    assert first == step
    begin = next(s for s in range(first, last + 1) if learner.probe_before(s))
    tail = next((last + 1 - s for s in range(begin, last + 1) if learner.flush_at(s)), 0)
    own = last - begin + 1 - tail
    decrease = per_step * own + (per_step if flushed is None else flushed) * tail
    learner.close(last, decrease, error * (own + tail), seconds * own)
    return last + 1


def _run_windows(
    learner: learn.Learner, step: int, decrease: dict[str, float], seconds: dict[str, float]
) -> int:
    """Runs the learner's windows from `step` while one opens there, and returns the step
    after them: each arm's loss falls ``decrease[arm]`` per step (its flush's, its flusher's),
    on top of a trend that slows down over training, at ``seconds[arm]`` per step."""
    while learner.window_start(step):
        first, last, name = learner.window_at(step)
        trend = statistics.fmean(0.005 / (1 + s / 100) for s in range(first, last + 1))
        flusher = learner.arms[learner.arm_at(last)]
        flushed = decrease.get(flusher, decrease[name]) + trend
        step = _close(learner, step, decrease[name] + trend, seconds[name], flushed=flushed)
    return step


def _round_order(learner: learn.Learner) -> list[str]:
    """The arms of the learner's windows from step 0 while one opens, each closed on a flat
    probe at a second a step."""
    step, order = 0, []
    while learner.window_start(step):
        order.append(learner.window_at(step)[2])
        step = _close(learner, step, 0.0)
    return order


def _last(event: str) -> dict:
    """The learners' latest record of `event` ("decision", "pruned", ...)."""
    return [d for d in learn.decisions() if d["event"] == event][-1]


def test_learner_picks_the_fastest_loss_per_second():
    # gTop-k: 80 % of dense's decrease per step at 40 % of its seconds.
    decrease = {"dense": 0.01, "gtopk": 0.008, "onebit": 0.002}
    seconds = {"dense": 0.5, "gtopk": 0.2, "onebit": 0.2}
    learner = _explored(decrease, seconds, rounds=2)
    assert learner.chosen == "gtopk"
    decision = _last("decision")
    assert decision["choice"] == "gtopk"
    # The steps factor: dense's decrease per step over gTop-k's, each with the training's own
    # mean decrease over the six windows (0.005 / (1 + s / 100) over steps 0-59).
    trend = sum(0.005 / (1 + s / 100) for s in range(60)) / 60
    expected = (0.01 + trend) / (0.008 + trend)
    assert decision["steps_factor"]["gtopk"] == pytest.approx(expected, rel=0.02)
    assert decision["seconds_per_step"]["dense"] == pytest.approx(0.5)
    # After the decision the chosen arm runs until the re-check, which tries every arm again;
    # a switch to a sparse arm is confirmed sooner than the usual re-check.
    after = decision["step"]
    assert learner.arm_at(after) == learner.arms.index("gtopk")
    recheck = after + learner.learning.confirm
    assert learner.learning.confirm < learner.learning.recheck_every
    assert learner.arm_at(recheck - 1) == learner.arms.index("gtopk")
    tried = len(learner.windows)
    _run_windows(learner, recheck, decrease, seconds)
    assert {w["arm"] for w in learner.windows[tried:]} == set(decrease)


def test_an_arm_too_slow_per_step_to_win_runs_no_second_round():
    # Dense at ten times gTop-k's seconds per step (a slow link): even credited with the best
    # decrease per step of the first round it cannot win, so the second round leaves it out.
    # In the first it opens and closes the round (the only safe arm brackets the others); its
    # closing window, measured dear, is half a window (as many seconds would be one step);
    # each compressor's window ends with dense's 4-step flush.
    decrease = {"dense": 0.01, "gtopk": 0.008, "onebit": 0.004}
    seconds = {"dense": 1.0, "gtopk": 0.1, "onebit": 0.1}
    learner = _explored(decrease, seconds, rounds=2)
    assert learner.chosen == "gtopk"
    spans = [(w["arm"], w["last_step"] - w["first_step"] + 1) for w in learner.windows]
    assert spans[:4] == [("dense", 10), ("gtopk", 14), ("onebit", 14), ("dense", 5)]
    assert [a for a, _ in spans].count("dense") == 2
    pruned = _last("pruned")
    assert pruned["arms"] == ["dense"] and pruned["step"] == 43
    # The decision's measurements prune the re-check too: it tries the compressors only,
    # dense still flushing (first what the decided gTop-k held back, then each window).
    recheck = learner.learning.confirm + _last("decision")["step"]
    tried = len(learner.windows)
    assert _run_windows(learner, recheck, decrease, seconds) == recheck + 4 + 14 + 14
    assert {w["arm"] for w in learner.windows[tried:]} == {"gtopk", "onebit"}


def test_a_switch_to_a_sparse_arm_is_confirmed_sooner_than_a_recheck():
    learning = learn.Learning(window=4, confirm=50, recheck_every=400)
    learner = learn.Learner(["dense", "gtopk"], learning)

    def round_from(step: int) -> int:  # dense, gtopk, dense: gTop-k twice as fast per second
        for arm, decrease in [("dense", 0.1), ("gtopk", 0.2), ("dense", 0.1)]:
            assert learner.window_start(step) and learner.window_at(step)[2] == arm
            step = _close(learner, step, decrease)
        return step

    end = round_from(0)
    assert learner.chosen == "gtopk" and learner.window_start(end + 50)
    end = round_from(end + 50)  # the confirmation: gTop-k stays, then a usual re-check
    assert learner.chosen == "gtopk" and not learner.window_start(end + 50)
    assert learner.window_start(end + 400)


def test_every_lossy_window_starts_and_ends_with_an_empty_residual():
    # A lossy window's last step runs the round's opening safe arm, which sends what the
    # window held back, and the probe is read after it: no window inherits another's
    # residual. A re-check after a lossy decision first flushes it the same way, before its
    # opening window is read.
    learning = learn.Learning(window=4, confirm=50, flush=2)
    learner = learn.Learner(["dense", "gtopk", "onebit"], learning)
    arms, step = [], 0
    while learner.window_start(step):
        first, last, name = learner.window_at(step)
        arms.append([learner.arms[learner.arm_at(s)] for s in range(first, last + 1)])
        step = _close(learner, step, {"dense": 0.1, "gtopk": 0.3, "onebit": 0.2}[name])
    assert arms == [["dense"] * 4, ["gtopk"] * 4 + ["dense"] * 2,
                    ["onebit"] * 4 + ["dense"] * 2, ["dense"] * 4]  # fmt: skip
    assert learner.chosen == "gtopk"
    recheck = step + 50
    first, last, name = learner.window_at(recheck)
    assert (first, name) == (recheck, "dense") and learner.arm_at(recheck) == 0
    assert not learner.probe_before(recheck + 1) and learner.probe_before(recheck + 2)
    assert [w["flushes"] for w in learner.windows] == [0, 2, 2, 0]


@pytest.mark.parametrize("noise, kept", [(0.1, True), (0.0, False)])
def test_a_recheck_overturns_a_decision_only_beyond_the_noise(noise, kept):
    # gTop-k is decided on clean windows; in the confirming round dense's loss falls faster.
    # Within twice the error of the difference (a noisy probe) the decision stays; on a
    # clean probe dense takes over.
    learner = learn.Learner(["dense", "gtopk"], learn.Learning(window=8, confirm=50))
    step = 0
    for decrease in (0.1, 0.2, 0.1):
        step = _close(learner, step, decrease)
    assert learner.chosen == "gtopk"
    step += 50
    for decrease in (0.1, 0.02, 0.1):
        step = _close(learner, step, decrease, error=noise)
    decision = _last("decision")
    assert decision["kept"] is kept
    assert learner.chosen == ("gtopk" if kept else "dense")


def test_learner_keeps_dense_unless_a_compressor_beats_it_by_the_margin():
    # gTop-k's loss falls 5 % faster per second: within the margin, dense stays.
    learner = _explored({"dense": 0.01, "gtopk": 0.0105}, {"dense": 1.0, "gtopk": 1.0}, margin=1.1)
    assert learner.chosen == "dense"


def test_learners_fed_the_same_windows_decide_the_same():
    made = []
    for _ in range(2):
        learner = _explored(
            {"dense": 0.01, "gtopk": 0.009, "adaptive": 0.0095},
            {"dense": 1.0, "gtopk": 0.5, "adaptive": 0.45},
            window=8,
        )
        made.append((learner.chosen, learner.windows))
    assert made[0] == made[1]


def test_trend_is_taken_out_of_the_comparison():
    # Two equal arms on a loss that slows down: the one that ran first would look better by
    # its raw mean; the fit says they are equal.
    ws = []
    for i, arm in enumerate(["A", "B", "B", "A", "A", "B"]):
        ws.append({"arm": arm, "first_step": 10 * i, "last_step": 10 * i + 9,
                   "loss_decrease_per_step": 1.0 - 0.1 * i})  # fmt: skip
    fitted = learn.arm_decrease(ws, ["A", "B"])
    assert fitted["A"] == pytest.approx(fitted["B"])


def test_propose_offers_only_compressors_the_model_predicts_faster():
    slow = World(2, 1, "across_hosts")
    arms = learn.propose(
        [25_000_000], slow, DEFAULT_PROFILE, ("dense", "gtopk", "topk_allgather", "onebit")
    )
    # Every compressor predicted faster gets a trial: their priors come from other models.
    assert arms[0] == "dense" and sorted(arms[1:]) == ["gtopk", "onebit", "topk_allgather"]
    assert learn.propose([100], slow, DEFAULT_PROFILE, ("dense", "gtopk")) == ["dense"]
    one = learn.Learner(["dense"])  # nothing to compare: dense from the start, no window
    assert one.chosen == "dense" and not one.window_start(0)


def test_the_safe_compressor_is_proposed_and_the_safe_arms_bracket_the_others():
    # On a slow link the model predicts block int8 faster than dense and the sparse ones
    # faster still; ranked by prior time alone, block int8 lost its trial to them. It has a
    # place of its own. Dense opens (and warms up): within its error the model is not sure
    # that block int8 is faster on this run's devices, and a short run spends its whole
    # warm-up on the opening arm.
    slow = World(2, 1, "across_hosts")
    allowed = ("dense", "gtopk", "topk_allgather", "onebit", "blockquant")
    arms = learn.propose([25_000_000], slow, DEFAULT_PROFILE, allowed)
    assert arms[:2] == ["dense", "blockquant"] and len(arms) == 5
    first = learn.first_arm(arms)
    learner = learn.Learner(arms, learn.Learning(window=10), first=first)
    order = _round_order(learner)
    assert order == ["dense", *arms[2:], "blockquant"]  # the safe arms bracket the others
    # Where the model predicts dense far slower, dense runs no window: block int8 opens.
    assert learn.first_arm(arms, {"dense": 1.0}) == 1
    assert learn.first_arm(["dense", "gtopk"], {"dense": 1.0}) == 0


def test_dense_runs_no_window_when_the_model_predicts_it_far_slower_than_block_int8():
    # On a slow link block int8 sends half of dense's 16-bit bytes: the model predicts
    # dense's step slower by more than `dense_over`, the two need the same steps, so dense's
    # window (the dearest) is skipped and block int8 brackets the sparse arm alone.
    slow, wide = World(2, 1, "across_hosts"), Options(element_bytes=2)
    links = {**DEFAULT_PROFILE.links, "across_hosts": Link(2e-4, 8e-8)}  # 100 Mbit/s
    profile = dataclasses.replace(DEFAULT_PROFILE, links=links)
    arms = ["dense", "blockquant", "gtopk"]
    skip = learn.skipped(arms, [2_000_000], slow, profile, wide)
    assert list(skip) == ["dense"] and skip["dense"] > 0
    assert learn.skipped(["dense", "gtopk"], [2_000_000], slow, profile, wide) == {}
    first = learn.first_arm(arms, skip)
    learner = learn.Learner(arms, learn.Learning(window=10), first=first, skip=skip)
    assert _last("skipped")["predicted_s"] == skip
    # Block int8's second window: as many seconds as 10 of gTop-k's steps, but at least 5
    # (gTop-k's window is 10 steps and block int8's 4-step flush, centred at 16.5).
    at = (16.5 - 4.5) / (26.0 - 4.5)
    safe = 0.05 + (0.04 - 0.05) * at  # the safe decrease interpolated to gTop-k's window
    step = 0
    for arm, decrease, seconds, span in [("blockquant", 0.05, 0.2, (0, 9)),
                                         ("gtopk", 0.03, 0.04, (10, 23)),
                                         ("blockquant", 0.04, 0.2, (24, 28))]:  # fmt: skip
        assert learner.window_at(step) == (*span, arm)
        step = _close(learner, step, decrease, seconds, flushed=safe)
    decision = _last("decision")
    assert learner.chosen == "gtopk" and "dense" not in decision["seconds_per_step"]
    # Steps relative to the safe arms' decrease at gTop-k's time; its flush's steps count
    # as the safe arm's.
    assert decision["steps_factor"]["gtopk"] == pytest.approx(safe / 0.03, rel=0.01)


@pytest.mark.parametrize("block_seconds, chosen", [(0.25, "dense"), (0.1, "blockquant")])
def test_the_guard_is_the_safe_arm_fastest_per_step(block_seconds, chosen):
    # Block int8's window runs first, where the loss falls fastest; its prior is dense's
    # steps, so only the seconds of the two are compared, and gTop-k's loss must beat the
    # faster one's.
    learner = _explored(
        {"dense": 0.01, "blockquant": 0.01, "gtopk": 0.002},
        {"dense": 0.15, "blockquant": block_seconds, "gtopk": 0.5},
        first=1,
    )
    assert learner.chosen == chosen


def test_a_sparse_window_is_compared_with_the_safe_decrease_of_its_time():
    # The held-out MLP at 1 Gbit/s: block int8's window first (the loss still falling fast),
    # then TopK-allgather's, then dense's (the loss flattening). Against dense's late window
    # alone TopK-allgather looked 3x faster per second and was chosen; it needed several
    # times dense's steps. Against the safe arms' decrease at its time, dense stays.
    arms = ["dense", "blockquant", "topk_allgather"]
    learner = learn.Learner(arms, learn.Learning(window=10), first=1)
    step = 0
    for decrease, seconds in [(0.1456, 0.395), (0.0467, 0.321), (0.0137, 0.318)]:
        step = _close(learner, step, decrease, seconds)
    assert learner.chosen == "dense"


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="window"):
        learn.Learning(window=2)
    with pytest.raises(ValueError, match="arms"):
        learn.Learner(["dense", "dense"])
    with pytest.raises(ValueError, match="first"):
        learn.Learner(["dense", "gtopk"], first=2)
    with pytest.raises(ValueError, match="skip"):
        learn.Learner(["dense", "gtopk"], skip={"dense": 1.0})
    with pytest.raises(ValueError, match="dense_over"):
        learn.Learning(dense_over=0.5)


@pytest.mark.slow  # a 2-device training world: CI runs it with `pytest -m slow`
def test_error_feedback_is_conserved_across_switches():
    done = run_script(HERE / "learning_worker.py", timeout=300, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["count"] == out["steps"]  # one update per step, whatever the arm
    # Every rank: sum of its gradients == what was sent + its residual, to float32 rounding.
    assert out["gap"] <= 1e-5 * out["scale"]
    assert out["residual_nonzero"]  # the compressors did hold signal back
    assert out["dense_left_zero_residual"]  # and dense sent all of it
    # Each arm's own program (how the examples' loop runs them) is the switch at that arm.
    assert out["fixed_same_as_switch"]
