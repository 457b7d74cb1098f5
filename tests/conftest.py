"""Shared pytest setup: make sure the installed package (with its compiled library) is used."""

from __future__ import annotations

import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO_ROOT


def pytest_configure(config: pytest.Config) -> None:
    import jaxcomm

    if (
        pathlib.Path(jaxcomm.__file__).resolve().parent == REPO_ROOT / "jaxcomm"
        and not (REPO_ROOT / "jaxcomm" / "libjaxcomm_ffi.so").exists()
    ):
        raise pytest.UsageError(
            "pytest imported jaxcomm from the source tree, which has no compiled library. "
            "Install it (python -m pip install .) and run the `pytest` command, not "
            "`python -m pytest` (which puts the repository root on sys.path)."
        )


# (processes, devices per process) of every world the collective suites run in.
WORLD_CONFIGS = [(1, 2), (1, 3), (1, 4), (1, 5), (1, 8), (2, 1), (2, 2), (3, 1), (4, 1)]
_world_runs: dict = {}
# The rank processes' environment that sends every byte through UCX (no shared-memory path:
# ffi/transport/ucx_world.h), so that the ring algorithms run on one host too.
UCX_ONLY = {"JAXCOMM_SHARED_MEMORY": "0"}


@pytest.fixture(scope="session")
def world_run(tmp_path_factory):
    """Runs tests/collective_worker.py once per (processes, devices, mode, env) and caches the
    result. `env`: extra environment variables of the rank processes."""
    from collectives_harness import world_once

    def get(processes: int, devices: int, mode: str = "cases", env: dict | None = None):
        key = (processes, devices, mode, tuple(sorted((env or {}).items())))
        name = f"world-{processes}x{devices}-{mode}"
        return world_once(
            _world_runs, key, tmp_path_factory, name, processes, devices, mode=mode, env=env
        )

    return get
