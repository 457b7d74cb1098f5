"""Builds the GoogleTest unit tests of kernels/ (and the transport) and runs them via ctest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def _cmake() -> str:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is not installed; `python -m pip install cmake` provides it")
    return cmake


@pytest.mark.slow  # a CMake build of the C++ tests (`pytest -m slow`; CI runs it)
@pytest.mark.timeout(900)
def test_gtest_suites_pass(repo_root, tmp_path_factory):
    build = tmp_path_factory.mktemp("gtest-build")
    configure = subprocess.run(
        [
            _cmake(),
            "-S",
            str(repo_root),
            "-B",
            str(build),
            "-DJAXCOMM_BUILD_TESTS=ON",
            "-DJAXCOMM_BUILD_FFI=OFF",
            f"-DPython_EXECUTABLE={sys.executable}",
        ],
        capture_output=True,
        text=True,
    )
    if "Could NOT find GTest" in configure.stderr + configure.stdout:
        pytest.fail("GoogleTest is missing: install Debian's libgtest-dev (.ci/run does)")
    assert configure.returncode == 0, configure.stdout + configure.stderr
    jobs = str(os.cpu_count() or 2)
    build_run = subprocess.run(
        [_cmake(), "--build", str(build), "-j", jobs], capture_output=True, text=True
    )
    assert build_run.returncode == 0, build_run.stdout[-5000:] + build_run.stderr[-5000:]
    env = dict(os.environ)
    try:
        import libucx

        ucx_lib = os.path.join(os.path.dirname(libucx.__file__), "lib")
        env["LD_LIBRARY_PATH"] = ucx_lib + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    except ImportError:
        pass
    ctest = subprocess.run(
        ["ctest", "--test-dir", str(build), "--output-on-failure", "-j", jobs, "--timeout", "300"],
        capture_output=True,
        text=True,
        env=env,
    )
    print(ctest.stdout[-3000:])
    assert ctest.returncode == 0, ctest.stdout[-8000:] + ctest.stderr[-2000:]
    assert "100% tests passed" in ctest.stdout
