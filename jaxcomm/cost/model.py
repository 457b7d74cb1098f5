"""The cost model's data: the world, the compressor options, a measured profile, a prediction.

The JSON of a profile (``jaxcomm probe`` writes it, ``Auto(profile=...)`` reads it) is defined
here; the kernels of :data:`DEFAULT_PROFILE` are the algorithms' cost records'
(:func:`jaxcomm.cost.algorithm_costs.kernels`). Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import textwrap
from collections.abc import Mapping
from typing import Any

from .. import algorithms
from ..algorithms import Setting
from . import algorithm_costs

LINK_CLASSES = ("same_process", "same_host", "across_hosts")
"""Link classes, fastest first."""

KERNELS = algorithm_costs.kernels()
"""Local kernels whose per-element cost a profile holds (every algorithm's cost record's)."""

ALGORITHMS = algorithms.planned()
"""Algorithm names the model lists by default (``jaxcomm plan``, ``benchmarks/allreduce.py``, the
``allreduce`` launcher job); every registered name (:func:`jaxcomm.algorithms.registered`) can
be predicted."""

QUANTIZER_KINDS = tuple(q.name for q in algorithms.quantizers())
"""The quantizers of the quantized allreduce."""

AUTO_CHOICES = algorithm_costs.auto_choices()
"""What ``algorithm="auto"`` may choose from (``dense`` = jaxcomm's ring allreduce)."""

DEFAULT_ALLOWED = algorithm_costs.default_allowed()
"""The default candidates of ``auto``: every algorithm whose bytes do not depend on a
user-tuned threshold (``threshold`` must be allowed explicitly, with its ``tau``)."""

MEASURED_FILE = pathlib.Path(__file__).with_name("default_profile.json")
"""The measured constants the model starts from, each named with where and how it was
measured: :data:`DEFAULT_PROFILE` and :data:`DEFAULT_STEPS_FACTOR`."""

_MEASURED = json.loads(MEASURED_FILE.read_text())

DEFAULT_STEPS_FACTOR = {
    name: float(_MEASURED["steps_factor"][name]["factor"])
    for name in AUTO_CHOICES
    if name in _MEASURED["steps_factor"]
}
"""Steps each of ``auto``'s choices needs to reach dense's accuracy, relative to dense (read
from :data:`MEASURED_FILE`).

What users pay is the time to a target accuracy, ``steps × step time``: an algorithm whose
call is a little faster but that needs twice the steps loses end to end. ``auto`` and
:func:`~jaxcomm.cost.plan` pick by ``factor × predicted seconds``. The factors are steps to
``digits-small``'s target measured by the end-to-end grid (``python benchmarks/train.py``,
docs/e2e.md); models differ, so pass measured ones through ``Auto(steps_factor=...)``."""


def steps_factor_of(name: str, steps_factor: Mapping[str, float] | None = None) -> float:
    """The steps `name` needs relative to dense: ``steps_factor[name]``, else the registry's
    default (:data:`DEFAULT_STEPS_FACTOR`), else 1.0.

    Args:
      name: an algorithm name.
      steps_factor: name -> factor, overriding the defaults name by name (a name it lacks
        keeps its default; None: the defaults).

    Returns:
      The factor.

    Raises:
      ValueError: a factor that is not finite and > 0.

    Example:
      >>> steps_factor_of("dense"), steps_factor_of("gtopk", {"gtopk": 1.5})
      (1.0, 1.5)
      >>> steps_factor_of("gtopk", {"dense": 1.0}) == DEFAULT_STEPS_FACTOR["gtopk"]
      True
    """
    # A measured table usually covers some names only (the algorithms a workload ran): the
    # others keep their default, not 1.0, which would make an unmeasured compressor look free.
    table = {**DEFAULT_STEPS_FACTOR, **(steps_factor or {})}
    factor = float(table.get(name, 1.0))
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"steps_factor[{name!r}] must be finite and > 0, got {factor!r}")
    return factor


