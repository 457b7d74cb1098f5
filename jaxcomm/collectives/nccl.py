"""Dense allreduce over NCCL on the GPU, on XLA's stream (platform "CUDA" only).

The communicator spans every GPU of the job (NCCL rank = position in the devices sorted by JAX
id); its unique id is created by process 0 and published through the ``jax.distributed``
key-value store, the same mechanism :mod:`jaxcomm._world` uses for UCX addresses. Use
:func:`nccl_allreduce` inside ``jax.shard_map`` over a mesh of all those GPUs, reducing over
every mesh axis (sub-group reductions need communicator splits, not implemented yet).

Example (one process, every local GPU)::

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    f = jax.shard_map(lambda v: nccl_allreduce(v), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxcomm import _ffi, _world

_ffi.register_gpu("jaxcomm_nccl_allreduce", "JaxcommNcclAllreduceCuda")

_UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_lock = threading.Lock()
_communicators: dict[tuple[int, ...], int] = {}
_generation = 0


class NcclError(RuntimeError):
    """NCCL could not be loaded or a communicator could not be created."""


def _nccl_library_path() -> bytes:
    """libnccl.so.2 of the nvidia-nccl wheel JAX uses, else b"" (the loader's soname)."""
    try:
        import nvidia.nccl  # type: ignore[import-not-found]
    except ImportError:
        return b""
    for root in getattr(nvidia.nccl, "__path__", []):
        import pathlib

        candidate = pathlib.Path(root) / "lib" / "libnccl.so.2"
        if candidate.exists():
            return str(candidate).encode()
    return b""


def _unique_id(lib: ctypes.CDLL, library: bytes) -> bytes:
    out = ctypes.create_string_buffer(_UNIQUE_ID_BYTES)
    error = ctypes.create_string_buffer(512)
    lib.jaxcomm_nccl_unique_id.restype = ctypes.c_int64
    got = lib.jaxcomm_nccl_unique_id(library, out, _UNIQUE_ID_BYTES, error, len(error))
    if got != _UNIQUE_ID_BYTES:
        raise NcclError(f"jaxcomm NCCL: {error.value.decode(errors='replace')}")
    return out.raw


def communicator(devices: Sequence[Any] | None = None) -> int:
    """Handle of the NCCL communicator over `devices` (default: all GPUs), created once.

    Collective over all processes when ``jax.process_count() > 1``: every process must call it
    (the first :func:`nccl_allreduce` trace does).
    """
    global _generation
    devices = sorted(devices if devices is not None else jax.devices("gpu"), key=lambda d: d.id)
    key = tuple(d.id for d in devices)
    with _lock:
        if key in _communicators:
            return _communicators[key]
        lib = _ffi.library()
        if not _ffi.has_gpu_kernels():
            raise NcclError("jaxcomm was built without CUDA (JAXCOMM_ENABLE_CUDA=ON)")
        library = _nccl_library_path()
        me = jax.process_index()
        local = [(r, d) for r, d in enumerate(devices) if d.process_index == me]
        if not local:
            raise NcclError(f"process {me} hosts none of the {len(devices)} devices")
        _generation += 1
        if jax.process_count() > 1:
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                raise NcclError("jax.process_count() > 1 needs jax.distributed.initialize()")
            name = f"jaxcomm/nccl/comm{_generation}/id"
            if me == devices[0].process_index:
                unique_id = _unique_id(lib, library)
                client.key_value_set_bytes(name, unique_id)
            else:
                timeout_ms = int(_world.default_timeout_s() * 1000)
                unique_id = client.blocking_key_value_get_bytes(name, timeout_ms)
        else:
            unique_id = _unique_id(lib, library)
        ranks = (ctypes.c_int * len(local))(*(r for r, _ in local))
        ordinals = (ctypes.c_int * len(local))(*(d.local_hardware_id for _, d in local))
        handle = ctypes.c_int64(0)
        error = ctypes.create_string_buffer(512)
        code = lib.jaxcomm_nccl_comm_create(
            library, unique_id, len(devices), ranks, ordinals, len(local),
            ctypes.byref(handle), error, len(error),
        )  # fmt: skip
        if code != 0:
            raise NcclError(f"jaxcomm NCCL: {error.value.decode(errors='replace')}")
        _communicators[key] = handle.value
        return handle.value


def nccl_allreduce(x: jax.Array, comm: int | None = None) -> jax.Array:
    """Sum of `x` over every rank of the NCCL communicator (float32, any shape).

    Call inside ``jax.shard_map`` over a mesh of all the communicator's GPUs; equals
    ``lax.psum(x, all_axes)``.
    """
    if x.dtype != np.float32:
        raise TypeError(f"nccl_allreduce needs float32, got {x.dtype}")
    handle = communicator() if comm is None else comm
    return jax.ffi.ffi_call(
        "jaxcomm_nccl_allreduce", _ffi.result_like(x, x.shape, x.dtype), has_side_effect=True
    )(x, comm=np.int64(handle))
