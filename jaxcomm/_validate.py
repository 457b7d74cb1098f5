"""Argument checks shared by the Python API: each error names the argument and the fix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jaxcomm._checks import finite_float, positive_int

__all__ = [
    "FLOAT_DTYPES",
    "MAX_ELEMENTS",
    "compress_inputs",
    "compressor_of",
    "finite_float",
    "float32_array",
    "float_array",
    "int_array",
    "non_empty",
    "packed_input",
    "positive_int",
    "residual_like",
]

MAX_ELEMENTS = 2**31 - 1  # indices travel as int32 / 31-bit fields on the wire

# Floating dtypes the collectives and compressors accept. 16-bit inputs are widened to float32
# before encoding (the kernels work in float32 and residuals stay float32); results come back in
# the input's dtype. The dense allreduce sends 16-bit words and sums in float32.
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def float32_array(x: Any, name: str, *, ndim: int | None = None) -> jnp.ndarray:
    """Returns `x` as a JAX array after checking it is float32 (and of rank `ndim`)."""
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(
            f"{name} must be float32, got {x.dtype}. Cast it with {name}.astype(jnp.float32) "
            "(bfloat16/float16 are not supported by the compression kernels yet)."
        )
    if ndim is not None and x.ndim != ndim:
        raise ValueError(
            f"{name} must have rank {ndim}, got shape {tuple(x.shape)}"
            + (f"; flatten it with {name}.ravel()" if ndim == 1 else "")
        )
    if x.size > MAX_ELEMENTS:
        raise ValueError(f"{name} has {x.size} elements; jaxcomm supports at most 2**31 - 1")
    return x


def float_array(x: Any, name: str) -> jnp.ndarray:
    """Returns `x` as a JAX array after checking it is float32, bfloat16 or float16."""
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, bfloat16 or float16, got {x.dtype}. Cast it, e.g. "
            f"{name}.astype(jnp.float32)"
        )
    if x.size > MAX_ELEMENTS:
        raise ValueError(f"{name} has {x.size} elements; jaxcomm supports at most 2**31 - 1")
    return x


def int_array(x: Any, name: str, *, ndim: int = 1) -> jnp.ndarray:
    """Returns `x` as an int32 JAX array of rank `ndim`, or raises naming `name`."""
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if x.dtype != jnp.int32:
        raise TypeError(
            f"{name} must be int32, got {x.dtype}; cast it with {name}.astype(jnp.int32)"
        )
    if x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(x.shape)}")
    return x


def compressor_of(compressor: Any, kind: type) -> None:
    """Raises TypeError unless `compressor` is a `kind` (e.g. ``jaxcomm.OneBit``).

    Example:
      >>> from jaxcomm.algorithms.onebit import OneBit
      >>> compressor_of(OneBit(32), OneBit)
    """
    if not isinstance(compressor, kind):
        raise TypeError(
            f"compressor must be jaxcomm.{kind.__name__}, got {type(compressor).__name__}"
        )


def non_empty(x: jnp.ndarray, api: str) -> None:
    """Refuses an empty ``x`` at trace time, naming ``api`` (the kernels need one element).

    Example:
      >>> non_empty(jnp.ones(3), "compress")
    """
    if x.size == 0:
        raise ValueError(f"x is empty; {api} needs at least one element")


def residual_like(x: Any, residual: Any) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Checks an (x, residual) pair of error feedback: x float32/bfloat16/float16, the residual
    float32 (error feedback is kept in float32 whatever x's dtype), same shape.

    Returns:
      ``(x as float32, residual)`` as JAX arrays (16-bit x is widened exactly).
    """
    x = float_array(x, "x")
    if not hasattr(residual, "dtype"):
        residual = jnp.asarray(residual)
    if residual.dtype != jnp.float32:
        raise TypeError(
            f"residual must be float32, got {residual.dtype}: error feedback is kept in float32 "
            f"even for {x.dtype} inputs (16-bit residuals would round away the small values "
            "that error feedback exists to keep). Start with jnp.zeros(x.shape, jnp.float32)"
        )
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}; "
            "start with jnp.zeros(x.shape, jnp.float32)"
        )
    return x.astype(jnp.float32), residual


def step_operand(step: Any, api: str) -> jnp.ndarray:
    """The int32 scalar step operand of a stepped collective (``BlockQuant``); None is 0.

    Example:
      >>> step_operand(3, "jaxcomm.compressed_allreduce").dtype
      dtype('int32')
    """
    if step is None:
        return jnp.zeros((), jnp.int32)
    if not hasattr(step, "dtype"):
        step = jnp.asarray(step)
    if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(
            f"{api}: step must be an integer scalar (the training step), got "
            f"{step.dtype}{list(step.shape)}; e.g. step=state.count"
        )
    # An int32 step is returned as is: a caller that keeps it alive keeps the operand alive.
    return step if step.dtype == jnp.int32 else step.astype(jnp.int32)


def compress_inputs(x: Any, residual: Any, compressor: Any) -> tuple[jnp.ndarray, jnp.ndarray, int]:
    """The checks of every compress kernel: :func:`residual_like`, at least one element.

    Args:
      x: the values to compress.
      residual: the error feedback of ``x``.
      compressor: the spec (``jaxcomm.TopK``, ``OneBit``, ...), already type-checked.

    Returns:
      ``(x as float32, residual, packed words of compressor for x.size)``.

    Example:
      >>> from jaxcomm.algorithms._sparse import TopK
      >>> compress_inputs(jnp.ones(8), jnp.zeros(8), TopK(0.25))[2]
      5
    """
    x, residual = residual_like(x, residual)
    non_empty(x, "compress")
    return x, residual, compressor.packed_words(x.size)


def packed_input(
    packed: Any, compressor: Any, size: int | Sequence[int]
) -> tuple[jnp.ndarray, tuple[int, ...]]:
    """The checks of every decompress kernel: a uint32 vector of the words ``compressor`` packs
    ``size`` elements into.

    Args:
      packed: what compress returned.
      compressor: the spec that packed it, already type-checked.
      size: element count or shape of the original ``x``.

    Returns:
      ``(packed as a JAX array, shape)``.

    Example:
      >>> from jaxcomm.algorithms._sparse import TopK
      >>> packed_input(jnp.zeros(5, jnp.uint32), TopK(0.25), 8)[1]
      (8,)
    """
    shape = (size,) if isinstance(size, int) else tuple(size)
    n = positive_int(math.prod(shape), "size", low=1, high=MAX_ELEMENTS)
    if not hasattr(packed, "dtype"):
        packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint32 or packed.ndim != 1:
        raise TypeError(f"packed must be a uint32 vector, got {packed.dtype}{list(packed.shape)}")
    expected = compressor.packed_words(n)
    if packed.shape[0] != expected:
        raise ValueError(
            f"packed has {packed.shape[0]} words but {compressor} packs {n} elements into "
            f"{expected}; pass the compressor and size used by compress"
        )
    return packed, shape
