"""Reading trial windows: each arm's loss decrease per step, the training's own slowing down
taken out, and the steps factor over dense's that it implies against a prior.

:class:`~jaxcomm.cost.learn.Learner` runs the windows; this module says what they show. A
window's decrease per step is the least-squares slope of its batch losses
(:func:`window_rate`, with its error :func:`slope_error`); the windows of a round are fitted as
an effect per arm plus a trend in time (:func:`arm_decrease`), the safe arms pooled in one
class (:func:`~jaxcomm.cost.arms.is_safe`: they share dense's steps); each other arm's steps
factor is the posterior mean of a log-normal prior given its decrease against the safe one
(:func:`steps_posterior`), and the arm of least expected seconds per dense step wins
(:func:`measure`, :func:`best_arm`).

Standard library only, deterministic in what it is fed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .arms import is_safe

if TYPE_CHECKING:
    from .learn import Learning

__all__ = [
    "NOISE",
    "PRIOR_DELAY",
    "PRIOR_SPREAD",
    "PRIOR_STEPS",
    "Measured",
    "arm_decrease",
    "best_arm",
    "fastest_safe",
    "measure",
    "measured_factors",
    "slope_error",
    "steps_posterior",
    "window_rate",
]

SAFE = "safe"  # the class of the safe arms' windows in the fit (:func:`is_safe`)
# The prior of every compressor's steps factor and how far windows are trusted against it
# (:class:`~jaxcomm.cost.learn.Learning` documents and takes them as its defaults).
PRIOR_STEPS = 2.5
PRIOR_SPREAD = 0.5
NOISE = 4.0
# The prior of a compressor's extra steps as a delay: the median steps beyond dense's that the
# compressors needed to reach the target on the workloads the prior's replay reads (every
# compressor at once, benchmarks/steps_delay.py, 2026-11-29; Learning.for_run reads it).
PRIOR_DELAY = 178.0


def _line(losses: Sequence[float], settle: int) -> tuple[float, float]:
    """The least-squares slope of ``losses[settle:]`` against their step and its standard
    error (the scatter about the line; 0 with under 3 points, both 0 with under 2)."""
    ys = [float(v) for v in losses[settle:]]
    n = len(ys)
    if n < 2:
        return 0.0, 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    slope = sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sxx
    if n < 3:
        return slope, 0.0
    scatter = sum((y - my - slope * (i - mx)) ** 2 for i, y in enumerate(ys)) / (n - 2)
    return slope, math.sqrt(scatter / sxx)


def window_rate(losses: Sequence[float], seconds: float, settle: int = 0) -> tuple[float, float]:
    """Loss decrease per step (the negated least-squares slope over ``losses[settle:]``) and
    per second of one window.

    Example:
      >>> window_rate([4.0, 3.0, 2.0, 1.0], 2.0)
      (1.0, 2.0)
    """
    per_step = -_line(losses, settle)[0]
    if len(losses) - settle < 2 or seconds <= 0:
        return 0.0, 0.0
    return per_step, per_step * len(losses) / seconds


def slope_error(losses: Sequence[float], settle: int = 0) -> float:
    """The standard error of :func:`window_rate`'s decrease per step: the least-squares
    slope's, from the scatter of ``losses[settle:]`` about their line (0 with under 3).

    Example:
      >>> slope_error([4.0, 3.0, 2.0, 1.0])
      0.0
    """
    return _line(losses, settle)[1]


class Measured(NamedTuple):
    """What windows say of each arm, by name (:func:`measure`)."""

    per_step: dict[str, float]  # loss decrease per step, the trend taken out
    seconds: dict[str, float]  # seconds per step
    rate: dict[str, float]  # decrease per second
    factors: dict[str, float]  # expected steps factor (safe arms: 1)
    cost: dict[str, float]  # seconds per step times the expected steps factor
    reference: float  # the safe decrease per step the factors were read against (0: none)


def measure(
    windows: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    learning: Learning,
    timed: Sequence[Mapping[str, Any]] | None = None,
    anchor: str | None = None,
) -> Measured:
    """Each of ``names``' loss decrease per step (the safe arms pooled in one class, fitted
    with the trend by :func:`arm_decrease`) and decrease per second over ``windows`` (each
    name has one at least), its seconds per step over ``timed`` (all its windows; None:
    ``windows``), its expected steps factor
    (:func:`steps_posterior`: against the safe arms' decrease, the prior of ``learning``)
    and its expected seconds per dense step.

    The safe arms share dense's steps: their windows are one class in the fit, so a window
    between two of theirs is compared with the safe decrease interpolated to when it ran,
    not with whichever safe window ran later. Where no safe arm ran (all pruned) or its
    loss did not fall, the windows cannot say how many more steps an arm needs than dense:
    the prior alone decides, unless an ``anchor`` (one of ``names``) is given. The others
    are then read against it, its steps taken at the prior's median: its decrease times the
    prior stands for the safe one, so the compressors are ranked on their windows against
    each other, as far as their errors allow.

    Example:
      >>> from jaxcomm.cost.learn import Learning
      >>> ws = [{"arm": a, "first_step": 20 * i, "last_step": 20 * i + 19,
      ...        "loss_decrease_per_step": d, "loss_decrease_se": 1e-5, "seconds_per_step": 0.01}
      ...       for i, (a, d) in enumerate([("gtopk", 0.02), ("onebit", 0.005), ("gtopk", 0.02)])]
      >>> measure(ws, ["gtopk", "onebit"], Learning()).factors  # no reference: the prior's mean
      {'gtopk': 2.83..., 'onebit': 2.83...}
      >>> {a: round(f, 1) for a, f in measure(ws, ["gtopk", "onebit"], Learning(),
      ...                                     anchor="gtopk").factors.items()}
      {'gtopk': 2.5, 'onebit': 10.0}
    """
    windows = [w for w in windows if w["arm"] in names]
    cls = {a: SAFE if is_safe(a) else a for a in names}
    pooled = [{**w, "arm": cls[w["arm"]]} for w in windows]
    fitted = arm_decrease(pooled, list(dict.fromkeys(cls.values())))
    per_step = {a: fitted[cls[a]] for a in names}
    # An arm's seconds a step are the world's, not the training's: over all its windows
    # (``timed``), weighted by their steps; one short window's, cut after 4 steps, erred by
    # a third and made a compressor that set the training back look the cheapest.
    steps, spent = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0)
    for w in timed or windows:
        if w["arm"] in steps:
            n = w["last_step"] - w["first_step"] + 1
            steps[w["arm"]] += n
            spent[w["arm"]] += w["seconds_per_step"] * n
    seconds = {a: spent[a] / steps[a] for a in names}
    rate = {a: per_step[a] / seconds[a] if seconds[a] > 0 else 0.0 for a in names}
    # Each class's error: the root sum of its windows' slope errors over their count.
    error = {
        c: math.sqrt(sum(w["loss_decrease_se"] ** 2 for w in group)) / len(group)
        for c in set(cls.values())
        if (group := [w for w, p in zip(windows, pooled, strict=True) if p["arm"] == c])
    }
    safe, safe_error = max(0.0, fitted.get(SAFE, 0.0)), error.get(SAFE, 0.0)
    if SAFE not in error and anchor in error:
        safe = max(0.0, learning.prior_steps * per_step[anchor])
        safe_error = learning.prior_steps * error[anchor]
    factors = {
        a: 1.0
        if is_safe(a)
        else steps_posterior(
            per_step[a], error[a], safe, safe_error,
            learning.prior_steps, learning.prior_spread, learning.noise,
        )
        for a in names
    }  # fmt: skip
    cost = {a: seconds[a] * factors[a] for a in names}
    return Measured(per_step, seconds, rate, factors, cost, safe)


def best_arm(measured: Measured, among: Sequence[str] | None = None) -> str:
    """The arm of ``among`` (None: all measured) of least expected seconds per dense step:
    the guard (:func:`fastest_safe`) stands for the safe arms, which share dense's steps,
    so only their seconds are compared; every other arm competes with it on its expected
    steps."""
    cost = {a: c for a, c in measured.cost.items() if among is None or a in among}
    guard = fastest_safe({a: measured.seconds[a] for a in cost})
    return min((a for a in cost if not is_safe(a) or a == guard), key=lambda a: (cost[a], a))


def measured_factors(per_step: Mapping[str, float]) -> dict[str, float | None]:
    """Steps relative to dense as the windows read them alone: the safe arms' shared
    decrease (dense's own, or the safe compressor's when dense ran no window) over each
    arm's (None where either did not fall)."""
    base = next((per_step[a] for a in per_step if is_safe(a)), 0.0)
    return {a: base / d if d > 0 and base > 0 else None for a, d in per_step.items()}


def steps_posterior(
    decrease: float,
    error: float,
    safe: float,
    safe_error: float,
    prior: float = PRIOR_STEPS,
    spread: float = PRIOR_SPREAD,
    noise: float = NOISE,
) -> float:
    """The posterior mean of an arm's steps factor ``f`` (steps to dense's accuracy over
    dense's), given its windows' loss decrease per step and the safe arms'.

    Its prior is log-normal about ``prior`` with ``spread`` in log steps (the defaults:
    :class:`Learning`'s); its windows read
    ``decrease ~ Normal(safe / f, noise² (error² + (safe_error / prior)²))``. Short windows are
    noisy beside what separates the arms (``benchmarks/learn_windows.py``: a 20-step
    window's ratio errs by several times itself), so an arm is credited with what its
    windows show only as far as their errors allow: clean windows set ``f``, noisy ones
    leave the prior. A ``safe`` decrease of 0 (the safe loss did not fall) says nothing of
    ``f``: the prior. Computed on a grid of ``f`` over the prior's 4 spreads each side.

    Example:
      >>> round(steps_posterior(0.005, 0.0, 0.01, 0.0), 2)  # clean windows: half the decrease
      2.0
      >>> round(steps_posterior(0.005, 0.001, 0.0, 0.001), 2)  # safe not falling: the prior
      2.83
      >>> round(steps_posterior(0.01, 0.0002, 0.01, 0.0002), 2)  # as fast as safe: near 1
      1.04
      >>> round(steps_posterior(0.01, 0.002, 0.01, 0.002), 2)  # the same, noisy: near the prior
      2.65
    """
    logs = [math.log(prior) + spread * (8.0 * i / (_GRID - 1) - 4.0) for i in range(_GRID)]
    weights = [-0.5 * ((x - math.log(prior)) / spread) ** 2 for x in logs]
    if safe > 0:
        # The safe decrease's error, carried to the arm's scale at the prior's factor: with
        # it at each f's own scale, a window far below every f's mean (a loss that rose)
        # would be explained best by the smallest f, whose scale is widest.
        variance = noise**2 * (error**2 + (safe_error / prior) ** 2)
        variance += (1e-9 * max(abs(decrease), safe)) ** 2  # clean windows: a near-delta
        for i, x in enumerate(logs):
            weights[i] -= 0.5 * (decrease - safe / math.exp(x)) ** 2 / variance
    top = max(weights)
    mass = [math.exp(w - top) for w in weights]
    return sum(math.exp(x) * m for x, m in zip(logs, mass, strict=True)) / sum(mass)


_GRID = 1001  # points of steps_posterior's grid (0.4 % apart in f)


def fastest_safe(seconds: Mapping[str, float]) -> str | None:
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
