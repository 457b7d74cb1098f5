"""Measuring the world a run is in, so that ``algorithm="auto"`` without a profile decides on
the run's own links and device rather than on the built-in profile.

:func:`measure_world` times, through jaxcomm's own collectives on every device of every
process:

* the call overhead (a jitted shard_mapped step that adds 1 to one element);
* ``sum``: an in-place float32 add on every device;
* the link between the ranks: ``jaxcomm.allreduce`` of 2 elements (latency) and of sizes that
  grow fourfold until one call takes :data:`LONG_CALL_S` or reaches :data:`MAX_LINK_ELEMENTS`
  (seconds on a slow link as on a fast one), fitted as ``jaxcomm probe`` fits it
  (:func:`fit_link`);
* each candidate compressor's whole ``jaxcomm.compressed_allreduce`` at the run's largest
  bucket (at most :data:`MAX_KERNEL_ELEMENTS`): its time beyond what the links and the other
  kernels explain sets its own kernels' gamma (:func:`calibrate_gamma`).

Every rank times the same calls in the same order, behind a barrier, and the times are
averaged over all ranks with ``jaxcomm.allreduce`` before anything is fitted, so every rank
holds the same profile and decides the same. The result is a :class:`~jaxcomm.cost.Profile`
(``jaxcomm probe``'s format, ``save`` writes it) with the run's :func:`hardware`, kept for the
rest of the process per world (:func:`world_key`). A profile given to ``auto`` that was measured
on other hardware draws a one-line warning (:func:`check_hardware`).

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .. import algorithms, config
from .model import AUTO_CHOICES, DEFAULT_PROFILE, Link, Options, Profile, World
from .timemodel import predict

__all__ = [
    "calibrate_gamma",
    "expect",
    "check_hardware",
    "fit_link",
    "hardware",
    "measure_world",
    "measured",
    "prepare",
    "world_key",
]

_log = logging.getLogger("jaxcomm.cost")

LATENCY_ELEMENTS = 2  # one 8-byte message per round: the latency test
FIRST_LINK_ELEMENTS = 1 << 12
MAX_LINK_ELEMENTS = 1 << 22
LONG_CALL_S = 0.05  # a size whose call takes this long has measured the bandwidth
MAX_KERNEL_ELEMENTS = 1 << 22
REPEATS = 5
AXIS = "jaxcomm_measure"
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

        ids = _gather([float(_host_id())])
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


# -- collectives ----------------------------------------------------------------------------


def _mesh() -> Any:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.asarray(jax.devices()), (AXIS,))


def _placed(mesh: Any, rows: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.make_array_from_process_local_data(NamedSharding(mesh, P(AXIS)), rows)


def _per_device(mesh: Any, fn: Callable[..., Any], *rows: Any, donate: bool = False) -> Callable:
    """A call of ``fn`` on every device at once (a jitted shard_map); ``donate``: the first
    operand is the previous call's output (in place)."""
    import jax
    from jax.sharding import PartitionSpec as P

    spec = P(AXIS)
    placed = [_placed(mesh, r) for r in rows]
    f = jax.jit(
        jax.shard_map(
            lambda *xs: jax.tree.map(lambda y: y[None], fn(*(x[0] for x in xs))),
            mesh=mesh,
            in_specs=(spec,) * len(placed),
            out_specs=spec,
            check_vma=False,
        ),
        donate_argnums=(0,) if donate else (),
    )

    def call() -> Any:
        out = f(*placed)
        if donate:
            placed[0] = out
        return out

    return call


def _gather(values: Sequence[float]) -> list[float]:
    """Every rank's ``values``, concatenated in device order (a jaxcomm allreduce of a vector
    in which each rank fills its own slot)."""
    return _reduce_rows(values, every_rank=True)


def _reduce_rows(values: Sequence[float], every_rank: bool = False) -> list[float]:
    """``every_rank``: each rank's slot of a ranks × len(values) vector, summed (a gather);
    else the mean of ``values`` over every rank."""
    import jax
    import numpy as np

    import jaxcomm

    mesh = _mesh()
    ranks, local, m = mesh.size, jax.local_device_count(), len(values)
    first = jax.process_index() * local  # a process's devices are contiguous in jax.devices()
    if every_rank:
        rows = np.zeros((local, ranks * m), np.float32)
        for d in range(local):
            rows[d, (first + d) * m : (first + d + 1) * m] = values
    else:
        rows = np.tile(np.asarray(values, np.float32), (local, 1))
    total = _per_device(mesh, lambda v: jaxcomm.allreduce(v, AXIS), rows)()
    out = np.asarray(total.addressable_data(0)).reshape(-1).astype(np.float64)
    return [float(v) for v in (out if every_rank else out / ranks)]


