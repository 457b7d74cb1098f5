"""jaxcomm: communication-efficient collectives for data-parallel JAX training.

Example:
  >>> import jax.numpy as jnp, jaxcomm
  >>> values, indices = jaxcomm.ops.topk_abs(jnp.array([1.0, -4.0, 2.0]), 1)
"""

from jaxcomm import ops
from jaxcomm.compressors import Adaptive, Compressor, OneBit, Threshold, TopK

__version__ = "0.1.0"

__all__ = ["Adaptive", "Compressor", "OneBit", "Threshold", "TopK", "ops", "__version__"]
