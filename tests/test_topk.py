"""jaxcomm.ops.topk_abs and the TopK compressor against NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm.ops import compress, decompress, topk_abs


def reference_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x|, ties toward the lower index, ascending.

    NaN ranks above Inf above finite values, as documented.
    """
    magnitude = np.abs(x).astype(np.float64)
    magnitude[np.isinf(x)] = np.finfo(np.float64).max
    magnitude[np.isnan(x)] = np.inf
    order = np.lexsort((np.arange(x.size), -magnitude))  # by -|x|, then index
    return np.sort(order[:k])


SIZES = [1, 7, 1000, 2**20 + 3]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("density", [1e-3, 0.01, 0.3, 1.0])
def test_topk_abs_matches_reference(n, density):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    k = max(1, int(np.ceil(density * n)))
    values, indices = topk_abs(jnp.asarray(x), k)
    expected = reference_topk(x, k)
    np.testing.assert_array_equal(np.asarray(indices), expected)
    np.testing.assert_array_equal(np.asarray(values), x[expected])
    assert indices.dtype == jnp.int32 and values.dtype == jnp.float32


@pytest.mark.parametrize(
    "x",
    [
        np.full(1000, 2.5, np.float32),  # all equal: lowest indices win
        -np.abs(np.random.default_rng(1).standard_normal(1000)).astype(np.float32),
        np.abs(np.random.default_rng(2).standard_normal(1000)).astype(np.float32),
        np.tile(np.array([1.0, -1.0], np.float32), 500),  # sign-only ties
        np.zeros(64, np.float32),
    ],
    ids=["all-equal", "negative-only", "positive-only", "signed-ties", "zeros"],
)
def test_topk_abs_special_inputs(x):
    for k in (1, 10, x.size // 2, x.size):
        values, indices = topk_abs(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(indices), reference_topk(x, k))


def test_topk_abs_propagates_non_finite_values():
    x = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    x[[10, 20, 30]] = [np.nan, -np.inf, np.inf]
    values, indices = topk_abs(jnp.asarray(x), 5)
    np.testing.assert_array_equal(np.asarray(indices)[:3], [10, 20, 30])
    assert np.isnan(values[0]) and np.isneginf(values[1]) and np.isposinf(values[2])
    # Finite entries next to them are selected exactly as without the non-finite ones.
    finite_part = np.asarray(indices)[3:]
    np.testing.assert_array_equal(finite_part, reference_topk(x, 5)[3:])


def test_topk_abs_under_jit():
    x = jnp.asarray(np.random.default_rng(4).standard_normal(4096).astype(np.float32))
    values, indices = jax.jit(topk_abs, static_argnums=1)(x, 40)
    np.testing.assert_array_equal(np.asarray(indices), reference_topk(np.asarray(x), 40))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("density", [1e-3, 0.05, 1.0])
def test_topk_compress_error_feedback_identity(n, density):
    rng = np.random.default_rng(n + 7)
    x = rng.standard_normal(n).astype(np.float32)
    r = (0.1 * rng.standard_normal(n)).astype(np.float32)
    c = jaxcomm.TopK(density)
    packed, r_out = jax.jit(compress, static_argnums=2)(jnp.asarray(x), jnp.asarray(r), c)
    k = c.k(n)
    assert packed.shape == (c.packed_words(n),) and packed.dtype == jnp.uint32
    words = np.asarray(packed)
    assert words[0] == 1 + 2 * k
    acc = x + r
    expected = reference_topk(acc, k)
    np.testing.assert_array_equal(words[1 : 1 + k].view(np.int32), expected)
    np.testing.assert_array_equal(words[1 + k :].view(np.float32), acc[expected])
    x_hat = np.asarray(decompress(packed, c, n))
    # Exact: the residual is acc with the sent entries zeroed.
    np.testing.assert_array_equal(x_hat + np.asarray(r_out), acc)
    assert np.count_nonzero(np.asarray(r_out)[expected]) == 0


def test_compress_keeps_shape_of_multidimensional_input():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((16, 33)).astype(np.float32))
    packed, r_out = compress(x, jnp.zeros_like(x), jaxcomm.TopK(0.1))
    assert r_out.shape == (16, 33)
    x_hat = decompress(packed, jaxcomm.TopK(0.1), (16, 33))
    np.testing.assert_array_equal(np.asarray(x_hat + r_out), np.asarray(x))


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -1, 11])
def test_topk_abs_rejects_k_out_of_range(k):
    with pytest.raises(ValueError, match="k must be in"):
        topk_abs(jnp.ones(10, jnp.float32), k)


def test_topk_abs_rejects_non_int_k():
    with pytest.raises(TypeError, match="k must be a Python int"):
        topk_abs(jnp.ones(10, jnp.float32), 2.5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32])
def test_topk_abs_rejects_other_dtypes(dtype):
    with pytest.raises(TypeError, match="x must be float32"):
        topk_abs(jnp.ones(10, dtype), 2)


def test_topk_abs_rejects_matrices_and_empty():
    with pytest.raises(ValueError, match="rank 1.*ravel"):
        topk_abs(jnp.ones((3, 4), jnp.float32), 2)
    with pytest.raises(ValueError, match="empty"):
        topk_abs(jnp.ones((0,), jnp.float32), 1)


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan")])
def test_topk_rejects_bad_density(density):
    with pytest.raises(ValueError, match="density"):
        jaxcomm.TopK(density)


def test_compress_rejects_mismatched_residual_and_compressor():
    x = jnp.ones(8, jnp.float32)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        compress(x, jnp.zeros(9, jnp.float32), jaxcomm.TopK(0.5))
    with pytest.raises(TypeError, match="compressor must be one of"):
        compress(x, jnp.zeros(8, jnp.float32), "topk")
    packed, _ = compress(x, jnp.zeros(8, jnp.float32), jaxcomm.TopK(0.5))
    with pytest.raises(ValueError, match="packed has 9 words"):
        decompress(packed, jaxcomm.TopK(0.25), 8)


def test_compressors_are_hashable_static_arguments():
    assert hash(jaxcomm.TopK(0.01)) == hash(jaxcomm.TopK(0.01))
    assert jaxcomm.TopK(0.01) != jaxcomm.TopK(0.02)
