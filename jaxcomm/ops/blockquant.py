"""BlockQuant compression: block-wise int8/int4 quantization with error feedback (C++ kernel
behind XLA FFI, kernels/blockquant.cc).

Each block of ``block`` elements of ``acc = x + residual`` becomes ``bits``-bit integers and
one float32 scale (its largest magnitude over 127 or 7). See :mod:`jaxcomm.ops.compress` for
the packed layout. :func:`jaxcomm.ops.compress` and :func:`jaxcomm.ops.decompress` dispatch
here for ``BlockQuant``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxcomm.algorithms.blockquant import BlockQuant
from jaxcomm.ops import _kernels


def _attrs(compressor: BlockQuant) -> dict[str, np.int64]:
    return {"bits": np.int64(compressor.bits), "block": np.int64(compressor.block)}


def compress(
    x: jax.Array, residual: jax.Array, compressor: BlockQuant, step: int = 0
) -> tuple[jax.Array, jax.Array]:
    """Quantizes ``x + residual`` to ``bits``-bit codes plus one float32 scale per block.

    The residual is always updated here (``error_feedback=False`` only changes what
    ``jaxcomm.compressed_allreduce`` returns).

    Args:
      x: float32, bfloat16 or float16 array (encoded from its exact float32 value) of any
        shape, 1 to 2**31 - 1 elements.
      residual: float32 array of ``x``'s shape (the previous call's ``new_residual``).
      compressor: the :class:`jaxcomm.BlockQuant` spec.
      step: the stochastic rounding's step (a Python int; the collective takes it traced).

    Returns:
      ``(packed, new_residual)``: ``packed`` is uint32 of ``compressor.packed_words(x.size)``
      words; ``new_residual = (x + residual) - decompress(packed)``. The call fails at run
      time, naming the flat index, if ``x + residual`` is not finite.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> from jaxcomm.ops import blockquant
      >>> c = jaxcomm.BlockQuant(bits=8, block=4)
      >>> packed, r = blockquant.compress(jnp.array([1.0, -0.5, 0.25, 0.0]), jnp.zeros(4), c)
      >>> packed.tolist()[0], hex(packed.tolist()[2])  # words; codes 127, -64, 32, 0
      (3, '0x20c07f')
    """

    def attributes(c: BlockQuant) -> dict[str, np.generic]:
        return {
            **_attrs(c),
            "stochastic": np.bool_(c.rounding == "stochastic"),
            "seed": np.int64(c.seed),
            "step": np.int64(int(step) % 2**32),
        }

    return _kernels.compress(
        "jaxcomm_blockquant_compress", BlockQuant, x, residual, compressor, attributes
    )


def decompress(packed: jax.Array, compressor: BlockQuant, shape: Sequence[int]) -> jax.Array:
    """Decodes a BlockQuant packed buffer: each element becomes ``code * scale``.

    Args:
      packed: the ``compressor.packed_words(prod(shape))`` uint32 words of :func:`compress`:
        ``used``, one float32 scale per block, then the ``bits``-bit codes.
      compressor: the :class:`jaxcomm.BlockQuant` spec that produced it (``bits``, ``block``).
      shape: shape of the original ``x``.

    Returns:
      float32 array of ``shape``. A header or scale that does not match fails at run time.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> from jaxcomm.ops import blockquant
      >>> c = jaxcomm.BlockQuant(bits=4, block=2)
      >>> packed, _ = blockquant.compress(jnp.array([7.0, -3.0]), jnp.zeros(2), c)
      >>> blockquant.decompress(packed, c, (2,)).tolist()
      [7.0, -3.0]
    """
    return _kernels.decompress(
        "jaxcomm_blockquant_decompress", BlockQuant, packed, compressor, shape, _attrs
    )
