"""The ⊤ merge of gTop-k: sum two sparse vectors and keep the top k (C++ kernel behind XLA FFI)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm import _ffi, _validate


def _sparse_pair(idx: Any, val: Any, side: str) -> tuple[jax.Array, jax.Array]:
    idx = _validate.int_array(idx, f"idx_{side}", ndim=1)
    val = _validate.float32_array(val, f"val_{side}", ndim=1)
    if idx.shape[0] != val.shape[0]:
        raise ValueError(
            f"idx_{side} and val_{side} must have the same length, got {idx.shape[0]} and "
            f"{val.shape[0]}; they are the indices and values of one sparse vector"
        )
    return idx, val


def sparse_merge(
    idx_a: jax.Array, val_a: jax.Array, idx_b: jax.Array, val_b: jax.Array, k: int
) -> tuple[jax.Array, jax.Array]:
    """The ⊤ operator of gTop-k (Shi et al. 2019, Definition 1) in O(ka + kb) expected time.

    Adds the sparse vectors a = (idx_a, val_a) and b = (idx_b, val_b) (values at a shared
    index are summed) and keeps the k entries of largest ``|sum|``. Ties in ``|sum|`` break
    toward the lower index; NaN and ±Inf rank above every finite value (NaN above Inf), as in
    :func:`jaxcomm.ops.topk_abs`. Entries that cancel to 0 are kept only when fewer than k
    entries are non-zero, so the result always has exactly k entries.

    Args:
      idx_a: int32 vector of ka indices, strictly ascending and >= 0 (as ``topk_abs`` returns
        them). Unsorted, duplicate or negative indices make the kernel fail at run time with
        an error naming the input and position.
      val_a: float32 vector of ka values, ``val_a[j]`` at index ``idx_a[j]``.
      idx_b: int32 vector of kb indices, same rules as ``idx_a``.
      val_b: float32 vector of kb values.
      k: number of entries to keep, 1 <= k <= max(ka, kb) (the union then always holds at
        least k entries).

    Returns:
      ``(idx, val)``: ``idx`` (int32, k) ascending; ``val`` (float32, k) the sums at ``idx``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomm.ops.sparse_merge import sparse_merge
      >>> idx, val = sparse_merge(jnp.array([1, 4], jnp.int32), jnp.array([2.0, -1.0]),
      ...                         jnp.array([0, 4], jnp.int32), jnp.array([0.5, -2.0]), 2)
      >>> idx.tolist(), val.tolist()
      ([1, 4], [2.0, -3.0])
    """
    idx_a, val_a = _sparse_pair(idx_a, val_a, "a")
    idx_b, val_b = _sparse_pair(idx_b, val_b, "b")
    largest = max(idx_a.shape[0], idx_b.shape[0])
    if largest == 0:
        raise ValueError("idx_a and idx_b are both empty; sparse_merge needs at least one entry")
    k = _validate.positive_int(k, "k", low=1)
    if k > largest:
        raise ValueError(
            f"k must be in [1, max(ka, kb)] = [1, {largest}], got {k}: a smaller union could "
            "hold fewer than k entries; lower k or pass longer inputs"
        )
    idx, val = jax.ffi.ffi_call(
        "jaxcomm_sparse_merge",
        (_ffi.result_like(idx_a, (k,), jnp.int32), _ffi.result_like(val_a, (k,), jnp.float32)),
    )(idx_a, val_a, idx_b, val_b)
    return idx, val
