"""The time model: seconds of one call, from alpha/beta per link class and gamma per kernel.

Each algorithm adds its critical path to a :class:`Tally` (its ``time`` function in
:mod:`jaxcomm.algorithms`); :func:`predict` turns the tally into a :class:`Prediction`.
:func:`fit_line` is the fit ``jaxcomm probe`` measures a profile with. Standard library only
(:func:`fit_line` imports NumPy when called).
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import algorithms
from ..algorithms.dense import dense_path, ring_path
from .ledger import bytes_sent, check_elements
from .model import DEFAULT_PROFILE, Options, Prediction, Profile, World

__all__ = ["Tally", "dense_path", "fit_line", "predict", "ring_path"]


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
    record = algorithms.get(algorithm)
    check_elements(n)
    t = Tally(profile)
    if n > 0:
        record.time(t, n, world, options)  # the algorithm's schedule (jaxcomm/algorithms/)
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


def fit_line(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Non-negative least squares of the *relative* error for a few columns (a column that
    comes out negative is dropped and the rest refitted): how ``jaxcomm probe`` fits alpha and
    beta.

    The probe's sizes span three orders of magnitude (4K to 4M elements). Plain least squares
    let the largest size decide alone and fitted alpha to 0 on the emulated links, so a small
    message looked free and ``auto`` sent 4096-element buckets through a compressor; weighing
    each measurement by 1/seconds makes every size count as much, as the predictions are
    judged by their relative error.

    Args:
      xs: one row of regressors per measurement (e.g. ``[messages, bytes]``).
      ys: the measured seconds.

    Returns:
      One coefficient >= 0 per column.

    Example:
      >>> [round(c, 6) for c in fit_line([[1, 10], [1, 20], [1, 40]], [0.3, 0.5, 0.9])]
      [0.1, 0.02]
      >>> alpha, beta = fit_line([[1, 1e4], [1, 1e6], [1, 1e7]], [2.1e-4, 1.0e-2, 1.02e-1])
      >>> round(alpha * 1e6), round(beta * 1e9, 1)  # a 100 µs latency a plain fit would lose
      (110, 10.0)
    """
    import numpy as np  # only the probe fits, in a process that has NumPy

    y = np.asarray(ys, np.float64)
    w = 1.0 / np.maximum(y, 1e-6)  # relative error; a zero-length measurement counts as 1 µs
    a = np.asarray(xs, np.float64) * w[:, None]
    y = y * w
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
