"""Which reductions a learning ``auto`` tries (:class:`jaxcomm.cost.learn.Learner`'s arms),
from the cost model's predictions on the measured world: the compressors predicted faster
per step than dense (:func:`propose`), whether dense needs a window at all (:func:`skipped`),
and which safe arm goes first (:func:`is_safe`, :func:`first_arm`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .choose import choose
from .model import DEFAULT_ALLOWED, Options, Profile, World, steps_factor_of
from .timemodel import predict

__all__ = [
    "DENSE_OVER",
    "first_arm",
    "is_safe",
    "predicted_step",
    "propose",
    "skipped",
    "warmup_seconds",
]

DENSE_OVER = 1.5
"""Dense runs no window when the model predicts its step slower than a proposed safe
compressor's by this factor (:func:`skipped`, ``Learning.dense_over``): a margin for the
model's error on a world it measured at start."""


def propose(
    sizes: Sequence[int],
    world: World,
    profile: Profile,
    allowed: Sequence[str] = DEFAULT_ALLOWED,
    options: Options | None = None,
    top: int | None = None,
) -> list[str]:
    """The arms worth a trial: dense, then the compressors of ``allowed`` (at most ``top``;
    None: all) whose step the model predicts faster than dense's: the fastest *safe* one (a prior steps factor
    of 1, :func:`is_safe`) first, then the others by their prior time to target (predicted
    seconds times the prior steps factor, which the trials then replace).

    Every compressor predicted faster gets a trial: a fast arm's window costs
    little, and its prior steps factor, measured on another model, can be off by an order of
    magnitude (ranked by it, gTop-k lost its only trial to adaptive on a model where it was
    the fastest). The safe compressor takes a place of its own.

    Each compressor's arm sends a bucket by the compressor only where the model predicts its
    call faster than dense's (a small bucket goes dense either way): ``choose`` between the
    two, steps counted alike.

    Args:
      sizes: the step's buckets, elements each.
      world: the ranks.
      profile: the (measured) profile.
      allowed: the candidates.
      options: their settings (``element_bytes`` of the dense wire).
      top: most compressors proposed (None: every one predicted faster).

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
    dense = predicted_step("dense", sizes, world, profile, options)
    faster = {}
    for name in allowed:
        if name != "dense":
            seconds = predicted_step(name, sizes, world, profile, options)
            if seconds < dense:
                faster[name] = seconds
    safe = sorted((a for a in faster if is_safe(a)), key=lambda a: (faster[a], a))[:1]
    rest = sorted(
        (a for a in faster if a not in safe), key=lambda a: (faster[a] * steps_factor_of(a), a)
    )
    return ["dense", *(safe + rest)[:top]]


def predicted_step(
    name: str, sizes: Sequence[int], world: World, profile: Profile, options: Options
) -> float:
    """The model's seconds of one step's reductions by the arm `name` (each bucket by `name`
    or dense, whichever the model predicts faster; dense: every bucket dense)."""
    if name == "dense":
        return sum(predict("dense", n, world, profile, options).seconds for n in sizes)
    pair = ("dense", name)
    return sum(
        predict(choose(n, world, pair, profile, options, steps_factor={name: 1.0}), n, world,
                profile, options).seconds
        for n in sizes
    )  # fmt: skip


def skipped(
    arms: Sequence[str],
    sizes: Sequence[int],
    world: World,
    profile: Profile,
    options: Options | None = None,
    over: float = DENSE_OVER,
) -> dict[str, float]:
    """``{"dense": its predicted seconds}`` when the model predicts dense's step slower than
    a proposed safe compressor's by ``over``, else ``{}``: the two need the same steps, so
    dense's window could only confirm that it loses, and it is the dearest window of all.

    Example:
      >>> from jaxcomm.cost import DEFAULT_PROFILE
      >>> slow = World(2, 1, "across_hosts")
      >>> list(skipped(["dense", "gtopk"], [10_000_000], slow, DEFAULT_PROFILE))
      []
    """
    options = options or Options()
    safe = [predicted_step(a, sizes, world, profile, options) for a in arms[1:] if is_safe(a)]
    dense = predicted_step("dense", sizes, world, profile, options)
    return {"dense": dense} if safe and dense > over * min(safe) else {}


def is_safe(name: str) -> bool:
    """Whether `name`'s prior says it needs no more steps than dense (a steps factor of at
    most 1 in :data:`~jaxcomm.cost.model.DEFAULT_STEPS_FACTOR`: dense, block int8)."""
    return steps_factor_of(name) <= 1.0


def first_arm(arms: Sequence[str], skip: Mapping[str, float] | None = None) -> int:
    """The arm a :class:`Learner` of :func:`propose`'s `arms` warms up on and opens each
    round with: the safe compressor where dense is ``skip``-ped (:func:`skipped`: the model
    predicts dense slower by a margin for its own error), else dense. A safe compressor
    predicted only a little faster than dense may be slower on the run's own devices, and a
    short run spends its whole warm-up on this arm: dense never loses to dense.

    Example:
      >>> first_arm(["dense", "blockquant", "gtopk"], {"dense": 0.5}), first_arm(["dense", "gtopk"])
      (1, 0)
      >>> first_arm(["dense", "blockquant", "gtopk"])  # the model is not sure: dense
      0
    """
    if not skip or "dense" not in skip:
        return 0
    return next((i for i, a in enumerate(arms) if i > 0 and is_safe(a)), 0)


def warmup_seconds(
    arms: Sequence[str],
    skip: Mapping[str, float],
    sizes: Sequence[int],
    world: World,
    profile: Profile,
    options: Options,
) -> dict[str, float]:
    """The model's seconds per step of the arms that run a window, by which the warm-up and
    its opening window are sized in seconds (``Learning.opens_at``, ``Learner``'s
    ``predicted``), where the warm-up runs a safe compressor (:func:`first_arm`: dense
    ``skip``-ped); ``{}`` where it runs dense, whose warm-up keeps its steps.

    A warm-up on dense costs nothing against dense, and its steps let a short run on a fast
    link finish before any trial (the model's seconds leave out the compute every arm shares,
    so they overstate how much dearer a dense step is). Where the model rules dense out, the
    link is dear and each safe step costs several of a sparse one.

    Example:
      >>> from jaxcomm.cost import DEFAULT_PROFILE
      >>> warmup_seconds(["dense", "gtopk"], {}, [1000], World(2), DEFAULT_PROFILE, Options())
      {}
    """
    if "dense" not in skip:
        return {}
    return {a: predicted_step(a, sizes, world, profile, options) for a in arms if a not in skip}
