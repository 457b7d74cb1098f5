"""A cost model of every jaxcomm allreduce: bytes on the wire and seconds per call.

Compression pays only when the network, not local compute, is the bottleneck. This module
predicts, for each algorithm, the bytes one rank sends and the time one call takes, so a user
(``jaxcomm plan``) or the optimizer (``algorithm="auto"``) can pick an algorithm before
spending compute on it.

Model
-----
A call's time is a sum of terms on its critical path:

* ``alpha[c]`` seconds per message and ``beta[c]`` seconds per byte, for the link class ``c``
  a message travels: ``same_process`` (two devices of one process), ``same_host`` (two
  processes of one machine: UCX shared memory or loopback) or ``across_hosts`` (a network).
  When several ranks of one process send across the process boundary at once, they share it:
  their bytes are multiplied by the number of such concurrent flows (``contention``).
* ``gamma[kernel]`` seconds per element of each local kernel: ``topk`` (top-k selection with
  error feedback over n elements), ``quantize.<kind>`` and ``decode.<kind>`` (one-bit,
  threshold, adaptive), ``merge`` (gTop-k's sparse ⊤ merge, per input entry) and ``sum``
  (one elementwise pass over float32 memory: a reduction, a copy, a memset or a scatter).

Byte counts are exact: they follow the schedules of ``ffi/*.cc`` message by message (the
ring's chunks, gTop-k's tree, the quantized allreduce's slices and ``used`` words) and equal
what ``jaxcomm.metrics()`` reports for the same call. Two algorithms send data-dependent
amounts, described by :class:`Options`: threshold (the fraction of entries above ``tau``) and
adaptive (the sign balance and how much the ranks' selections overlap).

A :class:`Profile` holds alpha, beta and gamma. ``jaxcomm probe RECIPE --out profile.json``
measures one on the recipe's own world; :data:`DEFAULT_PROFILE` is a measured fallback.

This module imports neither JAX nor the compiled library (``jaxcomm plan`` answers in well
under 2 s); :func:`resolve_auto` imports jaxcomm's compressors when it builds one.

Example:
  >>> from jaxcomm import cost
  >>> world = cost.World(processes=4, devices_per_process=1, inter_process="across_hosts")
  >>> p = cost.predict("gtopk", 25_000_000, world, options=cost.Options(density=0.001))
  >>> p.bytes_sent_per_rank  # 2(P-1) sets of 2k words over P ranks
  300000.0
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_log = logging.getLogger("jaxcomm.cost")

LINK_CLASSES = ("same_process", "same_host", "across_hosts")
"""Link classes, fastest first."""

QUANTIZER_KINDS = ("onebit", "threshold", "adaptive")
KERNELS = (
    "topk",
    "merge",
    "sum",
    *(f"quantize.{k}" for k in QUANTIZER_KINDS),
    *(f"decode.{k}" for k in QUANTIZER_KINDS),
)
"""Local kernels whose per-element cost a profile holds."""

ALGORITHMS = (
    "psum",
    "dense",
    "topk_allgather",
    "gtopk",
    "adaptive",
    "onebit",
    "threshold",
    "hier_dense",
    "hier_dense_leader",
    "hier_adaptive",
)
"""Algorithm names, as in ``benchmarks/allreduce.py`` and the ``allreduce`` launcher job."""

_EXTRA_ALGORITHMS = (
    "hier_onebit",
    "hier_threshold",
    "hier_adaptive_leader",
    "hier_onebit_leader",
    "hier_threshold_leader",
)

AUTO_CHOICES = ("dense", "gtopk", "topk_allgather", "adaptive", "onebit", "threshold")
"""What ``algorithm="auto"`` may choose from (``dense`` = jaxcomm's ring allreduce)."""

DEFAULT_ALLOWED = ("dense", "gtopk", "topk_allgather", "adaptive", "onebit")
"""The default candidates of ``auto``: every algorithm whose bytes do not depend on a
user-tuned threshold (``threshold`` must be allowed explicitly, with its ``tau``)."""

_F32 = 4  # bytes per float32 / uint32 word

DEFAULT_STEPS_FACTOR: Mapping[str, float] = {
    "dense": 1.0,
    "gtopk": 2.1,
    "topk_allgather": 2.0,
    "adaptive": 1.3,
    "onebit": 5.1,
    "threshold": 2.0,
}
"""Steps an algorithm needs to reach dense's accuracy, relative to dense (1.0).

What users pay is the time to a target accuracy: ``steps × step time``. An algorithm whose
step is a little faster but that needs twice the steps loses end to end, so ``auto`` and
:func:`plan` pick by ``factor × predicted seconds``. Measured by the end-to-end grid
(``python benchmarks/train.py``, docs/e2e.md): steps to the target of ``digits-small`` on 2
nodes, e.g. gTop-k 451 and one-bit 1081 against dense's 211 (sparse algorithms after the
paper's warm-up, π = 16 for adaptive). Models differ: pass your own through
``Auto(steps_factor=...)`` when you have measured them; an algorithm missing here counts 1.0.
"""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Inputs


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


@dataclasses.dataclass(frozen=True)
class Options:
    """Compressor settings and the data-dependent quantities the byte counts need.

    Args:
      density: ρ of TopK-allgather and gTop-k (``k = max(1, ceil(ρ n))``).
      proportion: π of adaptive quantization.
      column_size: column length of one-bit and adaptive quantization.
      tau: threshold of threshold quantization (only used to build the compressor).
      max_density: capacity of threshold quantization (fraction of a slice).
      threshold_fraction: expected fraction of entries with ``|x + r| > tau`` (threshold
        sends ``min(capacity, ceil(fraction m))`` entries per slice of m elements, and as many
        for the requantized sum).
      selection_overlap: in [0, 1], how much the ranks' adaptive selections coincide: 1 = the
        same positions on every rank (the sum has as many nonzeros as one rank sent), 0 =
        independent positions (the sum's nonzeros are the expected union).

    Example:
      >>> Options(density=0.01).k(1000)
      10
    """

    density: float = 0.001
    proportion: float = 64.0
    column_size: int = 1024
    tau: float = 3.0
    max_density: float = 1.0
    threshold_fraction: float = 0.003
    selection_overlap: float = 0.0

    def __post_init__(self) -> None:
        checks = {
            "density": 0.0 < self.density <= 1.0,
            "proportion": self.proportion >= 1.0,
            "column_size": self.column_size >= 32 and self.column_size % 32 == 0,
            "tau": self.tau > 0.0,
            "max_density": 0.0 < self.max_density <= 1.0,
            "threshold_fraction": 0.0 <= self.threshold_fraction <= 1.0,
            "selection_overlap": 0.0 <= self.selection_overlap <= 1.0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"Options.{name}={getattr(self, name)!r} is out of range "
                    "(density, max_density and the fractions in [0, 1], proportion >= 1, "
                    "column_size a positive multiple of 32, tau > 0)"
                )

    def k(self, n: int) -> int:
        """Entries of the sparse algorithms for ``n`` elements (``jaxcomm.TopK.k``)."""
        return min(n, max(1, math.ceil(self.density * n)))


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
      psum: ``lax.psum`` (XLA's collectives, Gloo on CPU) as ``alpha + beta * ring bytes``.
      call: seconds every call costs besides its messages and kernels (dispatching a jitted
        step and entering the handler), added to every algorithm alike.
      inter_process: the link class the probe found between processes.
      source: where the numbers come from (a command and a date).
      measured: which entries were measured (the others come from :data:`DEFAULT_PROFILE`).

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
          "measured"}``.

        Example:
          >>> sorted(DEFAULT_PROFILE.to_json()["links"])
          ['across_hosts', 'same_host', 'same_process']
        """
        return {
            "version": 1,
            "source": self.source,
            "inter_process": self.inter_process,
            "links": {c: dataclasses.asdict(self.links[c]) for c in LINK_CLASSES},
            "psum": dataclasses.asdict(self.psum),
            "call": self.call,
            "gamma": {k: self.gamma[k] for k in KERNELS},
            "measured": list(self.measured),
        }

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


# Measured on the development machine (2 cores shared with other jobs, jax 0.10.2, 2026-11-22),
# by `python benchmarks/cost_model.py` (its probes are saved in benchmarks/results/
# cost-model-*.json): kernels, call overhead, psum and same_host from the local 2 x 1 world,
# same_process from the local 2 x 2 world, across_hosts from the emulated 4 x 1 world on
# 1 Gbit/s tbf links (network namespaces: its alpha includes the emulation's CPU cost).
DEFAULT_PROFILE = Profile(
    links={
        "same_process": Link(alpha=4.6e-5, beta=6.2e-10),
        "same_host": Link(alpha=1.9e-4, beta=1.17e-9),
        "across_hosts": Link(alpha=1.15e-3, beta=9.28e-9),
    },
    gamma={
        "topk": 2.08e-9,
        "merge": 1.95e-8,
        "sum": 3.8e-10,
        "quantize.onebit": 3.31e-9,
        "quantize.threshold": 3.17e-9,
        "quantize.adaptive": 1.07e-8,
        "decode.onebit": 5.6e-10,
        "decode.threshold": 3.3e-10,
        "decode.adaptive": 8.5e-10,
    },
    psum=Link(alpha=0.0, beta=1.62e-9),
    call=6.2e-5,
    inter_process="same_host",
    source="built-in default (jaxcomm/cost.py: 2-core development machine, 2026-11-22)",
)


# ---------------------------------------------------------------------------------------------
# Exact byte counts (per rank), following ffi/*.cc


def _even_begin(n: int, parts: int, chunk: int) -> int:
    # ffi/quantized_common.h EvenBegin and ffi/allreduce.cc ChunkBegin.
    return chunk * (n // parts) + min(chunk, n % parts)


def _even_size(n: int, parts: int, chunk: int) -> int:
    chunk %= parts
    return _even_begin(n, parts, chunk + 1) - _even_begin(n, parts, chunk)


def ring_bytes(n: int, parts: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in jaxcomm's ring allreduce of ``n`` float32 over ``parts``.

    The reduce-scatter sends every chunk but ``rank + 1``, the allgather every chunk but
    ``rank + 2`` (ffi/allreduce.cc).

    Args:
      n: elements.
      parts: ranks in the ring.
      rank: this rank's index in the ring.

    Returns:
      Bytes sent.

    Example:
      >>> ring_bytes(10, 2, 0)
      40
    """
    if parts <= 1:
        return 0
    return _F32 * (2 * n - _even_size(n, parts, rank + 1) - _even_size(n, parts, rank + 2))


def _direct_rs_bytes(n: int, parts: int, rank: int, element_bytes: int = _F32) -> int:
    # DirectReduceScatter (ffi/direct_allreduce.cc): the peers read every slice of this rank's
    # input but its own (its notices go through shared memory, not a transport).
    if parts <= 1:
        return 0
    return element_bytes * (n - _even_size(n, parts, rank))


def _direct_ag_bytes(n: int, parts: int, rank: int, element_bytes: int = _F32) -> int:
    # DirectAllgather: every peer reads this rank's reduced slice.
    if parts <= 1:
        return 0
    return (parts - 1) * element_bytes * _even_size(n, parts, rank)


def direct_bytes(n: int, parts: int, rank: int, element_bytes: int = _F32) -> int:
    """Bytes rank ``rank`` sends in jaxcomm's shared-memory allreduce of ``n`` elements.

    Ranks of one host read each other's memory (ffi/direct_allreduce.h): the bytes a rank
    "sends" are those its peers read from it (every slice of its input but its own, then its
    reduced slice to each peer). The same 2(P-1)/P·n as the ring for even slices, through
    memory instead of a link; the ranks' notices live in shared memory and send nothing.
    The metric labels ``dense_direct`` (float32) and ``dense_bf16_direct`` /
    ``dense_f16_direct`` (2-byte elements) count these bytes.

    Args:
      n: elements.
      parts: ranks in the group.
      rank: this rank's index in the group.
      element_bytes: bytes per element: 4 (float32) or 2 (bfloat16, float16).

    Returns:
      Bytes sent.

    Example:
      >>> direct_bytes(10, 2, 0)
      40
      >>> direct_bytes(10, 2, 0, element_bytes=2)
      20
    """
    if element_bytes not in (2, _F32):
        raise ValueError(f"element_bytes must be 2 or 4, got {element_bytes}")
    return _direct_rs_bytes(n, parts, rank, element_bytes) + _direct_ag_bytes(
        n, parts, rank, element_bytes
    )


def gtopk_sends(rank: int, parts: int) -> int:
    """Number of sparse sets rank ``rank`` sends in gTop-k over ``parts`` ranks.

    The schedule of ffi/gtopk_schedule.h: fold the ranks above the largest power of two p2,
    a binomial tree of merges to rank 0, the broadcast down the same tree, the unfold.

    Args:
      rank: group rank.
      parts: group size.

    Returns:
      Messages of ``2k`` words this rank sends.

    Example:
      >>> [gtopk_sends(r, 4) for r in range(4)]
      [2, 1, 2, 1]
    """
    return sum(1 for op, _ in _gtopk_schedule(rank, parts) if op == "send")


def _gtopk_schedule(rank: int, parts: int) -> list[tuple[str, int]]:
    """(op, tag) of rank's steps: "send", "merge" (receive + merge) or "recv"."""
    steps: list[tuple[str, int]] = []
    p2 = 1
    while p2 * 2 <= parts:
        p2 *= 2
    extra = parts - p2
    tag = 0
    if rank >= p2:
        steps.append(("send", tag))
    elif rank < extra:
        steps.append(("merge", tag))
    tag += 1
    sent_up = rank >= p2
    d = 1
    while d < p2:
        if not sent_up:
            if rank % (2 * d) == d:
                steps.append(("send", tag))
                sent_up = True
            elif rank % (2 * d) == 0:
                steps.append(("merge", tag))
        d *= 2
        tag += 1
    d = p2 // 2
    while d >= 1:
        if rank < p2:
            if rank % (2 * d) == 0:
                steps.append(("send", tag))
            elif rank % (2 * d) == d:
                steps.append(("recv", tag))
        d //= 2
        tag += 1
    if rank < extra:
        steps.append(("send", tag))
    elif rank >= p2:
        steps.append(("recv", tag))
    return steps


def _slice_range(n: int, parts: int, q: int, unit: int) -> tuple[int, int]:
    # kernels/quantized_slices.cc SliceRange: whole units, the first units % parts get one more.
    units = _ceil_div(n, unit)

    def unit_begin(s: int) -> int:
        return s * (units // parts) + min(s, units % parts)

    return min(n, unit_begin(q) * unit), min(n, unit_begin(q + 1) * unit)


def _adaptive_keep(count: float, zeros: float, proportion: float) -> int:
    """Entries adaptive sends for one sign (kernels/adaptive.cc's AdaptiveSignKeep): 1/π of the
    sign's values counting the column's zeros, at most the sign's nonzero values."""
    if count <= 0:
        return 0
    return min(math.ceil(count), math.ceil(round((count + zeros) / proportion, 9)))


def _quantized_words(kind: str, m: int, options: Options, parts: int, stage: str) -> int:
    """``used`` words of one quantized slice of ``m`` elements.

    stage "send": a rank's own contribution; "sum": the owner's requantized sum of ``parts``.
    """
    if m == 0:
        return 1
    cs = options.column_size
    if kind == "onebit":
        return 1 + 2 * _ceil_div(m, cs) + _ceil_div(m, 32)
    if kind == "threshold":
        capacity = min(m, max(1, math.ceil(options.max_density * m)))
        return 1 + min(capacity, math.ceil(options.threshold_fraction * m))
    # adaptive: per column and sign, min(k±, ceil((k± + k0)/π)) entries (kernels/adaptive.cc,
    # k0 = the column's zeros); signs are assumed balanced (k+ = ceil(L/2), k- = floor(L/2)).
    pi = options.proportion
    words = 1
    for length, count in ((cs, m // cs), (m % cs, 1 if m % cs else 0)):
        if not count:
            continue
        signs = (_ceil_div(length, 2), length // 2)
        kept = [_adaptive_keep(sign_count, 0, pi) for sign_count in signs]
        if stage == "sum":
            # Nonzeros of the sum at each sign: `keep` when every rank picked the same
            # positions, the expected union of `parts` independent picks otherwise; the rest
            # of the column is zeros, which count toward each sign's share.
            nonzeros = []
            for sign_count, keep in zip(signs, kept, strict=True):
                union = sign_count * (1.0 - (1.0 - keep / sign_count) ** parts) if keep else 0
                overlap = options.selection_overlap
                nonzeros.append(round(overlap * keep + (1 - overlap) * union, 6))
            zeros = length - sum(nonzeros)
            kept = [_adaptive_keep(nz, zeros, pi) for nz in nonzeros]
        per_column = 2 + sum(kept)
        words += count * per_column
    return words


def _quantized_slices(
    kind: str, n: int, parts: int, options: Options
) -> tuple[list[int], list[int], list[int]]:
    """(slice lengths, words sent per slice, words of the requantized sum per slice)."""
    unit = 1 if kind == "threshold" else options.column_size
    lengths = [b - a for a, b in (_slice_range(n, parts, q, unit) for q in range(parts))]
    send = [_quantized_words(kind, m, options, parts, "send") for m in lengths]
    summed = [_quantized_words(kind, m, options, parts, "sum") for m in lengths]
    return lengths, send, summed


def quantized_bytes(kind: str, n: int, parts: int, rank: int, options: Options) -> int:
    """Bytes rank ``rank`` sends in the quantized allreduce (ffi/quantized_allreduce.cc).

    Pairwise reduce-scatter (``used`` words of slice ``rank + k`` to its owner, k = 1..P-1),
    then a ring allgather of the requantized sums (slices ``rank - k``, k = 0..P-2).

    Args:
      kind: ``"onebit"``, ``"threshold"`` or ``"adaptive"``.
      n: elements.
      parts: ranks.
      rank: group rank.
      options: compressor settings and data assumptions.

    Returns:
      Bytes sent.

    Example:
      >>> quantized_bytes("onebit", 2048, 2, 0, Options())
      280
    """
    if parts <= 1:
        return 0
    _, send, summed = _quantized_slices(kind, n, parts, options)
    words = sum(send[(rank + k) % parts] for k in range(1, parts))
    words += sum(summed[(rank - k) % parts] for k in range(parts - 1))
    return _F32 * words


@functools.cache  # the library reads the setting once per process, so asking once suffices
def small_allreduce_bytes() -> int:
    """The largest dense float32 allreduce (bytes) that takes the small-vector schedules.

    ``JAXCOMM_SMALL_ALLREDUCE_BYTES`` as the C++ library reads it (ffi/allreduce.h): vectors up
    to this size run recursive doubling over a transport and the one-shot read through shared
    memory, larger ones the ring and the direct reduce-scatter + allgather.

    Returns:
      Bytes (0: the small-vector schedules are off).

    Example:
      >>> small_allreduce_bytes() >= 0
      True
    """
    from jaxcomm import _ffi  # the library is the one place that reads the setting

    return int(_ffi.library().jaxcomm_allreduce_small_bytes())


def _doubling_rounds(parts: int) -> tuple[int, int]:
    """(log2 of the largest power of two p2 <= parts, ranks that fold in pairs)."""
    p2 = 1 << (parts.bit_length() - 1)
    return p2.bit_length() - 1, 2 * (parts - p2)


def doubling_bytes(n: int, parts: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in jaxcomm's recursive-doubling allreduce of ``n`` float32.

    Every exchange sends the whole vector (ffi/allreduce.cc, DoublingAllreduce). When ``parts``
    is not a power of two, the first 2(P - p2) ranks pair up: the even one sends its vector
    once and receives the result, the odd one exchanges for both and sends the result back.

    Args:
      n: elements.
      parts: ranks in the group.
      rank: this rank's index in the group.

    Returns:
      Bytes sent.

    Example:
      >>> [doubling_bytes(10, 3, r) for r in range(3)]
      [40, 80, 40]
    """
    if parts <= 1:
        return 0
    rounds, paired = _doubling_rounds(parts)
    if rank < paired:
        return _F32 * n * (1 if rank % 2 == 0 else rounds + 1)
    return _F32 * n * rounds


def oneshot_bytes(n: int, parts: int, rank: int) -> int:
    """Bytes rank ``rank`` "sends" in jaxcomm's one-shot shared-memory allreduce of ``n`` float32.

    Every peer reads all of this rank's input (ffi/direct_allreduce.h, DirectAllreduceOneShot).

    Args:
      n: elements.
      parts: ranks in the group.
      rank: this rank's index in the group (every rank sends as much).

    Returns:
      Bytes sent.

    Example:
      >>> oneshot_bytes(10, 3, 0)
      80
    """
    del rank
    return (parts - 1) * _F32 * n if parts > 1 else 0


def dense_bytes(n: int, parts: int, rank: int, shared_memory: bool) -> int:
    """Bytes rank ``rank`` sends in ``jaxcomm.allreduce`` of ``n`` float32 over ``parts`` ranks.

    The schedule of ffi/allreduce.h: by where the ranks are (``shared_memory``: one host) and
    by size (:func:`small_allreduce_bytes`).

    Args:
      n: elements.
      parts: ranks in the group.
      rank: this rank's index in the group.
      shared_memory: whether every rank of the group reads the others' memory (one host).

    Returns:
      Bytes sent.

    Example:
      >>> dense_bytes(1 << 20, 2, 0, shared_memory=False) == ring_bytes(1 << 20, 2, 0)
      True
    """
    small = _F32 * n <= small_allreduce_bytes()
    if shared_memory:
        return (oneshot_bytes if small else direct_bytes)(n, parts, rank)
    return (doubling_bytes if small else ring_bytes)(n, parts, rank)


def _hier_parts(algorithm: str) -> tuple[str | None, bool]:
    """(quantizer kind or None for dense, single leader?) of a hier_* algorithm."""
    name = algorithm.removeprefix("hier_")
    leader = name.endswith("_leader")
    name = name.removesuffix("_leader")
    return (None if name == "dense" else name), leader


def bytes_sent(
    algorithm: str, n: int, world: World, options: Options | None = None, rank: int | None = None
) -> float:
    """Bytes one rank sends in one call of ``algorithm`` over all ranks of ``world``.

    Equal to ``jaxcomm.metrics()``'s ``bytes_sent`` for the same call (``psum``: the ring
    volume, which XLA does not report).

    Args:
      algorithm: a name of :data:`ALGORITHMS` (or ``hier_onebit``, ``hier_threshold`` and the
        ``_leader`` variants of the hierarchical quantized ones).
      n: float32 elements per rank.
      world: the ranks.
      options: compressor settings (default :class:`Options`).
      rank: a world rank (process-major); None: the mean over all ranks.

    Returns:
      Bytes (an integer value for one rank, the mean otherwise).

    Example:
      >>> bytes_sent("dense", 100_000, World(processes=4))
      600000.0
    """
    options = options or Options()
    _check_algorithm(algorithm)
    _check_elements(n)
    if rank is None:
        return sum(bytes_sent(algorithm, n, world, options, r) for r in range(world.ranks)) / (
            world.ranks
        )
    if not 0 <= rank < world.ranks:
        raise ValueError(f"rank must be in [0, {world.ranks}), got {rank}")
    p = world.ranks
    if n == 0 or p == 1:
        return 0.0
    one_host = world.flat_link() != "across_hosts"
    if algorithm == "psum":
        return float(ring_bytes(n, p, rank))
    if algorithm == "dense":
        return float(dense_bytes(n, p, rank, shared_memory=one_host))
    if algorithm == "topk_allgather":
        return float((p - 1) * 2 * options.k(n) * _F32)
    if algorithm == "gtopk":
        return float(gtopk_sends(rank, p) * 2 * options.k(n) * _F32)
    if algorithm in QUANTIZER_KINDS:
        return float(quantized_bytes(algorithm, n, p, rank, options))
    # Hierarchical: a process is a node, its devices the local ranks.
    kind, leader = _hier_parts(algorithm)
    nodes, local = world.processes, world.devices_per_process
    node, l_rank = divmod(rank, local)

    def inter(m: int) -> int:
        if nodes == 1:
            return 0
        if kind is None:
            return dense_bytes(m, nodes, node, shared_memory=world.inter_process == "same_host")
        return quantized_bytes(kind, m, nodes, node, options)

    # A node's ranks share a process: its reduce-scatter and allgather are the shared-memory
    # ones (ffi/quantized_allreduce.cc, HierarchicalAllreduce), local rank l owning slice l.
    total = _direct_rs_bytes(n, local, l_rank) + _direct_ag_bytes(n, local, l_rank)
    if not leader or local == 1:
        total += inter(_even_size(n, local, l_rank))
    elif l_rank == 0:
        total += inter(n) + (local - 1) * n * _F32  # the sum, read by every rank
    return float(total)


# ---------------------------------------------------------------------------------------------
# Time


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


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS and algorithm not in _EXTRA_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def _check_elements(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n (elements) must be an integer >= 0, got {n!r}")


class _Tally:
    """Accumulates the critical path of one call: messages, bytes and kernel work."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.comm = 0.0
        self.compute = 0.0
        self.messages = 0.0

    def send(self, link: str, messages: float, nbytes: float, contention: int = 1) -> None:
        # `contention` flows share the link: each one's bytes take that much longer.
        self.comm += self.profile.links[link].seconds(messages, nbytes * max(1, contention))
        self.messages += messages

    def kernel(self, name: str, elements: float) -> None:
        self.compute += self.profile.gamma[name] * elements


def ring_path(n: int, parts: int) -> tuple[int, int]:
    """Latency steps and bytes on the critical path of jaxcomm's ring allreduce.

    2(P-1) steps (reduce-scatter, then allgather), each moving one chunk of ``ceil(n / P)``
    floats. A chunk travels in pipelined segments (ffi/allreduce.cc), which overlap, so the
    latency is counted once per step, not per segment.

    Args:
      n: elements.
      parts: ranks in the ring.

    Returns:
      ``(steps, bytes)`` one rank sends in sequence.

    Example:
      >>> ring_path(1 << 20, 4)
      (6, 6291456)
    """
    if parts <= 1 or n == 0:
        return 0, 0
    steps = 2 * (parts - 1)
    return steps, steps * _ceil_div(n, parts) * _F32


def dense_path(n: int, parts: int, shared_memory: bool) -> tuple[int, int, int]:
    """The critical path of ``jaxcomm.allreduce``'s schedule (ffi/allreduce.h) of n float32.

    Over a transport: recursive doubling (small vectors) or the pipelined ring. Through shared
    memory: the one-shot (small) or the direct reduce-scatter + allgather, whose "messages"
    are notice rounds and whose bytes are what a rank reads from its peers.

    Args:
      n: elements.
      parts: ranks in the group.
      shared_memory: whether the ranks read each other's memory (one host).

    Returns:
      ``(messages, bytes, summed)``: latency steps and bytes one rank moves in sequence, and
      the elements its reductions add (beyond the first copy of x into the output).

    Example:
      >>> dense_path(1 << 20, 4, shared_memory=False)
      (6, 6291456, 786432)
    """
    if parts <= 1 or n == 0:
        return 0, 0, 0
    if _F32 * n <= small_allreduce_bytes():
        if shared_memory:
            return 2, (parts - 1) * n * _F32, (parts - 1) * n
        rounds, paired = _doubling_rounds(parts)
        steps = rounds + (2 if paired else 0)
        return steps, steps * n * _F32, (rounds + (1 if paired else 0)) * n
    chunk = _ceil_div(n, parts)
    if shared_memory:
        return 3, 2 * (parts - 1) * chunk * _F32, (parts - 1) * chunk
    steps, nbytes = ring_path(n, parts)
    return steps, nbytes, (parts - 1) * chunk


def _dense_time(t: _Tally, n: int, parts: int, link: str, contention: int = 1) -> None:
    """``jaxcomm.allreduce``'s schedule of n floats over ``link`` (:func:`dense_path`)."""
    shared_memory = link != "across_hosts"
    messages, nbytes, summed = dense_path(n, parts, shared_memory)
    if messages == 0:
        return
    t.send(link, messages, nbytes, contention)
    t.kernel("sum", summed)
    if link == "same_host" and _F32 * n > small_allreduce_bytes():
        t.kernel("sum", n)  # staging: x into this rank's shared area


def _quantized_time(
    t: _Tally, kind: str, n: int, parts: int, link: str, options: Options, pairwise_flows: int
) -> None:
    """Quantized allreduce (ffi/quantized_allreduce.cc) of n floats over parts ranks."""
    if parts <= 1 or n == 0:
        t.kernel(f"quantize.{kind}", n)
        t.kernel(f"decode.{kind}", n)
        return
    lengths, send, summed = _quantized_slices(kind, n, parts, options)
    m = max(lengths)
    t.kernel(f"quantize.{kind}", n + m)  # every slice, then the owned sum
    t.kernel(f"decode.{kind}", parts * m + n)  # P contributions, then every sum
    t.kernel("sum", m + n)  # the requantization error into the residual; zeroing out
    t.send(link, parts - 1, (parts - 1) * max(send) * _F32, pairwise_flows)
    t.send(link, parts - 1, (parts - 1) * max(summed) * _F32)


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
      algorithm: a name of :data:`ALGORITHMS`.
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
    _check_algorithm(algorithm)
    _check_elements(n)
    t = _Tally(profile)
    p, nodes, local = world.ranks, world.processes, world.devices_per_process
    flat = world.flat_link()
    # Ranks of one process that send across its boundary at once in a pairwise exchange.
    pairwise_flows = local if nodes > 1 else 1
    if n == 0:
        pass
    elif algorithm == "psum":
        if p > 1:
            # XLA's collectives are a black box: their measured line, but never faster than
            # the links allow a ring to be (a profile from loopback planning a network).
            messages, nbytes = ring_path(n, p)
            wire = profile.links[flat].seconds(messages, nbytes)
            fitted = profile.psum.seconds(1, bytes_sent("psum", n, world, options, 0))
            t.comm += max(fitted, wire)
            t.messages += messages
    elif algorithm == "dense":
        t.kernel("sum", n)  # x into the output: a copy, or the first pass of the reduction
        _dense_time(t, n, p, flat)
    elif algorithm in ("topk_allgather", "gtopk"):
        k = options.k(n)
        t.kernel("topk", n)
        t.kernel("sum", n)  # memset of the dense result
        if algorithm == "topk_allgather":
            t.kernel("sum", p * k)  # scatter-add of every rank's set
            if p > 1:
                t.send(flat, p - 1, (p - 1) * 2 * k * _F32)
        else:
            # Rank 0 is on the critical path: fold, tree merges, broadcast sends, unfold.
            schedule = _gtopk_schedule(0, p)
            depth = len(schedule)
            merges = sum(1 for op, _ in schedule if op == "merge")
            t.kernel("merge", merges * 2 * k)
            t.kernel("sum", k)
            if p > 1:
                t.send(flat, depth, depth * 2 * k * _F32)
    elif algorithm in QUANTIZER_KINDS:
        _quantized_time(t, algorithm, n, p, flat, options, pairwise_flows)
    else:
        kind, leader = _hier_parts(algorithm)
        inter_link = world.inter_process
        if kind is not None:
            t.kernel("sum", 2 * n)  # acc = x + r; zeroing the new residual
        else:
            t.kernel("sum", n)  # copy of x into the output
        chunk = _ceil_div(n, local)
        if local > 1:
            t.send("same_process", local - 1, (local - 1) * chunk * _F32)
            t.kernel("sum", (local - 1) * chunk)
        if not leader or local == 1:
            # Every local rank runs its own inter-node allreduce through the process's link.
            if kind is None:
                _dense_time(t, chunk, nodes, inter_link, contention=local)
            else:
                _quantized_time(t, kind, chunk, nodes, inter_link, options, local)
            if local > 1:
                t.send("same_process", local - 1, (local - 1) * chunk * _F32)
        else:
            t.send("same_process", local - 1, (local - 1) * chunk * _F32)  # gather to leader
            if kind is None:
                _dense_time(t, n, nodes, inter_link)
            else:
                _quantized_time(t, kind, n, nodes, inter_link, options, 1)
            t.send("same_process", local - 1, (local - 1) * n * _F32)  # leader sends the sum
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


def plan(
    sizes: Sequence[int],
    world: World,
    profile: Profile | None = None,
    options: Options | None = None,
    algorithms: Iterable[str] = ALGORITHMS,
    allowed: Iterable[str] | None = None,
    overlap: bool = False,
    hidden_seconds: float = 0.0,
    steps_factor: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Predictions for every algorithm and size, and the pick (what ``jaxcomm plan`` prints).

    The pick, like ``auto``'s, has the least predicted time to target: seconds times the
    steps the algorithm needs relative to dense (``steps_factor``).

    Args:
      sizes: gradient sizes in elements per rank; the pick is made for the sum of one call
        per size (a step that reduces each of them once, e.g. one call per bucket).
      world: the ranks.
      profile: alpha/beta/gamma (default :data:`DEFAULT_PROFILE`).
      options: compressor settings.
      algorithms: algorithms to predict (default: all of :data:`ALGORITHMS`).
      allowed: algorithms the pick may be (default: all predicted ones).
      overlap: see :func:`predict`.
      hidden_seconds: see :func:`predict` (per call).
      steps_factor: steps relative to dense (default :data:`DEFAULT_STEPS_FACTOR`).

    Returns:
      ``{"pick": {"algorithm", "elements", "bytes_sent_per_rank", "seconds", "steps_factor"},
      "predictions": [{"algorithm", "elements", "processes", "devices_per_process",
      "bytes_sent_per_rank", "seconds"}, ...]}``.

    Raises:
      ValueError: no sizes, or ``allowed`` shares no algorithm with ``algorithms``.

    Example:
      >>> plan([1 << 20], World(processes=2))["pick"]["algorithm"] in ALGORITHMS
      True
    """
    sizes = [int(s) for s in sizes]
    if not sizes:
        raise ValueError("plan needs at least one gradient size")
    algorithms = list(algorithms)
    candidates = [a for a in algorithms if allowed is None or a in set(allowed)]
    if not candidates:
        raise ValueError(f"allowed={allowed!r} names none of the algorithms {algorithms}")
    predictions = []
    totals: dict[str, list[float]] = {}
    for n in sizes:
        for a in algorithms:
            p = predict(a, n, world, profile, options, overlap, hidden_seconds)
            keys = ("algorithm", "elements", "processes", "devices_per_process")
            row = {k: getattr(p, k) for k in keys}
            row.update(bytes_sent_per_rank=p.bytes_sent_per_rank, seconds=p.seconds)
            predictions.append(row)
            acc = totals.setdefault(a, [0.0, 0.0])
            acc[0] += p.seconds
            acc[1] += p.bytes_sent_per_rank
    _check_steps_factor(steps_factor)
    best = min(
        candidates,
        key=lambda a: (totals[a][0] * steps_factor_of(a, steps_factor), candidates.index(a)),
    )
    pick = {
        "algorithm": best,
        "elements": sum(sizes),
        "bytes_sent_per_rank": totals[best][1],
        "seconds": totals[best][0],
        "steps_factor": steps_factor_of(best, steps_factor),
    }
    return {"pick": pick, "predictions": predictions}


# ---------------------------------------------------------------------------------------------
# algorithm="auto"


@dataclasses.dataclass(frozen=True)
class Auto:
    """``algorithm`` of ``jaxcomm.optax.allreduce_gradients`` that picks per bucket.

    At trace time each bucket's algorithm is the one :func:`choose` predicts fastest for its
    static size and the static world: the same on every rank (a pure function of shapes, the
    mesh and the profile, which every rank must read from the same file).

    Args:
      allowed: names from :data:`AUTO_CHOICES` the choice may be (the convergence cost you
        accept); default :data:`DEFAULT_ALLOWED`.
      profile: a :class:`Profile`, a path to ``jaxcomm probe``'s JSON, or None for
        :data:`DEFAULT_PROFILE`.
      options: compressor settings of the candidates (density, proportion, tau, ...).
      steps_factor: steps each algorithm needs to reach dense's accuracy, relative to dense
        (default :data:`DEFAULT_STEPS_FACTOR`); the pick minimizes ``factor × seconds``.

    Example:
      >>> auto = Auto(allowed=("dense", "gtopk"), options=Options(density=0.01))
      >>> auto.allowed
      ('dense', 'gtopk')
    """

    allowed: tuple[str, ...] = DEFAULT_ALLOWED
    profile: Profile | str | None = None
    options: Options = dataclasses.field(default_factory=Options)
    steps_factor: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        allowed = (self.allowed,) if isinstance(self.allowed, str) else tuple(self.allowed)
        bad = [a for a in allowed if a not in AUTO_CHOICES]
        if bad or not allowed:
            raise ValueError(
                f"Auto.allowed must be a non-empty subset of {AUTO_CHOICES}, got {self.allowed!r}"
            )
        object.__setattr__(self, "allowed", allowed)
        _check_steps_factor(self.steps_factor)
        if isinstance(self.profile, (str, pathlib.Path)):
            object.__setattr__(self, "profile", Profile.load(self.profile))

    def resolved_profile(self) -> Profile:
        """The profile in use (:data:`DEFAULT_PROFILE` when none was given)."""
        return self.profile if isinstance(self.profile, Profile) else DEFAULT_PROFILE


_decisions: list[dict[str, Any]] = []


def _check_steps_factor(steps_factor: Mapping[str, float] | None) -> None:
    if steps_factor is None:
        return
    bad = {k: v for k, v in steps_factor.items() if not (math.isfinite(v) and v > 0)}
    if bad:
        raise ValueError(f"steps_factor values must be finite and > 0, got {bad}")


def steps_factor_of(name: str, steps_factor: Mapping[str, float] | None = None) -> float:
    """The steps `name` needs relative to dense (:data:`DEFAULT_STEPS_FACTOR`; 1.0 if absent).

    Example:
      >>> steps_factor_of("dense"), steps_factor_of("gtopk", {"gtopk": 1.5})
      (1.0, 1.5)
    """
    table = DEFAULT_STEPS_FACTOR if steps_factor is None else steps_factor
    return float(table.get(name, 1.0))


def choose(
    n: int,
    world: World,
    allowed: Iterable[str] = DEFAULT_ALLOWED,
    profile: Profile | None = None,
    options: Options | None = None,
    hierarchical: bool = False,
    steps_factor: Mapping[str, float] | None = None,
) -> str:
    """The algorithm among ``allowed`` with the least predicted time to target for one call on
    ``n`` elements: its seconds times the steps it needs relative to dense.

    Args:
      n: elements per rank.
      world: the ranks.
      allowed: names from :data:`AUTO_CHOICES`.
      profile: default :data:`DEFAULT_PROFILE`.
      options: compressor settings.
      hierarchical: the call is hierarchical (node, local): only dense and the quantizers
        have hierarchical forms, so the sparse names are skipped.
      steps_factor: steps relative to dense (default :data:`DEFAULT_STEPS_FACTOR`).

    Returns:
      A name from ``allowed``; ties go to the earlier one.

    Raises:
      ValueError: nothing in ``allowed`` is usable.

    Example:
      >>> choose(25_000_000, World(4, 1, "across_hosts"), ("dense", "gtopk"))
      'gtopk'
    """
    allowed = [a for a in allowed if not (hierarchical and a in ("gtopk", "topk_allgather"))]
    if not allowed:
        raise ValueError("no allowed algorithm has a hierarchical form; allow 'dense'")
    best, best_time = None, math.inf
    for name in allowed:
        if name not in AUTO_CHOICES:
            raise ValueError(f"unknown auto choice {name!r}; allowed: {AUTO_CHOICES}")
        model = "hier_" + name if hierarchical else name
        seconds = predict(model, n, world, profile, options).seconds
        seconds *= steps_factor_of(name, steps_factor)
        if seconds < best_time:
            best, best_time = name, seconds
    return best


def resolve_auto(
    auto: Auto | str,
    n: int,
    axis_size: int,
    processes: int,
    devices_per_process: int,
    hierarchical: bool = False,
) -> Any:
    """The algorithm ``allreduce_gradients`` uses for one bucket when ``algorithm="auto"``.

    Args:
      auto: ``"auto"`` (default :class:`Auto`) or an :class:`Auto`.
      n: the bucket's elements.
      axis_size: ranks reduced over (the product of the reduced mesh axes).
      processes: ``jax.process_count()``.
      devices_per_process: ``jax.local_device_count()``.
      hierarchical: the reduction is hierarchical over (node, local).

    Returns:
      None for the dense ring allreduce, else a jaxcomm algorithm (``GTopK``, ...).

    Example:
      >>> resolve_auto(Auto(allowed=("dense",)), 1000, 2, 2, 1) is None
      True
      >>> resolve_auto(Auto(allowed=("gtopk",)), 1000, 2, 2, 1)
      GTopK(density=0.001)
    """
    import jaxcomm  # only here: the rest of this module needs neither JAX nor the library

    if isinstance(auto, str):
        if auto != "auto":
            raise ValueError(f"algorithm string must be 'auto', got {auto!r}")
        auto = Auto()
    profile = auto.resolved_profile()
    # The reduced axis may span fewer ranks than the world (e.g. one axis of a 2-D mesh):
    # keep the world's devices per process where they divide it.
    local = math.gcd(axis_size, devices_per_process)
    nodes = max(1, axis_size // local)
    world = World(min(nodes, processes) if processes > 1 else 1, local, profile.inter_process)
    if world.ranks != axis_size:  # a world the model cannot split: treat it as flat
        world = World(axis_size, 1, profile.inter_process if processes > 1 else "same_host")
    name = choose(n, world, auto.allowed, profile, auto.options, hierarchical, auto.steps_factor)
    o = auto.options
    chosen = {
        "dense": lambda: None,
        "gtopk": lambda: jaxcomm.GTopK(o.density),
        "topk_allgather": lambda: jaxcomm.TopKAllgather(o.density),
        "adaptive": lambda: jaxcomm.Adaptive(o.proportion, column_size=o.column_size),
        "onebit": lambda: jaxcomm.OneBit(column_size=o.column_size),
        "threshold": lambda: jaxcomm.Threshold(o.tau, max_density=o.max_density),
    }[name]()
    decision = {
        "elements": n,
        "processes": world.processes,
        "devices_per_process": world.devices_per_process,
        "choice": name,
        "allowed": list(auto.allowed),
        "profile": profile.source,
    }
    _decisions.append(decision)
    _log.info("jaxcomm auto: %d elements over %d ranks -> %s", n, axis_size, name)
    return chosen


def auto_decisions() -> list[dict[str, Any]]:
    """The choices ``algorithm="auto"`` made in this process, in trace order.

    Returns:
      One dict per resolved bucket: ``elements``, ``processes``, ``devices_per_process``,
      ``choice``, ``allowed``, ``profile``.

    Example:
      >>> from jaxcomm import cost
      >>> isinstance(cost.auto_decisions(), list)
      True
    """
    return list(_decisions)


def auto_algorithm(
    algorithm: Any, n: int, axis_name: str | Sequence[str], hierarchical: bool = False
) -> Any:
    """Resolves ``algorithm="auto"`` for one bucket inside a traced, shard_mapped step.

    ``jaxcomm.optax.allreduce_gradients`` calls this for every bucket: any other algorithm
    comes back unchanged; ``"auto"`` or an :class:`Auto` becomes :func:`resolve_auto`'s choice
    for the bucket's static size, the reduced axes' static size and the process layout
    (``jax.process_count()``, ``jax.local_device_count()``), so every rank chooses the same.

    Args:
      algorithm: what the user passed as ``algorithm``.
      n: the bucket's elements.
      axis_name: the reduced mesh axis or axes (inside ``jax.shard_map``).
      hierarchical: the reduction is hierarchical.

    Returns:
      None (dense ring allreduce) or a jaxcomm algorithm (``GTopK``, ...).

    Example:
      >>> auto_algorithm(None, 1000, "dp") is None
      True
    """
    if not (isinstance(algorithm, Auto) or isinstance(algorithm, str)):
        return algorithm
    import jax
    from jax import lax

    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    axis_size = math.prod(lax.axis_size(a) for a in names)
    return resolve_auto(
        algorithm, n, axis_size, jax.process_count(), jax.local_device_count(), hierarchical
    )
