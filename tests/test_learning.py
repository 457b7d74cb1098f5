"""auto learns what each compressor costs in steps from the run (jaxcomm.cost.learn,
jaxcomm.learning): the learner's schedule and decisions, the guard that keeps dense unless a
compressor beats it, identical decisions from identical inputs, and error feedback conserved
across every switch between the arms' programs (tests/learning_worker.py, 2 CPU devices)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random

import pytest
from collectives_harness import run_script

from jaxcomm.cost import DEFAULT_PROFILE, Link, Options, World, learn

HERE = pathlib.Path(__file__).resolve().parent


def _explored(
    decrease: dict[str, float],
    seconds: dict[str, float],
    window: int = 10,
    settle: int = 2,
    first: int = 0,
    **more,
) -> learn.Learner:
    """A learner over the arms of `decrease` (in its order), ``Learning(window, settle, **more)``,
    after every planned window of its first exploration (:func:`_run_windows`)."""
    learning = learn.Learning(window=window, settle=settle, **more)
    learner = learn.Learner(list(decrease), learning, first=first)
    _run_windows(learner, 0, decrease, seconds)
    assert learner.chosen is not None
    return learner


def _run_windows(
    learner: learn.Learner, step: int, decrease: dict[str, float], seconds: dict[str, float]
) -> int:
    """Runs the learner's windows from `step` while one opens there, and returns the step
    after them: each arm's loss falls ``decrease[arm]`` per step, on top of a trend that slows
    down over training, at ``seconds[arm]`` per step."""
    while learner.window_start(step):
        first, last, name = learner.window_at(step)
        assert first == step
        losses, loss = [], 10.0 - 0.001 * step
        for i in range(last - first + 1):
            loss -= decrease[name] + 0.005 / (1 + (step + i) / 100)  # training slows down
            losses.append(loss)
        learner.close(last, losses, seconds[name] * len(losses))
        step = last + 1
    return step


def _round_order(learner: learn.Learner) -> list[str]:
    """The arms of the learner's windows from step 0 while one opens, each closed on flat
    losses at a second a step."""
    step, order = 0, []
    while learner.window_start(step):
        first, last, name = learner.window_at(step)
        order.append(name)
        learner.close(last, [1.0] * (last - first + 1), float(last - first + 1))
        step = last + 1
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
    # After the decision the chosen arm runs until the confirmation, sooner than the usual
    # re-check, which tries it against the safe arm only; the re-check after it tries every
    # arm again.
    after = decision["step"]
    assert learner.arm_at(after) == learner.arms.index("gtopk")
    recheck = after + learner.learning.confirm
    assert learner.learning.confirm < learner.learning.recheck_every
    assert learner.arm_at(recheck - 1) == learner.arms.index("gtopk")
    tried = len(learner.windows)
    step = _run_windows(learner, recheck, decrease, seconds)
    assert {w["arm"] for w in learner.windows[tried:]} == {"dense", "gtopk"}
    assert learner.chosen == "gtopk"
    tried = len(learner.windows)
    _run_windows(learner, step + learner.learning.recheck_every, decrease, seconds)
    assert {w["arm"] for w in learner.windows[tried:]} == set(decrease)


def test_an_arm_too_slow_per_step_to_win_runs_no_second_round():
    # Dense at ten times gTop-k's seconds per step (a slow link): even credited with the best
    # decrease per step of the first round it cannot win, so the second round leaves it out.
    # In the first it opens the round; at ten times the compressors' seconds (beyond the
    # steps the prior gives them at its 95th percentile) its closing window is left out.
    decrease = {"dense": 0.01, "gtopk": 0.008, "onebit": 0.004}
    seconds = {"dense": 1.0, "gtopk": 0.1, "onebit": 0.1}
    learner = _explored(decrease, seconds, rounds=2)
    assert learner.chosen == "gtopk"
    spans = [(w["arm"], w["last_step"] - w["first_step"] + 1) for w in learner.windows]
    assert spans[:3] == [("dense", 10), ("gtopk", 10), ("onebit", 10)]
    assert [a for a, _ in spans].count("dense") == 1
    assert _last("unbracketed")["step"] == 30
    pruned = _last("pruned")
    assert pruned["arms"] == ["dense"] and pruned["step"] == 30
    # The decision's measurements prune the re-check too: it tries the compressors only.
    # With no safe arm left to confirm the switch against, none comes before it.
    decided = _last("decision")["step"]
    assert not learner.window_start(decided + learner.learning.confirm)
    recheck = decided + learner.learning.recheck_every
    tried = len(learner.windows)
    assert _run_windows(learner, recheck, decrease, seconds) == recheck + 20
    assert {w["arm"] for w in learner.windows[tried:]} == {"gtopk", "onebit"}


def test_a_switch_to_a_sparse_arm_is_confirmed_sooner_than_a_recheck():
    learning = learn.Learning(window=4, settle=0, confirm=50, recheck_every=400)
    learner = learn.Learner(["dense", "gtopk"], learning)

    def round_from(start: int) -> None:  # dense, gtopk, dense: gTop-k twice as fast per second
        for i, (arm, decrease) in enumerate([(0, 0.1), (1, 0.2), (0, 0.1)]):
            first = start + 4 * i
            assert learner.arm_at(first) == arm and learner.window_start(first)
            learner.close(first + 3, [4.0 - decrease * j for j in range(4)], 1.0)

    round_from(0)
    assert learner.chosen == "gtopk" and learner.window_start(12 + 50)
    round_from(62)  # the confirmation: gTop-k stays, and the next round is a usual re-check
    assert learner.chosen == "gtopk" and not learner.window_start(74 + 50)
    assert learner.window_start(74 + 400)


def _two_rounds(
    learner: learn.Learner, confirm: tuple[float, float], noise: float, gtopk_seconds: float
) -> None:
    """A first round of dense, gTop-k, dense windows on clean losses (both fall 0.1 a step;
    dense at 1 s a step, gTop-k at ``gtopk_seconds``), then the confirming round, where they
    fall ``confirm`` (dense, gTop-k), each loss scattered by ``noise`` (a fixed draw)."""
    draw = random.Random(0)
    rounds = [(0, (0.1, 0.1), 0.0), (learner.learning.confirm, confirm, noise)]
    step = 0
    for gap, (dense, gtopk), wobble in rounds:
        step += gap
        for arm in ("dense", "gtopk", "dense"):
            first, last, name = learner.window_at(step)
            assert name == arm
            fall, seconds = (dense, 1.0) if arm == "dense" else (gtopk, gtopk_seconds)
            n = last - first + 1
            losses = [4.0 - fall * j + wobble * draw.gauss(0, 1) for j in range(n)]
            learner.close(last, losses, n * seconds)
            step = last + 1
        if not gap:
            assert learner.chosen == "gtopk"


@pytest.mark.parametrize("noise, chosen", [(0.3, "gtopk"), (0.0, "dense")])
def test_a_recheck_weighs_its_windows_by_their_noise(noise, chosen):
    # gTop-k is decided on clean windows; in the confirming round its loss falls a fifth of
    # dense's. On clean losses that is 5x dense's steps at 0.34x its seconds: dense takes
    # over. On noisy batch losses the windows say little, and the prior (2.5x dense's steps)
    # keeps gTop-k.
    learner = learn.Learner(["dense", "gtopk"], learn.Learning(window=16, settle=0, confirm=50))
    _two_rounds(learner, (0.1, 0.02), noise, 0.34)
    assert learner.chosen == chosen
    decision = _last("decision")
    assert decision["steps_factor"]["gtopk"] == pytest.approx(5.0 if noise == 0 else 2.5, rel=0.3)


@pytest.mark.parametrize("gtopk, kept", [(0.1 / 2.1, True), (0.1 / 2.5, False)])
def test_a_recheck_keeps_the_decided_arm_unless_the_pick_beats_it_by_the_margin(gtopk, kept):
    # Clean confirming windows, gTop-k at half dense's seconds a step: it needs 2.1x dense's
    # steps (1.05 s a dense step against dense's 1.0: within the margin of 1.1, it stays) or
    # 2.5x (1.25 s: dense).
    learner = learn.Learner(["dense", "gtopk"], learn.Learning(window=8, settle=0, confirm=50))
    _two_rounds(learner, (0.1, gtopk), 0.0, 0.5)
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
            settle=0,
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
    learner = learn.Learner(arms, learn.Learning(window=10, settle=2), first=first)
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
    learner = learn.Learner(arms, learn.Learning(window=10, settle=2), first=first, skip=skip)
    assert _last("skipped")["predicted_s"] == skip
    step, centers = 0, []
    for arm, decrease, seconds in [("blockquant", 0.05, 0.2), ("gtopk", 0.03, 0.04),
                                   ("blockquant", 0.04, 0.2)]:  # fmt: skip
        first, last, name = learner.window_at(step)
        assert (first, name) == (step, arm)
        n = last - first + 1
        learner.close(last, [2.0 - decrease * j for j in range(n)], seconds * n)
        centers.append((first + last) / 2)
        step = last + 1
    # Block int8's second window: as many seconds as 10 of gTop-k's steps, but at least 5.
    assert step == 25
    decision = _last("decision")
    assert learner.chosen == "gtopk" and "dense" not in decision["seconds_per_step"]
    # Steps relative to the safe arms' decrease, interpolated to gTop-k's window.
    at = (centers[1] - centers[0]) / (centers[2] - centers[0])
    safe = 0.05 + (0.04 - 0.05) * at
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
    learner = learn.Learner(arms, learn.Learning(window=10, settle=2), first=1)
    measured = [(0.1456, 0.395), (0.0467, 0.321), (0.0137, 0.318)]  # per step, s per step
    for i, (decrease, seconds) in enumerate(measured):
        losses = [2.0 - decrease * j for j in range(10)]
        learner.close(10 * i + 9, losses, seconds * 10)
    assert learner.chosen == "dense"


def test_a_safe_window_after_a_lossy_arm_reads_past_the_flush():
    # Block int8 closes the round after one-bit, and its first step sends what one-bit held
    # back: the loss jumps and falls back over 4 steps, then falls 0.01 a step as in the
    # opening window. One-bit falls as fast at half the seconds a step. Read after the usual
    # settle the recovery made block int8 look faster per second than one-bit; read from
    # where the loss is back at one-bit's last level, one-bit wins.
    learning = learn.Learning(window=20, settle=3)
    learner = learn.Learner(["blockquant", "onebit"], learning)
    learner.close(19, [2.0 - 0.01 * j for j in range(20)], 20.0)
    assert learner.windows[-1]["settle"] == 3  # after the warm-up's safe steps
    learner.close(39, [1.8 - 0.01 * j for j in range(20)], 10.0)
    first, last, arm = learner.window_at(40)
    n = last - first + 1
    assert arm == "blockquant" and n == 10  # as many seconds as 20 of one-bit's steps
    flush = [2.6 - 0.2 * j if j < 4 else 1.6 - 0.01 * j for j in range(n)]
    assert learn.window_rate(flush, 1.0, 3)[0] > 0.05  # what the usual settle read
    learner.close(last, flush, float(n))
    closing = learner.windows[-1]
    assert closing["settle"] == 4 and learner.flushes(40) and not learner.flushes(20)
    assert closing["loss_decrease_per_step"] == pytest.approx(0.01)
    assert learner.chosen == "onebit"
    # After a decision for one-bit the re-check's opening window follows one-bit's steps:
    # half of it is left out, whatever level an earlier window ended at.
    recheck = _last("decision")["step"] + learner.learning.confirm
    assert learner.flushes(recheck) and learner.window_at(recheck)[2] == "blockquant"
    first, last, _ = learner.window_at(recheck)
    learner.close(last, [0.5] * (last - first + 1), float(last - first + 1))
    assert learner.windows[-1]["settle"] == (last - first + 1) // 2
    # A flush the loss never recovers from within the window: at most half of it is left out;
    # one after which the loss is at once below the level: the usual settle.
    for losses, settle in [([3.0 - 0.01 * j for j in range(n)], 5), ([1.0] * n, 3)]:
        learner = learn.Learner(["blockquant", "onebit"], learning)
        learner.close(19, [2.0 - 0.01 * j for j in range(20)], 20.0)
        learner.close(39, [1.8 - 0.01 * j for j in range(20)], 10.0)
        learner.close(49, losses, float(n))
        assert learner.windows[-1]["settle"] == settle


@pytest.mark.parametrize("seconds, chosen", [(0.05, "gtopk"), (0.4, "blockquant")])
def test_a_guard_whose_loss_did_not_fall_leaves_the_choice_to_the_prior(seconds, chosen):
    # Held-out smallbatch at 100 Mbit/s: block int8 (the guard) read a rising loss over its
    # windows, and the compressors' losses rose too. The windows then say nothing of how
    # many more steps a compressor needs than dense: the prior decides. At a tenth of the
    # guard's seconds a step a compressor wins (and is confirmed after `confirm` steps); at
    # four fifths it would need under 1.25x dense's steps, and the guard stays.
    # (At a tenth, block int8's closing window is left out: it could not win.)
    arms = ["blockquant", "gtopk", "onebit"]
    learner = learn.Learner(arms, learn.Learning(window=10, settle=0))
    step = 0
    order = ["blockquant", "gtopk", "onebit"] + (["blockquant"] if seconds > 0.1 else [])
    for arm in order:
        first, last, name = learner.window_at(step)
        assert name == arm
        fall = {"blockquant": -0.005, "gtopk": -0.01, "onebit": -0.02}[arm]
        n = last - first + 1
        each = 0.5 if arm == "blockquant" else seconds
        learner.close(last, [2.0 - fall * j for j in range(n)], each * n)
        step = last + 1
    assert learner.chosen == chosen
    decision = _last("decision")
    assert decision["steps_factor"]["gtopk"] == pytest.approx(2.83, rel=0.01)
    if chosen == "gtopk":
        assert learner.window_start(decision["step"] + learner.learning.confirm)


def _noisy(level: float, slope: float, steps: int, seed: int, scatter: float = 0.1) -> list:
    """Batch losses from ``level`` falling ``slope`` per step, with a fixed scatter."""
    rng = random.Random(seed)
    return [level - slope * j + rng.gauss(0.0, scatter) for j in range(steps)]


def _feed(learner: learn.Learner, step: int, losses: list) -> int:
    """Runs the window opening at ``step`` on ``losses`` as the loop does (:meth:`cut` after
    each step it is due, :meth:`close` at its end, a second a step); the step after it."""
    first, last, _ = learner.window_at(step)
    assert len(losses) >= last - first + 1
    for j in range(last - first + 1):
        seen = losses[: j + 1]
        if first + j == last or (
            learner.cut_due(first + j, len(seen)) and learner.cut(first + j, seen)
        ):
            learner.close(first + j, seen, float(len(seen)))
            return first + j + 1
    raise AssertionError("unreachable: the window's last step closes it")


@pytest.mark.parametrize("seed", range(5))
def test_a_compressor_whose_loss_rises_is_cut_short_and_not_chosen(seed):
    # Dense falls; gTop-k's loss climbs 0.05 a step (error feedback setting training back);
    # one-bit falls more slowly than dense (merely slower): only gTop-k's window ends early.
    learning = learn.Learning(window=20, settle=2, stop_z=3.0, stop_after=4)
    learner = learn.Learner(["dense", "gtopk", "onebit"], learning)
    step = _feed(learner, 0, _noisy(2.0, 0.01, 20, seed))
    assert learner.window_at(step)[2] == "gtopk"
    step = _feed(learner, step, _noisy(1.8, -0.05, 20, seed + 10))
    cut = learner.windows[-1]
    assert cut["cut"] and 4 <= cut["last_step"] - cut["first_step"] + 1 < 20
    assert cut["loss_decrease_per_step"] < 0  # read whole: the rise is what it measured
    assert learner.window_at(step) == (step, step + 19, "onebit")  # the round goes on at once
    step = _feed(learner, step, _noisy(1.9, 0.004, 20, seed + 20))
    assert not learner.windows[-1]["cut"]
    _feed(learner, step, _noisy(1.85, 0.01, 20, seed + 30))
    assert learner.chosen != "gtopk"
    assert [w["cut"] for w in learner.windows] == [False, True, False, False]


def test_a_window_is_never_cut_on_noise_nor_a_safe_one_nor_before_stop_after():
    # A flat loss with the same scatter as the window before it: no cut in 200 windows.
    learning = learn.Learning(window=20, settle=0, stop_z=3.0, stop_after=4)
    cuts = 0
    for seed in range(200):
        learner = learn.Learner(["dense", "gtopk"], learning)
        step = _feed(learner, 0, _noisy(1.0, 0.0, 20, seed))
        _feed(learner, step, _noisy(1.0, 0.0, 20, seed + 1000))
        cuts += learner.windows[-1]["cut"]
    assert cuts <= 2
    learner = learn.Learner(["dense", "blockquant", "gtopk"], learning)
    step = _feed(learner, 0, _noisy(1.0, 0.0, 20, 0))
    assert learner.window_at(step)[2] == "gtopk"
    assert not learner.cut_due(step + 2, 3)  # fewer than stop_after steps
    assert learner.cut_due(step + 3, 4)
    assert not learner.cut_due(step + 19, 20)  # its last step: it closes anyway
    step = _feed(learner, step, _noisy(1.0, 0.0, 20, 1))
    assert learner.window_at(step)[2] == "blockquant"  # safe: never tested
    assert not learner.cut_due(step + 10, 11)
    assert not learner.cut(step + 10, [5.0] * 11)


@pytest.mark.parametrize("seed", range(5))
def test_a_rise_that_goes_on_after_a_cut_window_is_cut_again(seed):
    # gTop-k's loss climbs and its window is cut. One-bit inherits the residual behind the
    # rise: climbing on from where gTop-k's window ended, it is cut too; holding there or
    # falling back, it runs its window.
    learning = learn.Learning(window=20, settle=0, stop_z=3.0, stop_after=4)
    for onebit, cut in ((-0.2, True), (0.0, False), (0.02, False)):
        learner = learn.Learner(["dense", "gtopk", "onebit"], learning)
        step = _feed(learner, 0, _noisy(1.0, 0.0, 20, seed))
        step = _feed(learner, step, _noisy(1.0, -0.2, 20, seed + 10))
        rose = learner.windows[-1]
        assert rose["cut"] and learner.window_at(step)[2] == "onebit"
        assert learner.cut_due(step + 3, 4)
        _feed(learner, step, _noisy(rose["end_level"], onebit, 20, seed + 20))
        window = learner.windows[-1]
        assert window["arm"] == "onebit" and window["cut"] == cut
        assert (window["last_step"] - window["first_step"] + 1 < 10) == cut


def test_the_warm_up_lasts_as_long_as_warmup_steps_of_the_fastest_arm():
    # Block int8 predicted at 5x gTop-k's seconds (a slow link): the warm-up is 10 of its
    # steps, all of them the opening window (half a window: as many seconds would be 4);
    # dense predicted as fast as gTop-k warms up 50 steps, the last 20 the opening window.
    learning = learn.Learning(window=20, warmup=50)
    assert learning.opens_at(0.1, 0.02) == 0
    assert learning.opens_at(0.02, 0.02) == learning.opens_at() == 30
    predicted = {"dense": 0.2, "blockquant": 0.1, "gtopk": 0.02}
    learner = learn.Learner(
        list(predicted), learning, 0, first=1, skip={"dense": 0.2}, predicted=predicted
    )
    assert learner.window_at(0) == (0, 9, "blockquant")
    learner.close(9, [1.0 - 0.01 * j for j in range(10)], 1.0)
    assert learner.window_at(10) == (10, 29, "gtopk")  # measured: gTop-k is not yet
    # The model's seconds size the warm-up only where it runs block int8 (dense ruled out).
    slow, sizes = World(2, 1, "across_hosts"), [4_000_000]
    arms = ["dense", "blockquant", "gtopk"]
    assert learn.warmup_seconds(arms, {}, sizes, slow, DEFAULT_PROFILE, Options()) == {}
    seconds = learn.warmup_seconds(arms, {"dense": 1.0}, sizes, slow, DEFAULT_PROFILE, Options())
    assert set(seconds) == {"blockquant", "gtopk"} and seconds["gtopk"] < seconds["blockquant"]


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
    with pytest.raises(ValueError, match="stop_after"):
        learn.Learning(window=10, stop_after=11)


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


def test_the_steps_posterior_leaves_the_prior_only_as_far_as_the_windows_errors_allow():
    # An arm whose loss falls half the safe one's: 2x dense's steps on clean windows; the
    # farther from that the noisier they are, toward the prior's mean (2.5 x e^(0.5^2 / 2)).
    prior_mean = 2.5 * math.exp(0.5**2 / 2)
    means = [learn.steps_posterior(0.005, e, 0.01, e) for e in (0.0, 0.0005, 0.002, 0.05)]
    assert means[0] == pytest.approx(2.0, rel=0.01)
    assert means[0] < means[1] < means[2] <= means[3] == pytest.approx(prior_mean, rel=0.01)
    # A loss that rose in the window: more steps than the prior, not fewer.
    assert learn.steps_posterior(-0.02, 1e-6, 0.01, 1e-4) > prior_mean
    # A safe loss that did not fall says nothing: the prior, whatever the arm read.
    assert learn.steps_posterior(0.02, 0.0, 0.0, 0.0) == pytest.approx(prior_mean, rel=0.01)
    with pytest.raises(ValueError, match="noise"):
        learn.Learning(noise=math.inf)


def test_a_decision_records_the_steps_it_expected_and_the_windows_read():
    learner = _explored({"dense": 0.01, "gtopk": 0.008}, {"dense": 0.5, "gtopk": 0.2})
    decision = _last("decision")
    measured, expected = decision["steps_factor_measured"], decision["steps_factor"]
    assert expected["dense"] == measured["dense"] == 1.0
    # Clean windows: the expected factor is the windows' own.
    assert expected["gtopk"] == pytest.approx(measured["gtopk"], rel=0.01)
    costs = decision["seconds_per_dense_step"]
    assert costs["gtopk"] == pytest.approx(0.2 * expected["gtopk"])
    assert learner.chosen == min(costs, key=costs.get) == "gtopk"


def test_rechecks_wait_twice_as_long_each_time():
    # Dense stays decided (no switch, no confirmation): re-checks after 400, 800, 1600 steps.
    decrease, seconds = {"dense": 0.01, "gtopk": 0.002}, {"dense": 0.5, "gtopk": 0.4}
    learner = _explored(decrease, seconds)
    starts, step = [], _last("decision")["step"]
    for _ in range(3):
        assert learner.chosen == "dense"
        wait = next(s for s in range(step, step + 5000) if learner.window_start(s)) - step
        starts.append(wait)
        step = _run_windows(learner, step + wait, decrease, seconds)
    assert starts == [400, 800, 1600]


def test_a_recheck_without_a_safe_arm_reads_against_the_last_safe_window():
    # Dense, ten times the compressors' seconds, is pruned after the first round. At the
    # re-check gTop-k's loss rises (it set the training back) while one-bit's falls as
    # dense's did. Against dense's last window one-bit needs about dense's steps, gTop-k
    # many more, and one-bit is taken although gTop-k is the cheaper per step; with no
    # reference both would be read at the prior, and the cheaper taken.
    arms = ["dense", "gtopk", "onebit"]
    learner = learn.Learner(arms, learn.Learning(window=10, settle=0, confirm=50))
    falls = {"dense": 0.01, "gtopk": 0.012, "onebit": 0.002}
    each = {"dense": 1.0, "gtopk": 0.09, "onebit": 0.1}
    step = _run_windows(learner, 0, falls, each)
    assert learner.chosen == "gtopk" and _last("pruned")["arms"] == ["dense"]
    step = next(s for s in range(step, step + 1000) if learner.window_start(s))
    _run_windows(learner, step, {**falls, "gtopk": -0.02, "onebit": 0.01}, each)
    decision = _last("decision")
    assert learner.chosen == "onebit" and "dense" in decision["seconds_per_step"]
    assert decision["steps_factor"]["gtopk"] > 2 * decision["steps_factor"]["onebit"]


def test_a_recheck_with_no_falling_safe_loss_keeps_the_decision():
    # Held-out fourmid at 100 Mbit/s, seed 2: block int8, pruned, last read a loss that
    # rose; at the re-check every compressor was read at the prior, and one-bit, cheapest
    # in its window, replaced TopK-allgather for 800 steps (8.9 s against 3.9). With nothing
    # to read the steps against, the decision stands.
    arms = ["blockquant", "topk_allgather", "onebit"]
    learner = learn.Learner(arms, learn.Learning(window=10, settle=0))
    falls = {"blockquant": -0.01, "topk_allgather": 0.03, "onebit": -0.02}
    each = {"blockquant": 1.0, "topk_allgather": 0.09, "onebit": 0.1}
    step = _run_windows(learner, 0, falls, each)
    assert learner.chosen == "topk_allgather" and _last("pruned")["arms"] == ["blockquant"]
    step = next(s for s in range(step, step + 1000) if learner.window_start(s))
    _run_windows(learner, step, falls, {**each, "topk_allgather": 0.2})
    decision = _last("decision")
    assert (
        decision["seconds_per_dense_step"]["onebit"]
        < decision["seconds_per_dense_step"]["topk_allgather"]
    )
    assert learner.chosen == "topk_allgather" and decision["kept"]


def test_an_arms_seconds_a_step_are_read_over_all_its_windows():
    # One-bit's 4-step window, cut short, read 5 ms a step; its 14-step window before, 7 ms.
    # The re-check's windows alone would make it cheaper than TopK-allgather (6 ms); over
    # all its windows, weighted by their steps, it is not.
    def window(arm, first, steps, seconds):
        return {"arm": arm, "first_step": first, "last_step": first + steps - 1,
                "loss_decrease_per_step": 0.01, "loss_decrease_se": 0.001,
                "seconds_per_step": seconds}  # fmt: skip

    earlier = [window("onebit", 0, 14, 0.007), window("topk_allgather", 14, 20, 0.006)]
    now = [window("onebit", 500, 4, 0.005), window("topk_allgather", 504, 20, 0.006)]
    names, learning = ["onebit", "topk_allgather"], learn.Learning()
    assert learn.measure(now, names, learning).seconds["onebit"] == pytest.approx(0.005)
    pooled = learn.measure(now, names, learning, earlier + now).seconds
    assert pooled["onebit"] == pytest.approx((14 * 0.007 + 4 * 0.005) / 18)
    assert pooled["onebit"] > pooled["topk_allgather"] == pytest.approx(0.006)


@pytest.mark.parametrize("dense_seconds, closed", [(0.5, True), (1.0, False)])
def test_a_closing_safe_window_that_cannot_change_the_pick_is_left_out(dense_seconds, closed):
    # The compressors at 0.1 s a step. Dense at 5x that could still win, were a compressor to
    # need its prior's 95th percentile of steps (5.7x): it closes the round. At 10x it
    # could not: the round ends after the compressors, read against the opening window.
    seconds = {"dense": dense_seconds, "gtopk": 0.1, "onebit": 0.1}
    learner = _explored({"dense": 0.01, "gtopk": 0.008, "onebit": 0.004}, seconds)
    assert [w["arm"] for w in learner.windows][-1] == ("dense" if closed else "onebit")
    assert learner.chosen == "gtopk"


@pytest.mark.parametrize("block_model, left_out", [(0.05, True), (0.02, False)])
def test_a_safe_arm_predicted_far_dearer_runs_after_the_cheapest_or_not_at_all(
    block_model, left_out
):
    # Dense ruled out (a slow link); the model predicts block int8 at 10x-25x gTop-k's
    # communication, beyond the prior's 95th percentile of steps (5.7x): gTop-k's window
    # opens the round. It measures 3 ms a step the model left out (the compute every arm
    # shares): with it block int8 is estimated at 53 ms against gTop-k's 5 ms, still
    # outpaced, and runs no window at all; at 23 ms it could win and runs as before.
    predicted = {"blockquant": block_model, "gtopk": 0.002, "onebit": 0.004}
    learning = learn.Learning(window=10, settle=2)
    learner = learn.Learner(
        ["dense", *predicted], learning, 0, first=1, skip={"dense": 1.0}, predicted=predicted
    )
    seconds = {"blockquant": block_model + 0.003, "gtopk": 0.005, "onebit": 0.006}
    decrease = {"blockquant": 0.01, "gtopk": 0.01, "onebit": 0.002}
    _run_windows(learner, 0, decrease, seconds)
    arms = [w["arm"] for w in learner.windows]
    if left_out:
        # gTop-k, the prior's pick among the compressors (the fastest a step), is decided on
        # its window alone.
        assert arms == ["gtopk"] and _last("decision")["step"] == 10
        outpaced = _last("outpaced")
        assert outpaced["arms"] == ["blockquant"] and outpaced["step"] == 10
        assert outpaced["seconds_per_step"] == pytest.approx(0.053)
        # No safe arm is left to confirm the switch against; the re-check tries the others,
        # bracketed by gTop-k and read against it at the prior's median: one-bit's fifth of
        # its decrease puts it far above, gTop-k stays at the prior.
        assert not learner.window_start(10 + learning.confirm)
        _run_windows(learner, 10 + learning.recheck_every, decrease, seconds)
        assert [w["arm"] for w in learner.windows[1:]] == ["gtopk", "onebit", "gtopk"]
        factors = _last("decision")["steps_factor"]
        assert factors["onebit"] > 2 * factors["gtopk"]
        assert factors["gtopk"] == pytest.approx(learning.prior_steps, rel=0.1)
    else:
        assert arms == ["gtopk", "blockquant", "onebit", "blockquant"]
    assert learner.chosen == "gtopk"


def test_with_timed_steps_the_prior_decides_at_once_and_the_trials_wait_until_cheap():
    # Every arm's step timed at start: gTop-k's 8 ms times the prior's mean steps (2.8) beats
    # block int8's 30 ms by the margin, so gTop-k runs from the learner's start; before it,
    # the guard (the fastest safe arm) warms up. No window runs until a round of them costs
    # a tenth of the run so far; then the windows show gTop-k needing ten times dense's
    # steps, and the guard takes over.
    timed = {"dense": 0.05, "blockquant": 0.03, "gtopk": 0.008}
    learning = learn.Learning(window=10, settle=2)
    learner = learn.Learner(list(timed), learning, 5, timed=timed)
    assert learner.chosen == "gtopk"
    decided = _last("decision")
    assert decided["prior"] and decided["step"] == 5
    assert decided["steps_factor"]["gtopk"] == pytest.approx(2.5 * math.exp(0.5**2 / 2), rel=1e-3)
    assert [learner.arms[learner.arm_at(s)] for s in (0, 4, 5)] == ["blockquant"] * 2 + ["gtopk"]
    opens = decided["explores_at"]
    assert opens == learner.priced(5, [0, 1, 2])
    assert not any(learner.in_window(s) for s in range(opens)) and learner.window_start(opens)
    # The round's seconds: gTop-k's full window and block int8's half one, opening and
    # closing (dense, dearer a step than gTop-k's by more than the prior's 95th percentile
    # of steps, runs none), are a tenth of the run's: 5 warm-up steps of block int8, then
    # gTop-k's steps.
    round_s = 10 * 0.008 + 2 * 5 * 0.03
    assert opens == 5 + math.ceil((round_s / 0.1 - 5 * 0.03) / 0.008)
    decrease = {"dense": 0.01, "blockquant": 0.01, "gtopk": 0.001}
    _run_windows(learner, opens, decrease, timed)
    assert learner.chosen == "blockquant" and not _last("decision").get("prior")


def test_a_run_that_gives_dense_steps_reads_the_prior_as_a_delay_over_them():
    # Timed at start, gTop-k's 12 ms a step times the factor prior's mean steps (2.8) loses to
    # block int8's 20 ms; on a run whose dense training takes 5000 steps the delay prior's
    # mean (1 + 178 / 5000 times the spread's) makes it the pick. A run too short for the
    # delay to read as less than the factor keeps the factor.
    timed = {"dense": 0.05, "blockquant": 0.02, "gtopk": 0.012}
    learning = learn.Learning(window=10, settle=2)
    assert learning.for_run(None) is learning
    assert learning.for_run(50).prior_steps == learning.prior_steps
    long = learning.for_run(5000)
    assert long.prior_steps == pytest.approx(1 + learning.prior_delay / 5000)
    chosen = {}
    for name, given in (("factor", learning), ("delay", long)):
        chosen[name] = learn.Learner(list(timed), given, 5, timed=timed).chosen
        assert _last("arms")["prior_steps"] == given.prior_steps  # in the metrics
    assert chosen == {"factor": "blockquant", "delay": "gtopk"}
    with pytest.raises(ValueError, match="dense_steps"):
        learning.for_run(0)


@pytest.mark.parametrize("share", [0.05, 0.1, 0.5])
def test_the_first_round_waits_for_the_run_to_be_long_enough_to_pay_for_it(share):
    # The round's seconds are at most ``explore_share`` of the run's at its first step.
    # Dense (20 ms a step) stands: gTop-k's 10 ms times the prior's steps is dearer.
    timed = {"dense": 0.02, "gtopk": 0.01}
    learning = learn.Learning(window=10, settle=2, explore_share=share)
    learner = learn.Learner(list(timed), learning, 0, timed=timed)
    assert learner.chosen == "dense"
    opens = _last("decision")["explores_at"]
    round_s = 2 * 5 * 0.02 + 10 * 0.01  # dense's half windows open and close, gTop-k between
    assert round_s <= share * opens * 0.02 + 1e-12
    assert round_s > share * (opens - 1) * 0.02
    assert learner.window_at(opens)[2] == "dense"
