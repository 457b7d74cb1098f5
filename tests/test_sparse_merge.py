"""jaxcomm.ops.sparse_merge (the ⊤ operator of gTop-k) against a NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compress_helpers import KERNEL_ERRORS

from jaxcomm.ops.sparse_merge import sparse_merge


def reference_merge(
    idx_a: np.ndarray, val_a: np.ndarray, idx_b: np.ndarray, val_b: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Definition 1 of Shi et al. 2019: G = G^a + G^b densely, keep the k largest |G|.

    Only indices present in a or b are candidates (an entry that cancels to 0 still counts,
    so exactly k come back); ties toward the lower index; NaN > Inf > finite.
    """
    n = int(max(idx_a.max(initial=-1), idx_b.max(initial=-1))) + 1
    dense = np.zeros(n, np.float32)
    present = np.zeros(n, bool)
    dense[idx_a] += val_a
    dense[idx_b] += val_b  # float32 add: the same single rounding as the kernel
    present[idx_a] = True
    present[idx_b] = True
    union = np.flatnonzero(present)
    sums = dense[union]
    magnitude = np.abs(sums).astype(np.float64)
    magnitude[np.isinf(sums)] = np.finfo(np.float64).max
    magnitude[np.isnan(sums)] = np.inf
    keep = np.sort(np.lexsort((union, -magnitude))[:k])  # by -|G|, then index
    return union[keep].astype(np.int32), sums[keep]


def random_sparse(
    rng: np.random.Generator, size: int, index_range: int, discrete: bool
) -> tuple[np.ndarray, np.ndarray]:
    idx = np.sort(rng.choice(index_range, size=size, replace=False)).astype(np.int32)
    if discrete:  # few distinct magnitudes: many exact ties and cancellations
        val = rng.choice(np.array([-2, -1, -0.5, 0, 0.5, 1, 2], np.float32), size=size)
    else:
        val = rng.standard_normal(size).astype(np.float32)
    return idx, val


def check(idx_a, val_a, idx_b, val_b, k, fn=sparse_merge):
    idx, val = fn(jnp.asarray(idx_a), jnp.asarray(val_a), jnp.asarray(idx_b), jnp.asarray(val_b), k)
    assert idx.dtype == jnp.int32 and val.dtype == jnp.float32
    assert idx.shape == (k,) and val.shape == (k,)
    want_idx, want_val = reference_merge(idx_a, val_a, idx_b, val_b, k)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(val), want_val)


