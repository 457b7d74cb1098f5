"""Measuring the world a run is in, so that ``algorithm="auto"`` without a profile decides on
the run's own links and device rather than on the built-in profile.

:func:`measure_world` times, through jaxcomm's own collectives on every device of every
process:

* the call overhead (a jitted shard_mapped step that adds 1 to one element);
* ``sum``: an in-place float32 add on every device;
* the link between the ranks: ``jaxcomm.allreduce`` of 2 elements (latency) and of sizes that
  grow fourfold until one call takes :data:`~jaxcomm.cost.timing.LONG_CALL_S` or reaches
  :data:`MAX_LINK_ELEMENTS` (seconds on a slow link as on a fast one), fitted as
  ``jaxcomm probe`` fits it (:func:`~jaxcomm.cost.fit.fit_link`);
* each candidate compressor's whole ``jaxcomm.compressed_allreduce`` at the run's largest
  bucket (at most :data:`MAX_KERNEL_ELEMENTS`): its time beyond what the links and the other
  kernels explain sets its own kernels' gamma (:func:`~jaxcomm.cost.fit.calibrate_gamma`).

Every rank times the same calls in the same order, behind a barrier, and the times are
averaged over all ranks (:mod:`jaxcomm.cost.timing`) before anything is fitted, so every rank
holds the same profile and decides the same. The result is a :class:`~jaxcomm.cost.Profile`
(``jaxcomm probe``'s format, ``save`` writes it) with the run's :func:`hardware`, kept for the
rest of the process per world (:func:`world_key`). ``jaxcomm probe`` measures more, with
the same collectives and fits (:mod:`jaxcomm.cost.probe`). A profile given to ``auto`` that
was measured on other hardware draws a one-line warning (:func:`check_hardware`).

Unlike the rest of :mod:`jaxcomm.cost` this module needs JAX and the compiled library; it is
imported when a step that uses ``auto`` is traced, or explicitly.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import socket
import threading
import time
import warnings
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from .. import algorithms, config
from .fit import LATENCY_ELEMENTS, calibrate_gamma, fit_link, own_kernels
from .kernels import call_step, sum_step
from .model import AUTO_CHOICES, DEFAULT_PROFILE, Options, Profile, World
from .timing import AXIS, LONG_CALL_S, Timer, agree, gather, mesh, per_device

__all__ = [
    "expect",
    "check_hardware",
    "hardware",
    "measure_world",
    "measured",
    "prepare",
    "world_key",
]

_log = logging.getLogger("jaxcomm.cost")

FIRST_LINK_ELEMENTS = 1 << 12
MAX_LINK_ELEMENTS = 1 << 22
MAX_KERNEL_ELEMENTS = 1 << 22
HARDWARE_FIELDS = ("platform", "device_kind", "cpu")
"""The fields of :func:`hardware` that a profile and a run must share."""

_lock = threading.Lock()
_profiles: dict[tuple, Profile] = {}  # world key -> measured profile
_key: tuple | None = None  # this process's world key, gathered once
_active: Profile | None = None  # the profile measured for this process's world
_warned: set[str] = set()


# -- identity -------------------------------------------------------------------------------


def hardware() -> dict[str, Any]:
    """What this process runs on: JAX's platform and device kind, the CPU model, and the
    world's shape. Local only (no collective).

    Example:
      >>> sorted(hardware())  # doctest: +SKIP
      ['cpu', 'device_kind', 'devices_per_process', 'platform', 'processes']
    """
    import jax

    device = jax.local_devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "cpu": _cpu_model(),
        "processes": jax.process_count(),
        "devices_per_process": jax.local_device_count(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_id() -> int:
    """This process's host: its name and, on the emulated cluster, its node's own address
    (emulated nodes share the machine's name). Below 2**23, so a float32 sum of ids carries
    it exactly."""
    name = f"{socket.gethostname()}|{config.get('JAXCOMM_NODE_ADDRESS')}"
    return zlib.crc32(name.encode()) % (1 << 23)


def world_key() -> tuple:
    """The identity of this process's world: hardware, layout and every process's host.

    The first call gathers the hosts with a collective over every device (every process must
    make it); later calls return the same key without communicating.
    """
    global _key
    if _key is None:
        import jax

        ids = gather([float(_host_id())])
        _key = (*(hardware()[f] for f in HARDWARE_FIELDS), jax.process_count(),
                jax.local_device_count(), tuple(sorted(set(ids))))  # fmt: skip
    return _key


def check_hardware(profile: Profile) -> None:
    """Warns, in one line, when ``profile`` was measured on other hardware than this run's
    (its ``hardware`` names another platform, device kind or CPU). A profile without a
    record of its hardware (older probes, the built-in one) is taken as it is.

    Example:
      >>> check_hardware(DEFAULT_PROFILE)  # doctest: +SKIP
    """
    recorded = profile.hardware or {}
    here = hardware()
    differs = [f for f in HARDWARE_FIELDS if f in recorded and recorded[f] != here[f]]
    if not differs or profile.source in _warned:
        return
    _warned.add(profile.source)
    what = ", ".join(f"{f} {recorded[f]!r} (this run: {here[f]!r})" for f in differs)
    warnings.warn(
        f"jaxcomm auto: the profile '{profile.source}' was measured on other hardware: {what}; "
        "pass no profile to measure this world",
        RuntimeWarning,
        stacklevel=2,
    )


# -- the measurement ------------------------------------------------------------------------


def measure_world(
    allowed: Iterable[str] = AUTO_CHOICES,
    sizes: Sequence[int] = (),
    options: Options | None = None,
) -> Profile:
    """Measures the links between this run's ranks and the candidates' kernels on its
    device; returns (and keeps for this world) the profile. Outside any jitted function, or
    from :func:`prepare`. Every process must call it, in the same order as its other
    collectives.

    Args:
      allowed: the algorithms whose kernels to measure (``dense`` has none of its own).
      sizes: the buckets' elements; the kernels are timed at the largest (at most
        :data:`MAX_KERNEL_ELEMENTS`; none given: that bound).
      options: the candidates' settings (density, proportion, ...).

    Returns:
      The :class:`~jaxcomm.cost.Profile`, the same on every rank: ``measured`` lists what was
      measured, ``hardware`` what it ran on, ``source`` says it was measured at start.

    Example:
      >>> profile = jaxcomm.cost.measure_world(("dense", "gtopk"))  # doctest: +SKIP
      >>> profile.save("profile.json")  # doctest: +SKIP
    """
    global _active
    import jax

    key = world_key()
    options = options or Options()
    with _lock:
        known = _profiles.get(key)
    wanted = [a for a in allowed if a in AUTO_CHOICES and a != "dense"]
    missing = [a for a in wanted if known is None or f"auto.{a}" not in known.measured]
    if known is not None and not missing:
        return known
    start = time.perf_counter()
    world_mesh = mesh()
    timer = Timer(world_mesh)
    n_kernel = max(64, min(max(sizes, default=MAX_KERNEL_ELEMENTS), MAX_KERNEL_ELEMENTS))
    ranks, local = world_mesh.size, jax.local_device_count()
    hosts = len(set(key[-1]))
    if known is None:
        inter = "same_host" if hosts == 1 else "across_hosts"
        link = "same_process" if jax.process_count() == 1 else inter
        profile = _measure_links(timer, world_mesh, link, inter, n_kernel)
    else:
        profile, inter = known, known.inter_process
    world = World(jax.process_count(), local, inter) if ranks > 1 else World(1, 1)
    profile = _measure_kernels(timer, world_mesh, profile, world, missing, options, n_kernel)
    seconds = time.perf_counter() - start
    profile = dataclasses.replace(
        profile,
        source=(
            f"measured at start by jaxcomm.cost.measure ({jax.process_count()} processes x "
            f"{local} {profile.hardware['device_kind']}, {hosts} hosts)"
        ),
    )
    with _lock:
        _profiles[key] = profile
        _active = profile
    _seconds.append(seconds)
    _log.info("jaxcomm auto: measured this world in %.2f s: %s", seconds, _summary(profile))
    return profile


_seconds: list[float] = []  # this process's time spent measuring, per measurement


def _measure_links(timer: Timer, mesh: Any, link: str, inter: str, n_kernel: int) -> Profile:
    """The call overhead, ``sum`` and the link of a fresh profile (the default elsewhere)."""
    import numpy as np

    import jaxcomm

    local = mesh.local_mesh.size
    times = {
        "call": timer(call_step(mesh)),
        "sum": timer(sum_step(mesh, np.ones((local, n_kernel), np.float32))),
    }

    def ring(n: int) -> float:
        rows = np.random.default_rng(n).standard_normal((local, n)).astype(np.float32)
        return timer(per_device(mesh, lambda v: jaxcomm.allreduce(v, AXIS), rows))

    measured = ["call", "gamma.sum"]
    links = dict(DEFAULT_PROFILE.links)
    agreed = agree(times)
    if mesh.size > 1:
        times[f"ring.{LATENCY_ELEMENTS}"] = ring(LATENCY_ELEMENTS)
        n = FIRST_LINK_ELEMENTS
        while True:  # grow until a call is long enough to show the bandwidth
            times[f"ring.{n}"] = ring(n)
            longest = agree({"t": times[f"ring.{n}"]})["t"]
            if longest >= LONG_CALL_S or n >= MAX_LINK_ELEMENTS:
                break
            n *= 4
        agreed = agree(times)
        sized = {
            int(k.split(".")[1]): v
            for k, v in agreed.items()
            if k.startswith("ring.") and k != f"ring.{LATENCY_ELEMENTS}"
        }
        links[link] = fit_link(
            agreed[f"ring.{LATENCY_ELEMENTS}"],
            sized,
            mesh.size,
            link,
            agreed["call"],
            agreed["sum"] / n_kernel,
        )
        measured.append(f"links.{link}")
    return Profile(
        links=links,
        gamma={**DEFAULT_PROFILE.gamma, "sum": agreed["sum"] / n_kernel},
        psum=DEFAULT_PROFILE.psum,
        call=agreed["call"],
        inter_process=inter,
        measured=tuple(measured),
        hardware=hardware(),
    )


def _measure_kernels(
    timer: Timer,
    mesh: Any,
    profile: Profile,
    world: World,
    names: Sequence[str],
    options: Options,
    n: int,
) -> Profile:
    """Each of ``names``' compressed allreduce at ``n`` elements, and its own kernels' gamma
    rescaled to it (a kernel two candidates share is set by the first)."""
    import jax
    import numpy as np

    import jaxcomm

    if not names:
        return profile
    local = mesh.local_mesh.size
    rng = np.random.default_rng(7)
    x = rng.standard_normal((local, n)).astype(np.float32)
    zeros = np.zeros_like(x)
    times = {}
    for name in names:
        compressor = algorithms.build(name, options)

        def reduce(v: Any, r: Any, c: Any = compressor) -> Any:
            step = jax.numpy.zeros((), jax.numpy.int32)
            return jaxcomm.compressed_allreduce(v, r, AXIS, c, step=step)[0]

        times[name] = timer(per_device(mesh, reduce, x, zeros))
    agreed = agree(times)
    gamma = dict(profile.gamma)
    taken: set[str] = {k for k in profile.measured if k.startswith("gamma.")}
    kernels = {}
    for name in names:
        own = [
            k for k in own_kernels(name, n, world, profile, options) if f"gamma.{k}" not in taken
        ]
        taken |= {f"gamma.{k}" for k in own}
        if own:
            kernels[name] = (own, options)
    base = {
        "version": 1,
        "links": {c: dataclasses.asdict(v) for c, v in profile.links.items()},
        "call": profile.call,
        "inter_process": profile.inter_process,
        "psum": dataclasses.asdict(profile.psum),
    }
    calibrate_gamma(gamma, kernels, agreed, base, world, n)
    measured = [*profile.measured, *sorted(taken - set(profile.measured))]
    measured += [f"auto.{name}" for name in names]
    return dataclasses.replace(profile, gamma=gamma, measured=tuple(measured))


def _summary(profile: Profile) -> str:
    link = next((c for c in ("across_hosts", "same_host", "same_process")
                 if f"links.{c}" in profile.measured), None)  # fmt: skip
    if link is None:
        return "one rank, kernels only"
    a, b = profile.links[link].alpha, profile.links[link].beta
    return f"{link} alpha {a * 1e6:.1f} us, {8 / max(b, 1e-30) / 1e9:.3g} Gbit/s"


def measured() -> dict[str, Any] | None:
    """What :func:`measure_world` measured in this process (None: nothing): the profile's
    JSON and the seconds the measurements took, for ``jaxcomm.metrics()`` and run summaries.

    Example:
      >>> measured() is None or "profile" in measured()
      True
    """
    with _lock:
        active = _active
    if active is None:
        return None
    return {"profile": active.to_json(), "seconds": list(_seconds), "summary": _summary(active)}


def active() -> Profile | None:
    """The profile measured for this process's world, or None before any measurement."""
    with _lock:
        return _active


