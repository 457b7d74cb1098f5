"""Learning what a compressor costs in steps, from the run itself.

The cost model predicts seconds per step; what it cannot predict is how many more steps a
compressor needs on this model, optimizer and phase of training. :class:`Learner` measures it
as the run goes: it runs the candidate reductions ("arms": dense first, the guard, then the
compressors the model proposes) in short interleaved windows, compares them by the training
loss's decrease per second, keeps the best one, and re-checks now and then.

* A window is ``window`` steps of one arm. The loss decrease per step is the least-squares
  slope of the loss over the window's steps after its first ``settle`` (the switch's
  transient); its seconds are the window's wall clock (the largest over the ranks).
* A round runs every arm once, each round in an order rotated by one arm. The loss falls
  faster early in training than later, so the windows' decreases are fitted as an effect per
  arm plus a trend in time (:func:`arm_decrease`); an arm's rate is its decrease per step
  over its seconds per step.
* The first round starts with the fastest *safe* arm (:func:`first_arm`): the one whose
  prior says it needs dense's steps (dense, or a bounded-error quantizer predicted faster).
  Early windows move the loss the most, and a short run may reach its target within the
  exploration: they go to the arm least likely to waste them.
* The guard is the safe arm fastest per step (the safe arms share dense's steps, so only
  their seconds are compared). The decision takes the arm with the greatest rate; a sparse
  or one-bit arm must beat the guard's rate by ``margin`` (auto is never much worse than
  dense). The decided arm runs ``recheck_every`` steps, then one round re-checks every arm.
* Steps factors follow from the windows: dense's decrease per step over the arm's, what
  :class:`~jaxcomm.cost.Auto` otherwise takes as priors (:func:`propose` uses those priors
  only to rank the arms worth a trial).

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

from .choose import choose
from .model import DEFAULT_ALLOWED, Options, Profile, World, steps_factor_of
from .timemodel import predict

__all__ = [
    "Learner",
    "Learning",
    "arm_decrease",
    "decisions",
    "first_arm",
    "is_safe",
    "propose",
    "window_rate",
]

_decisions: list[dict[str, Any]] = []
SAFE = "safe"  # the class of the safe arms' windows in the fit (:func:`is_safe`)


@dataclasses.dataclass(frozen=True)
class Learning:
    """How :class:`Learner` explores.

    Args:
      window: steps per trial window.
      settle: first steps of a window left out of its slope (the switch's transient).
      rounds: rounds of the first exploration (each rotated by one arm).
      recheck_every: steps the decided arm runs before a round re-checks every arm.
      margin: a compressor is chosen over dense only when its rate exceeds dense's by this
        factor.
      prune: after the first round, an arm so slow per step that, even with the greatest
        decrease per step of any arm, its rate stays below the best's over this factor runs
        no further window (dense too: on a slow link its windows cost the most).

    Example:
      >>> Learning(window=10).window
      10
    """

    window: int = 10
    settle: int = 2
    rounds: int = 1
    recheck_every: int = 400
    margin: float = 1.1
    prune: float = 3.0

    def __post_init__(self) -> None:
        if self.window < 4 or not 0 <= self.settle <= self.window - 3:
            raise ValueError(
                f"Learning.window must be >= 4 and settle leave >= 3 steps of it, got "
                f"window={self.window}, settle={self.settle}"
            )
        if self.rounds < 1:
            raise ValueError(f"Learning.rounds must be >= 1, got {self.rounds}")
        if self.recheck_every < 1 or not (math.isfinite(self.margin) and self.margin >= 1.0):
            raise ValueError("Learning.recheck_every must be >= 1 and margin finite and >= 1")
        if not self.prune > 1.0:
            raise ValueError(f"Learning.prune must be > 1, got {self.prune}")


def window_rate(losses: Sequence[float], seconds: float, settle: int = 0) -> tuple[float, float]:
    """Loss decrease per step (the negated least-squares slope over ``losses[settle:]``) and
    per second of one window.

    Example:
      >>> window_rate([4.0, 3.0, 2.0, 1.0], 2.0)
      (1.0, 2.0)
    """
    ys = [float(v) for v in losses[settle:]]
    n = len(ys)
    if n < 2 or seconds <= 0:
        return 0.0, 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    slope = sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum(
        (i - mx) ** 2 for i in range(n)
    )
    per_step = -slope
    return per_step, per_step * len(losses) / seconds


class Learner:
    """Which arm each step runs, from the windows' losses and seconds (see the module).

    Args:
      arms: the candidates' names, dense first (the steps factors' reference).
      learning: the exploration's settings.
      start: the first step the learner schedules.
      first: the arm the first round starts with (:func:`first_arm`).

    Example:
      >>> learner = Learner(["dense", "gtopk"], Learning(window=4, settle=0, rounds=1))
      >>> [learner.arm_at(s) for s in range(8)]
      [0, 0, 0, 0, 1, 1, 1, 1]
      >>> learner.close(3, [4.0, 3.9, 3.8, 3.7], 1.0)  # dense: 0.1 per step, 0.4 per s
      >>> learner.close(7, [3.7, 3.5, 3.3, 3.1], 1.0)  # gtopk: 0.2 per step, 0.8 per s
      >>> learner.arm_at(8), learner.chosen
      (1, 'gtopk')
    """

    def __init__(
        self,
        arms: Sequence[str],
        learning: Learning | None = None,
        start: int = 0,
        first: int = 0,
    ):
        if not arms or len(set(arms)) != len(arms):
            raise ValueError(f"Learner.arms must be distinct names, dense first; got {arms!r}")
        if not 0 <= first < len(arms):
            raise ValueError(f"Learner.first must index arms (0 to {len(arms) - 1}), got {first}")
        self.arms = list(arms)
        self.learning = learning or Learning()
        self.windows: list[dict[str, Any]] = []
        self.chosen: str | None = None
        self._plan: list[tuple[int, int, int]] = []  # (first step, last step, arm)
        self._rounds = first  # the next round starts with this arm, each one arm later
        _decisions.append({"event": "arms", "step": start, "arms": list(self.arms)})
        if len(self.arms) == 1:  # nothing to compare: decided at once
            self.chosen = self.arms[0]
            _decisions.append(
                {"event": "decision", "step": start, "choice": self.chosen,
                 "loss_decrease_per_s": {}, "seconds_per_step": {}, "steps_factor": {}}
            )  # fmt: skip
            return
        self._explore(start, self.learning.rounds)

    def _explore(self, start: int, rounds: int) -> None:
        """Plans ``rounds`` rounds of every arm from ``start`` (one at a time: the first
        may prune), then the decision."""
        self._explored_from, self._rounds_left = start, rounds
        self._active = list(range(len(self.arms)))
        self._plan_round(start)

    def _plan_round(self, start: int) -> None:
        """One window per active arm from ``start``, in an order rotated by one each round."""
        w, k = self.learning.window, len(self._active)
        self._plan = [
            (start + j * w, start + (j + 1) * w - 1, self._active[(self._rounds + j) % k])
            for j in range(k)
        ]
        self._rounds += 1
        self._rounds_left -= 1
        self._round_end = start + k * w

    def _rates(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """Each active arm's (loss decrease per step, seconds per step, decrease per second)
        over this exploration's windows."""
        names = [self.arms[i] for i in self._active]
        since = [
            w for w in self.windows if w["first_step"] >= self._explored_from and w["arm"] in names
        ]
        # The safe arms share dense's steps: their windows are one class in the fit, so a
        # sparse arm's window between two of theirs is compared with the safe decrease
        # interpolated to when it ran, not with whichever safe window ran later.
        cls = {a: SAFE if is_safe(a) else a for a in names}
        pooled = [{**w, "arm": cls[w["arm"]]} for w in since]
        fitted = arm_decrease(pooled, list(dict.fromkeys(cls.values())))
        per_step = {a: fitted[cls[a]] for a in names}
        seconds = {
            a: statistics.fmean(w["seconds_per_step"] for w in since if w["arm"] == a)
            for a in names
        }
        rate = {a: per_step[a] / seconds[a] if seconds[a] > 0 else 0.0 for a in names}
        return per_step, seconds, rate

    def _prune(self, step: int) -> None:
        """Drops the arms too slow per step to win: credited with the greatest decrease per
        step any arm showed, an arm whose rate is still below the best's over ``prune``.
        Only its seconds can prune it (a decrease measured in one window is confounded with
        when the window ran), and further windows of it would only cost time."""
        per_step, seconds, rate = self._rates()
        best, most = max(rate.values()), max(per_step.values())
        if best <= 0:
            return
        keep = [
            i
            for i in self._active
            if most / max(seconds[self.arms[i]], 1e-12) * self.learning.prune >= best
        ]
        dropped = [self.arms[i] for i in self._active if i not in keep]
        if dropped:
            _decisions.append({"event": "pruned", "step": step, "arms": dropped, "rates": rate})
            self._active = keep

    def arm_at(self, step: int) -> int:
        """The arm of ``step`` (steps are asked in increasing order)."""
        for first, last, arm in self._plan:
            if first <= step <= last:
                return arm
        return self.arms.index(self.chosen) if self.chosen is not None else 0

    def in_window(self, step: int) -> bool:
        """Whether ``step`` belongs to a planned window (its loss is then due)."""
        return any(first <= step <= last for first, last, _ in self._plan)

    def window_start(self, step: int) -> bool:
        """Whether ``step`` is the first of a planned window (its clock starts then)."""
        return any(first == step for first, _, _ in self._plan)

    def window_end(self, step: int) -> bool:
        """Whether ``step`` is the last of a planned window (its losses are then due)."""
        return any(last == step for _, last, _ in self._plan)

    def close(self, step: int, losses: Sequence[float], seconds: float) -> None:
        """Records the window that ended at ``step`` (its steps' losses, averaged over the
        ranks, and its seconds, the largest over the ranks); decides once the exploration's
        last window is in.

        Args:
          step: the window's last step.
          losses: each step's loss, in order.
          seconds: the window's wall clock.
        """
        first, last, arm = next(p for p in self._plan if p[1] == step)
        per_step, rate = window_rate(losses, seconds, self.learning.settle)
        record = {
            "event": "window",
            "first_step": first,
            "last_step": last,
            "arm": self.arms[arm],
            "loss_decrease_per_step": per_step,
            "loss_decrease_per_s": rate,
            "seconds_per_step": seconds / max(1, len(losses)),
        }
        self.windows.append(record)
        _decisions.append(record)
        if step + 1 != self._round_end:
            return
        if self._rounds_left > 0:
            self._prune(step + 1)
        if self._rounds_left > 0 and len(self._active) > 1:
            self._plan_round(step + 1)
        else:
            self._decide(step + 1)

    def _decide(self, step: int) -> None:
        """Takes the best arm of the windows since the last decision; plans the re-check."""
        per_step, seconds, rate = self._rates()
        guard = _fastest_safe(seconds)
        others = [a for a in rate if not is_safe(a)]  # the guard is a safe arm
        best = max(others, key=lambda a: rate[a], default=guard)
        if guard is None:  # every safe arm was pruned: far slower than the best
            pick = max(rate, key=lambda a: rate[a])
        else:
            # The guard unless a compressor's loss falls faster per second by the margin; a
            # guard whose loss does not fall at all (rate <= 0) says nothing, and it stays.
            margin = self.learning.margin
            pick = best if rate[guard] > 0 and rate[best] > margin * rate[guard] else guard
        base = per_step.get(self.arms[0], 0.0)  # steps relative to dense
        factors = {a: base / d if d > 0 and base > 0 else None for a, d in per_step.items()}
        self.chosen = pick
        record = {
            "event": "decision",
            "step": step,
            "choice": pick,
            "loss_decrease_per_s": rate,
            "seconds_per_step": seconds,
            "steps_factor": factors,
        }
        _decisions.append(record)
        self._explore(step + self.learning.recheck_every, 1)


