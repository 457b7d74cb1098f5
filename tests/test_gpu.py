"""GPU (platform "CUDA") kernels against the CPU kernels and NumPy references.

Run with ``pytest -m gpu`` on a machine with a CUDA GPU and a jaxcomm built with
``JAXCOMM_ENABLE_CUDA=ON``. Every case runs the same jitted op once on a CPU device and once on
the GPU and requires the same bytes (the GPU kernels share the CPU wire format and round the
same way), plus the NumPy reference of the CPU suites. Without a GPU the module is skipped.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compress_helpers import raw_adaptive_compress
from gpu_support import GPU_MARKS, GPUS

import jaxcomm
from jaxcomm import _ffi
from jaxcomm.ops import compress, decompress, topk_abs
from jaxcomm.ops.sparse_merge import sparse_merge

pytestmark = GPU_MARKS

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


@pytest.mark.parametrize(
    "c",
    [jaxcomm.TopK(0.01), jaxcomm.Adaptive(64, 1000, 0), jaxcomm.Adaptive(64, 1000, 256)],
    ids=["topk", "adaptive", "adaptive_sampled"],
)
def test_compress_in_place_residual_over_steps(c):
    """Donated residual carried through a loop (residual_out aliases residual_in on the GPU): the
    GPU reads acc back, not x + residual twice."""
    n = 100_003

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


# ---- adaptive -----------------------------------------------------------------------------
# XLA's CPU threads flush denormals to zero (a denormal acc is neither > 0 nor < 0 there), the
# GPU kernels keep them like the plain C++ kernel: the data here holds none. The raw kernels,
# denormals included, are compared in kernels/tests/adaptive_cuda_test.cc (test below).


def adaptive_inputs(n: int, kind: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    x = data(n, kind, seed)
    r = data(n, kind, seed + 1) * np.float32(0.25 if kind == "ties" else 0.1)
    return x, r


def assert_adaptive_matches_cpu(c: jaxcomm.Adaptive, x: np.ndarray, r: np.ndarray) -> None:
    n = x.size
    cpu, gpu = both(lambda a, b: compress(a, b, c), x, r)
    assert_same_bits(cpu, gpu)
    dec = [on(d, lambda p: decompress(p, c, (n,)), gpu[0]) for d in (CPU, GPUS[0])]
    assert_same_bits(dec[0], dec[1])
    # Error feedback, up to the rounding of (acc - mean) + mean at the data's scale.
    acc = x + r
    scale = float(np.abs(acc).max()) if n else 0.0
    np.testing.assert_allclose(dec[1] + gpu[1], acc, rtol=1e-6, atol=1e-6 * scale)


# 1000: a ragged last column for most n; 5000: columns above the 4096 elements the kernel
# stages in shared memory (and a sample of 5000 is recomputed instead of staged).
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("column_size", [64, 1000, 5000])
@pytest.mark.parametrize("proportion", [64, 3.5])
@pytest.mark.parametrize("sample_size", [0, 48, 5000])
def test_adaptive_matches_cpu(n, column_size, proportion, sample_size):
    c = jaxcomm.Adaptive(proportion, column_size, sample_size)
    assert_adaptive_matches_cpu(c, *adaptive_inputs(n, "normal", 11))


@pytest.mark.parametrize("column_size", [7, 256, 1000, 4096, 10_000, 2**20])
@pytest.mark.parametrize("sample_size", [0, 5, 300])
def test_adaptive_ties_pick_the_lower_indices(column_size, sample_size):
    """Few distinct values: exact mode takes the first ties by index, sampled mode all of them
    up to the column capacity. 2**20 > n: one column, longer than the kernel's block."""
    c = jaxcomm.Adaptive(3.5, column_size, sample_size)
    assert_adaptive_matches_cpu(c, *adaptive_inputs(50_003, "ties", 13))


