"""Helpers shared by the compressor tests (test_onebit.py, test_threshold.py, test_adaptive.py,
test_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm

# An ffi::Error from a handler surfaces as JaxRuntimeError when it is raised while the result
# is fetched, and as ValueError (INVALID_ARGUMENT) when eager dispatch runs the op inline and
# raises it at once. Which one a test sees depends on XLA:CPU's scheduling (seen: a test that
# passed alone got ValueError in a loaded full run), so tests of kernel errors accept both.
KERNEL_ERRORS = (jax.errors.JaxRuntimeError, ValueError)


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


def check_jit_round_trip(
    c, shape: tuple[int, ...], seed: int, expected, atol: float
) -> tuple[np.ndarray, np.ndarray]:
    """Under ``jax.jit``, ``compress`` equals ``expected(x, r, c)`` bit for bit and
    ``decompress`` restores ``x + r - new_residual`` (random ``x`` and ``r`` of ``shape``).

    Args:
      c: the compressor.
      shape: shape of ``x`` and ``r``.
      seed: NumPy seed of ``x`` and ``r``.
      expected: ``(x, r, c) -> (packed, new_residual)``, eager or a reference.
      atol: absolute tolerance of ``x_hat + new_residual == x + r``.

    Returns:
      ``(x, r)``, for further checks.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32)
    r = rng.standard_normal(shape, dtype=np.float32)
    packed, new_r, x_hat = jit_round_trip(x, r, c)
    want_packed, want_r = expected(x, r, c)
    np.testing.assert_array_equal(packed, want_packed)
    np.testing.assert_array_equal(new_r, want_r)
    assert x_hat.shape == x.shape
    np.testing.assert_allclose(x_hat + new_r, x + r, rtol=1e-6, atol=atol)
    return x, r


def raw_adaptive_compress(words: int, attrs: dict):
    """The ``jaxcomm_adaptive_compress`` target called directly, past Python's checks.

    Args:
      words: the packed result's length.
      attrs: ``proportion``, ``column_size`` and ``sample_size``, typed here as the handler
        binds them.

    Returns:
      A function of one 64-element float32 array, used as both x and the residual.
    """
    call = jax.ffi.ffi_call(
        "jaxcomm_adaptive_compress",
        (jax.ShapeDtypeStruct((words,), jnp.uint32), jax.ShapeDtypeStruct((64,), jnp.float32)),
    )
    typed = {
        "proportion": np.float64(attrs["proportion"]),
        "column_size": np.int64(attrs["column_size"]),
        "sample_size": np.int64(attrs["sample_size"]),
    }
    return lambda x: call(x, x, **typed)
