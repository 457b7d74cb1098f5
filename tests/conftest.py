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

    if pathlib.Path(jaxcomm.__file__).resolve().parent == REPO_ROOT / "jaxcomm" and not (
        REPO_ROOT / "jaxcomm" / "libjaxcomm_ffi.so"
    ).exists():
        raise pytest.UsageError(
            "pytest imported jaxcomm from the source tree, which has no compiled library. "
            "Install it (python -m pip install .) and run the `pytest` command, not "
            "`python -m pytest` (which puts the repository root on sys.path)."
        )