def _fastest_safe(seconds: Mapping[str, float]) -> str | None:
    """The guard: of the safe arms measured (:func:`is_safe`), the fastest per step. Their
    prior is dense's steps, so their windows' loss decreases, confounded with when each ran,
    are not compared: only their seconds are."""
    safe = [a for a in seconds if is_safe(a)]
    return min(safe, key=lambda a: (seconds[a], a)) if safe else None


def arm_decrease(windows: Sequence[Mapping[str, Any]], arms: Sequence[str]) -> dict[str, float]:
    """Each arm's loss decrease per step, the training's own slowing down taken out.

    The loss falls faster early in training than later, so a window's decrease depends on
    when it ran as much as on its arm. The windows' decreases are fitted as an effect per arm
    plus a polynomial in the window's position (none with one window per arm, linear with
    one or two more, quadratic beyond), by least squares; each arm's decrease is its effect
    plus the trend's mean over the windows. One spare window is enough for a line: an arm
    run between two windows of another is compared with that other interpolated.

    Args:
      windows: ``{"arm", "first_step", "last_step", "loss_decrease_per_step"}`` each; every
        arm has at least one.
      arms: the arms' names.

    Returns:
      name -> loss decrease per step.

    Example:
      >>> ws = [{"arm": a, "first_step": 10 * i, "last_step": 10 * i + 9,
      ...        "loss_decrease_per_step": d}
      ...       for i, (a, d) in enumerate([("A", 1.0), ("B", 0.8), ("B", 0.7), ("A", 0.5)])]
      >>> {a: round(v, 3) for a, v in arm_decrease(ws, ["A", "B"]).items()}
      {'A': 0.75, 'B': 0.75}
    """
    k = len(arms)
    spare = len(windows) - k  # windows beyond one per arm: each buys a trend coefficient
    degree = 0 if spare < 1 else min(2, max(1, spare - 1))
    centers = [(w["first_step"] + w["last_step"]) / 2 for w in windows]
    mid = statistics.fmean(centers)
    spread = max(1.0, max(abs(c - mid) for c in centers))
    xs = [(c - mid) / spread for c in centers]
    rows = [
        [1.0 if w["arm"] == a else 0.0 for a in arms] + [x ** (p + 1) for p in range(degree)]
        for w, x in zip(windows, xs, strict=True)
    ]
    ys = [float(w["loss_decrease_per_step"]) for w in windows]
    coef = _least_squares(rows, ys)
    trend = statistics.fmean(sum(coef[k + p] * x ** (p + 1) for p in range(degree)) for x in xs)
    return {a: coef[i] + trend for i, a in enumerate(arms)}


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Solves the normal equations of a small least-squares problem (Gaussian elimination
    with partial pivoting; a column without information gets 0)."""
    m = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(m)] for i in range(m)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(m)]
    for col in range(m):
        pivot = max(range(col, m), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-12:
            continue
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for i in range(m):
            if i != col and a[i][col]:
                f = a[i][col] / a[col][col]
                a[i] = [u - f * v for u, v in zip(a[i], a[col], strict=True)]
                b[i] -= f * b[col]
    return [b[i] / a[i][i] if abs(a[i][i]) >= 1e-12 else 0.0 for i in range(m)]


def propose(
    sizes: Sequence[int],
    world: World,
    profile: Profile,
    allowed: Sequence[str] = DEFAULT_ALLOWED,
    options: Options | None = None,
    top: int = 2,
) -> list[str]:
    """The arms worth a trial: dense, then at most ``top`` compressors of ``allowed`` whose
    step the model predicts faster than dense's: the fastest *safe* one (a prior steps factor
    of 1, :func:`is_safe`) first, then the others by their prior time to target (predicted
    seconds times the prior steps factor, which the trials then replace).

    The safe compressor takes a place of its own: ranked by prior time alone, a compressor
    predicted a little slower per step but needing no extra steps lost its trial to sparse
    ones whose prior, measured on another model, was off by an order of magnitude.

    Each compressor's arm sends a bucket by the compressor only where the model predicts its
    call faster than dense's (a small bucket goes dense either way): ``choose`` between the
    two, steps counted alike.

    Args:
      sizes: the step's buckets, elements each.
      world: the ranks.
      profile: the (measured) profile.
      allowed: the candidates.
      options: their settings (``element_bytes`` of the dense wire).
      top: most compressors proposed.

    Returns:
      ``["dense", ...]``.

    Example:
      >>> slow = World(2, 1, "across_hosts")
      >>> from jaxcomm.cost import DEFAULT_PROFILE
      >>> propose([10_000_000], slow, DEFAULT_PROFILE, ("dense", "gtopk", "onebit"))[0]
      'dense'
      >>> propose([100], slow, DEFAULT_PROFILE, ("dense", "gtopk"))  # nothing pays
      ['dense']
    """
    options = options or Options()
    dense = sum(predict("dense", n, world, profile, options).seconds for n in sizes)
    faster = {}
    for name in allowed:
        if name == "dense":
            continue
        pair = ("dense", name)
        seconds = 0.0
        for n in sizes:
            pick = choose(n, world, pair, profile, options, steps_factor={name: 1.0})
            seconds += predict(pick, n, world, profile, options).seconds
        if seconds < dense:
            faster[name] = seconds
    safe = sorted((a for a in faster if is_safe(a)), key=lambda a: (faster[a], a))[:1]
    rest = sorted(
        (a for a in faster if a not in safe), key=lambda a: (faster[a] * steps_factor_of(a), a)
    )
    return ["dense", *(safe + rest)[:top]]


def is_safe(name: str) -> bool:
    """Whether `name`'s prior says it needs no more steps than dense (a steps factor of at
    most 1 in :data:`~jaxcomm.cost.model.DEFAULT_STEPS_FACTOR`: dense, block int8)."""
    return steps_factor_of(name) <= 1.0


def first_arm(arms: Sequence[str]) -> int:
    """The arm a :class:`Learner` of :func:`propose`'s `arms` starts with: the safe
    compressor when one was proposed (the model predicts it faster than dense), else dense.

    Example:
      >>> first_arm(["dense", "blockquant", "gtopk"]), first_arm(["dense", "gtopk"])
      (1, 0)
    """
    return next((i for i, a in enumerate(arms) if i > 0 and is_safe(a)), 0)


def decisions() -> list[dict[str, Any]]:
    """The learners' windows and decisions in this process, in order: ``{"event": "window",
    "arm", "first_step", "last_step", "loss_decrease_per_step", "loss_decrease_per_s",
    "seconds_per_step"}`` and ``{"event": "decision", "step", "choice",
    "loss_decrease_per_s", "seconds_per_step", "steps_factor"}`` (per arm).

    Example:
      >>> isinstance(decisions(), list)
      True
    """
    return list(_decisions)