@dataclasses.dataclass(frozen=True)
class World:
    """The ranks of one allreduce: processes x devices per process.

    Args:
      processes: number of processes (on CPU each is a node of a hierarchical allreduce).
      devices_per_process: devices (ranks) in each process.
      inter_process: link class between two processes, ``"same_host"`` or ``"across_hosts"``.

    Example:
      >>> World(processes=2, devices_per_process=2).ranks
      4
    """

    processes: int
    devices_per_process: int = 1
    inter_process: str = "same_host"

    def __post_init__(self) -> None:
        for name in ("processes", "devices_per_process"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"World.{name} must be an integer >= 1, got {value!r}")
        if self.inter_process not in LINK_CLASSES[1:]:
            raise ValueError(
                f"World.inter_process must be 'same_host' or 'across_hosts', got "
                f"{self.inter_process!r}"
            )

    @property
    def ranks(self) -> int:
        """Total number of ranks (devices)."""
        return self.processes * self.devices_per_process

    def flat_link(self) -> str:
        """The slowest link class of a flat group over all ranks."""
        return "same_process" if self.processes == 1 else self.inter_process


COMMON_SETTINGS = (
    Setting(
        "element_bytes",
        int,
        4,
        lambda v: v in (2, 4),
        "2 or 4",
        "bytes per element of the gradient: 4 (float32) or 2 (bfloat16, float16). The dense "
        "allreduce carries 16-bit gradients on its 16-bit wire, half the bytes; the compressors "
        "quantize from float32 whatever the input, so only dense (and PowerSGD's dense leaves) "
        "reads it.",
    ),
)
"""The fields of :class:`Options` that are no algorithm's setting but the gradient's (its width,
which ``auto`` sets per bucket); the others are declared by the algorithms' modules and their
cost modules (:func:`jaxcomm.cost.algorithm_costs.settings`)."""

SETTINGS = algorithm_costs.settings() + COMMON_SETTINGS
"""Every field of :class:`Options`: the algorithms' and their cost models' settings, then
:data:`COMMON_SETTINGS`."""


def _with_settings(cls: type) -> type:
    """``cls`` as a frozen, keyword-only dataclass with one field per :data:`SETTINGS` entry,
    and their docs as the ``Args`` of its docstring (inserted before its ``Example:``)."""
    names = [s.name for s in SETTINGS]
    clash = {n for n in names if names.count(n) > 1} | (set(names) & set(vars(cls)))
    if clash:
        raise ImportError(f"cost.Options: settings {sorted(clash)} are declared twice")
    cls.__annotations__ = {s.name: s.type for s in SETTINGS}
    for s in SETTINGS:
        setattr(cls, s.name, s.default)
    args = ["    Args:"]
    for s in SETTINGS:
        args += textwrap.wrap(
            f"{s.name}: {s.doc}", 96, initial_indent="      ", subsequent_indent="        "
        )
    head, example = cls.__doc__.split("\n    Example:", 1)
    cls.__doc__ = head.rstrip() + "\n\n" + "\n".join(args) + "\n\n    Example:" + example
    # kw_only: the fields' order follows the registry, which a new algorithm may change.
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


