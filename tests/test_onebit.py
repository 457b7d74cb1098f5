"""OneBit (one-bit quantization, Dryden et al. 2016 §3.1) against a NumPy reference.

Bits and packed headers are compared bit-exactly. Column means are compared to float
tolerance (rtol 3e-7, a few ulp): the kernel sums in double over 8 interleaved lanes, NumPy in
its own pairwise order, and the rounded means may differ in the last bit. The residual is then
checked bit-exactly against the kernel's own decoded values.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from compress_helpers import KERNEL_ERRORS, check_jit_round_trip

import jaxcomm
from jaxcomm.ops import onebit

MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(z: np.ndarray) -> np.ndarray:
    """wire::Mix, in wrapping uint64 arithmetic."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & MASK64


def sample_positions(column: int, count: int, length: int) -> np.ndarray:
    """wire::SamplePosition(column, j, length) for j in [0, count)."""
    keys = (np.uint64(column) << np.uint64(32)) | np.arange(count, dtype=np.uint64)
    return (splitmix64(keys) % np.uint64(length)).astype(np.int64)


def sign_means(values: np.ndarray) -> tuple[np.float32, np.float32]:
    """Means of the non-negative and of the negative values; 0.0 for a sign with none."""
    nonneg = values[values >= 0].astype(np.float64)
    neg = values[values < 0].astype(np.float64)
    return (
        np.float32(nonneg.mean() if nonneg.size else 0.0),
        np.float32(neg.mean() if neg.size else 0.0),
    )


def reference(acc: np.ndarray, c: jaxcomm.OneBit) -> tuple[np.ndarray, np.ndarray]:
    """(means [ncols, 2] float32, bit words uint32) of the one-bit encoding of flat `acc`."""
    n = acc.size
    ncols = c.num_columns(n)
    means = np.zeros((ncols, 2), np.float32)
    for col in range(ncols):
        column = acc[col * c.column_size : (col + 1) * c.column_size]
        if c.sample_size:
            column = column[sample_positions(col, c.sample_size, column.size)]
        means[col] = sign_means(column)
    bits = np.packbits(acc >= 0, bitorder="little")
    bits = np.pad(bits, (0, -bits.size % 4)).view("<u4")
    return means, bits


def run(x: np.ndarray, r: np.ndarray, c: jaxcomm.OneBit) -> tuple[np.ndarray, np.ndarray]:
    packed, new_r = jaxcomm.ops.compress(jnp.asarray(x), jnp.asarray(r), c)
    return np.asarray(packed), np.asarray(new_r)


def check_against_reference(x: np.ndarray, r: np.ndarray, c: jaxcomm.OneBit) -> None:
    packed, new_r = run(x, r, c)
    n = x.size
    acc = (x + r).ravel()
    ref_means, ref_bits = reference(acc, c)
    ncols = c.num_columns(n)
    assert packed.shape == (c.packed_words(n),)
    assert packed[0] == packed.size
    means = packed[1 : 1 + 2 * ncols].view(np.float32).reshape(ncols, 2)
    np.testing.assert_allclose(means, ref_means, rtol=3e-7, atol=0)
    np.testing.assert_array_equal(packed[1 + 2 * ncols :], ref_bits)
    x_hat = np.asarray(jaxcomm.ops.decompress(jnp.asarray(packed), c, x.shape))
    decoded = np.where(acc >= 0, np.repeat(means[:, 0], c.column_size)[:n], 0) + np.where(
        acc < 0, np.repeat(means[:, 1], c.column_size)[:n], 0
    )
    np.testing.assert_array_equal(x_hat.ravel(), decoded)
    # Error feedback: computed from the very float acc that was encoded.
    np.testing.assert_array_equal(new_r.ravel(), acc - x_hat.ravel())
    np.testing.assert_allclose(x_hat + new_r, x + r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 7, 1000, 2**20 + 3])
@pytest.mark.parametrize("column_size", [32, 1024])
@pytest.mark.parametrize("sample_size", [0, 48])
def test_matches_reference(n, column_size, sample_size):
    rng = np.random.default_rng(n + column_size + sample_size)
    x = rng.standard_normal(n, dtype=np.float32)
    r = 0.1 * rng.standard_normal(n, dtype=np.float32)
    check_against_reference(x, r, jaxcomm.OneBit(column_size, sample_size))


