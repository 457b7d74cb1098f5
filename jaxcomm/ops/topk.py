"""Magnitude top-k selection and the TopK compressor (C++ kernel behind XLA FFI)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomm import _ffi, _validate
from jaxcomm.algorithms._sparse import TopK


def topk_abs(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact top-k of a vector by magnitude, in O(n) expected time.

    Ties in ``|x|`` break toward the lower index. NaN and ±Inf rank above every finite value
    (NaN above Inf), so non-finite entries are always selected and stay visible.

    Args:
      x: float32 vector of n elements.
      k: number of entries to select, 1 <= k <= n.

    Returns:
      ``(values, indices)``: ``indices`` (int32, k) ascending; ``values`` (float32, k) are
      ``x[indices]`` with their signs.

    Example:
      >>> import jax.numpy as jnp, jaxcomm
      >>> values, indices = jaxcomm.ops.topk_abs(jnp.array([0.1, -3.0, 2.0, 0.5]), 2)
      >>> indices.tolist(), values.tolist()
      ([1, 2], [-3.0, 2.0])
    """
    x = _validate.float32_array(x, "x", ndim=1)
    n = x.shape[0]
    _validate.non_empty(x, "topk_abs")
    k = _validate.positive_int(k, "k", low=1, high=n)
    values, indices = jax.ffi.ffi_call(
        "jaxcomm_topk_abs",
        (_ffi.result_like(x, (k,), jnp.float32), _ffi.result_like(x, (k,), jnp.int32)),
    )(x)
    return values, indices


def compress_topk(
    x: jax.Array, residual: jax.Array, compressor: TopK
) -> tuple[jax.Array, jax.Array]:
    """TopK compression with fused error feedback; see :func:`jaxcomm.ops.compress`."""
    x, residual, words = _validate.compress_inputs(x, residual, compressor)
    return _ffi.compress_call("jaxcomm_topk_compress", x, residual, words)


def decompress_topk(packed: jax.Array, compressor: TopK, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`compress_topk`; see :func:`jaxcomm.ops.decompress`."""
    return _ffi.decompress_call("jaxcomm_topk_decompress", packed, shape)
