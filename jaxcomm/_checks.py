"""Argument checks of plain Python numbers, with the standard library only.

The algorithm specs (``jaxcomm.GTopK`` and the others) validate their parameters with these, so
they load without JAX (the launcher reads them); :mod:`jaxcomm._validate` adds the array checks.
NumPy registers its scalar types with :mod:`numbers`, so ``np.int64`` and ``np.float32`` pass.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def positive_int(value: Any, name: str, *, low: int = 1, high: int | None = None) -> int:
    """Returns `value` as a Python int in [low, high], or raises naming `name`.

    Example:
      >>> positive_int(3, "column_size")
      3
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bound}, got {value}")
    return value


def finite_float(value: Any, name: str) -> float:
    """Returns `value` as a finite Python float, or raises naming `name`.

    Example:
      >>> finite_float(1, "tau")
      1.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value
