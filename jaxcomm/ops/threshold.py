"""Threshold compression: Strom's threshold quantization with error feedback (C++ kernel).

As described by Dryden et al. (2016, §3.2): entries of ``acc = x + residual`` above ``tau``
are sent as ``+tau``, below ``-tau`` as ``-tau``, each as one 32-bit word (sign bit + 31-bit
index); the rest stay in the residual. See :mod:`jaxcomm.ops.compress` for the packed layout.
:func:`jaxcomm.ops.compress` and :func:`jaxcomm.ops.decompress` dispatch here for
``Threshold``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxcomm.algorithms.threshold import Threshold
from jaxcomm.ops import _kernels


def _attrs(compressor: Threshold) -> dict[str, np.float32]:
    return {"tau": np.float32(compressor.tau)}


def compress(
    x: jax.Array, residual: jax.Array, compressor: Threshold
) -> tuple[jax.Array, jax.Array]:
    """Sends the entries of ``x + residual`` beyond ``±tau`` as ``±tau``.

    At most ``compressor.capacity(x.size)`` entries are sent; when more pass, the lowest
    indices win and the others stay whole in the residual.

    Args:
      x: float32, bfloat16 or float16 array (encoded from its exact float32 value) of any shape, 1 to 2**31 - 1 elements.
      residual: float32 array of ``x``'s shape (the previous call's ``new_residual``).
      compressor: the :class:`jaxcomm.Threshold` spec (``tau`` is used as float32).

    Returns:
      ``(packed, new_residual)``: ``packed``, the ``compressor.packed_words(x.size)`` uint32
      words of the sent entries; ``new_residual``, of ``x``'s shape, is ``x + residual`` less
      ``±tau`` where an entry was sent, ``(x + residual) - decompress(packed)``. A non-finite
      ``x + residual`` fails at run time, naming its flat index.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> from jaxcomm.ops import threshold
      >>> x = jnp.array([0.5, 2.0, -3.0, 1.0])
      >>> packed, r = threshold.compress(x, jnp.zeros_like(x), jaxcomm.Threshold(1.0))
      >>> [hex(w) for w in packed.tolist()]
      ['0x3', '0x80000001', '0x2', '0x0', '0x0']
      >>> r.tolist()
      [0.5, 1.0, -2.0, 1.0]
    """
    return _kernels.compress(
        "jaxcomm_threshold_compress", Threshold, x, residual, compressor, _attrs
    )


def decompress(packed: jax.Array, compressor: Threshold, shape: Sequence[int]) -> jax.Array:
    """Decodes a Threshold packed buffer: ``±tau`` at the sent indices, 0 elsewhere.

    Args:
      packed: the ``compressor.packed_words(prod(shape))`` uint32 words of :func:`compress`:
        ``used``, then one ``sign << 31 | index`` entry per sent element, zeros after.
      compressor: the :class:`jaxcomm.Threshold` spec that produced it (its ``tau``).
      shape: shape of the original ``x`` (every index is below its size).

    Returns:
      float32 array of ``shape``. A header out of range, or an entry whose index is out of
      range or not ascending, fails at run time.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> from jaxcomm.ops import threshold
      >>> c = jaxcomm.Threshold(1.0)
      >>> x = jnp.array([0.5, 2.0, -3.0, 1.0])
      >>> packed, _ = threshold.compress(x, jnp.zeros_like(x), c)
      >>> threshold.decompress(packed, c, (4,)).tolist()
      [0.0, 1.0, -1.0, 0.0]
    """
    return _kernels.decompress(
        "jaxcomm_threshold_decompress", Threshold, packed, compressor, shape, _attrs
    )
