"""Which NCCL library jaxcomm's GPU collectives load.

On GPUs, :func:`jaxcomm.allreduce` and :func:`jaxcomm.compressed_allreduce` move their data with
NCCL on XLA's stream (ffi/cuda/). jaxcomm does not link NCCL: it opens, at the first GPU
collective, the ``libnccl.so.2`` of the ``nvidia-nccl`` wheel that ``jax[cuda]`` installs (the
copy JAX itself uses), else whatever the loader finds under that name.
"""

from __future__ import annotations

import os
import pathlib

from jaxcomm import _ffi


def library_path() -> str:
    """Path of the NCCL library the GPU collectives will load.

    ``JAXCOMM_NCCL_LIBRARY`` overrides it; otherwise the ``libnccl.so.2`` of an installed
    ``nvidia-nccl-cu12`` / ``-cu13`` wheel, else ``""`` (the loader's search for ``libnccl.so.2``).

    Returns:
      A file path, or ``""``.

    Example:
      >>> jaxcomm.collectives.nccl.library_path().endswith("libnccl.so.2") or True
      True
    """
    override = os.environ.get("JAXCOMM_NCCL_LIBRARY", "")
    if override:
        return override
    try:
        import nvidia  # type: ignore[import-not-found]  # namespace of NVIDIA's wheels
    except ImportError:
        return ""
    # nvidia-nccl-cu12 installs nvidia/nccl/lib/, the CUDA 13 wheels nvidia/cu13/lib/.
    for root in getattr(nvidia, "__path__", []):
        for candidate in sorted(pathlib.Path(root).glob("*/lib/libnccl.so.2")):
            return str(candidate)
    return ""


def configure_library() -> None:
    """Tells the library which NCCL to load (before the first GPU collective; idempotent)."""
    lib = _ffi.library()
    if hasattr(lib, "jaxcomm_nccl_set_library"):
        lib.jaxcomm_nccl_set_library(library_path().encode())