def _agree(times: Mapping[str, float]) -> dict[str, float]:
    """The mean of each named time over every rank (names in sorted order: the same vector
    everywhere), so every rank fits the same numbers."""
    names = sorted(times)
    return dict(zip(names, _reduce_rows([times[n] for n in names]), strict=True))


class _Timer:
    """The least seconds of a call over :data:`REPEATS`, every rank starting it together: on a
    machine shared with other work, load only ever adds time, and a few samples' median
    still carries it."""

    def __init__(self, mesh: Any) -> None:
        import numpy as np

        import jaxcomm

        self._barrier = _per_device(
            mesh,
            lambda v: jaxcomm.allreduce(v, AXIS),
            np.ones((mesh.local_mesh.size, 1), np.float32),
        )
        self.ranks = mesh.size

    def __call__(self, fn: Callable[[], Any], repeats: int = REPEATS) -> float:
        import jax

        jax.block_until_ready(fn())  # compile
        jax.block_until_ready(fn())  # connections, pages
        samples: list[float] = []
        for i in range(repeats):
            # Long calls vary little: stop after three, all ranks or none, on their mean (a
            # rank that stopped on its own clock left its peers in a collective it never ran).
            if i == 3 and self._agreed(min(samples)) >= LONG_CALL_S:
                break
            if self.ranks > 1:
                jax.block_until_ready(self._barrier())
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            samples.append(time.perf_counter() - t0)
        return min(samples)

    def _agreed(self, seconds: float) -> float:
        """`seconds` averaged over every rank (one allreduce that every rank runs)."""
        return _agree({"t": seconds})["t"] if self.ranks > 1 else seconds


# -- fits -----------------------------------------------------------------------------------


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
      >>> gamma = dict(DEFAULT_PROFILE.gamma)
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
    mesh = _mesh()
    timer = _Timer(mesh)
    n_kernel = max(64, min(max(sizes, default=MAX_KERNEL_ELEMENTS), MAX_KERNEL_ELEMENTS))
    ranks, local = mesh.size, jax.local_device_count()
    hosts = len(set(key[-1]))
    if known is None:
        inter = "same_host" if hosts == 1 else "across_hosts"
        link = "same_process" if jax.process_count() == 1 else inter
        profile = _measure_links(timer, mesh, link, inter, n_kernel)
    else:
        profile, inter = known, known.inter_process
    world = World(jax.process_count(), local, inter) if ranks > 1 else World(1, 1)
    profile = _measure_kernels(timer, mesh, profile, world, missing, options, n_kernel)
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


def _measure_links(timer: _Timer, mesh: Any, link: str, inter: str, n_kernel: int) -> Profile:
    """The call overhead, ``sum`` and the link of a fresh profile (the default elsewhere)."""
    import numpy as np

    import jaxcomm

    local = mesh.local_mesh.size
    times = {
        "call": timer(_per_device(mesh, lambda v: v + 1.0, np.ones((local, 1), np.float32))),
        "sum": timer(
            _per_device(
                mesh,
                lambda a, b: a + b,
                np.zeros((local, n_kernel), np.float32),
                np.ones((local, n_kernel), np.float32),
                donate=True,
            )
        ),
    }

    def ring(n: int) -> float:
        rows = np.random.default_rng(n).standard_normal((local, n)).astype(np.float32)
        return timer(_per_device(mesh, lambda v: jaxcomm.allreduce(v, AXIS), rows))

    measured = ["call", "gamma.sum"]
    links = dict(DEFAULT_PROFILE.links)
    agreed = _agree(times)
    if mesh.size > 1:
        times[f"ring.{LATENCY_ELEMENTS}"] = ring(LATENCY_ELEMENTS)
        n = FIRST_LINK_ELEMENTS
        while True:  # grow until a call is long enough to show the bandwidth
            times[f"ring.{n}"] = ring(n)
            longest = _agree({"t": times[f"ring.{n}"]})["t"]
            if longest >= LONG_CALL_S or n >= MAX_LINK_ELEMENTS:
                break
            n *= 4
        agreed = _agree(times)
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
    timer: _Timer,
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

        times[name] = timer(_per_device(mesh, reduce, x, zeros))
    agreed = _agree(times)
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
