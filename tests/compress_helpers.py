"""Helpers shared by the compressor tests (test_onebit.py, test_threshold.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm


def jit_round_trip(x: np.ndarray, r: np.ndarray, c) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``compress`` then ``decompress`` of ``(x, r)`` with compressor `c` under one ``jax.jit``.

    Returns:
      ``(packed, new_residual, x_hat)`` as NumPy arrays.
    """

    @jax.jit
    def step(x, r):
        packed, new_r = jaxcomm.ops.compress(x, r, c)
        return packed, new_r, jaxcomm.ops.decompress(packed, c, x.shape)

    packed, new_r, x_hat = step(jnp.asarray(x), jnp.asarray(r))
    return np.asarray(packed), np.asarray(new_r), np.asarray(x_hat)
