"""Learning what a compressor costs in steps, from the run itself.

The cost model predicts seconds per step; what it cannot predict is how many more steps a
compressor needs on this model, optimizer and phase of training. :class:`Learner` measures it
as the run goes: it runs the candidate reductions ("arms": dense first, the guard, then the
compressors the model proposes) in short interleaved windows, weighs what their training
losses show of each one's steps against a prior, keeps the one of least expected seconds to
dense's progress, and re-checks now and then.

Where the caller timed every arm's step at start (``timed``: a few steps of each arm's own
program on a copy of the run's state, outside the training clock), the prior decides at once
on those seconds, and the first round waits until it costs at most ``explore_share`` of the
run's seconds so far (:meth:`Learner.priced`): its windows cost seconds whatever they find,
and the windows' bound (``benchmarks/learn_windows.py``) showed a round dearer than the
targets allow on runs of a few seconds, where the prior's pick on measured seconds was
within them more often than the windows' (docs/cost-model.md). A long run still learns: its
rounds then cost a small share of it, and re-checks follow. Untimed, the learner explores at
once, as follows.

* The first steps run the first safe arm alone (:func:`first_arm`: dense, or the safe
  compressor where the model predicts dense far slower), as DGC and gTop-k warm up before
  compressing: the model changes fastest there, a window there says least about the rest
  of the run, and a short run reaches its target within them. On dense they are
  ``warmup`` steps; on the safe compressor they last as many seconds as ``warmup`` steps
  of the arm the model predicts fastest (:func:`warmup_seconds`, :meth:`Learning.opens_at`):
  where dense is ruled out a safe step costs several of a sparse one. Their last steps are
  the first round's opening window, which runs that arm anyway.
* Where the model predicts the safe compressor's step dearer than the cheapest
  compressor's by more than the prior's 95th percentile of steps (:meth:`Learning.outpaced`),
  there is no warm-up: the cheapest compressor (the *lead*) opens the round. Its window
  measures what the model leaves out (the compute every arm shares); with it the safe
  arm's step is estimated, and where that is still outpaced the safe arm runs no window
  at all (:meth:`Learner._leave_out_outpaced`): it could not win, and on a run of a few
  seconds its one window cost more than the targets allow (docs/cost-model.md). The lead,
  the prior's pick among compressors, is then decided at once; the re-check's round tries
  the others, bracketed by the lead and read against it, its steps taken at the prior's
  median.
* A window is ``window`` steps of one arm, or as many seconds: exploration is paid for in
  seconds, so an arm measured slower per step than the fastest measured so far runs
  proportionally fewer steps (at least half a window, :meth:`Learning.steps_for`); on a slow
  link the safe arms' windows are the dearest. The loss decrease per step is the
  least-squares slope of the loss over the window's steps after its first ``settle`` (the
  switch's transient); its seconds are the window's wall clock (the largest over the ranks).
  A safe window after an arm that is not safe leaves out its steps until the loss is back
  at the level that arm ended at, up to half the window (:meth:`Learner.flushes`): its
  first step sends everything that arm held back, and the spike and its recovery would
  read as a fall faster than the safe arm's own.
* A window of an arm that is not safe ends early (:meth:`Learner.cut`) once the mean of its
  batch losses lies above the level the window before it ended at by ``stop_z`` standard
  errors: a compressor that sets training back (error feedback starting from a dense run, a
  momentum or Adam state fed a sparse gradient) does so while its window runs, and each
  further step of it is one the run must undo. The window is then read whole, its rise
  included; an arm whose loss merely falls more slowly runs its full window. The window
  after a cut one is tested against where that one ended: it inherits the residual that
  set the training back, and a rise that goes on is cut again.
* A round runs every arm once, the *safe* arms (whose prior says they need dense's steps:
  dense, or a bounded-error quantizer) bracketing the others: the first safe arm opens,
  the others in an order rotated by one each round, then the second safe
  arm, or the first again when it is the only one. The loss falls faster early in training
  than later, so the windows' decreases are fitted as an effect per arm plus a trend in time
  (:func:`arm_decrease`), and every other arm is compared with the safe decrease
  interpolated to when it ran. An arm's rate is its decrease per step over its seconds per
  step. Early windows move the loss the most, and a short run may reach its target within
  the exploration: they go to the arm least likely to waste them. The closing safe window
  is left out where its arm is dearer a step than the cheapest compressor by more than the
  prior's 95th percentile of steps (:meth:`Learner._leave_out_outpaced`): it could not win.
* Every compressor the model predicts faster per step than dense gets a trial
  (:func:`propose`): a fast arm's window costs little, and the priors that would rank them are
  measured on other models. Dense runs no window when the measured model predicts it slower
  per step than a proposed safe compressor by ``dense_over`` (:func:`skipped`): the two need
  the same steps, so its window could only confirm that it loses, at the highest price.
* The guard is the safe arm fastest per step (the safe arms share dense's steps, so only
  their seconds are compared). The decision takes the arm of least expected seconds per
  dense step: its seconds per step times its expected steps factor, 1 for the guard and,
  for the others, the posterior mean given its windows' decrease against the safe arms'
  (:func:`steps_posterior`): a log-normal prior (``prior_steps``, one number for every
  compressor; where the run gives dense's steps, a delay over them, :meth:`Learning.for_run`)
  weighed against windows whose errors are taken ``noise`` times their slopes'.
  Short windows read a decrease that errs by more than what separates the arms, and the
  runs' first decisions chose better on the prior than on the windows read at face value
  (docs/cost-model.md); clean windows still override it. A pick must beat the arm it
  displaces (the guard, or the decided arm at a re-check) by ``margin``. A switch to an
  arm that is not safe is confirmed after ``confirm`` steps against the safe arms still in
  play: windows early in training are the least telling, and a wrong sparse pick costs a
  multiple of the steps. The decided arm then runs ``recheck_every`` steps, and one round
  re-checks every arm but those too slow per step to win on the decision's measurements
  (``prune``); each further re-check waits twice as long (:meth:`Learner._next_exploration`).
  A re-check with no safe arm left reads the others against the latest safe window, and
  keeps the decision where no safe loss fell (the prior alone would rank by seconds).
* The decisions record both steps factors: the expected one they used and the windows'
  own (dense's decrease per step over the arm's), what :class:`~jaxcomm.cost.Auto`
  otherwise takes from its table (:func:`propose` uses that table only to rank the arms
  worth a trial).

The error-feedback residuals are shared by every arm (``jaxcomm.learning``): a compressor
keeps what it did not send for the next arm, and the dense arm sends them with its gradient,
so a switch loses no signal.

The learner is host-side and standard library only. It is deterministic in what it is fed:
with the same losses (averaged over the ranks) and the same seconds (agreed over the ranks)
every rank switches at the same steps to the same arm.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .arms import (
    DENSE_OVER,
    first_arm,
    is_safe,
    predicted_step,
    propose,
    skipped,
    warmup_seconds,
)
from .windows import (
    NOISE,
    PRIOR_DELAY,
    PRIOR_SPREAD,
    PRIOR_STEPS,
    Measured,
    arm_decrease,
    best_arm,
    fastest_safe,
    measure,
    measured_factors,
    slope_error,
    steps_posterior,
    window_rate,
)

__all__ = [
    "Learner",
    "Learning",
    "Measured",
    "arm_decrease",
    "best_arm",
    "compiled",
    "decisions",
    "fastest_safe",
    "first_arm",
    "is_safe",
    "leading",
    "measure",
    "propose",
    "predicted_step",
    "skipped",
    "slope_error",
    "steps_posterior",
    "timed",
    "warmup_seconds",
    "window_rate",
]

_decisions: list[dict[str, Any]] = []
LEVEL = 8  # a window's last losses whose mean is the level it ended at (:meth:`Learner.cut`)
_UPPER = 1.645  # the standard normal's 95th percentile


@dataclasses.dataclass(frozen=True)
class Learning:
    """How :class:`Learner` explores.

    Args:
      window: steps per trial window of the fastest arm (the slope of a few noisy batch
        losses errs by as much as the decrease it measures; a slope's error falls as its
        points to the power 1.5); a slower arm's window lasts as many seconds
        (:meth:`steps_for`).
      settle: first steps of a window left out of its slope (the switch's transient).
      rounds: rounds of the first exploration (each rotated by one arm).
      recheck_every: steps the decided arm runs before a round re-checks every arm (each
        further re-check waits twice as long as the one before).
      confirm: steps before a switch to an arm that is not safe is confirmed against the
        safe arms still in play.
      warmup: steps the first safe arm runs (on the safe compressor: for as many seconds as
        this many steps of the fastest arm, :func:`warmup_seconds`) before any other arm's
        trial, the last of them the first
        round's opening window (the caller starts the learner at :meth:`opens_at`): as
        DGC's and gTop-k's warm-ups, no compressor that needs more steps trains the first
        steps, where the model changes fastest and a window says the least about the rest
        of the run; a short run reaches its target in them.
      margin: a pick replaces the arm it would displace (the guard, or the decided arm at a
        re-check) only when its expected seconds per dense step are lower by this factor.
      prior_steps: the prior steps factor of every arm that is not safe, the median of a
        log-normal (:func:`steps_posterior`). One number for all: fitted on the first
        decisions of the grid's and the judged held-out workloads' auto cells
        (``benchmarks/results/e2e*``), where the registry's per-algorithm factors, measured on
        digits-small, chose worse than one shared prior.
      prior_spread: the prior's standard deviation in log steps (0.5: a factor of 1.65).
      prior_delay: a compressor's extra steps as a delay, what :meth:`for_run` makes of the
        run's length: in the grid's full runs they looked more like a delay than a factor
        (``benchmarks/steps_delay.py``: what error feedback holds back reaches the model
        late), so a factor fitted on runs of hundreds of steps overstates them on longer ones.
      noise: how much the scatter of a window's decrease exceeds its slope's own standard
        error (the loss trend, the residual an arm inherits, the switch); windows are
        weighed against the prior with their errors times this (fitted with
        ``prior_steps``).
      prune: after the first round, an arm so slow per step that, even with the greatest
        decrease per step of any arm, its rate stays below the best's over this factor runs
        no further window (dense too: on a slow link its windows cost the most); a re-check
        leaves out the arms the last decision's measurements prune so.
      dense_over: dense runs no window when the model predicts its step slower than a
        proposed safe compressor's by this factor (:func:`skipped`).
      stop_z: a window of an arm that is not safe ends early when its losses so far lie
        above the level at which the window before it ended by this many standard errors
        (:meth:`Learner.cut`; ``math.inf``: never): a compressor that sets the training back
        does so while its window runs, and each further step of it is damage the run must
        then undo.
      stop_after: the fewest steps of such a window before it may end early (the mean of
        its losses needs a few batches).
      explore_share: where every arm's step was timed at start (:class:`Learner`'s
        ``timed``), the prior decides at once, and the first round of windows opens only
        once its seconds are at most this share of the run's so far
        (:meth:`Learner.priced`): a round costs seconds whatever it finds, and on runs of
        seconds it cost more than the targets allow (``benchmarks/learn_windows.py``).

    Example:
      >>> Learning(window=10).window
      10
    """

    window: int = 20
    settle: int = 3
    rounds: int = 1
    recheck_every: int = 400
    confirm: int = 100
    warmup: int = 50
    margin: float = 1.1
    prior_steps: float = PRIOR_STEPS
    prior_spread: float = PRIOR_SPREAD
    prior_delay: float = PRIOR_DELAY
    noise: float = NOISE
    prune: float = 3.0
    dense_over: float = DENSE_OVER
    stop_z: float = 2.5
    stop_after: int = 4
    explore_share: float = 0.1

    def opens_at(
        self, seconds: float | None = None, fastest: float | None = None, led: bool = False
    ) -> int:
        """Steps after the learner's first step at which its first window opens, the
        warm-up's last window being the first round's opening one. The warm-up lasts as
        many seconds as ``warmup`` steps of the fastest arm, its first arm predicted at
        ``seconds`` a step and the fastest proposed at ``fastest`` (None: ``warmup`` steps):
        on a slow link the safe arm's steps are the dearest of the run. No warm-up (0)
        where a compressor leads the round (``led``, :func:`leading`): its window opens
        the run.

        Example:
          >>> Learning(window=20, warmup=50).opens_at(), Learning(window=20, warmup=10).opens_at()
          (30, 0)
          >>> Learning(window=20, warmup=50).opens_at(0.05, 0.02)  # 20 steps: 10 + a window of 10
          10
          >>> Learning(window=20, warmup=200).opens_at(0.5, 0.02, led=True)  # a lead: no warm-up
          0
        """
        if led:
            return 0  # the lead's window opens the round (:func:`leading`)
        warm = self.warmup
        if seconds and fastest:
            warm = round(self.warmup * min(1.0, fastest / seconds))
        return max(0, warm - self.steps_for(seconds, fastest))

    def for_run(self, dense_steps: int | None) -> Learning:
        """These settings for a run whose dense training needs about ``dense_steps`` to reach
        its target (what its schedule is set for; None: unknown, unchanged): the prior's
        steps factor becomes a delay of ``prior_delay`` steps over that run, no more than
        ``prior_steps`` (a run too short to read as a delay keeps the factor).

        Example:
          >>> [Learning().for_run(n).prior_steps for n in (None, 100, 2000)]
          [2.5, 2.5, 1.089]
        """
        if dense_steps is None:
            return self
        if not (isinstance(dense_steps, int) and dense_steps >= 1):
            raise ValueError(f"dense_steps must be an int >= 1 or None, got {dense_steps!r}")
        prior = min(self.prior_steps, 1.0 + self.prior_delay / dense_steps)
        return dataclasses.replace(self, prior_steps=prior)

    def most_steps(self) -> float:
        """The steps factor (over dense's) that the prior puts 95 % of compressors under.

        Example:
          >>> round(Learning().most_steps(), 1)
          5.7
        """
        return self.prior_steps * math.exp(_UPPER * self.prior_spread)

    def outpaced(self, safe_seconds: float, cheapest: float) -> bool:
        """Whether a safe arm at ``safe_seconds`` a step cannot win against a compressor at
        ``cheapest`` unless the prior is far off: it is dearer a step by more than the
        compressor's steps at the prior's 95th percentile (:meth:`most_steps`).

        Example:
          >>> Learning().outpaced(0.060, 0.010), Learning().outpaced(0.050, 0.010)
          (True, False)
        """
        return safe_seconds > cheapest * self.most_steps()

    def steps_for(self, seconds: float | None, fastest: float | None) -> int:
        """The steps of a window of an arm measured at ``seconds`` per step, when the
        fastest arm measured runs ``fastest`` (None: not measured yet, a full window): as
        many seconds as ``window`` steps of the fastest, and at least half a window (and
        ``settle`` + 3) for a slope.

        Example:
          >>> [Learning(window=20).steps_for(s, 0.02) for s in (0.02, 0.03, 0.08)]
          [20, 13, 10]
        """
        if not seconds or not fastest:
            return self.window
        floor = max(self.settle + 3, self.window // 2)
        return max(floor, min(self.window, round(self.window * fastest / seconds)))

    def __post_init__(self) -> None:
        if self.window < 4 or not 0 <= self.settle <= self.window - 3:
            raise ValueError(
                f"Learning.window must be >= 4 and settle leave >= 3 steps of it, got "
                f"window={self.window}, settle={self.settle}"
            )
        if self.rounds < 1:
            raise ValueError(f"Learning.rounds must be >= 1, got {self.rounds}")
        if min(self.recheck_every, self.confirm) < 1 or self.warmup < 0:
            raise ValueError("Learning.recheck_every and confirm must be >= 1, warmup >= 0")
        if not (math.isfinite(self.margin) and self.margin >= 1.0):
            raise ValueError(f"Learning.margin must be finite and >= 1, got {self.margin}")
        if not (self.prior_steps >= 1.0 and self.prior_spread > 0 and 0 < self.noise < math.inf
                and self.prior_delay >= 0):  # fmt: skip
            raise ValueError(
                f"Learning.prior_steps must be >= 1, prior_spread > 0, prior_delay >= 0 and "
                f"noise finite > 0, got prior_steps={self.prior_steps}, "
                f"prior_spread={self.prior_spread}, prior_delay={self.prior_delay}, "
                f"noise={self.noise}"
            )
        if not self.prune > 1.0:
            raise ValueError(f"Learning.prune must be > 1, got {self.prune}")
        if not self.dense_over >= 1.0:
            raise ValueError(f"Learning.dense_over must be >= 1, got {self.dense_over}")
        if not 0 < self.explore_share <= 1:
            raise ValueError(f"Learning.explore_share must be in (0, 1], got {self.explore_share}")
        if not (self.stop_z > 0 and 2 <= self.stop_after <= self.window):
            raise ValueError(
                f"Learning.stop_z must be > 0 (math.inf: never stop) and stop_after between 2 "
                f"and window, got stop_z={self.stop_z}, stop_after={self.stop_after}"
            )


def leading(
    arms: Sequence[str],
    first: int,
    predicted: Mapping[str, float],
    learning: Learning,
    skip: Mapping[str, float] | None = None,
) -> int | None:
    """The compressor whose window opens the first round before the safe arm's (the
    *lead*), or None: of the ``arms`` not ``skip``-ped, the one ``predicted`` cheapest a
    step, where the safe ``first`` arm is :meth:`Learning.outpaced` by it (dense ruled out:
    a slow link). The safe window could then only be the round's reference, at the round's
    highest price; the lead's window measures what the model leaves out (the compute every
    arm shares) before the safe arm runs at all (:meth:`Learner._leave_out_outpaced`); where
    the safe arm is left out the lead is decided, and is the reference the others are read
    against at a re-check. A led learner has no warm-up (:meth:`Learning.opens_at`).

    Example:
      >>> leading(["dense", "blockquant", "gtopk"], 1, {"blockquant": 0.5, "gtopk": 0.02},
      ...         Learning(), {"dense": 1.0})
      2
      >>> leading(["dense", "blockquant", "gtopk"], 1, {"blockquant": 0.05, "gtopk": 0.02},
      ...         Learning(), {"dense": 1.0})  # not outpaced: the safe arm opens
    """
    skip = skip or {}
    lossy = [i for i, a in enumerate(arms) if a not in skip and not is_safe(a) and a in predicted]
    if not lossy or arms[first] not in predicted:
        return None
    lead = min(lossy, key=lambda i: (predicted[arms[i]], arms[i]))
    return lead if learning.outpaced(predicted[arms[first]], predicted[arms[lead]]) else None


class Learner:
    """Which arm each step runs, from the windows' losses and seconds (see the module).

    Args:
      arms: the candidates' names, dense first (the steps factors' reference).
      learning: the exploration's settings.
      start: the first step the learner schedules (before it: the ``first`` arm).
      first: the safe arm that opens every round (:func:`first_arm`).
      skip: arms that run no window, each with the predicted seconds per step that ruled it
        out (:func:`skipped`).
      predicted: the model's seconds per step of the arms, which size the first window
        before any is measured (as :meth:`Learning.opens_at` sizes the warm-up).
      timed: each arm's seconds per step, timed at start on the run's own state (the
        caller's steps, their results dropped). With every arm not skipped timed, the
        prior decides at ``start`` (:meth:`_decide_by_prior`) and the first round opens
        once it is cheap beside the run so far (:meth:`priced`); the arm decided before
        any window is then named by a ``"decision"`` of ``"prior": True``.

    Example:
      >>> learner = Learner(["dense", "gtopk"], Learning(window=4, settle=0, rounds=1))
      >>> learner.window_at(0)  # each window is planned when the one before it closes
      (0, 3, 'dense')
      >>> learner.close(3, [4.0, 3.9, 3.8, 3.7], 1.0)  # dense: 0.1 per step, 0.4 per s
      >>> learner.window_at(4)
      (4, 7, 'gtopk')
      >>> learner.close(7, [3.7, 3.5, 3.3, 3.1], 1.0)  # gtopk: 0.2 per step, 0.8 per s
      >>> learner.window_at(8)  # both arms measured at 0.25 s a step: a full window
      (8, 11, 'dense')
      >>> learner.close(11, [3.1, 3.0, 2.9, 2.8], 1.0)  # dense again
      >>> learner.arm_at(12), learner.chosen
      (1, 'gtopk')
    """

    def __init__(
        self,
        arms: Sequence[str],
        learning: Learning | None = None,
        start: int = 0,
        first: int = 0,
        skip: Mapping[str, float] | None = None,
        predicted: Mapping[str, float] | None = None,
        timed: Mapping[str, float] | None = None,
    ):
        if not arms or len(set(arms)) != len(arms):
            raise ValueError(f"Learner.arms must be distinct names, dense first; got {arms!r}")
        if not 0 <= first < len(arms):
            raise ValueError(f"Learner.first must index arms (0 to {len(arms) - 1}), got {first}")
        skip = dict(skip or {})
        if set(skip) - set(arms) or arms[first] in skip:
            raise ValueError(f"Learner.skip must name arms other than the first, got {skip!r}")
        self.arms = list(arms)
        self.learning = learning or Learning()
        self.windows: list[dict[str, Any]] = []
        self.chosen: str | None = None
        self._plan: list[tuple[int, int, int]] = []  # (first step, last step, arm)
        self._queue: list[int] = []  # the round's arms not planned yet
        self._first = first
        self._predicted = dict(predicted or {})
        self._timed = dict(timed or {})
        self._decided_at = start  # the chosen arm runs from here (before: the first)
        self._cut = False  # the open window was cut short (:meth:`cut`)
        self._rounds = 0  # rotates the bracketed arms by one each round
        self._rechecks = 0  # full re-checks planned: each waits twice the one before
        self._lead: int | None = None  # the compressor opening in the safe arm's place
        _decisions.append({"event": "arms", "step": start, "arms": list(self.arms),
                           "prior_steps": self.learning.prior_steps})  # fmt: skip
        if skip:
            _decisions.append({"event": "skipped", "step": start, "predicted_s": skip})
        active = [i for i, a in enumerate(self.arms) if a not in skip]
        if len(active) == 1:  # nothing to compare: decided at once
            self.chosen = self.arms[active[0]]
            _decisions.append(
                {"event": "decision", "step": start, "choice": self.chosen,
                 "loss_decrease_per_s": {}, "seconds_per_step": {}, "steps_factor": {}}
            )  # fmt: skip
            return
        self._pool = active  # the arms still in play (:meth:`_prune` drops from it)
        seconds = {**self._predicted, **self._timed}
        self._lead = leading(self.arms, first, seconds, self.learning, skip)
        if all(self.arms[i] in self._timed for i in active):
            self._decide_by_prior(start, active)
            return
        self._explore(start, self.learning.rounds, active)

    def _decide_by_prior(self, start: int, active: list[int]) -> None:
        """Decides at ``start`` on the arms' timed seconds and the prior alone: each
        compressor's expected steps are the prior's mean, the safe arms' dense's, and a pick
        must beat the guard by ``margin`` (:meth:`_choose`); then plans the first round
        where it is cheap enough (:meth:`priced`)."""
        names = [self.arms[i] for i in active]
        seconds = {a: self._timed[a] for a in names}
        mean = steps_posterior(0.0, 0.0, 0.0, 0.0, self.learning.prior_steps,
                               self.learning.prior_spread, self.learning.noise)  # fmt: skip
        factors = {a: 1.0 if is_safe(a) else mean for a in names}
        cost = {a: seconds[a] * factors[a] for a in names}
        zero = dict.fromkeys(names, 0.0)
        _, pick = self._choose(Measured(zero, seconds, zero, factors, cost, 0.0), names)
        self.chosen = pick
        explores_at = self.priced(start, active)
        _decisions.append(
            {"event": "decision", "step": start, "choice": pick, "kept": False, "prior": True,
             "loss_decrease_per_s": {}, "seconds_per_step": seconds, "steps_factor": factors,
             "steps_factor_measured": {}, "seconds_per_dense_step": cost,
             "explores_at": explores_at}
        )  # fmt: skip
        self._explore(explores_at, self.learning.rounds, active)

    def priced(self, start: int, active: Sequence[int]) -> int:
        """The step at which a round of the ``active`` arms costs at most ``explore_share``
        of the run's seconds so far: the round's seconds are each arm's window
        (:meth:`Learning.steps_for`) at its timed seconds, the safe arms outpaced by the
        cheapest compressor left out (:meth:`_leave_out_outpaced`); the run's, the first
        arm's steps before ``start`` and the decided arm's after it.

        Example:
          >>> learner = Learner(["dense", "gtopk"], Learning(window=10), 0,
          ...                   timed={"dense": 0.04, "gtopk": 0.01})
          >>> learner.chosen  # 0.01 s a step times the prior's 2.8 steps beat dense's 0.04 s
          'gtopk'
          >>> learner.priced(0, [0, 1])  # dense 6 steps twice, gTop-k 10: 0.58 s, a tenth of 5.8
          580
        """
        seconds = {self.arms[i]: self._timed[self.arms[i]] for i in active}
        fastest = min(seconds.values())
        lossy = [s for a, s in seconds.items() if not is_safe(a)]
        safe = [a for a in seconds if is_safe(a)
                and not (lossy and self.learning.outpaced(seconds[a], min(lossy)))]  # fmt: skip
        runs = [a for a in seconds if not is_safe(a) or a in safe]
        if safe and lossy:  # the safe arms bracket the others: the opening one runs twice
            runs.append(min(safe, key=lambda a: (seconds[a], a)))
        cost = sum(self.learning.steps_for(seconds[a], fastest) * seconds[a] for a in runs)
        before = start * self._timed.get(self.arms[self._first], fastest)
        each = seconds.get(self.chosen, fastest)
        return start + max(0, math.ceil((cost / self.learning.explore_share - before) / each))

    def _explore(self, start: int, rounds: int, active: list[int]) -> None:
        """Plans ``rounds`` rounds of the ``active`` arms from ``start`` (one at a time: the
        first may prune), then the decision."""
        self._explored_from, self._rounds_left = start, rounds
        self._active = active
        self._plan_round(start)

    def _next_exploration(self, step: int, switched: bool) -> None:
        """After the decision at ``step``: a switch to an arm that is not safe is confirmed
        after ``confirm`` steps against the safe arms still in play (none left: no
        confirmation); then every arm in play is re-checked after ``recheck_every`` steps,
        each further re-check waiting twice as long as the one before. In the runs a
        re-check's pick was no better than keeping the decision (docs/cost-model.md), and
        each of its windows of another compressor costs the run, most where it sets the
        training back: re-checks guard against a change late in training, "now and then"."""
        pool = self._pool
        if len(pool) < 2:  # nothing left to compare: the decision stands
            self._plan = []
            return
        confirming = [i for i in pool if is_safe(self.arms[i]) or self.arms[i] == self.chosen]
        if switched and len(confirming) > 1:
            self._explore(step + self.learning.confirm, 1, confirming)
            return
        wait = self.learning.recheck_every * 2**self._rechecks
        self._rechecks += 1
        self._explore(step + wait, 1, pool)

    def _order(self) -> list[int]:
        """One round's arms: the safe ones bracket the others, which rotate by one a round.
        Until a safe window has run, the lead (:func:`leading`) goes first, and brackets
        the others where no safe arm is left (the trend is then fitted against it)."""
        safe = [i for i in self._active if is_safe(self.arms[i])]
        others = [i for i in self._active if i not in safe]
        if others:
            turn = self._rounds % len(others)
            others = others[turn:] + others[:turn]
        lead = self._lead if self._lead in others and not self._safe_ran() else None
        if lead is not None:
            others = [lead, *(i for i in others if i != lead)]
        if not safe:
            return [*others, lead] if lead is not None and len(others) > 1 else others
        opener = self._first if self._first in safe else safe[0]
        rest = [i for i in safe if i != opener]
        if not others:
            return [opener, *rest]
        if lead is not None:
            return [lead, opener, *others[1:], *(rest or [opener])]
        return [opener, *others, *(rest or [opener])]

    def _safe_ran(self) -> bool:
        """Whether any safe arm has run a window."""
        return any(is_safe(w["arm"]) for w in self.windows)

    def _plan_round(self, start: int) -> None:
        """One round of windows from ``start`` (:meth:`_order`), planned one at a time: a
        window's steps follow the seconds measured before it (:meth:`_plan_next`)."""
        self._queue = self._order()
        self._plan = []
        self._rounds += 1
        self._rounds_left -= 1
        self._plan_next(start)

    def _plan_next(self, start: int) -> None:
        """The round's next window from ``start``, as long in seconds as a full window of
        the fastest arm measured (:meth:`Learning.steps_for`)."""
        arm = self._queue.pop(0)
        # Measured seconds; before any window, the model's (the warm-up's opening window).
        latest = self._latest_seconds() or self._predicted
        measured = [latest[self.arms[i]] for i in self._active if self.arms[i] in latest]
        steps = self.learning.steps_for(latest.get(self.arms[arm]), min(measured, default=None))
        self._plan.append((start, start + steps - 1, arm))

    def _latest_seconds(self) -> dict[str, float]:
        """Each arm's seconds per step in its latest window, or as timed at start (what plans
        the next windows)."""
        return {**self._timed, **{w["arm"]: w["seconds_per_step"] for w in self.windows}}

    def _rates(self) -> Measured:
        """What this exploration's windows say of each active arm (:func:`measure`). Where
        no safe arm ran in it (all pruned), the latest safe window before it joins as the
        reference the others' steps are read against (the fitted trend carries it to their
        time): without one, a compressor that set the training back would look as good as
        any (the prior alone). Where no safe arm ever ran (:meth:`_leave_out_outpaced`), the
        lead is the reference."""
        names = [self.arms[i] for i in self._active]
        since = [w for w in self.windows if w["first_step"] >= self._explored_from]
        anchor = None
        if not any(is_safe(w["arm"]) for w in since):
            last = next((w for w in reversed(self.windows) if is_safe(w["arm"])), None)
            if last is not None:
                since, names = [last, *since], [*dict.fromkeys([*names, last["arm"]])]
            elif self._lead is not None:  # no safe arm ever ran: the lead is the reference
                anchor = self.arms[self._lead]
        return measure(since, names, self.learning, self.windows, anchor)

    def _kept(self, measured: Measured) -> list[int]:
        """The active arms fast enough per step to win: credited with the greatest decrease
        per step any arm showed, an arm whose rate is still below the best's over ``prune``
        is dropped. Only its seconds can drop it (a decrease measured in one window is
        confounded with when the window ran), and further windows of it would only cost
        time."""
        per_step, seconds, rate = measured.per_step, measured.seconds, measured.rate
        best, most = max(rate.values()), max(per_step.values())
        if best <= 0:
            return list(self._active)
        return [
            i
            for i in self._active
            if most / max(seconds[self.arms[i]], 1e-12) * self.learning.prune >= best
        ]

    def _prune(self, step: int, measured: Measured | None = None) -> None:
        """Drops the arms too slow per step to win (:meth:`_kept`), on this exploration's
        windows or on ``measured`` (a decision's)."""
        measured = measured or self._rates()
        keep = self._kept(measured)
        dropped = [self.arms[i] for i in self._active if i not in keep]
        if dropped:
            _decisions.append(
                {"event": "pruned", "step": step, "arms": dropped, "rates": measured.rate}
            )
            self._active = keep
            self._pool = [i for i in self._pool if self.arms[i] not in dropped]

    def _span(self, step: int) -> tuple[int, int, int] | None:
        """The planned window holding ``step``: ``(first step, last step, arm index)``."""
        return next((p for p in self._plan if p[0] <= step <= p[1]), None)

    def window_at(self, step: int) -> tuple[int, int, str] | None:
        """The planned window holding ``step``: ``(first step, last step, arm)``, or None."""
        span = self._span(step)
        return None if span is None else (span[0], span[1], self.arms[span[2]])

    def arm_at(self, step: int) -> int:
        """The arm of ``step`` (steps are asked in increasing order)."""
        span = self._span(step)
        if span is not None:
            return span[2]
        if self.chosen is not None and step >= self._decided_at:
            return self.arms.index(self.chosen)
        return self._first

    def in_window(self, step: int) -> bool:
        """Whether ``step`` belongs to a planned window (its loss is then due)."""
        return self._span(step) is not None

    def window_start(self, step: int) -> bool:
        """Whether ``step`` is the first of a planned window (its clock starts then)."""
        span = self._span(step)
        return span is not None and span[0] == step

    def window_end(self, step: int) -> bool:
        """Whether ``step`` is the last of a planned window (its losses are then due)."""
        span = self._span(step)
        return span is not None and span[1] == step

    def cut_due(self, step: int, count: int) -> bool:
        """Whether :meth:`cut` tests the window holding ``step`` after its first ``count``
        steps (their losses are then due): a window of an arm that is not safe, at least
        ``stop_after`` steps in and before its last, that follows directly another window.

        Example:
          >>> learner = Learner(["dense", "gtopk"], Learning(window=8, settle=0, stop_after=4))
          >>> learner.cut_due(3, 4)  # dense's window: safe, never cut
          False
        """
        span = self._span(step)
        if span is None or step >= span[1] or is_safe(self.arms[span[2]]):
            return False
        if count < self.learning.stop_after:
            return False
        # After a cut window too: its end level is mid-rise, but the window after it
        # inherits the residual that caused the rise, and left untested it often rose on.
        return self._window_before(span[0]) is not None

    def cut(self, step: int, losses: Sequence[float]) -> bool:
        """Whether the window holding ``step`` ends early, at ``step``; if so its plan ends
        there and the caller closes it now (:meth:`close`).

        Only an arm that is not safe, after ``stop_after`` steps, whose window follows
        directly another (:meth:`cut_due`): it ends when the mean of its
        ``losses`` so far (the window's steps up to ``step``, averaged over the ranks) lies
        above the level at which the window before it ended by more than ``stop_z``
        standard errors of the difference (each side's scatter of batch losses). A
        compressor that sets the training back does so while its window runs (a loss that
        rises, not one that falls slowly), and every further step of it is a step the run
        must undo; one that is merely slow runs its whole window.

        Args:
          step: a step of the window, not its last.
          losses: the window's losses up to ``step``, in order.
        """
        if not self.cut_due(step, len(losses)):
            return False
        span, before = self._span(step), self.windows[-1]
        rise = statistics.fmean(losses) - before["end_level"]
        error = math.sqrt(
            before["end_scatter"] ** 2 / before["end_points"]
            + statistics.variance(losses) / len(losses)
        )
        if not rise > self.learning.stop_z * error:
            return False
        self._plan[self._plan.index(span)] = (span[0], step, span[2])
        self._cut = True
        return True

    def close(self, step: int, losses: Sequence[float], seconds: float) -> None:
        """Records the window that ended at ``step`` (its steps' losses, averaged over the
        ranks, and its seconds, the largest over the ranks); decides once the exploration's
        last window is in.

        Args:
          step: the window's last step.
          losses: each step's loss, in order.
          seconds: the window's wall clock.
        """
        first, last, arm = self._span(step)
        settle = self._settle(first, arm, losses)
        per_step, rate = window_rate(losses, seconds, settle)
        end = [float(v) for v in losses[-LEVEL:]]
        record = {
            "event": "window",
            "first_step": first,
            "last_step": last,
            "arm": self.arms[arm],
            "loss_decrease_per_step": per_step,
            "loss_decrease_se": slope_error(losses, settle),
            "loss_decrease_per_s": rate,
            "seconds_per_step": seconds / max(1, len(losses)),
            "cut": self._cut,
            "settle": settle,
            # The level it ended at, which the next window's cut is tested against.
            "end_level": statistics.fmean(end),
            "end_scatter": statistics.stdev(end) if len(end) > 1 else 0.0,
            "end_points": len(end),
        }
        self._cut = False
        self.windows.append(record)
        _decisions.append(record)
        if self._queue and is_safe(self.arms[self._queue[0]]):
            self._leave_out_outpaced(step + 1)
        if self._queue:
            self._plan_next(step + 1)
            return
        if self._rounds_left > 0:
            self._prune(step + 1)
        if self._rounds_left > 0 and len(self._active) > 1:
            self._plan_round(step + 1)
        else:
            self._decide(step + 1)

    def _leave_out_outpaced(self, step: int) -> None:
        """Leaves out the safe window due at ``step`` (and records so) where its arm's seconds
        a step exceed the cheapest compressor's measured in the round by more than the steps
        any compressor needs at the prior's 95th percentile (:meth:`Learning.outpaced`): the
        safe arm cannot win unless the prior is far off, and on such a link its window is the
        round's dearest.

        * The round's closing window (``"unbracketed"``): the compressors are read against
          the opening safe window alone (the trend then goes unfitted: a later, slower safe
          window would only lower the safe decrease, and with it their steps). A second safe
          arm that has not run in the round (the guard opened it) leaves play.
        * A window before any safe one ran (after the lead's, :meth:`_order`;
          ``"outpaced"``): its arm's seconds are the model's plus what the lead's window
          measured beyond the model's (:meth:`_estimated`). The safe arms leave the run, and
          the round ends on the lead's window: the compressors share one prior steps factor,
          so the prior ranks them by their seconds a step and picks the lead, and short
          windows seldom move it (``benchmarks/steps_prior.py``) while each costs a share of
          a short run. The re-check tries the others, read against the lead, its steps taken
          at the prior's median (:func:`measure`'s ``anchor``)."""
        due = self.arms[self._queue[0]]
        latest = self._latest_seconds()
        seconds = latest.get(due) or self._estimated(due)
        lossy = [latest[self.arms[i]] for i in self._active
                 if not is_safe(self.arms[i]) and self.arms[i] in latest]  # fmt: skip
        if not (seconds and lossy) or not self.learning.outpaced(seconds, min(lossy)):
            return
        record = {"step": step, "arm": due, "seconds_per_step": seconds, "cheapest": min(lossy)}
        if len(self._queue) == 1:
            self._queue = []
            _decisions.append({"event": "unbracketed", **record})
            since = {w["arm"] for w in self.windows if w["first_step"] >= self._explored_from}
            if due not in since:  # a second safe arm, not the opener: out of play
                self._active = [i for i in self._active if self.arms[i] != due]
                self._pool = [i for i in self._pool if self.arms[i] != due]
            return
        safe = [i for i in self._active if is_safe(self.arms[i])]
        self._pool = [i for i in self._pool if i not in safe]
        self._active, self._queue = [i for i in self._active if i == self._lead], []
        _decisions.append({"event": "outpaced", **record, "arms": [self.arms[i] for i in safe]})

    def _estimated(self, name: str) -> float | None:
        """The seconds a step of ``name``, which ran no window: the model's (None: none)
        plus the least excess of a measured arm's seconds over the model's (the compute every
        arm shares, which the model leaves out)."""
        if name not in self._predicted:
            return None
        latest = self._latest_seconds()
        excess = [latest[a] - self._predicted[a] for a in latest if a in self._predicted]
        return self._predicted[name] + max(0.0, min(excess, default=0.0))

    def _settle(self, first: int, arm: int, losses: Sequence[float]) -> int:
        """The first steps of the window from ``first`` left out of its slope: none for a
        window cut short (its rise after the switch is what it measured); for a safe arm's
        window that follows steps of an arm that is not safe (:meth:`flushes`), those until
        its loss is back at the level the window before it ended at (within that level's
        scatter), at most half the window, and half after the decided arm's steps (no level
        recorded); ``settle`` otherwise."""
        settle = self.learning.settle
        if self._cut:
            return 0
        if not (is_safe(self.arms[arm]) and self.flushes(first)):
            return settle
        before = self._window_before(first)
        most = max(settle, len(losses) // 2)
        if before is None:  # after the decided arm's steps
            return most
        level = before["end_level"] + before["end_scatter"]
        back = (j for j in range(settle, most) if losses[j] <= level)
        return next(back, most)

    def flushes(self, first: int) -> bool:
        """Whether the step before ``first`` ran an arm that is not safe: a safe window from
        ``first`` then sends at its first step all that arm held back (the shared residual
        of its unsent values), a stale update whose spike and recovery its first steps read
        as a fall faster than the arm's own; in the runs the round's closing safe window
        read a greater decrease than its opening one, later in training, more often than
        not (docs/cost-model.md)."""
        before = self._window_before(first)
        if before is not None:
            return not is_safe(before["arm"])
        ran = self.chosen if self.chosen is not None else self.arms[self._first]
        return not is_safe(ran)

    def _window_before(self, first: int) -> dict[str, Any] | None:
        """The window that ended at the step before ``first``, or None (the warm-up's or the
        decided arm's steps ran there)."""
        return next((w for w in reversed(self.windows) if w["last_step"] == first - 1), None)

    def _choose(self, measured: Measured, names: Sequence[str]) -> tuple[str, str]:
        """The arm of ``names`` of least expected seconds per dense step (:func:`best_arm`)
        and the pick: that arm where it beats the arm it displaces by ``margin`` (the guard
        at first, the decided arm at a re-check: a switch costs a confirmation round), else
        the displaced arm. The guard opens the rounds from then on."""
        cost = measured.cost
        guard = fastest_safe(measured.seconds)
        best = pick = best_arm(measured, names)
        standing = self.chosen if self.chosen in cost else guard
        if standing is not None and cost[best] * self.learning.margin >= cost[standing]:
            pick = standing
        if guard is not None:
            self._first = self.arms.index(guard)
        return best, pick

    def _decide(self, step: int) -> None:
        """Takes the arm of least expected seconds per dense step over the windows since the
        last decision (:func:`best_arm`); plans the re-check without the arms its
        measurements prune."""
        measured = self._rates()
        per_step, seconds, rate, factors, cost, reference = measured
        best, pick = self._choose(measured, [self.arms[i] for i in self._active])
        # A re-check with no falling safe loss to read the steps against keeps the
        # decision: the prior alone ranks by seconds a step, which the decision weighed
        # with more to go on.
        if self.chosen in cost and reference <= 0:
            pick = self.chosen
        kept = pick == self.chosen and best != pick
        switched = pick != self.chosen and not is_safe(pick)
        self.chosen = pick
        record = {
            "event": "decision",
            "step": step,
            "choice": pick,
            "kept": kept,
            "loss_decrease_per_s": rate,
            "seconds_per_step": seconds,
            "steps_factor": factors,
            "steps_factor_measured": measured_factors(per_step),
            "seconds_per_dense_step": cost,
        }
        _decisions.append(record)
        self._prune(step, measured)
        self._next_exploration(step, switched)


def compiled(step: int, arms: Sequence[str], seconds: float) -> None:
    """Records that the programs of ``arms`` compiled before ``step``, in ``seconds``
    (outside the training clock: an event of :func:`decisions`).

    Example:
      >>> compiled(1, ["gtopk"], 0.5)
      >>> decisions()[-1]["event"]
      'compiled'
    """
    _decisions.append({"event": "compiled", "step": step, "arms": list(arms), "seconds": seconds})


def timed(step: int, seconds: Mapping[str, float], spent: float) -> None:
    """Records each arm's ``seconds`` a step as timed before ``step`` (on a copy of its
    arguments, outside the training clock), and the ``spent`` seconds the timing took (an
    event of :func:`decisions`).

    Example:
      >>> timed(1, {"dense": 0.02, "gtopk": 0.01}, 0.09)
      >>> decisions()[-1]["seconds_per_step"]
      {'dense': 0.02, 'gtopk': 0.01}
    """
    _decisions.append(
        {"event": "timed", "step": step, "seconds_per_step": dict(seconds), "seconds": spent}
    )


def decisions() -> list[dict[str, Any]]:
    """The learners' windows and decisions in this process, in order: ``{"event": "window",
    "arm", "first_step", "last_step", "loss_decrease_per_step", "loss_decrease_per_s",
    "seconds_per_step", "cut", "settle", "end_level"}`` (``cut``: ended early,
    :meth:`Learner.cut`; ``settle``: its first steps left out of the slope)
    and ``{"event": "decision", "step", "choice", "kept", "loss_decrease_per_s",
    "seconds_per_step", "steps_factor", "steps_factor_measured", "seconds_per_dense_step"}``
    (per arm; ``steps_factor``: the expected one the decision used, :func:`steps_posterior`),
    with ``"pruned"``, ``"skipped"``, ``"unbracketed"`` (a closing safe window left out),
    ``"outpaced"`` (the safe arms left out before they ran, :meth:`Learner._leave_out_outpaced`)
    and ``"timed"`` (each arm's seconds a step timed at start, :func:`timed`) events between
    them; a decision taken on the prior and the timed seconds alone has ``"prior": True``
    and the step its first round opens at (``"explores_at"``).

    Example:
      >>> isinstance(decisions(), list)
      True
    """
    return list(_decisions)