@_with_settings
class Options:
    """Compressor settings and the data-dependent quantities the byte counts need.

    One keyword-only field per setting: each algorithm module declares the settings it reads
    (``Algorithm.settings``) and its cost module those only the cost model reads
    (``AlgorithmCost.settings``; :func:`jaxcomm.cost.algorithm_costs.settings`), with its
    default, its check and the line below; ``element_bytes`` is the cost model's own (:data:`COMMON_SETTINGS`).

    Example:
      >>> Options(density=0.01).k(1000)
      10
      >>> Options(bits=4).bits, Options().start_step
      (4, 1000)
    """

    def __post_init__(self) -> None:
        for setting in SETTINGS:
            problem = setting.problem(getattr(self, setting.name))
            if problem is not None:
                raise ValueError(f"Options.{problem}")

    def k(self, n: int) -> int:
        """Entries of the sparse algorithms for ``n`` elements (``jaxcomm.TopK.k``)."""
        return min(n, max(1, math.ceil(self.density * n)))

    @classmethod
    def from_args(cls, args: Mapping[str, Any], **given: Any) -> Options:
        """The options named in ``args`` (e.g. a recipe's free-form ``args``), each converted
        to its setting's type; other keys are ignored, missing settings keep their defaults.
        A new algorithm's setting is read with no edit here or at the caller.

        Args:
          args: name -> value, e.g. ``{"tau": "0.5", "sizes": [...]}``.
          **given: values that take precedence over ``args``.

        Returns:
          The :class:`Options`.

        Example:
          >>> o = Options.from_args({"tau": "0.5", "bits": 4.0, "sizes": [1]}, density=0.01)
          >>> o.tau, o.bits, o.density
          (0.5, 4, 0.01)
        """
        values = {**args, **given}
        return cls(**{s.name: s.type(values[s.name]) for s in SETTINGS if s.name in values})


@dataclasses.dataclass(frozen=True)
class Link:
    """Latency and inverse bandwidth of one link class.

    Args:
      alpha: seconds per message.
      beta: seconds per byte.

    Example:
      >>> round(Link(alpha=50e-6, beta=8e-9).seconds(messages=2, nbytes=1000), 9)
      0.000108
    """

    alpha: float
    beta: float

    def seconds(self, messages: float, nbytes: float) -> float:
        """Time of ``messages`` messages carrying ``nbytes`` bytes in total, in sequence."""
        return messages * self.alpha + nbytes * self.beta


@dataclasses.dataclass(frozen=True)
class Profile:
    """Measured alpha, beta per link class, gamma per kernel, and lax.psum's own line.

    Args:
      links: link class -> :class:`Link`; every class of :data:`LINK_CLASSES`.
      gamma: kernel -> seconds per element; every kernel of :data:`KERNELS`.
      psum: ``lax.psum`` (XLA's collectives, Gloo on CPU) as ``alpha + beta * ring bytes``
        per operand (XLA:CPU reduces each leaf of a tree as a collective of its own).
      call: seconds every call costs besides its messages and kernels (dispatching a jitted
        step and entering the handler), added to every algorithm alike.
      inter_process: the link class the probe found between processes.
      source: where the numbers come from (a command and a date).
      measured: which entries were measured (the others come from :data:`DEFAULT_PROFILE`).
      hardware: what it was measured on (``platform``, ``device_kind``, ``cpu``, the world's
        shape; :func:`jaxcomm.cost.measure.hardware`), or None when not recorded.

    Example:
      >>> DEFAULT_PROFILE.links["across_hosts"].beta > DEFAULT_PROFILE.links["same_host"].beta
      True
    """

    links: Mapping[str, Link]
    gamma: Mapping[str, float]
    psum: Link
    call: float = 0.0
    inter_process: str = "same_host"
    source: str = ""
    measured: tuple[str, ...] = ()
    hardware: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        missing = [c for c in LINK_CLASSES if c not in self.links]
        missing += [k for k in KERNELS if k not in self.gamma]
        if missing:
            raise ValueError(f"Profile lacks {missing}; a profile needs every link and kernel")
        values = [*(v for link in self.links.values() for v in (link.alpha, link.beta))]
        values += [*self.gamma.values(), self.psum.alpha, self.psum.beta, self.call]
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise ValueError("Profile values must be finite and >= 0")

    def to_json(self) -> dict[str, Any]:
        """The profile as a JSON-able dict (the format ``jaxcomm probe`` writes).

        Returns:
          ``{"version", "source", "inter_process", "links", "psum", "call", "gamma",
          "measured"}``, and ``"hardware"`` when recorded.

        Example:
          >>> sorted(DEFAULT_PROFILE.to_json()["links"])
          ['across_hosts', 'same_host', 'same_process']
        """
        data = {
            "version": 1,
            "source": self.source,
            "inter_process": self.inter_process,
            "links": {c: dataclasses.asdict(self.links[c]) for c in LINK_CLASSES},
            "psum": dataclasses.asdict(self.psum),
            "call": self.call,
            "gamma": {k: self.gamma[k] for k in KERNELS},
            "measured": list(self.measured),
        }
        if self.hardware is not None:
            data["hardware"] = dict(self.hardware)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Profile:
        """Builds a profile from :meth:`to_json`'s format; missing entries come from the default.

        Args:
          data: the parsed JSON.

        Returns:
          The profile.

        Raises:
          ValueError: not a profile (wrong version, bad values).

        Example:
          >>> Profile.from_json(DEFAULT_PROFILE.to_json()) == DEFAULT_PROFILE
          True
        """
        if not isinstance(data, Mapping) or data.get("version") != 1:
            raise ValueError("not a jaxcomm profile (expected a mapping with version: 1)")
        try:
            links = dict(DEFAULT_PROFILE.links)
            links.update({c: Link(**v) for c, v in (data.get("links") or {}).items()})
            gamma = dict(DEFAULT_PROFILE.gamma)
            gamma.update({k: float(v) for k, v in (data.get("gamma") or {}).items()})
            psum = Link(**data["psum"]) if "psum" in data else DEFAULT_PROFILE.psum
            return cls(
                links=links,
                gamma=gamma,
                psum=psum,
                call=float(data.get("call", DEFAULT_PROFILE.call)),
                inter_process=data.get("inter_process", "same_host"),
                source=str(data.get("source", "")),
                measured=tuple(data.get("measured", ())),
                hardware=data.get("hardware"),
            )
        except (TypeError, KeyError) as exc:
            raise ValueError(f"malformed jaxcomm profile: {exc}") from None

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Profile:
        """Reads a profile written by ``jaxcomm probe``.

        Args:
          path: the JSON file.

        Returns:
          The profile.

        Raises:
          ValueError: the file is not a profile (the message names the file).

        Example:
          >>> profile = Profile.load("profile.json")  # doctest: +SKIP
        """
        try:
            return cls.from_json(json.loads(pathlib.Path(path).read_text()))
        except (OSError, json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"cannot read profile {path}: {exc}") from None

    def save(self, path: str | pathlib.Path) -> None:
        """Writes the profile as JSON (see :meth:`to_json`)."""
        pathlib.Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


