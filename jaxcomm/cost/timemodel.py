"""The time model: seconds of one call, from alpha/beta per link class and gamma per kernel.

Each algorithm adds its critical path to a :class:`Tally` (its cost record's ``time``,
:mod:`jaxcomm.cost.algorithm_costs`); :func:`predict` turns the tally into a :class:`Prediction`.
:func:`fit_line` is the fit ``jaxcomm probe`` measures a profile with. Standard library only
(:func:`fit_line` imports NumPy when called).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from . import algorithm_costs
from .algorithm_costs.dense import dense_path, ring_path
from .ledger import bytes_sent, check_elements
from .model import DEFAULT_PROFILE, Options, Prediction, Profile, World

__all__ = ["Tally", "dense_path", "fit_line", "predict", "predict_tree", "ring_path"]


class Tally:
    """Accumulates the critical path of one call: messages, bytes and kernel work.

    Args:
      profile: the alpha, beta and gamma to charge.

    Example:
      >>> t = Tally(DEFAULT_PROFILE)
      >>> t.kernel("sum", 1000)
      >>> t.compute > 0
      True
    """

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.comm = 0.0
        self.compute = 0.0
        self.messages = 0.0

    def send(self, link: str, messages: float, nbytes: float, contention: int = 1) -> None:
        """Charges ``messages`` messages carrying ``nbytes`` over ``link``; ``contention``
        flows share the link, so each one's bytes take that much longer."""
        self.comm += self.profile.links[link].seconds(messages, nbytes * max(1, contention))
        self.messages += messages

    def kernel(self, name: str, elements: float) -> None:
        """Charges local kernel ``name`` (a key of the profile's gamma) over ``elements``."""
        self.compute += self.profile.gamma[name] * elements


def predict(
    algorithm: str,
    n: int,
    world: World,
    profile: Profile | None = None,
    options: Options | None = None,
    overlap: bool = False,
    hidden_seconds: float = 0.0,
) -> Prediction:
    """Predicts bytes and seconds of one call of ``algorithm`` on ``n`` elements per rank.

    Args:
      algorithm: a registered name (:data:`ALGORITHMS` and the other hierarchical forms).
      n: float32 elements per rank (one bucket).
      world: the ranks (its ``inter_process`` link class is used between processes).
      profile: alpha/beta/gamma (default :data:`DEFAULT_PROFILE`).
      options: compressor settings (default :class:`Options`).
      overlap: the call overlaps ``hidden_seconds`` of other work (the backward pass): only
        the communication beyond that is exposed. Local kernels compete with that work for
        the same cores, so they are never hidden.
      hidden_seconds: compute the communication can hide behind when ``overlap`` is on.

    Returns:
      A :class:`Prediction`.

    Example:
      >>> p = predict("dense", 1 << 20, World(processes=2))
      >>> p.bytes_sent_per_rank
      4194304.0
    """
    profile = profile or DEFAULT_PROFILE
    options = options or Options()
    record = algorithm_costs.get(algorithm)
    check_elements(n)
    t = Tally(profile)
    if n > 0:
        record.time(t, n, world, options)  # the algorithm's schedule
    if n > 0:
        t.compute += profile.call
    comm = t.comm
    exposed = max(0.0, comm - hidden_seconds) if overlap else comm
    return Prediction(
        algorithm=algorithm,
        elements=n,
        processes=world.processes,
        devices_per_process=world.devices_per_process,
        bytes_sent_per_rank=bytes_sent(algorithm, n, world, options),
        seconds=exposed + t.compute,
        communication_seconds=comm,
        compute_seconds=t.compute,
        messages=t.messages,
    )


def predict_tree(
    algorithm: str,
    shapes: Sequence[Sequence[int]],
    world: World,
    profile: Profile | None = None,
    options: Options | None = None,
) -> Prediction:
    """Predicts bytes and seconds of one step of a leaf-shaped algorithm (``powersgd``) over
    gradient leaves of ``shapes``: it sends per leaf shape, not per bucket of n elements, so
    its calls come from the shapes (its cost record's ``tree_bytes`` and ``tree_time``).

    Args:
      algorithm: a registered leaf-shaped name (``Algorithm.leafwise`` set).
      shapes: the gradient leaves' shapes, in tree order.
      world: the ranks.
      profile: alpha/beta/gamma (default :data:`DEFAULT_PROFILE`).
      options: its settings (default :class:`Options`; ``element_bytes`` 2 for 16-bit
        gradients, whose dense leaves go on the 16-bit wire).

    Returns:
      A :class:`Prediction`; ``elements`` is the leaves' total.

    Raises:
      ValueError: an algorithm that is not leaf-shaped (it is predicted per bucket,
        :func:`predict`).

    Example:
      >>> p = predict_tree("powersgd", [(4096, 4096), (4096,)], World(processes=4))
      >>> p.bytes_sent_per_rank < predict("dense", 4096 * 4097, World(processes=4)).bytes_sent_per_rank
      True
    """
    profile = profile or DEFAULT_PROFILE
    options = options or Options()
    record = algorithm_costs.get(algorithm)
    if record.tree_time is None or record.tree_bytes is None:
        raise ValueError(
            f"{algorithm!r} reduces flat buckets, not leaves by shape: predict each bucket "
            "with jaxcomm.cost.predict"
        )
    shapes = [tuple(int(d) for d in s) for s in shapes]
    t = Tally(profile)
    record.tree_time(t, shapes, world, options)  # its calls' overheads included
    nbytes = [record.tree_bytes(shapes, world, options, r) for r in range(world.ranks)]
    return Prediction(
        algorithm=algorithm,
        elements=sum(math.prod(s) for s in shapes),
        processes=world.processes,
        devices_per_process=world.devices_per_process,
        bytes_sent_per_rank=sum(nbytes) / world.ranks,
        seconds=t.comm + t.compute,
        communication_seconds=t.comm,
        compute_seconds=t.compute,
        messages=t.messages,
    )


def fit_line(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Non-negative least squares for a few columns (a column that comes out negative is
    dropped and the rest refitted): how ``jaxcomm probe`` fits alpha and beta.

    Args:
      xs: one row of regressors per measurement (e.g. ``[messages, bytes]``).
      ys: the measured seconds.

    Returns:
      One coefficient >= 0 per column.

    Example:
      >>> [round(c, 6) for c in fit_line([[1, 10], [1, 20], [1, 40]], [0.3, 0.5, 0.9])]
      [0.1, 0.02]
    """
    import numpy as np  # only the probe fits, in a process that has NumPy

    a = np.asarray(xs, np.float64)
    y = np.asarray(ys, np.float64)
    active = list(range(a.shape[1]))
    while active:
        coef, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (coef >= 0).all():
            out = [0.0] * a.shape[1]
            for i, c in zip(active, coef, strict=True):
                out[i] = float(c)
            return out
        active.pop(int(np.argmin(coef)))
    return [0.0] * a.shape[1]
