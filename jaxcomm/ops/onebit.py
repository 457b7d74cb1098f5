"""OneBit compression: one-bit quantization with error feedback (C++ kernel behind XLA FFI).

Seide et al.'s scheme as described by Dryden et al. (2016, §3.1): every element of
``acc = x + residual`` becomes one bit (``acc >= 0``), decoded to the mean of its column's
non-negative or negative values. See :mod:`jaxcomm.ops.compress` for the packed layout.
:func:`jaxcomm.ops.compress` and :func:`jaxcomm.ops.decompress` dispatch here for ``OneBit``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxcomm.algorithms.onebit import OneBit
from jaxcomm.ops import _kernels


def _attrs(compressor: OneBit) -> dict[str, np.int64]:
    return {
        "column_size": np.int64(compressor.column_size),
        "sample_size": np.int64(compressor.sample_size),
    }


def compress(x: jax.Array, residual: jax.Array, compressor: OneBit) -> tuple[jax.Array, jax.Array]:
    """Quantizes ``x + residual`` to one bit per element plus two means per column.

    Column means are exact (``sample_size=0``) or estimated from ``sample_size`` deterministic
    samples per column; a sign with no values in the column (or its sample) has mean 0.0.

    Args:
      x: float32, bfloat16 or float16 array (encoded from its exact float32 value) of any shape, 1 to 2**31 - 1 elements.
      residual: float32 array of ``x``'s shape (the previous call's ``new_residual``).
      compressor: the :class:`jaxcomm.OneBit` spec.

    Returns:
      ``(packed, new_residual)``: ``packed``, the ``compressor.packed_words(x.size)`` uint32
      words of the column means and sign bits; ``new_residual``, of ``x``'s shape, is each
      element's distance to its column's mean of its sign, ``(x + residual) -
      decompress(packed)``. A non-finite ``x + residual`` fails at run time, naming its flat
      index.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> from jaxcomm.ops import onebit
      >>> x = jnp.array([1.0, -2.0, 3.0, -4.0])
      >>> packed, r = onebit.compress(x, jnp.zeros_like(x), jaxcomm.OneBit(32))
      >>> packed.tolist()[0], packed.tolist()[-1]  # used words, bits 0b0101
      (4, 5)
      >>> r.tolist()
      [-1.0, 1.0, 1.0, -1.0]
    """
    return _kernels.compress("jaxcomm_onebit_compress", OneBit, x, residual, compressor, _attrs)


def decompress(packed: jax.Array, compressor: OneBit, shape: Sequence[int]) -> jax.Array:
    """Decodes a OneBit packed buffer: each element becomes its column's mean of its sign.

    Args:
      packed: the ``compressor.packed_words(prod(shape))`` uint32 words of :func:`compress`:
        ``used``, each column's two means, then one sign bit per element.
      compressor: the :class:`jaxcomm.OneBit` spec that produced it (its ``column_size``).
      shape: shape of the original ``x``.

    Returns:
      float32 array of ``shape``. A header that does not match the compressor fails at run
      time.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> from jaxcomm.ops import onebit
      >>> c = jaxcomm.OneBit(32)
      >>> x = jnp.array([1.0, -2.0, 3.0, -4.0])
      >>> packed, _ = onebit.compress(x, jnp.zeros_like(x), c)
      >>> onebit.decompress(packed, c, (4,)).tolist()
      [2.0, -3.0, 2.0, -3.0]
    """
    return _kernels.decompress(
        "jaxcomm_onebit_decompress", OneBit, packed, compressor, shape, _attrs
    )
