"""CI compile check of the GPU path: configures and builds the CUDA targets without a GPU.

CI machines have nvcc and the NCCL headers but no GPU, so the GPU tests (tests/test_gpu.py) skip
there; this test at least keeps kernels/*.cu and ffi/cuda/*.cc compiling and linking. It builds
the way the README says, `CMAKE_ARGS="-DJAXCOMM_ENABLE_CUDA=ON" pip install .`, with no
architecture given (the default, sm_80 and sm_90 without a GPU), as a wheel into a temporary
directory (no build isolation: the test environment already has jax and scikit-build-core). A
second, configure-only test checks that CUDAARCHS is honoured. nvcc missing is a failure, not a
skip: the CI image is supposed to have it.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_HOME = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))


# The plain C functions a CUDA build exports: the registration table and the GPU world's entry
# points. The handlers are not exported; the build's table is read below instead.
EXPORTED = ["jaxcomm_registrations", "jaxcomm_gpu_world_ordinals", "jaxcomm_nccl_set_library"]


def read_table(library: pathlib.Path) -> dict[str, list[bool]]:
    """Loads a built library in a fresh interpreter and reads its registration table: target
    name -> [has a CUDA handler, may split on the GPU]. The table is built by the handlers'
    own registrars while the library loads, so a CUDA file that was not linked in shows here."""
    script = (
        "import ctypes, json, sys\n"
        "from jaxcomm import _ffi\n"
        "lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)\n"
        "table = _ffi.read_registrations(lib)\n"
        "print(json.dumps({t: [r.cuda is not None, r.gpu_split] for t, r in table.items()}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(library)], capture_output=True, text=True, cwd="/"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc") or str(CUDA_HOME / "bin" / "nvcc")
    if not os.access(nvcc, os.X_OK):
        pytest.fail(
            f"nvcc not found on PATH or in {CUDA_HOME}/bin: CI must compile the CUDA code "
            "(install the CUDA toolkit or set CUDA_HOME)"
        )
    return nvcc


def build_env(nvcc: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDAARCHS", "CMAKE_ARGS")}
    env["CUDACXX"] = nvcc
    env.update(extra)
    return env


def run_ok(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, (
        f"{' '.join(cmd)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    )
    return result


@pytest.mark.slow  # a CUDA build (`pytest -m slow`; CI runs it)
@pytest.mark.timeout(1800)  # nvcc for two architectures on 2 cores; the transport added CUDA files
def test_cuda_build_as_readme_says(tmp_path):
    """The README's CUDA build, no architecture given, builds every GPU handler."""
    env = build_env(find_nvcc(), CMAKE_ARGS="-DJAXCOMM_ENABLE_CUDA=ON")
    build = tmp_path / "build"
    run_ok(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            ".",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            f"--config-settings=build-dir={build}",
        ],
        env,
    )
    library = build / "libjaxcomm_ffi.so"
    assert library.exists()
    # The default architectures without a GPU: nvcc was asked for sm_80 and sm_90 code.
    flags = "".join(
        p.read_text() for pattern in ("build.ninja", "flags.make") for p in build.rglob(pattern)
    )
    assert "arch=compute_80" in flags and "arch=compute_90" in flags, flags[-3000:]
    if shutil.which("nm"):
        exported = subprocess.run(
            ["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True
        ).stdout
        missing = [s for s in EXPORTED if s not in exported]
        assert not missing, f"C functions not exported: {missing}"
    # Every target is in the CUDA build's table, each with a CUDA handler but the CPU-only
    # ones, and the splittable ones flagged as ffi/cuda/ defines them.
    from test_registrations import CPU_ONLY_TARGETS, EXPECTED_TARGETS, cuda_definitions

    table = read_table(library)
    assert set(table) == EXPECTED_TARGETS
    assert {t for t, (cuda, _) in table.items() if cuda} == EXPECTED_TARGETS - CPU_ONLY_TARGETS
    splittable = {
        t for t, kind in cuda_definitions(REPO_ROOT).items() if kind.endswith("SPLITTABLE")
    }
    assert {t for t, (_, split) in table.items() if split} == splittable
    if shutil.which("ldd"):
        # The CUDA runtime is linked statically: JAX brings its own libcudart.
        deps = subprocess.run(["ldd", str(library)], capture_output=True, text=True).stdout
        assert "libcudart.so" not in deps, deps
        assert "libnccl" not in deps, deps  # dlopened when a communicator is created


@pytest.mark.slow  # a CMake configure with nvcc
@pytest.mark.timeout(300)
def test_cudaarchs_is_honoured(tmp_path):
    """CUDAARCHS (CMake's own environment variable) overrides the default architectures."""
    env = build_env(find_nvcc(), CUDAARCHS="86")
    build = tmp_path / "build"
    run_ok(
        [
            "cmake",
            "-S",
            str(REPO_ROOT),
            "-B",
            str(build),
            "-DJAXCOMM_ENABLE_CUDA=ON",
            "-DJAXCOMM_BUILD_FFI=OFF",
            "-DJAXCOMM_ENABLE_UCX=OFF",
        ],
        env,
    )
    assert "CMAKE_CUDA_ARCHITECTURES:STRING=86" in (build / "CMakeCache.txt").read_text()