@pytest.mark.parametrize("size", [1, 7, 1000, 100_000])
@pytest.mark.parametrize("overlap", ["sparse", "dense"])
@pytest.mark.parametrize("discrete", [False, True], ids=["normal", "ties"])
def test_matches_reference(size, overlap, discrete):
    rng = np.random.default_rng(size * 7 + discrete)
    # A range of 3x the size makes coincident indices rare-ish; 1.2x makes most coincide.
    index_range = int(size * (3 if overlap == "sparse" else 1.2)) + 1
    idx_a, val_a = random_sparse(rng, size, index_range, discrete)
    idx_b, val_b = random_sparse(rng, size, index_range, discrete)
    for k in sorted({1, max(1, size // 10), size}):
        check(idx_a, val_a, idx_b, val_b, k)


@pytest.mark.parametrize("ka,kb", [(5, 1), (1, 5), (0, 3), (3, 0), (1000, 17)])
def test_unequal_sizes(ka, kb):
    rng = np.random.default_rng(ka * 100 + kb)
    idx_a, val_a = random_sparse(rng, ka, 3 * max(ka, kb) + 1, False)
    idx_b, val_b = random_sparse(rng, kb, 3 * max(ka, kb) + 1, False)
    for k in (1, max(ka, kb)):
        check(idx_a, val_a, idx_b, val_b, k)


def test_ties_break_toward_lower_index():
    idx_a = np.array([2, 4, 6], np.int32)
    val_a = np.array([1, -1, 1], np.float32)
    idx_b = np.array([1, 9], np.int32)
    val_b = np.array([-1, 1], np.float32)
    idx, val = sparse_merge(idx_a, val_a, idx_b, val_b, 2)
    assert idx.tolist() == [1, 2] and val.tolist() == [-1.0, 1.0]


def test_cancellation():
    idx_a = np.array([1, 3, 5], np.int32)
    val_a = np.array([2, 5, 1], np.float32)
    idx_b = np.array([1, 3, 5], np.int32)
    val_b = np.array([-2, 1, -1], np.float32)
    # 1 and 5 cancel to 0: with k = 1 only index 3 survives ...
    idx, val = sparse_merge(idx_a, val_a, idx_b, val_b, 1)
    assert idx.tolist() == [3] and val.tolist() == [6.0]
    # ... and with k = 3 the zeros fill the result, which always has exactly k entries.
    idx, val = sparse_merge(idx_a, val_a, idx_b, val_b, 3)
    assert idx.tolist() == [1, 3, 5] and val.tolist() == [0.0, 6.0, 0.0]
    rng = np.random.default_rng(0)
    idx_c, val_c = random_sparse(rng, 1000, 1500, False)
    check(idx_c, val_c, idx_c, -val_c, 10)  # everything cancels


def test_non_finite_values_rank_first():
    idx_a = np.array([0, 1, 2], np.int32)
    val_a = np.array([1e30, -np.inf, 3.0], np.float32)
    idx_b = np.array([2, 3], np.int32)
    val_b = np.array([np.nan, 2.0], np.float32)
    idx, val = sparse_merge(idx_a, val_a, idx_b, val_b, 2)
    assert idx.tolist() == [1, 2]
    assert np.isneginf(val[0]) and np.isnan(val[1])


def test_under_jit():
    rng = np.random.default_rng(5)
    idx_a, val_a = random_sparse(rng, 1000, 2500, False)
    idx_b, val_b = random_sparse(rng, 700, 2500, False)
    merged = jax.jit(sparse_merge, static_argnums=4)
    check(idx_a, val_a, idx_b, val_b, 300, fn=merged)

    # Chained as in a gTop-k tree: ((a ⊤ b) ⊤ (c ⊤ d)) in one program.
    sets = [random_sparse(rng, 200, 600, False) for _ in range(4)]

    @jax.jit
    def tree(s0, s1, s2, s3):
        left = sparse_merge(*s0, *s1, 200)
        right = sparse_merge(*s2, *s3, 200)
        return sparse_merge(*left, *right, 200)

    idx, val = tree(*sets)
    left = reference_merge(*sets[0], *sets[1], 200)
    right = reference_merge(*sets[2], *sets[3], 200)
    want_idx, want_val = reference_merge(*left, *right, 200)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(val), want_val)


GOOD_IDX = np.array([0, 2, 4], np.int32)
GOOD_VAL = np.array([1, 2, 3], np.float32)


@pytest.mark.parametrize(
    "bad_idx,message",
    [
        (np.array([0, 4, 2], np.int32), "idx_a is not strictly ascending at position 2"),
        (np.array([0, 2, 2], np.int32), "idx_a is not strictly ascending at position 2"),
        (np.array([-1, 2, 4], np.int32), r"idx_a\[0\] = -1 is negative"),
    ],
    ids=["unsorted", "duplicate", "negative"],
)
def test_bad_indices_fail_in_the_kernel(bad_idx, message):
    with pytest.raises(KERNEL_ERRORS, match=message):
        jax.block_until_ready(sparse_merge(bad_idx, GOOD_VAL, GOOD_IDX, GOOD_VAL, 2))
    with pytest.raises(KERNEL_ERRORS, match=message.replace("idx_a", "idx_b")):
        merged = jax.jit(sparse_merge, static_argnums=4)
        jax.block_until_ready(merged(GOOD_IDX, GOOD_VAL, bad_idx, GOOD_VAL, 2))


@pytest.mark.parametrize(
    "args,error,message",
    [
        (
            (GOOD_IDX.astype(np.int64), GOOD_VAL, GOOD_IDX, GOOD_VAL, 2),
            TypeError,
            "idx_a must be int32",
        ),
        (
            (GOOD_IDX, GOOD_VAL, GOOD_IDX, GOOD_VAL.astype(np.float64), 2),
            TypeError,
            "val_b must be float32",
        ),
        ((GOOD_IDX[None], GOOD_VAL, GOOD_IDX, GOOD_VAL, 2), ValueError, "idx_a must have rank 1"),
        ((GOOD_IDX, GOOD_VAL[None], GOOD_IDX, GOOD_VAL, 2), ValueError, "val_a must have rank 1"),
        ((GOOD_IDX, GOOD_VAL[:2], GOOD_IDX, GOOD_VAL, 2), ValueError, "same length"),
        ((GOOD_IDX, GOOD_VAL, GOOD_IDX, GOOD_VAL, 0), ValueError, "k must be"),
        ((GOOD_IDX, GOOD_VAL, GOOD_IDX, GOOD_VAL, 4), ValueError, r"max\(ka, kb\)\] = \[1, 3\]"),
        ((GOOD_IDX, GOOD_VAL, GOOD_IDX, GOOD_VAL, 2.0), TypeError, "k must be a Python int"),
        ((GOOD_IDX[:0], GOOD_VAL[:0], GOOD_IDX[:0], GOOD_VAL[:0], 1), ValueError, "both empty"),
    ],
    ids=[
        "idx-dtype",
        "val-dtype",
        "idx-rank",
        "val-rank",
        "length",
        "k0",
        "k-big",
        "k-float",
        "empty",
    ],
)
def test_bad_arguments_fail_in_python(args, error, message):
    with pytest.raises(error, match=message):
        sparse_merge(*args)