@pytest.mark.parametrize(
    "x",
    [
        np.full(100, 0.25, np.float32),  # all equal: decodes exactly, residual 0
        -np.abs(np.random.default_rng(1).standard_normal(300, dtype=np.float32)) - 1e-3,
        np.abs(np.random.default_rng(2).standard_normal(300, dtype=np.float32)),
        np.zeros(33, np.float32),
    ],
    ids=["all-equal", "negative-only", "positive-only", "zeros"],
)
@pytest.mark.parametrize("sample_size", [0, 5])
def test_single_signed_and_constant_inputs(x, sample_size):
    c = jaxcomm.OneBit(64, sample_size)
    check_against_reference(x, np.zeros_like(x), c)
    packed, new_r = run(x, np.zeros_like(x), c)
    means = packed[1 : 1 + 2 * c.num_columns(x.size)].view(np.float32).reshape(-1, 2)
    if (x >= 0).all():
        assert (means[:, 1] == 0).all()  # no negative values: documented mean 0.0
    if (x < 0).all():
        assert (means[:, 0] == 0).all() and (packed[1 + means.size :] == 0).all()
    if (x == x[0]).all():
        assert (new_r == 0).all()


def test_hand_computed():
    x = np.array([1.0, -2.0, 3.0, -4.0, 0.0], np.float32)
    packed, new_r = run(x, np.zeros_like(x), jaxcomm.OneBit(32))
    m = np.float32(4 / 3)
    assert packed.tolist() == [
        4,
        int(m.view(np.uint32)),
        int(np.float32(-3).view(np.uint32)),
        0b10101,
    ]
    np.testing.assert_array_equal(new_r, np.array([1 - m, 1, 3 - m, -1, -m], np.float32))


def test_multidimensional_and_jit():
    c = jaxcomm.OneBit(96, 0)
    x, r = check_jit_round_trip(c, (37, 29), 3, run, atol=1e-6)
    check_against_reference(x, r, c)


def test_error_feedback_over_steps_delivers_the_sum():
    # Everything that was not applied is still in the residual: after T steps the applied sum
    # plus the residual equals the sum of the inputs.
    rng = np.random.default_rng(4)
    c = jaxcomm.OneBit(128, 16)
    r = jnp.zeros(1000, jnp.float32)
    applied = np.zeros(1000, np.float64)
    total = np.zeros(1000, np.float64)
    for _ in range(5):
        x = rng.standard_normal(1000, dtype=np.float32)
        packed, r = jaxcomm.ops.compress(jnp.asarray(x), r, c)
        applied += np.asarray(jaxcomm.ops.decompress(packed, c, 1000))
        total += x
    np.testing.assert_allclose(applied + np.asarray(r), total, rtol=1e-5, atol=1e-5)


def test_bad_parameters_and_inputs():
    with pytest.raises(ValueError, match="multiple of 32"):
        jaxcomm.OneBit(48)
    with pytest.raises(ValueError, match="sample_size"):
        jaxcomm.OneBit(32, -1)
    x = jnp.ones(10, jnp.float32)
    with pytest.raises(TypeError, match="float32"):
        jaxcomm.ops.compress(x.astype(jnp.float16), x.astype(jnp.float16), jaxcomm.OneBit())
    with pytest.raises(TypeError, match="float32"):
        onebit.compress(x.astype(jnp.int32), x, jaxcomm.OneBit())
    with pytest.raises(ValueError, match="shape"):
        jaxcomm.ops.compress(x, jnp.ones(11, jnp.float32), jaxcomm.OneBit())
    with pytest.raises(ValueError, match="shape"):
        onebit.compress(x, jnp.ones(11, jnp.float32), jaxcomm.OneBit())
    with pytest.raises(TypeError, match="OneBit"):
        onebit.compress(x, x, jaxcomm.Threshold(0.1))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_names_the_index(bad):
    x = np.ones(5000, np.float32)
    x[4321] = bad
    x[4999] = np.nan
    with pytest.raises(KERNEL_ERRORS, match=r"OneBit.*flat index 4321\b"):
        run(x, np.zeros_like(x), jaxcomm.OneBit(64))


def test_overflowing_sum_is_non_finite():
    x = np.array([1.0, 3e38], np.float32)
    with pytest.raises(KERNEL_ERRORS, match=r"flat index 1\b"):
        run(x, x, jaxcomm.OneBit(32))


def test_decompress_rejects_bad_packed():
    c = jaxcomm.OneBit(32)
    x = jnp.arange(40, dtype=jnp.float32) - 20
    packed, _ = jaxcomm.ops.compress(x, jnp.zeros_like(x), c)
    with pytest.raises(KERNEL_ERRORS, match=r"decompress\(OneBit\).*packed\[0\]"):
        np.asarray(jaxcomm.ops.decompress(packed.at[0].set(3), c, 40))
    with pytest.raises(ValueError, match="words"):
        jaxcomm.ops.decompress(packed, c, 80)
    # Direct op with a mismatched size reaches the handler's own check.
    with pytest.raises(KERNEL_ERRORS, match=r"OneBit.*packs 80 elements"):
        np.asarray(onebit.decompress(packed, c, (80,)))


def test_empty_x_is_refused_at_trace_time():
    with pytest.raises(ValueError, match="x is empty"):
        jaxcomm.ops.onebit.compress(jnp.zeros(0), jnp.zeros(0), jaxcomm.OneBit())
