"""jaxcomm: communication-efficient collectives for data-parallel JAX training.

Importing the package is light: it imports neither JAX nor the compiled library, so the
stdlib-only modules (``jaxcomm.cost``, ``jaxcomm.algorithms``, ``jaxcomm.config``,
``jaxcomm.checkpoints``) are imported plainly, by the launcher too. The API that needs JAX
loads on first use (PEP 562 ``__getattr__``); the first module that calls a jaxcomm FFI target
imports ``jaxcomm._ffi``, which checks the ``JAXCOMM_*`` settings, loads the library and
registers every target once. The one thing importing jaxcomm does besides defining names: it
hooks XLA:CPU's launch-pool sizing (jaxcomm/pacing.py) into JAX's import, so the pool is sized
before JAX creates its CPU client whether JAX is imported before or after jaxcomm; a process
that never imports JAX (the launcher's) never runs it.

Example:
  >>> import jax.numpy as jnp, jaxcomm
  >>> values, indices = jaxcomm.ops.topk_abs(jnp.array([1.0, -4.0, 2.0]), 1)
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from jaxcomm import _jax_compat, algorithms, config
from jaxcomm.algorithms._sparse import TopK

__version__ = "0.1.0"


def _size_launch_pool() -> None:
    from jaxcomm._launch_pool import size_cpu_launch_pool

    size_cpu_launch_pool()


# A launch pool that several devices cannot starve, set before JAX creates its CPU client:
# now if JAX is imported already, else right after JAX is imported (no device exists before).
_jax_compat.after_jax_import(_size_launch_pool)

# The API that needs JAX: name -> the module that defines it, imported on first use.
_LAZY = {
    "allreduce": "jaxcomm.collectives",
    "compressed_allreduce": "jaxcomm.collectives",
    "start_allreduce": "jaxcomm.collectives",
    "wait": "jaxcomm.collectives",
    "Pending": "jaxcomm.collectives",
    "metrics": "jaxcomm._metrics",
    "reset_metrics": "jaxcomm._metrics",
    "DataParallelStep": "jaxcomm.parallel_step",
    "data_parallel": "jaxcomm.parallel_step",
    "data_parallel_step": "jaxcomm.parallel_step",
    "Compressor": "jaxcomm.ops.compress",
    "CollectiveError": "jaxcomm.pacing",
    "Paced": "jaxcomm.pacing",
    "paced": "jaxcomm.pacing",
    "size_cpu_launch_pool": "jaxcomm.pacing",
}

# Every registered algorithm's spec is public as jaxcomm.<Spec> (the registry is light), so an
# algorithm module added to jaxcomm/algorithms/ needs no edit here.
_SPECS = {cls.__name__: cls for cls in algorithms.spec_classes()}
globals().update(_SPECS)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f"{__name__}.{name}")  # jaxcomm.ops, jaxcomm.optax, ...
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    *sorted(set(_SPECS) - {"Adaptive", "GTopK", "OneBit", "Threshold", "TopKAllgather"}),
    "Adaptive",
    "CollectiveError",
    "Compressor",
    "DataParallelStep",
    "GTopK",
    "OneBit",
    "Paced",
    "Pending",
    "Threshold",
    "TopK",
    "TopKAllgather",
    "__version__",
    "algorithms",
    "allreduce",
    "compressed_allreduce",
    "config",
    "data_parallel",
    "data_parallel_step",
    "metrics",
    "ops",
    "optax",
    "paced",
    "reset_metrics",
    "start_allreduce",
    "timeline",
    "wait",
]