# Where and how each value was measured: MEASURED_FILE's "profile_measured".
_DEFAULT = _MEASURED["profile"]
_UNMEASURED = [k for k in KERNELS if k not in _DEFAULT["gamma"]]
if _UNMEASURED:
    raise ValueError(
        f"kernels {_UNMEASURED} of the algorithms' cost records have no measured seconds per element: "
        f"add them to {MEASURED_FILE} (profile.gamma, and profile_measured saying how)"
    )
DEFAULT_PROFILE = Profile(
    links={c: Link(**v) for c, v in _DEFAULT["links"].items()},
    gamma={k: float(_DEFAULT["gamma"][k]) for k in KERNELS},
    psum=Link(**_DEFAULT["psum"]),
    call=float(_DEFAULT["call"]),
    inter_process=_DEFAULT["inter_process"],
    source=_DEFAULT["source"],
)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The model's answer for one (algorithm, n, world).

    Attributes:
      algorithm: the algorithm name.
      elements: float32 elements per rank.
      processes: processes of the world.
      devices_per_process: devices per process.
      bytes_sent_per_rank: mean bytes one rank sends per call.
      seconds: predicted time of one call (exposed time when ``overlap`` was on).
      communication_seconds: the alpha and beta terms.
      compute_seconds: the gamma terms and the profile's per-call overhead.
      messages: messages on the critical path.
    """

    algorithm: str
    elements: int
    processes: int
    devices_per_process: int
    bytes_sent_per_rank: float
    seconds: float
    communication_seconds: float
    compute_seconds: float
    messages: float

    def to_json(self) -> dict[str, Any]:
        """The prediction as a dict; the first six keys are ``jaxcomm plan --json``'s."""
        return dataclasses.asdict(self)
