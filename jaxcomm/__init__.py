"""jaxcomm: communication-efficient collectives for data-parallel JAX training.

Example:
  >>> import jax.numpy as jnp, jaxcomm
  >>> values, indices = jaxcomm.ops.topk_abs(jnp.array([1.0, -4.0, 2.0]), 1)
"""

from jaxcomm import _ffi, algorithms, config, ops, optax, timeline
from jaxcomm.collectives import allreduce, compressed_allreduce
from jaxcomm.compressors import (
    Adaptive,
    Compressor,
    GTopK,
    OneBit,
    Threshold,
    TopK,
    TopKAllgather,
)
from jaxcomm.metrics import metrics, reset_metrics
from jaxcomm.pacing import CollectiveError, Paced, paced, size_cpu_launch_pool

__version__ = "0.1.0"

# Before the C++ library (which reads some of the settings) is loaded: a bad JAXCOMM_* value
# fails here, naming the variable (jaxcomm/config.py SETTINGS).
config.check_environment()
_ffi.register_all()  # every FFI target, from the library's own table (ffi/registrations.h)

# Before JAX creates its CPU client: a launch pool that several devices cannot starve
# (jaxcomm/pacing.py).
size_cpu_launch_pool()

# Every registered algorithm's spec is public as jaxcomm.<Spec>: the ones above by name (for
# readers and editors), and any algorithm module added to jaxcomm/algorithms/ without an edit
# here.
_SPECS = {cls.__name__: cls for cls in algorithms.spec_classes()}
globals().update(_SPECS)

__all__ = [
    *sorted(set(_SPECS) - {"Adaptive", "GTopK", "OneBit", "Threshold", "TopKAllgather"}),
    "Adaptive",
    "CollectiveError",
    "Compressor",
    "GTopK",
    "OneBit",
    "Paced",
    "Threshold",
    "TopK",
    "TopKAllgather",
    "__version__",
    "algorithms",
    "allreduce",
    "compressed_allreduce",
    "config",
    "metrics",
    "ops",
    "optax",
    "paced",
    "reset_metrics",
    "timeline",
]
