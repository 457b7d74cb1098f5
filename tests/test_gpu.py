"""GPU (platform "CUDA") kernels against the CPU kernels and NumPy references.

Run with ``pytest -m gpu`` on a machine with a CUDA GPU and a jaxcomm built with
``JAXCOMM_ENABLE_CUDA=ON``. Every case runs the same jitted op once on a CPU device and once on
the GPU and requires the same bytes (the GPU kernels share the CPU wire format and round the
same way), plus the NumPy reference of the CPU suites. Without a GPU the module is skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm import _ffi
from jaxcomm.ops import compress, decompress, topk_abs
from jaxcomm.ops.sparse_merge import sparse_merge


def _gpu_devices() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpu_devices()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="needs a CUDA GPU: jax.devices('gpu') found none"),
]

CPU = jax.devices("cpu")[0]
SIZES = [1, 7, 1000, 2**20 + 3]


def on(device: jax.Device, fn, *args):
    """Runs jit(fn) with its array arguments placed on `device`; returns NumPy results."""
    placed = [jax.device_put(a, device) if isinstance(a, np.ndarray) else a for a in args]
    out = jax.jit(fn)(*placed)
    return jax.tree.map(np.asarray, out)


def both(fn, *args):
    """(cpu result, gpu result) of the same jitted computation."""
    return on(CPU, fn, *args), on(GPUS[0], fn, *args)


def assert_same_bits(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def reference_topk(x: np.ndarray, k: int) -> np.ndarray:
    magnitude = np.abs(x).astype(np.float64)
    magnitude[np.isinf(x)] = np.finfo(np.float64).max
    magnitude[np.isnan(x)] = np.inf
    return np.sort(np.lexsort((np.arange(x.size), -magnitude))[:k])


def data(n: int, kind: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "ties":  # few distinct magnitudes: the tie-break decides most of the selection
        return rng.choice(np.array([-2, -1, 0, 1, 2], np.float32), size=n)
    raise ValueError(kind)


def test_library_has_gpu_kernels():
    assert _ffi.has_gpu_kernels(), (
        "a GPU is present but jaxcomm was built without CUDA: "
        "reinstall with JAXCOMM_ENABLE_CUDA=ON python -m pip install ."
    )


# ---- top-k --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("density", [1e-3, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_topk_abs_matches_cpu_and_reference(n, density, kind):
    x = data(n, kind)
    k = max(1, int(np.ceil(density * n)))
    cpu, gpu = both(lambda v: topk_abs(v, k), x)
    assert_same_bits(cpu, gpu)
    np.testing.assert_array_equal(gpu[1], reference_topk(x, k))
    np.testing.assert_array_equal(gpu[0], x[gpu[1]])


@pytest.mark.parametrize(
    "x",
    [
        np.zeros(100, np.float32),
        np.array([-0.0, 0.0, -0.0, 1e-45, -1e-45], np.float32),
        np.array([1.0, np.nan, -np.inf, 3.0, np.inf, -np.nan, 2.0], np.float32),
        np.full(5000, 7.0, np.float32),
    ],
    ids=["zeros", "signed-zeros-denormals", "non-finite", "constant"],
)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_topk_abs_special_inputs(x, k):
    cpu, gpu = both(lambda v: topk_abs(v, k), x)
    assert_same_bits(cpu, gpu)
    np.testing.assert_array_equal(gpu[1], reference_topk(x, k))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("density", [1e-3, 0.05, 1.0])
def test_topk_compress_matches_cpu_and_conserves(n, density):
    x, r = data(n, "normal", 1), data(n, "ties", 2) * np.float32(0.25)
    c = jaxcomm.TopK(density)
    cpu, gpu = both(lambda a, b: compress(a, b, c), x, r)
    assert_same_bits(cpu, gpu)
    packed, new_r = gpu
    x_hat = on(GPUS[0], lambda p: decompress(p, c, (n,)), packed)
    assert_same_bits(x_hat, on(CPU, lambda p: decompress(p, c, (n,)), packed))
    np.testing.assert_array_equal(x_hat + new_r, x + r)  # exact: disjoint supports


def test_topk_compress_in_place_residual_over_steps():
    """Donated residual (input_output_aliases): the GPU reads acc back, not x + residual twice."""
    n, c = 100_003, jaxcomm.TopK(0.01)

    def steps(x, r):
        def body(i, carry):
            r, total = carry
            packed, r = compress(x * (i + 1).astype(jnp.float32), r, c)
            return r, total + decompress(packed, c, (n,))

        return jax.lax.fori_loop(0, 5, body, (r, jnp.zeros_like(x)))

    x = data(n, "normal", 3)
    cpu, gpu = both(steps, x, np.zeros(n, np.float32))
    assert_same_bits(cpu, gpu)


def test_topk_decompress_bad_index_is_nan_on_gpu():
    c = jaxcomm.TopK(0.5)
    packed = np.array([5, 1, 9, 0, 0], np.uint32)  # index 9 is out of range for n = 4
    out = on(GPUS[0], lambda p: decompress(p, c, (4,)), packed)
    assert np.isnan(out).all()


# ---- sparse merge -------------------------------------------------------------------------


def random_sparse(rng, size, index_range, discrete):
    idx = np.sort(rng.choice(index_range, size=size, replace=False)).astype(np.int32)
    if discrete:
        val = rng.choice(np.array([-2, -1, -0.5, 0, 0.5, 1, 2], np.float32), size=size)
    else:
        val = rng.standard_normal(size).astype(np.float32)
    return idx, val


@pytest.mark.parametrize("size", [1, 7, 1000, 100_000])
@pytest.mark.parametrize("overlap", ["sparse", "dense"])
@pytest.mark.parametrize("discrete", [False, True], ids=["normal", "ties"])
def test_sparse_merge_matches_cpu(size, overlap, discrete):
    rng = np.random.default_rng(size)
    index_range = size * (100 if overlap == "sparse" else 2)
    a = random_sparse(rng, size, index_range, discrete)
    b = random_sparse(rng, size, index_range, discrete)
    cpu, gpu = both(lambda ia, va, ib, vb: sparse_merge(ia, va, ib, vb, size), *a, *b)
    assert_same_bits(cpu, gpu)


@pytest.mark.parametrize("ka,kb", [(5, 1), (1, 5), (0, 3), (3, 0), (1000, 17)])
def test_sparse_merge_unequal_sizes(ka, kb):
    rng = np.random.default_rng(ka * 31 + kb)
    a = random_sparse(rng, ka, 5000, False)
    b = random_sparse(rng, kb, 5000, False)
    k = max(ka, kb)
    cpu, gpu = both(lambda ia, va, ib, vb: sparse_merge(ia, va, ib, vb, k), *a, *b)
    assert_same_bits(cpu, gpu)


def test_sparse_merge_non_finite_and_bad_indices():
    a = (np.array([0, 2, 4], np.int32), np.array([1.0, np.nan, -np.inf], np.float32))
    # NaN is never summed: x86 keeps a NaN operand's payload, the GPU returns its canonical NaN.
    b = (np.array([0, 3, 5], np.int32), np.array([5.0, np.inf, 2.0], np.float32))
    cpu, gpu = both(lambda ia, va, ib, vb: sparse_merge(ia, va, ib, vb, 3), *a, *b)
    assert_same_bits(cpu, gpu)
    bad = (np.array([0, 2, 2], np.int32), np.array([1.0, 2.0, 3.0], np.float32))
    _, val = on(GPUS[0], lambda ia, va, ib, vb: sparse_merge(ia, va, ib, vb, 3), *bad, *b)
    assert np.isnan(val).all()


# ---- quantizers ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("column_size", [32, 1024])
@pytest.mark.parametrize("sample_size", [0, 48])
def test_onebit_matches_cpu(n, column_size, sample_size):
    c = jaxcomm.OneBit(column_size, sample_size)
    x, r = data(n, "normal", 4), data(n, "normal", 5) * np.float32(0.1)
    cpu, gpu = both(lambda a, b: compress(a, b, c), x, r)
    assert_same_bits(cpu, gpu)
    dec = [on(d, lambda p: decompress(p, c, (n,)), gpu[0]) for d in (CPU, GPUS[0])]
    assert_same_bits(dec[0], dec[1])


@pytest.mark.parametrize("sample_size", [0, 5])
@pytest.mark.parametrize(
    "x",
    [np.full(100, 3.0, np.float32), -np.arange(1, 70, dtype=np.float32), np.zeros(64, np.float32)],
    ids=["positive", "negative", "zeros"],
)
def test_onebit_single_signed_and_constant_inputs(x, sample_size):
    c = jaxcomm.OneBit(32, sample_size)
    cpu, gpu = both(lambda a, b: compress(a, b, c), x, np.zeros_like(x))
    assert_same_bits(cpu, gpu)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("max_density", [1.0, 0.01])
def test_threshold_matches_cpu(n, max_density):
    c = jaxcomm.Threshold(0.5, max_density)
    x, r = data(n, "normal", 6), data(n, "normal", 7) * np.float32(0.1)
    cpu, gpu = both(lambda a, b: compress(a, b, c), x, r)
    assert_same_bits(cpu, gpu)
    dec = [on(d, lambda p: decompress(p, c, (n,)), gpu[0]) for d in (CPU, GPUS[0])]
    assert_same_bits(dec[0], dec[1])


def test_threshold_capacity_overflow_large():
    n = 3_000_017
    c = jaxcomm.Threshold(0.1, 0.001)  # far more than capacity pass: the lowest indices win
    x = data(n, "normal", 8)
    cpu, gpu = both(lambda a, b: compress(a, b, c), x, np.zeros_like(x))
    assert_same_bits(cpu, gpu)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(
    "compressor", [jaxcomm.OneBit(32), jaxcomm.Threshold(0.5)], ids=["onebit", "threshold"]
)
def test_non_finite_input_marks_packed_header(bad, compressor):
    """The GPU cannot raise without synchronizing: packed[0] = 0, which decompress rejects."""
    x = data(1000, "normal", 9)
    x[777] = bad
    packed, _ = on(GPUS[0], lambda a, b: compress(a, b, compressor), x, np.zeros_like(x))
    assert packed[0] == 0
    out = on(GPUS[0], lambda p: decompress(p, compressor, (1000,)), packed)
    assert np.isnan(out).all()
