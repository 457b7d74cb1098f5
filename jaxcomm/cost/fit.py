"""Fitting the cost model's parameters to measured times: a link's alpha and beta
(:func:`fit_link`), ``lax.psum``'s line (:func:`fit_psum`) and the kernels' gamma inside their
collectives (:func:`calibrate_gamma`). Pure arithmetic on the model: no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .model import Link, Options, Profile, World
from .timemodel import predict

__all__ = ["calibrate_gamma", "fit_link", "fit_psum", "own_kernels"]

LATENCY_ELEMENTS = 2  # one 8-byte message per round: the latency test
# lax.psum of a tree: this many leaves of PSUM_TREE_ELEMENTS each (a model's gradient tree,
# e.g. bytes-lm's 70 leaves), to measure what each operand of its all-reduce costs.
PSUM_TREE_LEAVES, PSUM_TREE_ELEMENTS = 64, 1 << 12


def fit_link(
    latency_s: float,
    times: Mapping[int, float],
    parts: int,
    link: str,
    call: float,
    sum_gamma: float,
) -> Link:
    """Alpha and beta of ``link`` from ``jaxcomm.allreduce`` timed over ``parts`` ranks.

    Each time, less the call overhead and the reduction kernel, is the schedule the allreduce
    took at that size (``jaxcomm.cost.dense_path``). Alpha comes from the latency test alone,
    beta from the sizes by least squares with alpha fixed (Hockney's two-step fit): a joint
    fit lets a shaped link's token bucket, which passes a small message at line rate, pull
    alpha to 0.

    Args:
      latency_s: seconds of a :data:`LATENCY_ELEMENTS`-element allreduce.
      times: elements -> seconds of larger allreduces.
      parts: ranks of the allreduce.
      link: the link class measured (``across_hosts`` has no shared memory).
      call: the per-call overhead (seconds).
      sum_gamma: seconds per element of the float32 add.

    Returns:
      The :class:`~jaxcomm.cost.Link`.

    Example:
      >>> from jaxcomm.cost.algorithm_costs.dense import dense_path
      >>> link = fit_link(2e-3, {1 << 20: 0.5}, 2, "across_hosts", 0.0, 0.0)
      >>> link.alpha > 0 and link.beta > 0
      True
    """
    from .algorithm_costs.dense import dense_path

    def row(n: int, seconds: float) -> tuple[int, int, float]:
        steps, nbytes, summed = dense_path(n, parts, link != "across_hosts")
        return steps, nbytes, max(0.0, seconds - call - sum_gamma * (n + summed))

    lat_steps, _, lat_y = row(LATENCY_ELEMENTS, latency_s)
    alpha = lat_y / lat_steps if lat_steps else 0.0
    rows = [row(n, s) for n, s in sorted(times.items())]
    num = sum(b * (y - alpha * st) for st, b, y in rows)
    den = sum(b * b for _, b, _ in rows)
    beta = num / den if den else 0.0
    if beta <= 0.0 and rows:
        # Noise at small sizes can leave no slope: charge the largest size's time to
        # bandwidth alone, so the link is never modeled as infinitely fast.
        alpha, beta = 0.0, max(rows[-1][2], 1e-9) / max(1, rows[-1][1])
    return Link(alpha=alpha, beta=max(beta, 0.0))


def own_kernels(
    algorithm: str, n: int, world: World, profile: Profile, options: Options
) -> list[str]:
    """The kernels whose gamma ``algorithm``'s predicted time reads (``sum`` aside, which
    every algorithm shares and is measured alone).

    Example:
      >>> from jaxcomm.cost import DEFAULT_PROFILE
      >>> own_kernels("gtopk", 1 << 20, World(2), DEFAULT_PROFILE, Options())
      ['topk', 'topk.entry', 'merge']
    """
    base = predict(algorithm, n, world, profile, options).seconds
    names = []
    for k in profile.gamma:
        if k == "sum" or profile.gamma[k] == 0.0:
            continue
        without = dataclasses.replace(profile, gamma={**profile.gamma, k: 0.0})
        if predict(algorithm, n, world, without, options).seconds < base:
            names.append(k)
    return names


def calibrate_gamma(
    gamma: dict[str, float],
    kernels: Mapping[str, tuple[Sequence[str], Options]],
    times: Mapping[str, float],
    base: Mapping[str, Any],
    world: World,
    n: int,
) -> dict[str, float]:
    """Rescales the kernels' gamma (in place) to what they cost inside their collective.

    Each calibration (``"gtopk"``, ``"gtopk.wide"``, a quantizer's kind) is a compressed
    allreduce of ``n`` elements timed on this world; its time beyond what the links and the
    other kernels explain, over what its own kernels predict, scales those kernels' gamma.
    Calibrations run in order, each on the gammas the ones before it set; one whose time the
    rest already explains (a noisy sample on a loaded machine) leaves its kernels as they were.

    Args:
      gamma: kernel -> seconds per element; updated in place.
      kernels: calibration -> (its kernels, its ``Options``); the algorithm is the
        calibration's name before any ``"."``.
      times: calibration -> measured seconds of its collective.
      base: the profile's other fields (``version``, ``links``, ``call``, ``inter_process``).
      world: the ``World`` the collectives ran on.
      n: elements per rank of each calibration.

    Returns:
      calibration -> the scale applied (only those applied).

    Example:
      >>> gamma = dict(jaxcomm.cost.DEFAULT_PROFILE.gamma)
      >>> base = {"version": 1, "links": {}, "call": 0.0, "inter_process": "same_host"}
      >>> calibrate_gamma(gamma, {"gtopk": (("topk",), Options())}, {"gtopk": 0.0},
      ...                 base, World(2, 1, "same_host"), 1 << 20)  # explained by the rest
      {}
    """
    scales: dict[str, float] = {}
    for calibration, (names, opts) in kernels.items():
        algorithm = calibration.split(".")[0]  # "gtopk.wide" is gTop-k at another density
        profile = Profile.from_json(dict(base, gamma=gamma))
        without = dict(profile.gamma, **{name: 0.0 for name in names})
        rest = predict(
            algorithm, n, world, dataclasses.replace(profile, gamma=without), opts
        ).seconds
        unit = predict(algorithm, n, world, profile, opts).seconds - rest
        if unit > 0 and times[calibration] > rest:
            scales[calibration] = (times[calibration] - rest) / unit
            for name in names:
                gamma[name] *= scales[calibration]
    return scales


def fit_psum(t: Mapping[str, float], sizes: Sequence[int], ranks: int) -> dict[str, float]:
    """lax.psum's line: alpha per operand, beta per ring byte, beyond the call overhead.

    Args:
      t: the medians: ``call``, ``psum.<n>`` for each of ``sizes`` and ``psum.tree``.
      sizes: the single arrays' elements per rank.
      ranks: ranks of the all-reduce.

    Returns:
      ``{"alpha": ..., "beta": ...}``, the profile's ``psum``.

    Example:
      >>> t = {"call": 0.0, "psum.1024": 1e-4, "psum.1048576": 1e-2, "psum.tree": 7e-3}
      >>> sorted(fit_psum(t, [1024, 1048576], 2))
      ['alpha', 'beta']
    """
    from .ledger import ring_bytes
    from .timemodel import fit_line

    call = t["call"]
    # [operands, ring bytes]: the single arrays and the tree (one all-reduce of its leaves).
    tree_bytes = PSUM_TREE_LEAVES * ring_bytes(PSUM_TREE_ELEMENTS, ranks, 0)
    rows = [[1.0, ring_bytes(n, ranks, 0)] for n in sizes]
    rows.append([float(PSUM_TREE_LEAVES), tree_bytes])
    ys = [max(0.0, t[f"psum.{n}"] - call) for n in sizes]
    ys.append(max(0.0, t["psum.tree"] - call))
    a, b = fit_line(rows, ys)
    return {"alpha": a, "beta": b}
