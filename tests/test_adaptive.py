"""Adaptive quantization against a NumPy reference written from Dryden et al. §3.3 and the
format documented in jaxcomm/ops/compress.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compress_helpers import KERNEL_ERRORS, raw_adaptive_compress
from reference import adaptive_keep

import jaxcomm
from jaxcomm.ops import adaptive

SIGN = np.uint32(1 << 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 (kernels/wire.h Mix) on uint64 arrays; wrapping arithmetic is intended."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _sample_positions(column: int, count: int, length: int) -> np.ndarray:
    """wire::SamplePosition(column, j, length) for j in [0, count)."""
    keys = (np.uint64(column) << np.uint64(32)) | np.arange(count, dtype=np.uint64)
    return (_mix(keys) % np.uint64(length)).astype(np.int64)


def reference(acc: np.ndarray, c: jaxcomm.Adaptive):
    """Returns (packed, residual) for the float32 vector acc = x + residual_in."""
    n = acc.size
    ncols = c.num_columns(n)
    means = np.zeros((ncols, 2), np.float32)
    entries = []
    residual = acc.copy()
    for col in range(ncols):
        begin = col * c.column_size
        a = acc[begin : begin + c.column_size]
        if c.sample_size == 0:
            # Exactly adaptive_keep per sign; a stable sort puts the lower index first among ties.
            pos = np.flatnonzero(a > 0)
            neg = np.flatnonzero(a < 0)
            zeros = a.size - pos.size - neg.size
            keep_pos = adaptive_keep(pos.size, zeros, c.proportion)
            keep_neg = adaptive_keep(neg.size, zeros, c.proportion)
            pos = pos[np.argsort(-a[pos], kind="stable")[:keep_pos]]
            neg = neg[np.argsort(a[neg], kind="stable")[:keep_neg]]
        else:
            sample = a[_sample_positions(col, c.sample_size, a.size)]
            qualifies = np.zeros(a.size, bool)
            s_pos = np.sort(sample[sample > 0])[::-1]
            s_neg = np.sort(sample[sample < 0])
            s_zeros = sample.size - s_pos.size - s_neg.size
            if s_pos.size:
                qualifies |= a >= s_pos[adaptive_keep(s_pos.size, s_zeros, c.proportion) - 1]
            if s_neg.size:
                qualifies |= a <= s_neg[adaptive_keep(s_neg.size, s_zeros, c.proportion) - 1]
            sent = np.flatnonzero(qualifies)[: c.column_capacity(a.size)]
            pos, neg = sent[a[sent] > 0], sent[a[sent] < 0]
        for j, chosen in enumerate((pos, neg)):
            if chosen.size:
                means[col, j] = np.float32(a[chosen].astype(np.float64).mean())
                residual[begin + chosen] = a[chosen] - means[col, j]
        sent = np.sort(np.concatenate([pos, neg]))
        signs = np.where(a[sent] > 0, SIGN, np.uint32(0))
        entries.append(signs | (begin + sent).astype(np.uint32))
    entries = np.concatenate(entries) if entries else np.zeros(0, np.uint32)
    used = 1 + 2 * ncols + entries.size
    packed = np.zeros(c.packed_words(n), np.uint32)
    packed[0] = used
    packed[1 : 1 + 2 * ncols] = means.reshape(-1).view(np.uint32)
    packed[1 + 2 * ncols : used] = entries
    return packed, residual


def decode(packed: np.ndarray, c: jaxcomm.Adaptive, n: int) -> np.ndarray:
    ncols = c.num_columns(n)
    means = packed[1 : 1 + 2 * ncols].view(np.float32).reshape(ncols, 2)
    entries = packed[1 + 2 * ncols : packed[0]]
    index = (entries & ~SIGN).astype(np.int64)
    out = np.zeros(n, np.float32)
    out[index] = means[index // c.column_size, np.where(entries & SIGN, 0, 1)]
    return out


def check_against_reference(x: np.ndarray, r: np.ndarray, c: jaxcomm.Adaptive) -> np.ndarray:
    packed, new_r = jaxcomm.ops.compress(jnp.asarray(x), jnp.asarray(r), c)
    packed, new_r = np.asarray(packed), np.asarray(new_r)
    acc = (x + r).reshape(-1)
    want_packed, want_r = reference(acc, c)
    ncols = c.num_columns(acc.size)
    assert packed.shape == (c.packed_words(acc.size),)
    assert packed[0] == want_packed[0], "used"
    header = 1 + 2 * ncols
    np.testing.assert_array_equal(packed[header:], want_packed[header:])  # entries and zeros
    np.testing.assert_allclose(
        packed[1:header].view(np.float32), want_packed[1:header].view(np.float32), rtol=1e-6
    )
    np.testing.assert_allclose(new_r.reshape(-1), want_r, rtol=1e-6, atol=1e-6)
    # Error feedback: nothing is lost, only delayed.
    x_hat = np.asarray(jaxcomm.ops.decompress(jnp.asarray(packed), c, acc.size))
    np.testing.assert_array_equal(x_hat, decode(packed, c, acc.size))
    np.testing.assert_allclose(x_hat + new_r.reshape(-1), acc, rtol=1e-6, atol=1e-6)
    return packed


def gradient_like(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x[::5] = 0.0
    r = (0.1 * rng.standard_normal(n)).astype(np.float32)
    r[::5] = 0.0
    return x, r


@pytest.mark.parametrize("n", [1, 7, 1000, 2**20 + 3])
@pytest.mark.parametrize("proportion", [1, 2, 64, 1000])
@pytest.mark.parametrize("sample_size", [0, 256])
def test_matches_reference(n, proportion, sample_size):
    x, r = gradient_like(n, seed=n + proportion)
    c = jaxcomm.Adaptive(proportion=proportion, column_size=1024, sample_size=sample_size)
    packed = check_against_reference(x, r, c)
    if sample_size == 0:
        # Exact mode sends adaptive_keep(k+, k0) + adaptive_keep(k-, k0) per column.
        acc = x + r
        expected = 1 + 2 * c.num_columns(n)
        for begin in range(0, n, c.column_size):
            a = acc[begin : begin + c.column_size]
            pos, neg = int((a > 0).sum()), int((a < 0).sum())
            zeros = a.size - pos - neg
            expected += adaptive_keep(pos, zeros, proportion) + adaptive_keep(
                neg, zeros, proportion
            )
        assert packed[0] == expected


@pytest.mark.parametrize("column_size", [1, 3, 7, 333, 999, 1000, 1001])
@pytest.mark.parametrize("sample_size", [0, 5, 64])
def test_column_tails(column_size, sample_size):
    x, r = gradient_like(1000, seed=column_size)
    c = jaxcomm.Adaptive(proportion=3.5, column_size=column_size, sample_size=sample_size)
    check_against_reference(x, r, c)


@pytest.mark.parametrize(
    "kind", ["all_equal", "negative_only", "positive_only", "zeros", "ties", "scales"]
)
@pytest.mark.parametrize("sample_size", [0, 256])
def test_special_values(kind, sample_size):
    n = 5000
    rng = np.random.default_rng(7)
    x = {
        "all_equal": np.full(n, 0.75, np.float32),
        "negative_only": -np.abs(rng.standard_normal(n)).astype(np.float32) - 1e-3,
        "positive_only": np.abs(rng.standard_normal(n)).astype(np.float32) + 1e-3,
        "zeros": np.zeros(n, np.float32),
        "ties": rng.integers(-3, 4, n).astype(np.float32),
        # Columns of very different magnitudes, as layers of a model have.
        "scales": (rng.standard_normal(n) * 10.0 ** (np.arange(n) // 1024 % 3 * 3 - 3)).astype(
            np.float32
        ),
    }[kind]
    c = jaxcomm.Adaptive(proportion=64, column_size=1024, sample_size=sample_size)
    packed = check_against_reference(x, np.zeros_like(x), c)
    ncols = c.num_columns(n)
    means = packed[1 : 1 + 2 * ncols].view(np.float32).reshape(ncols, 2)
    if kind == "zeros":
        assert packed[0] == 1 + 2 * ncols and not means.any()
    if kind == "positive_only":
        assert not means[:, 1].any() and (means[:, 0] > 0).all()
    if kind == "negative_only":
        assert not means[:, 0].any() and (means[:, 1] < 0).all()
    if kind == "all_equal":
        np.testing.assert_array_equal(means[:, 0], 0.75)
        if sample_size:  # every value reaches the sampled threshold: capacity cuts each column
            assert packed[0] == c.packed_words(n)


def test_multidimensional_and_repeated_steps():
    c = jaxcomm.Adaptive(proportion=16, column_size=100)
    rng = np.random.default_rng(3)
    r = np.zeros((37, 29), np.float32)
    applied = np.zeros((37, 29), np.float64)
    total = np.zeros((37, 29), np.float64)
    for _ in range(4):
        x = rng.standard_normal((37, 29)).astype(np.float32)
        packed, new_r = jaxcomm.ops.compress(jnp.asarray(x), jnp.asarray(r), c)
        assert new_r.shape == x.shape
        x_hat = np.asarray(jaxcomm.ops.decompress(packed, c, (37, 29)))
        assert x_hat.shape == x.shape
        np.testing.assert_allclose(x_hat + np.asarray(new_r), x + r, rtol=1e-6, atol=1e-6)
        applied += x_hat
        total += x
        r = np.asarray(new_r)
    np.testing.assert_allclose(applied + r, total, atol=1e-4)


def test_under_jit_with_donated_residual():
    c = jaxcomm.Adaptive(proportion=64, column_size=1024, sample_size=256)
    x, r = gradient_like(100_000, seed=11)
    eager_packed, eager_r = jaxcomm.ops.compress(jnp.asarray(x), jnp.asarray(r), c)

    @jax.jit
    def roundtrip(x, r):
        packed, new_r = jaxcomm.ops.compress(x, r, c)
        return packed, new_r, jaxcomm.ops.decompress(packed, c, x.shape)

    step = jax.jit(roundtrip.__wrapped__, donate_argnums=1)
    for fn in (roundtrip, step):
        packed, new_r, x_hat = fn(jnp.asarray(x), jnp.asarray(r))
        np.testing.assert_array_equal(np.asarray(packed), np.asarray(eager_packed))
        np.testing.assert_array_equal(np.asarray(new_r), np.asarray(eager_r))
        np.testing.assert_allclose(np.asarray(x_hat) + np.asarray(new_r), x + r, atol=1e-6)


def test_bad_compressor_parameters():
    with pytest.raises(ValueError, match="proportion"):
        jaxcomm.Adaptive(proportion=0.5)
    with pytest.raises(ValueError, match="column_size"):
        jaxcomm.Adaptive(column_size=0)
    with pytest.raises(ValueError, match="sample_size"):
        jaxcomm.Adaptive(sample_size=-1)


def test_bad_arguments():
    c = jaxcomm.Adaptive()
    x = jnp.ones(10, jnp.float32)
    with pytest.raises(TypeError, match="float32"):
        jaxcomm.ops.compress(x.astype(jnp.int32), jnp.zeros(10, jnp.float32), c)
    with pytest.raises(TypeError, match="float32"):
        adaptive.compress(x, jnp.zeros(10, jnp.bfloat16), c)
    with pytest.raises(ValueError, match="shape"):
        jaxcomm.ops.compress(x, jnp.zeros(11, jnp.float32), c)
    with pytest.raises(ValueError, match="shape"):
        adaptive.compress(x, jnp.zeros((2, 5), jnp.float32), c)
    with pytest.raises(TypeError, match="Adaptive"):
        adaptive.compress(x, x, jaxcomm.TopK(0.1))
    packed, _ = jaxcomm.ops.compress(x, jnp.zeros_like(x), c)
    with pytest.raises(ValueError, match="words"):
        jaxcomm.ops.decompress(packed, c, 2000)
    with pytest.raises(ValueError, match="words"):
        adaptive.decompress(packed[:-1], c, 10)


@pytest.mark.parametrize("where", ["x", "residual"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_names_the_index(where, bad):
    x, r = gradient_like(300_000, seed=5)
    (x if where == "x" else r)[[200_123, 250_000]] = bad
    c = jaxcomm.Adaptive(proportion=64, column_size=1024)
    with pytest.raises(KERNEL_ERRORS, match="flat index 200123"):
        jax.block_until_ready(jaxcomm.ops.compress(jnp.asarray(x), jnp.asarray(r), c))


def test_corrupt_packed_is_rejected():
    c = jaxcomm.Adaptive(proportion=4, column_size=16)
    x, r = gradient_like(64, seed=1)
    packed = np.asarray(jaxcomm.ops.compress(jnp.asarray(x), jnp.asarray(r), c)[0]).copy()
    header = 1 + 2 * c.num_columns(64)
    for word, value, message in [
        (0, c.packed_words(64) + 1, "used"),
        (0, 2, "used"),
        (header, 64, "out of range"),
        (header + 1, packed[header], "ascending"),
    ]:
        bad = packed.copy()
        bad[word] = value
        with pytest.raises(KERNEL_ERRORS, match=r"decompress\(Adaptive\).*" + message):
            jax.block_until_ready(jaxcomm.ops.decompress(jnp.asarray(bad), c, 64))


@pytest.mark.parametrize(
    "attrs, words, message",
    [
        ({"proportion": 0.5, "column_size": 16, "sample_size": 0}, 49, "proportion"),
        ({"proportion": np.inf, "column_size": 16, "sample_size": 0}, 49, "proportion"),
        ({"proportion": 4.0, "column_size": 0, "sample_size": 0}, 49, "column_size"),
        ({"proportion": 4.0, "column_size": 16, "sample_size": -1}, 49, "sample_size"),
        ({"proportion": 4.0, "column_size": 16, "sample_size": 0}, 50, "packs 64 elements into 49"),
    ],
)
def test_ffi_handler_validates_what_python_would(attrs, words, message):
    # Calls the FFI target directly, as a collective built on it would: the handler must turn
    # bad parameters into an error naming the op instead of aborting the process.
    assert jaxcomm.Adaptive(4, 16).packed_words(64) == 49
    x = jnp.ones(64, jnp.float32)
    call = raw_adaptive_compress(words, attrs)
    with pytest.raises(KERNEL_ERRORS, match=r"compress\(Adaptive\).*" + message):
        jax.block_until_ready(call(x))