@pytest.mark.parametrize("sample_size", [0, 256])
@pytest.mark.parametrize("proportion", [1, 64, 1000])
@pytest.mark.parametrize(
    "kind", ["all_equal", "positive_only", "negative_only", "zeros", "signed_zeros", "scales"]
)
def test_adaptive_special_inputs(kind, proportion, sample_size):
    n = 5000
    rng = np.random.default_rng(7)
    x = {
        "all_equal": np.full(n, 0.75, np.float32),
        "positive_only": np.abs(rng.standard_normal(n)).astype(np.float32) + 1e-3,
        "negative_only": -np.abs(rng.standard_normal(n)).astype(np.float32) - 1e-3,
        "zeros": np.zeros(n, np.float32),
        "signed_zeros": np.where(rng.random(n) < 0.5, -0.0, 0.0).astype(np.float32),
        "scales": (rng.standard_normal(n) * 10.0 ** (np.arange(n) // 1024 % 3 * 3 - 3)).astype(
            np.float32
        ),
    }[kind]
    c = jaxcomm.Adaptive(proportion, 1024, sample_size)
    assert_adaptive_matches_cpu(c, x, np.zeros_like(x))


def test_adaptive_decompress_corrupt_is_nan_on_gpu():
    """What the CPU decompress rejects (tests/test_adaptive.py) decodes to all-NaN on the GPU."""
    c = jaxcomm.Adaptive(proportion=4, column_size=16)
    x = data(64, "normal", 15)
    packed = on(CPU, lambda a, b: compress(a, b, c)[0], x, np.zeros_like(x)).copy()
    header = 1 + 2 * c.num_columns(64)
    assert packed[0] > header + 1
    for word, value in [
        (0, c.packed_words(64) + 1),  # used beyond the buffer
        (0, 2),  # used inside the header
        (0, 0),  # the mark of a failed compress
        (header, 64),  # index out of range
        (header + 1, packed[header]),  # not ascending
    ]:
        bad = packed.copy()
        bad[word] = value
        out = on(GPUS[0], lambda p: decompress(p, c, (64,)), bad)
        assert np.isnan(out).all(), (word, value)


@pytest.mark.parametrize(
    "attrs, words, message",
    [
        ({"proportion": 0.5, "column_size": 16, "sample_size": 0}, 49, "proportion"),
        ({"proportion": 4.0, "column_size": 0, "sample_size": 0}, 49, "column_size"),
        ({"proportion": 4.0, "column_size": 16, "sample_size": -1}, 49, "sample_size"),
        ({"proportion": 4.0, "column_size": 16, "sample_size": 0}, 50, "packs 64 elements into 49"),
    ],
)
def test_adaptive_handler_checks_are_the_cpu_ones(attrs, words, message):
    """The CUDA handler runs the CPU handler's static checks (ffi/compress_checks.h)."""
    call = raw_adaptive_compress(words, attrs)
    x = np.ones(64, np.float32)
    for device in (CPU, GPUS[0]):
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"compress\(Adaptive\).*" + message):
            on(device, call, x)


@pytest.mark.timeout(900)
def test_adaptive_cuda_kernel_gtest(tmp_path):
    """Builds and runs kernels/tests/adaptive_cuda_test.cc: the raw CUDA kernels against the
    CPU kernel, with what XLA cannot pass (denormals, a null residual, accumulate=true)."""
    cuda_home = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    nvcc = shutil.which("nvcc") or str(cuda_home / "bin" / "nvcc")
    if not os.access(nvcc, os.X_OK) or not shutil.which("cmake"):
        pytest.skip("needs nvcc and cmake to build the CUDA gtest")
    capability = getattr(GPUS[0], "compute_capability", "")
    arch = capability.replace(".", "") if capability else "80;90"
    root = pathlib.Path(__file__).resolve().parents[1]
    build = tmp_path / "build"
    configure = subprocess.run(
        [
            "cmake",
            "-S",
            str(root),
            "-B",
            str(build),
            "-DJAXCOMM_ENABLE_CUDA=ON",
            "-DJAXCOMM_BUILD_TESTS=ON",
            "-DJAXCOMM_BUILD_FFI=OFF",
            "-DJAXCOMM_ENABLE_UCX=OFF",
            f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
        ],
        capture_output=True,
        text=True,
    )
    if "Could NOT find GTest" in configure.stdout + configure.stderr:
        pytest.skip("GoogleTest is missing (Debian's libgtest-dev)")
    assert configure.returncode == 0, configure.stdout[-4000:] + configure.stderr[-4000:]
    jobs = str(os.cpu_count() or 2)
    built = subprocess.run(
        ["cmake", "--build", str(build), "--target", "adaptive_cuda_test", "-j", jobs],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    run = subprocess.run(
        [str(build / "adaptive_cuda_test")], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "SKIPPED" not in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize(
    "compressor",
    [
        jaxcomm.OneBit(32),
        jaxcomm.Threshold(0.5),
        jaxcomm.Adaptive(64, 256),
        jaxcomm.Adaptive(64, 256, sample_size=32),
    ],
    ids=["onebit", "threshold", "adaptive", "adaptive-sampled"],
)
def test_non_finite_input_marks_packed_header(bad, compressor):
    """The GPU cannot raise without synchronizing: packed[0] = 0, which decompress rejects."""
    x = data(1000, "normal", 9)
    x[777] = bad
    packed, _ = on(GPUS[0], lambda a, b: compress(a, b, compressor), x, np.zeros_like(x))
    assert packed[0] == 0
    out = on(GPUS[0], lambda p: decompress(p, compressor, (1000,)), packed)
    assert np.isnan(out).all()