# -- the hook of allreduce_gradients --------------------------------------------------------

_expected: set[str] = set()  # candidates a later trace will ask for (expect)


def expect(names: Iterable[str]) -> None:
    """Announces candidates that several ``Auto`` of one step will ask for one at a time (the
    arms of a learning ``auto``), so that the first measurement times them all at once.
    Host-side, no communication; every process must announce the same.

    Example:
      >>> expect(["gtopk", "onebit"])
    """
    _expected.update(n for n in names if n in AUTO_CHOICES)


def prepare(algorithm: Any, sizes: Sequence[int]) -> None:
    """Gets ``algorithm="auto"`` ready to decide for buckets of ``sizes``: with a profile, warns
    once when it comes from other hardware; without one, measures this world (once per world
    and candidate set), on a thread of its own so that it may run while a step is traced.
    Anything else: nothing.

    ``jaxcomm.optax.allreduce_gradients`` calls it when its update is traced: every rank
    traces the same step, so every rank measures at the same point of its program.

    Args:
      algorithm: what the user passed as ``algorithm``.
      sizes: the step's bucket sizes in elements.
    """
    from .auto import Auto

    if not isinstance(algorithm, (str, Auto)):
        return
    auto = Auto() if isinstance(algorithm, str) else algorithm
    if isinstance(auto.profile, Profile):
        check_hardware(auto.profile)
        return
    if len(auto.allowed) < 2:  # nothing to decide
        return
    result: dict[str, Any] = {}
    wanted = [*auto.allowed, *(a for a in sorted(_expected) if a not in auto.allowed)]

    def run() -> None:
        try:
            result["profile"] = measure_world(wanted, sizes, auto.options)
        except BaseException as exc:  # handed to the tracing thread
            result["error"] = exc

    # A thread has no trace of its own: the measurement's jitted calls run, not traced
    # into the step being traced.
    thread = threading.Thread(target=run, name="jaxcomm-measure")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
