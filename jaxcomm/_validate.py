"""Argument checks shared by the Python API: each error names the argument and the fix."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

MAX_ELEMENTS = 2**31 - 1  # indices travel as int32 / 31-bit fields on the wire


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


def positive_int(value: Any, name: str, *, low: int = 1, high: int | None = None) -> int:
    """Returns `value` as a Python int in [low, high], or raises naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | np.integer):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bound}, got {value}")
    return value


def finite_float(value: Any, name: str) -> float:
    """Returns `value` as a finite Python float, or raises naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real | np.floating):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def residual_like(x: Any, residual: Any) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Checks an (x, residual) pair of error feedback: both float32, same shape, non-empty.

    Returns:
      ``(x, residual)`` as JAX arrays.
    """
    x = float32_array(x, "x")
    residual = float32_array(residual, "residual")
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}; "
            "start with jnp.zeros_like(x)"
        )
    return x, residual
