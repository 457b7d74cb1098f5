"""Per-collective metrics recorded by the C++ handlers: bytes on the wire, time, algorithm.

Reading them costs a JSON copy on the host and never synchronizes a device: the handlers
append a record when each collective finishes.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

from jaxcomm import _ffi


def metrics() -> dict[str, Any]:
    """Returns the metrics of every jaxcomm collective this process ran.

    Returns:
      ``{"totals": [...], "recent": [...]}``. Each total aggregates one (world rank, API name,
      algorithm): ``calls``, ``group_size``, ``elements``, ``bytes_sent``, ``bytes_received``,
      ``seconds``. ``recent`` lists the last 4096 calls individually (with ``seq``).

    Example:
      >>> import jaxcomm
      >>> totals = jaxcomm.metrics()["totals"]
    """
    lib = _ffi.library()
    fn = lib.jaxcomm_metrics_json
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    size = fn(None, 0)
    buffer = ctypes.create_string_buffer(size + 1)
    fn(buffer, size + 1)
    return json.loads(buffer.value.decode())


def reset_metrics() -> None:
    """Forgets all recorded metrics (e.g. after warm-up steps).

    Example:
      >>> import jaxcomm
      >>> jaxcomm.reset_metrics()
    """
    _ffi.library().jaxcomm_metrics_reset()
