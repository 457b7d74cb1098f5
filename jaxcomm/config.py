"""jaxcomm's configuration: every environment setting, declared once, and the NCCL library.

:data:`SETTINGS` is the one table of the ``JAXCOMM_*`` environment variables: who reads each
one (Python or the C++ library), its default, what values it accepts and what it does. Python
reads a setting only through :func:`get`, which validates it and names the variable in its
error; ``import jaxcomm`` runs :func:`check_environment` before the C++ library is loaded, so a
bad value of a setting that C++ reads also fails there, with the same message, instead of
being parsed loosely in C++. ``docs/DESIGN.md`` ("Environment settings") is generated from
this table (:func:`markdown_table`).

This module imports only the standard library (the launcher loads it without JAX).

Example:
  >>> import jaxcomm.config
  >>> jaxcomm.config.get("JAXCOMM_TIMEOUT_S")
  120.0
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any


class ConfigError(ValueError):
    """An environment setting has a value jaxcomm cannot use; the message names it."""


def _number(kind: type, minimum: float, exclusive: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)  # ValueError on garbage
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
            raise ValueError(f"must be {'>' if exclusive else '>='} {minimum:g}")
        return value

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text

    return parse


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError("must be in 1-65535")
    return port


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, with "" (unset and no default) meaning None."""
    return lambda text: None if text == "" else parse(text)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable.

    Attributes:
      name: the variable, e.g. ``JAXCOMM_TIMEOUT_S``.
      default: the value used when it is unset or empty (as text; parsed like a set value).
      accepts: what values are valid, in words (for errors and the docs).
      read_by: where it is read (a Python module, or a C++ file: then Python only validates).
      doc: what it does.
      parse: text -> value; raises ValueError for an invalid value.
    """

    name: str
    default: str
    accepts: str
    read_by: str
    doc: str
    parse: Callable[[str], Any] = str


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "JAXCOMM_TIMEOUT_S",
            "120",
            "seconds, a number > 0",
            "C++ ffi/transport/settings.cc (DefaultTimeout); Python jaxcomm/_world.py reads it "
            "back through jaxcomm_world_default_timeout_s",
            "Deadline of every wait of a collective, the world bootstrap and a GPU "
            "communicator; a peer silent for longer fails the collective naming it.",
            _number(float, 0.0, exclusive=True),
        ),
        Setting(
            "JAXCOMM_UCX_WAIT",
            "wakeup",
            "wakeup or backoff",
            "C++ ffi/transport/settings.cc (UcxWorld::Create)",
            "How a rank waits for UCX: sleep on the worker's event fd (wakeup) or poll with "
            "growing sleeps (backoff).",
            _choice("wakeup", "backoff"),
        ),
        Setting(
            "JAXCOMM_UCX_SPIN_US",
            "20",
            "microseconds, a number >= 0",
            "C++ ffi/transport/settings.cc (UcxWorld::Create)",
            "How long a wait polls UCX (or a same-host peer's notice) before it sleeps.",
            _number(float, 0.0, exclusive=False),
        ),
        Setting(
            "JAXCOMM_SHARED_MEMORY",
            "1",
            "1 or 0",
            "C++ ffi/transport/settings.cc (SharedMemoryEnabled)",
            "1: ranks of one host read each other's buffers directly (same process: loads; "
            "same host: process_vm_readv) and exchange notices in shared memory, the dense "
            "allreduce's fast path; 0: every byte goes through UCX.",
            _choice("1", "0"),
        ),
        Setting(
            "JAXCOMM_TRANSPORT",
            "auto",
            "auto, ucx or nccl",
            "C++ ffi/transport/settings.cc (ReadTransportName; the table: "
            "ffi/transport/registry.cc)",
            "Which transport moves a collective's buffers: auto takes ucx for CPU buffers and "
            "nccl for GPU buffers; ucx on GPU stages the dense allreduce through pinned host "
            "memory (other GPU collectives refuse it); nccl refuses CPU buffers.",
            _choice("auto", "ucx", "nccl"),
        ),
        Setting(
            "JAXCOMM_SMALL_ALLREDUCE_BYTES",
            "32768",
            "bytes, an integer >= 0",
            "C++ ffi/allreduce.cc (SmallAllreduceBytes); Python "
            "jaxcomm/cost/algorithm_costs/dense.py (the cost model) reads it too",
            "Dense float32 allreduces of at most this many bytes take the latency-optimal "
            "schedules (recursive doubling over a transport, one-shot through shared memory) "
            "instead of the ring or the direct reduce-scatter + allgather; 0 turns them off.",
            _number(int, 0, exclusive=False),
        ),
        Setting(
            "JAXCOMM_NCCL_LIBRARY",
            "",
            "a path to libnccl.so.2, or empty",
            "Python jaxcomm/config.py (nccl_library_path)",
            "The NCCL library the GPU collectives load; empty: the nvidia-nccl wheel's, else "
            "the loader's libnccl.so.2.",
        ),
        Setting(
            "JAXCOMM_INIT_TIMEOUT",
            "120",
            "seconds, an integer >= 1",
            "Python launcher/jaxcomm_launcher/worker.py",
            "How long a launched rank waits for jax.distributed.initialize to meet the others.",
            _number(int, 1, exclusive=False),
        ),
        Setting(
            "JAXCOMM_HOST_MALLOC",
            "keep",
            "keep or system",
            "Python launcher/jaxcomm_launcher/hostmem.py",
            "keep: a launched rank's glibc malloc uses one arena, neither maps large buffers "
            "anew nor trims its heap, so a step's host buffers are not page-faulted again "
            "every step; "
            "system: glibc's adaptive thresholds (also kept when MALLOC_* or GLIBC_TUNABLES "
            "tune malloc).",
            _choice("keep", "system"),
        ),
        Setting(
            "JAXCOMM_STATE_DIR",
            "/run/jaxcomm",
            "a directory",
            "Python launcher/jaxcomm_launcher/cleanup.py",
            "Where emulated launches record what they created, for `jaxcomm cleanup`.",
        ),
        Setting(
            "JAXCOMM_PROCESS_ID",
            "",
            "an integer >= 0 (set by the launcher)",
            "Python launcher/jaxcomm_launcher/worker.py",
            "This rank's process index (local and emulated backends; mpirun and Slurm ranks "
            "read OMPI_COMM_WORLD_RANK / SLURM_PROCID instead).",
            _optional(_number(int, 0, exclusive=False)),
        ),
        Setting(
            "JAXCOMM_NUM_PROCESSES",
            "",
            "an integer >= 1 (set by the launcher)",
            "Python launcher/jaxcomm_launcher/worker.py",
            "The number of processes (with JAXCOMM_PROCESS_ID).",
            _optional(_number(int, 1, exclusive=False)),
        ),
        Setting(
            "JAXCOMM_COORDINATOR",
            "",
            "host:port (set by the launcher)",
            "Python launcher/jaxcomm_launcher/worker.py",
            "The jax.distributed coordinator (rank 0).",
        ),
        Setting(
            "JAXCOMM_COORDINATOR_PORT",
            "",
            "a port, an integer 1-65535 (set in Slurm jobs)",
            "Python launcher/jaxcomm_launcher/worker.py",
            "Slurm: the coordinator's base port on the step's first node (plus the step id).",
            _optional(_port),
        ),
        Setting(
            "JAXCOMM_NODE_ADDRESS",
            "",
            "an IPv4 address (set by the emulated backend)",
            "jobs that need their own address",
            "The rank's address inside its emulated network namespace.",
        ),
    )
}
"""Every ``JAXCOMM_*`` variable jaxcomm reads at run time. Build-time switches
(``JAXCOMM_ENABLE_CUDA``, ``JAXCOMM_ENABLE_UCX``) are CMake options, listed in the README."""


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The validated value of setting ``name`` (its default when unset or empty).

    Args:
      name: a key of :data:`SETTINGS`.
      environ: where to read it (default ``os.environ``).

    Returns:
      The parsed value (e.g. a float for ``JAXCOMM_TIMEOUT_S``).

    Raises:
      KeyError: ``name`` is not a declared setting.
      ConfigError: the value is invalid; the message names the variable and what it accepts.

    Example:
      >>> get("JAXCOMM_UCX_WAIT", {"JAXCOMM_UCX_WAIT": "backoff"})
      'backoff'
    """
    setting = SETTINGS[name]
    text = (os.environ if environ is None else environ).get(name, "")
    given = text != ""
    try:
        return setting.parse(text if given else setting.default)
    except ValueError as e:
        raise ConfigError(
            f"{name}={text!r} is invalid ({e}); it accepts {setting.accepts}. "
            f"Unset it for the default ({setting.default or 'empty'!s})."
        ) from None


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Validates every setting of :data:`SETTINGS` that is set.

    ``import jaxcomm`` calls it before the C++ library (which reads some of them) is loaded.

    Args:
      environ: where to read (default ``os.environ``).

    Returns:
      None.

    Raises:
      ConfigError: the first invalid setting.

    Example:
      >>> check_environment({"JAXCOMM_UCX_SPIN_US": "5"})
    """
    for name in SETTINGS:
        get(name, environ)


def markdown_table() -> str:
    """The settings as a Markdown table (the one in ``docs/DESIGN.md``).

    Returns:
      ``| variable | default | accepts | read by | what it does |`` and one row per setting.

    Example:
      >>> markdown_table().splitlines()[0]
      '| variable | default | accepts | read by | what it does |'
    """
    rows = ["| variable | default | accepts | read by | what it does |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        rows.append(
            f"| `{s.name}` | {f'`{s.default}`' if s.default else '–'} | {s.accepts} | "
            f"{s.read_by} | {s.doc} |"
        )
    return "\n".join(rows)


def nccl_library_path() -> str:
    """Path of the NCCL library the GPU collectives will load.

    On GPUs, :func:`jaxcomm.allreduce` and :func:`jaxcomm.compressed_allreduce` move their data
    with NCCL on XLA's stream (ffi/cuda/). jaxcomm does not link NCCL: at the first GPU
    collective it opens ``JAXCOMM_NCCL_LIBRARY`` when set, else the ``libnccl.so.2`` of an
    installed ``nvidia-nccl-cu12`` / ``-cu13`` wheel (the copy ``jax[cuda]`` installs and JAX
    itself uses), else ``""`` (the loader's search for ``libnccl.so.2``).

    Returns:
      A file path, or ``""``.

    Example:
      >>> nccl_library_path()  # doctest: +SKIP
      '/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2'
    """
    override = get("JAXCOMM_NCCL_LIBRARY")
    if override:
        return override
    try:
        import nvidia  # type: ignore[import-not-found]  # namespace of NVIDIA's wheels
    except ImportError:
        return ""
    # nvidia-nccl-cu12 installs nvidia/nccl/lib/, the CUDA 13 wheels nvidia/cu13/lib/.
    for root in getattr(nvidia, "__path__", []):
        for candidate in sorted(pathlib.Path(root).glob("*/lib/libnccl.so.2")):
            return str(candidate)
    return ""


def configure_nccl() -> None:
    """Tells the C++ library which NCCL to load (before the first GPU collective; idempotent).

    Returns:
      None.

    Example:
      >>> configure_nccl()  # doctest: +SKIP
    """
    from jaxcomm import _ffi

    lib = _ffi.library()
    if hasattr(lib, "jaxcomm_nccl_set_library"):  # CUDA builds only
        lib.jaxcomm_nccl_set_library(nccl_library_path().encode())
