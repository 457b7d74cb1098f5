"""compress / decompress: one entry point for every compressor's C++ kernels."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxcomm import _validate, algorithms
from jaxcomm.compressors import Compressor, TopK
from jaxcomm.ops import topk

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
    rounding of the additions. See :mod:`jaxcomm.compressors` for the packed layout.

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
