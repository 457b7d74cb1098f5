"""Argument checks shared by the Python API: each error names the argument and the fix."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxcomm._checks import finite_float, positive_int

__all__ = [
    "FLOAT_DTYPES",
    "MAX_ELEMENTS",
    "compressor_of",
    "finite_float",
    "float32_array",
    "float_array",
    "int_array",
    "non_empty",
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
      >>> from jaxcomm.compressors import OneBit
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
