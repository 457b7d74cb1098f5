"""Threshold (Strom's threshold quantization, Dryden et al. 2016 §3.2) against a NumPy
reference written from the paper and the documented wire format. Everything is compared
bit-exactly: there is no summation, only one float32 add and one float32 subtract per element.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from compress_helpers import KERNEL_ERRORS, check_jit_round_trip

import jaxcomm
from jaxcomm.ops import threshold


def reference(x: np.ndarray, r: np.ndarray, c: jaxcomm.Threshold) -> tuple[np.ndarray, np.ndarray]:
    """(packed, new_residual) of Threshold compression of x + r."""
    acc = (x + r).ravel()
    tau = np.float32(c.tau)
    capacity = c.capacity(acc.size)
    positive = acc > tau
    sent = np.flatnonzero(positive | (acc < -tau))[:capacity]
    packed = np.zeros(1 + capacity, np.uint32)
    packed[0] = 1 + sent.size
    packed[1 : 1 + sent.size] = sent.astype(np.uint32) | (
        positive[sent].astype(np.uint32) << np.uint32(31)
    )
    new_r = acc.copy()
    new_r[sent] = acc[sent] - np.where(positive[sent], tau, -tau)
    return packed, new_r.reshape(x.shape)


def run(x: np.ndarray, r: np.ndarray, c: jaxcomm.Threshold) -> tuple[np.ndarray, np.ndarray]:
    packed, new_r = jaxcomm.ops.compress(jnp.asarray(x), jnp.asarray(r), c)
    return np.asarray(packed), np.asarray(new_r)


def check_against_reference(x: np.ndarray, r: np.ndarray, c: jaxcomm.Threshold) -> None:
    packed, new_r = run(x, r, c)
    ref_packed, ref_r = reference(x, r, c)
    np.testing.assert_array_equal(packed, ref_packed)
    np.testing.assert_array_equal(new_r, ref_r)
    x_hat = np.asarray(jaxcomm.ops.decompress(jnp.asarray(packed), c, x.shape))
    np.testing.assert_array_equal(new_r, (x + r) - x_hat)
    np.testing.assert_allclose(x_hat + new_r, x + r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [1, 7, 1000, 2**20 + 3])
@pytest.mark.parametrize("max_density", [1.0, 0.01])
def test_matches_reference(n, max_density):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n, dtype=np.float32)
    r = 0.5 * rng.standard_normal(n, dtype=np.float32)
    check_against_reference(x, r, jaxcomm.Threshold(1.5, max_density))


@pytest.mark.parametrize(
    "x",
    [
        np.full(100, 0.25, np.float32),
        np.full(100, 2.0, np.float32),
        -np.abs(np.random.default_rng(1).standard_normal(300, dtype=np.float32)),
        np.abs(np.random.default_rng(2).standard_normal(300, dtype=np.float32)),
        np.array([1.0, -1.0, 1.0000001, -1.0000001], np.float32),  # |acc| == tau is not sent
    ],
    ids=["all-equal-below", "all-equal-above", "negative-only", "positive-only", "at-tau"],
)
def test_edge_inputs(x):
    check_against_reference(x, np.zeros_like(x), jaxcomm.Threshold(1.0))


def test_hand_computed_and_capacity_overflow():
    x = np.array([0.5, 2.0, -3.0, 1.0, -1.0, -1.5], np.float32)
    packed, new_r = run(x, np.zeros_like(x), jaxcomm.Threshold(1.0))
    assert packed.tolist() == [4, 0x80000001, 2, 5, 0, 0, 0]
    assert new_r.tolist() == [0.5, 1.0, -2.0, 1.0, -1.0, -0.5]
    # capacity = ceil(0.3 * 6) = 2: the lowest indices win, index 5 stays whole.
    packed, new_r = run(x, np.zeros_like(x), jaxcomm.Threshold(1.0, max_density=0.3))
    assert packed.tolist() == [3, 0x80000001, 2]
    assert new_r.tolist() == [0.5, 1.0, -2.0, 1.0, -1.0, -1.5]


def test_capacity_overflow_large():
    # Far more than capacity pass, spread over all of the kernel's parallel ranges.
    rng = np.random.default_rng(5)
    x = rng.standard_normal(2**20 + 3, dtype=np.float32)
    check_against_reference(x, np.zeros_like(x), jaxcomm.Threshold(0.5, max_density=0.001))


def test_multidimensional_and_jit():
    check_jit_round_trip(jaxcomm.Threshold(1.0, 0.2), (64, 33), 6, reference, atol=1e-7)


def test_bad_parameters_and_inputs():
    for tau in (0.0, -1.0):
        with pytest.raises(ValueError, match="tau must be > 0"):
            jaxcomm.Threshold(tau)
    with pytest.raises(ValueError, match="finite"):
        jaxcomm.Threshold(float("nan"))
    x = jnp.ones(10, jnp.float32)
    with pytest.raises(TypeError, match="float32"):
        jaxcomm.ops.compress(x.astype(jnp.int32), x, jaxcomm.Threshold(0.1))
    # bf16 gradients are accepted (issue 11): the residual stays float32.
    _, bf16_residual = jaxcomm.ops.compress(x.astype(jnp.bfloat16), x, jaxcomm.Threshold(0.1))
    assert bf16_residual.dtype == jnp.float32
    with pytest.raises(TypeError, match="float32"):
        threshold.compress(x, x.astype(jnp.int32), jaxcomm.Threshold(0.1))
    with pytest.raises(ValueError, match="shape"):
        jaxcomm.ops.compress(x, jnp.ones((2, 5), jnp.float32), jaxcomm.Threshold(0.1))
    with pytest.raises(ValueError, match="shape"):
        threshold.compress(x, jnp.ones(9, jnp.float32), jaxcomm.Threshold(0.1))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_names_the_index(bad):
    x = np.full(300000, 0.01, np.float32)  # nothing passes tau, the NaN must still be found
    r = np.zeros_like(x)
    r[123456] = bad
    x[200000] = np.nan
    with pytest.raises(KERNEL_ERRORS, match=r"Threshold.*flat index 123456\b"):
        run(x, r, jaxcomm.Threshold(1.0))


def test_decompress_rejects_bad_packed():
    c = jaxcomm.Threshold(1.0)
    good = jnp.array([3, 0x80000001, 5, 0, 0, 0, 0, 0], jnp.uint32)
    x_hat = jaxcomm.ops.decompress(good, c, 7)
    assert np.asarray(x_hat).tolist() == [0, 1, 0, 0, 0, -1, 0]
    for bad, what in [
        (good.at[0].set(0), r"packed\[0\] = 0"),
        (good.at[0].set(9), r"packed\[0\] = 9"),
        (good.at[2].set(7), "entry 1"),  # index 7 >= n
        (good.at[2].set(1), "entry 1"),  # not ascending
    ]:
        with pytest.raises(KERNEL_ERRORS, match=rf"decompress\(Threshold\).*{what}"):
            np.asarray(jaxcomm.ops.decompress(bad, c, 7))


def test_empty_x_is_refused_at_trace_time():
    with pytest.raises(ValueError, match="x is empty"):
        jaxcomm.ops.threshold.compress(jnp.zeros(0), jnp.zeros(0), jaxcomm.Threshold(0.1))
