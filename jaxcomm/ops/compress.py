"""compress / decompress: one entry point for every compressor's C++ kernels, and the packed
wire format they produce.

A compressor is an immutable, hashable spec (safe as a static argument of ``jax.jit``),
defined with its algorithm in :mod:`jaxcomm.algorithms` (``TopK``: a compressor only, in
``jaxcomm.algorithms._sparse``); construction validates every parameter, so a bad value fails
where it was written, not inside a jitted step. :data:`Compressor` names the ones with a
packed format.

Wire format
-----------
``jaxcomm.ops.compress`` returns ``packed``: a 1-D ``uint32`` array whose length
``compressor.packed_words(n)`` depends only on the compressor and the element count ``n``
(XLA needs static shapes). Word 0 always holds ``used``, the number of meaningful words
including word 0; the words after ``used`` are zero. Collectives send ``packed[:used]`` only.
Floats are stored as their IEEE-754 bits; words are in host byte order (little-endian on every
supported platform). Element indices refer to the row-major flattening of ``x`` and must fit
in 31 bits (``n < 2**31``).

``TopK(density)``, ``k = max(1, ceil(density * n))``::

    [used = 1 + 2k] [k indices, ascending] [k float32 values]

``OneBit(column_size, sample_size)``, ``ncols = ceil(n / column_size)``::

    [used = 1 + 2*ncols + ceil(n / 32)] [ncols x (mean_nonneg f32, mean_neg f32)] [bits]

  bit ``i % 32`` of bit word ``i // 32`` is 1 when ``acc[i] >= 0`` (decodes to the column's
  ``mean_nonneg``) and 0 otherwise (decodes to ``mean_neg``). ``column_size`` is a multiple of
  32, so a column's bits start on a word boundary.

``Threshold(tau, max_density)``, ``capacity = max(1, ceil(max_density * n))``::

    [used = 1 + m] [m entries, ascending index] [zeros up to 1 + capacity]

  entry = ``sign << 31 | index``; sign 1 decodes to ``+tau`` (``acc > tau``), sign 0 to ``-tau``
  (``acc < -tau``). When more than ``capacity`` entries pass the threshold, those of the lowest
  indices are sent and the rest stay in the residual.

``Adaptive(proportion, column_size, sample_size)``::

    [used = 1 + 2*ncols + m] [ncols x (mean_pos f32, mean_neg f32)] [m entries] [zeros]

  entry = ``sign << 31 | index`` as for ``Threshold``; sign 1 decodes to the column's
  ``mean_pos``, 0 to ``mean_neg``. Capacity per column of length ``L`` is
  ``min(L, 2 * ceil(L / proportion) + 2)``.

``BlockQuant(bits, block)``, ``nblocks = ceil(n / block)``::

    [used = 1 + nblocks + ceil(n * bits / 32)] [nblocks x scale f32] [codes]

  codes: n two's-complement integers of ``bits`` bits in [-qmax, qmax] (qmax = 127 or 7),
  element i at byte i (int8) or nibble i (int4: low nibble of byte i // 2 for even i), bytes
  little-endian in their words, unused trailing bits zero. Element i decodes to
  ``code[i] * scale[i // block]``; ``scale = absmax / qmax`` of its block (0 for a block whose
  scale would be below the smallest normal float).

Error feedback: every compressor returns ``new_residual = (x + residual) - decompress(packed)``
exactly (it is computed from the very float values that were encoded), so nothing is lost,
only delayed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxcomm import _validate, algorithms
from jaxcomm.algorithms._sparse import TopK
from jaxcomm.algorithms.adaptive import Adaptive
from jaxcomm.algorithms.blockquant import BlockQuant
from jaxcomm.algorithms.onebit import OneBit
from jaxcomm.algorithms.threshold import Threshold
from jaxcomm.ops import topk

Compressor = TopK | OneBit | Threshold | Adaptive | BlockQuant
"""What ``jaxcomm.ops.compress`` accepts: the compressors with a packed wire format."""

# compressor type -> (compress(x, residual, c), decompress(packed, c, shape)), one C++ kernel
# pair (and op module) per compressor: TopK's, and every algorithm's of the registry that has
# single-device ops (Algorithm.ops).
_KERNELS: dict[type, tuple[Callable[..., Any], Callable[..., Any]]] = {
    TopK: (topk.compress_topk, topk.decompress_topk),
}
for _record in algorithms.registered():
    if _record.ops is not None and _record.hierarchy is None:
        _module = importlib.import_module(f"jaxcomm.ops.{_record.ops}")
        _KERNELS[_record.spec] = (_module.compress, _module.decompress)


def _check_compressor(compressor: Any) -> None:
    if type(compressor) not in _KERNELS:
        known = ", ".join(f"jaxcomm.{cls.__name__}" for cls in _KERNELS)
        raise TypeError(f"compressor must be one of {known}; got {type(compressor).__name__}")


def compress(
    x: jax.Array, residual: jax.Array, compressor: Compressor
) -> tuple[jax.Array, jax.Array]:
    """Compresses ``x + residual`` into the packed wire format, with error feedback.

    The identity ``x + residual == decompress(packed) + new_residual`` holds up to float
    rounding of the additions. See :mod:`jaxcomm.ops.compress` for the packed layout.

    Non-finite values: ``TopK`` selects them first (they reach the result and leave the
    residual clean); the quantizers raise an error naming the flat index, since a NaN would
    poison its column's reconstruction values.

    Args:
      x: float32, bfloat16 or float16 array (encoded from its exact float32 value) of any shape with at least one element.
      residual: float32 array of ``x``'s shape (zeros at the first step).
      compressor: ``jaxcomm.TopK``, ``OneBit``, ``Threshold`` or ``Adaptive``.

    Returns:
      ``(packed, new_residual)``: packed is uint32 of ``compressor.packed_words(x.size)``
      words; new_residual has x's shape.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> x = jnp.arange(8, dtype=jnp.float32)
      >>> packed, r = jaxcomm.ops.compress(x, jnp.zeros_like(x), jaxcomm.TopK(0.25))
      >>> packed.tolist()[:3]
      [5, 6, 7]
    """
    _check_compressor(compressor)
    return _KERNELS[type(compressor)][0](x, residual, compressor)


def decompress(packed: jax.Array, compressor: Compressor, size: int | Sequence[int]) -> jax.Array:
    """Decodes a packed buffer produced by :func:`compress` with the same compressor.

    Args:
      packed: uint32 vector from :func:`compress`.
      compressor: the compressor that produced it.
      size: element count (returns a vector) or shape of the original ``x``.

    Returns:
      float32 array of that size/shape: the applied (reconstructed) values.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> x = jnp.array([0.0, 5.0, -1.0, 2.0])
      >>> c = jaxcomm.TopK(0.5)
      >>> packed, _ = jaxcomm.ops.compress(x, jnp.zeros_like(x), c)
      >>> jaxcomm.ops.decompress(packed, c, 4).tolist()
      [0.0, 5.0, 0.0, 2.0]
    """
    _check_compressor(compressor)
    packed, shape = _validate.packed_input(packed, compressor, size)
    return _KERNELS[type(compressor)][1](packed, compressor, shape)
