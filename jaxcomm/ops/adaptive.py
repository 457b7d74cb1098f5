"""Adaptive quantization (Dryden et al. 2016, §3.3): C++ kernels behind XLA FFI.

The semantics and the packed layout are those documented in :mod:`jaxcomm.ops.compress`
(class :class:`jaxcomm.Adaptive`). :func:`jaxcomm.ops.compress` and
:func:`jaxcomm.ops.decompress` dispatch here for ``Adaptive`` compressors.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxcomm.algorithms.adaptive import Adaptive
from jaxcomm.ops import _kernels


def _layout_attrs(compressor: Adaptive) -> dict[str, np.generic]:
    # float64 so that the kernel's ceil(k / proportion) is the very expression Python's
    # Adaptive.packed_words evaluates; a float32 π could disagree for non-integer proportions.
    return {
        "proportion": np.float64(compressor.proportion),
        "column_size": np.int64(compressor.column_size),
    }


def compress(
    x: jax.Array, residual: jax.Array, compressor: Adaptive
) -> tuple[jax.Array, jax.Array]:
    """Quantizes ``acc = x + residual`` column by column, with error feedback.

    Per column and sign, the ``min(k±, ceil((k± + k0) / π))`` values of largest magnitude
    (k±: the values of that sign, k0: the zeros) are sent as ``sign << 31 | index`` entries
    that decode to the mean of the values of their sign that were sent. The residual keeps everything else, so
    ``x + residual == decompress(packed) + new_residual`` up to float rounding.

    Args:
      x: float32, bfloat16 or float16 array (encoded from its exact float32 value) of any shape with 1 to 2**31 - 1 elements.
      residual: float32 array of ``x``'s shape (zeros at the first step). Its buffer is reused
        for ``new_residual`` when the caller donates it.
      compressor: a :class:`jaxcomm.Adaptive`.

    Returns:
      ``(packed, new_residual)``: ``packed`` is a uint32 vector of
      ``compressor.packed_words(x.size)`` words; ``new_residual`` has ``x``'s shape.

    Raises:
      TypeError, ValueError: on a wrong dtype or shape (at trace time).
      jax.errors.JaxRuntimeError: when ``x + residual`` holds a NaN or Inf; the message names
        the first such flat index. On a GPU (which cannot raise without synchronizing) the
        call succeeds with ``packed[0] == 0`` instead, which :func:`decompress` decodes to NaN.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> x = jnp.array([3.0, -1.0, 2.0, 0.0, -5.0, 4.0, 1.0, -2.0])
      >>> c = jaxcomm.Adaptive(proportion=2, column_size=8)
      >>> packed, r = jaxcomm.ops.adaptive.compress(x, jnp.zeros_like(x), c)
      >>> int(packed[0]), r.tolist()
      (8, [0.0, -1.0, -1.0, 0.0, -1.5, 1.0, 1.0, 1.5])
    """
    return _kernels.compress(
        "jaxcomm_adaptive_compress",
        Adaptive,
        x,
        residual,
        compressor,
        lambda c: {"sample_size": np.int64(c.sample_size), **_layout_attrs(c)},
    )


def decompress(packed: jax.Array, compressor: Adaptive, shape: int | Sequence[int]) -> jax.Array:
    """Decodes a packed buffer produced by :func:`compress` with the same compressor.

    Args:
      packed: uint32 vector of ``compressor.packed_words(n)`` words.
      compressor: the :class:`jaxcomm.Adaptive` that produced it.
      shape: element count or shape of the original ``x``.

    Returns:
      float32 array of that shape: each sent entry holds its column's mean of its sign, every
      other element 0.

    Raises:
      jax.errors.JaxRuntimeError: when the packed buffer is malformed (bad ``used`` word,
        index out of range or not ascending, a column over its capacity). On a GPU such a
        buffer decodes to all-NaN instead.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> x = jnp.array([3.0, -1.0, 2.0, 0.0, -5.0, 4.0, 1.0, -2.0])
      >>> c = jaxcomm.Adaptive(proportion=2, column_size=8)
      >>> packed, _ = jaxcomm.ops.adaptive.compress(x, jnp.zeros_like(x), c)
      >>> jaxcomm.ops.adaptive.decompress(packed, c, 8).tolist()
      [3.0, 0.0, 3.0, 0.0, -3.5, 3.0, 0.0, -3.5]
    """
    return _kernels.decompress(
        "jaxcomm_adaptive_decompress",
        Adaptive,
        packed,
        compressor,
        shape,
        _layout_attrs,
        checked=True,
    )
