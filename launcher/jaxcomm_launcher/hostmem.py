"""Makes a launched rank keep the host memory it frees, so its step's buffers stay mapped.

XLA on CPU allocates a step's temporary buffers with ``malloc`` and frees them when the step
ends. glibc's ``malloc`` hands memory back to the system in three ways: a large request gets
a fresh ``mmap``, unmapped on free (above its mmap threshold); the top of a heap is trimmed
when more than its trim threshold is free there; and a thread's arena unmaps a whole heap
once nothing in it is in use. glibc moves both thresholds as the process frees memory, so
which of a step's buffers come back unmapped depends on the order of earlier frees across
XLA's threads. A rank that lands in that state page-faults every page of those buffers again
on every step, in the kernel, while its peers wait for it in the collective.

:func:`keep_freed_memory` turns all three off for the rank, the way MPI libraries do for
their registration caches: one arena for all threads (``M_ARENA_MAX`` 1: the main heap, which
grows without the 64 MiB bound of a thread's heaps), no request served by ``mmap``
(``M_MMAP_MAX`` 0) and no trimming (``M_TRIM_THRESHOLD`` -1). A rank's memory then stays at
its peak, which training reaches in its first steps anyway. ``JAXCOMM_HOST_MALLOC=system`` or
any of glibc's own malloc variables in the environment leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Mapping

from jaxcomm import config

# glibc's <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

GLIBC_MALLOC_VARIABLES = (
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
)


def _user_chose(environ: Mapping[str, str]) -> bool:
    """Whether the environment already tunes glibc's malloc (then it is the user's choice)."""
    if any(name in environ for name in GLIBC_MALLOC_VARIABLES):
        return True
    return "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory(environ: Mapping[str, str]) -> bool:
    """Sets glibc's malloc to keep freed memory in this process (see the module docstring).

    Args:
      environ: the rank's environment (``JAXCOMM_HOST_MALLOC`` and glibc's variables).

    Returns:
      True when all three settings took effect; False when the setting says ``system``, the
      environment tunes malloc itself, or the C library is not glibc.

    Raises:
      jaxcomm.config.ConfigError: ``JAXCOMM_HOST_MALLOC`` has an invalid value.

    Example:
      >>> keep_freed_memory({"JAXCOMM_HOST_MALLOC": "system"})
      False
    """
    if config.get("JAXCOMM_HOST_MALLOC", environ) == "system" or _user_chose(environ):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    # One arena first: a thread's own arena would keep unmapping heaps it empties.
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
    return all([bool(libc.mallopt(param, value)) for param, value in settings])
