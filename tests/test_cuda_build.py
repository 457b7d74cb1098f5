"""CI compile check of the GPU path: configures and builds the CUDA targets without a GPU.

CI machines have nvcc and the NCCL headers but no GPU, so the GPU tests (tests/test_gpu.py) skip
there; this test at least keeps kernels/*.cu and ffi/cuda/*.cc compiling and linking. It builds
one architecture (sm_90) and only libjaxcomm_ffi.so with its kernels and the UCX transport (no
tests) into a temporary directory: about a minute on two cores, so it is not marked slow. nvcc missing is a failure, not a skip: the CI image is
supposed to have it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_HOME = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
EXPECTED_SYMBOLS = [
    "JaxcommTopKAbsCuda",
    "JaxcommTopKCompressCuda",
    "JaxcommTopKDecompressCuda",
    "JaxcommSparseMergeCuda",
    "JaxcommOneBitCompressCuda",
    "JaxcommOneBitDecompressCuda",
    "JaxcommThresholdCompressCuda",
    "JaxcommThresholdDecompressCuda",
    "JaxcommAdaptiveCompressCuda",
    "JaxcommAdaptiveDecompressCuda",
    "JaxcommAllreduceCuda",
    "JaxcommTopKAllgatherCuda",
    "JaxcommGTopKCuda",
    "JaxcommQuantizedAllreduceCuda",
    "JaxcommHierarchicalAllreduceCuda",
    "JaxcommHierarchicalQuantizedCuda",
    "jaxcomm_gpu_world_ordinals",
    "jaxcomm_nccl_set_library",
]


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc") or str(CUDA_HOME / "bin" / "nvcc")
    if not os.access(nvcc, os.X_OK):
        pytest.fail(
            f"nvcc not found on PATH or in {CUDA_HOME}/bin: CI must compile the CUDA code "
            "(install the CUDA toolkit or set CUDA_HOME)"
        )
    return nvcc


@pytest.mark.timeout(900)
def test_cuda_targets_build(tmp_path):
    nvcc = find_nvcc()
    build = tmp_path / "build"
    configure = [
        "cmake",
        "-S",
        str(REPO_ROOT),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DJAXCOMM_ENABLE_CUDA=ON",
        "-DJAXCOMM_ENABLE_UCX=ON",
        "-DCMAKE_CUDA_ARCHITECTURES=90",
        f"-DCMAKE_CUDA_COMPILER={nvcc}",
        f"-DPython_EXECUTABLE={sys.executable}",
    ]
    for cmd in (configure, ["cmake", "--build", str(build), "--target", "jaxcomm_ffi", "-j2"]):
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, (
            f"{' '.join(cmd)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
        )
    library = build / "libjaxcomm_ffi.so"
    assert library.exists()
    if shutil.which("nm"):
        exported = subprocess.run(
            ["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True
        ).stdout
        missing = [s for s in EXPECTED_SYMBOLS if s not in exported]
        assert not missing, f"GPU handlers not exported: {missing}"
    if shutil.which("ldd"):
        # The CUDA runtime is linked statically: JAX brings its own libcudart.
        deps = subprocess.run(["ldd", str(library)], capture_output=True, text=True).stdout
        assert "libcudart.so" not in deps, deps
        assert "libnccl" not in deps, deps  # dlopened when a communicator is created
