"""Loads libjaxcomm_ffi.so once: its XLA FFI targets and its plain C functions, one table each.

:data:`TARGETS` lists every handler the library exports; ``import jaxcomm`` registers them all
(:func:`register_all`, idempotent). ``tests/test_cuda_build.py`` reads the same table.
:data:`C_FUNCTIONS` holds the ctypes prototype of every plain C function (metrics, marks, the
UCX world, the GPU world, NCCL); :func:`library` applies them when it loads the library, so no
other module declares a prototype.
"""

from __future__ import annotations

import ctypes
import pathlib
import threading
from collections.abc import Sequence
from typing import Any

import jax

_LIBRARY_NAME = "libjaxcomm_ffi.so"
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_registered: set[tuple[str, str]] = set()

# Every XLA FFI target of the library: target name -> (CPU handler symbol, has a CUDA handler).
# The CUDA handler is the CPU symbol + "Cuda", registered for platform "CUDA" when the library
# was built with CUDA (JAXCOMM_ENABLE_CUDA=ON).
TARGETS: dict[str, tuple[str, bool]] = {
    # single-device ops (jaxcomm/ops/)
    "jaxcomm_topk_abs": ("JaxcommTopKAbs", True),
    "jaxcomm_topk_compress": ("JaxcommTopKCompress", True),
    "jaxcomm_topk_decompress": ("JaxcommTopKDecompress", True),
    "jaxcomm_onebit_compress": ("JaxcommOneBitCompress", True),
    "jaxcomm_onebit_decompress": ("JaxcommOneBitDecompress", True),
    "jaxcomm_threshold_compress": ("JaxcommThresholdCompress", True),
    "jaxcomm_threshold_decompress": ("JaxcommThresholdDecompress", True),
    "jaxcomm_adaptive_compress": ("JaxcommAdaptiveCompress", True),
    "jaxcomm_adaptive_decompress": ("JaxcommAdaptiveDecompress", True),
    "jaxcomm_sparse_merge": ("JaxcommSparseMerge", True),
    # collectives (jaxcomm/collectives/)
    "jaxcomm_allreduce": ("JaxcommAllreduce", True),
    "jaxcomm_allreduce_bf16": ("JaxcommAllreduceBf16", False),  # 16-bit wire, CPU only
    "jaxcomm_allreduce_f16": ("JaxcommAllreduceF16", False),
    "jaxcomm_topk_allgather": ("JaxcommTopKAllgather", True),
    "jaxcomm_gtopk": ("JaxcommGTopK", True),
    "jaxcomm_quantized_allreduce": ("JaxcommQuantizedAllreduce", True),
    "jaxcomm_hierarchical_allreduce": ("JaxcommHierarchicalAllreduce", True),
    "jaxcomm_hierarchical_quantized": ("JaxcommHierarchicalQuantized", True),
    # the second half of a split collective (jaxcomm/collectives/_call.py)
    "jaxcomm_collective_done": ("JaxcommCollectiveDone", True),
    # timeline (jaxcomm/timeline.py)
    "jaxcomm_mark": ("JaxcommMark", False),
}

# Collectives whose CUDA handler may run split (start/done) on jaxcomm's own stream: those that
# take no XLA scratch memory (ffi/cuda/gpu_collective.h, JAXCOMM_DEFINE_GPU_COLLECTIVE_SPLITTABLE;
# the others refuse `split`). Every CPU collective may split.
GPU_SPLIT_TARGETS: frozenset[str] = frozenset({"jaxcomm_allreduce"})

_i32, _i64, _u32, _f64 = ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_double
_str, _ptr = ctypes.c_char_p, ctypes.c_void_p

# Every plain C function of the library: name -> (restype, argtypes), as declared in C++.
# Functions of a CUDA build only (``cuda``: ffi/cuda/gpu_collective.cc) are absent otherwise.
C_FUNCTIONS: dict[str, tuple[Any, list[Any]]] = {
    # ffi/group.cc, ffi/mark.cc: JSON readers (int64 fn(char* buffer, int64 capacity)) and resets
    "jaxcomm_metrics_json": (_i64, [_str, _i64]),
    "jaxcomm_metrics_reset": (None, []),
    "jaxcomm_marks_json": (_i64, [_str, _i64]),
    "jaxcomm_marks_reset": (None, []),
    # ffi/allreduce.h: the largest vector (bytes) of the small-vector dense schedules
    "jaxcomm_allreduce_small_bytes": (_i64, []),
    # ffi/world_api.cc: the UCX world
    "jaxcomm_world_last_error": (_str, []),
    "jaxcomm_world_default_timeout_s": (_f64, []),
    "jaxcomm_world_create": (_i32, [_i32, ctypes.POINTER(_i32), _i32, ctypes.POINTER(_i64)]),
    "jaxcomm_world_address": (_i64, [_i64, _i32, _str, _i64]),
    "jaxcomm_world_connect": (_i32, [_i64, _str, ctypes.POINTER(_i64), _i32]),
    "jaxcomm_world_destroy": (_i32, [_i64]),
    "jaxcomm_world_counters": (_i32, [_i64, _i32, ctypes.POINTER(ctypes.c_uint64)]),
    "jaxcomm_world_sendrecv": (
        _i32,
        [_i64, _i32, _i32, _ptr, _i64, _i32, _ptr, _i64, ctypes.POINTER(_i64), _u32, _f64],
    ),
    # ffi/cuda/gpu_collective.cc (CUDA builds)
    "jaxcomm_gpu_world_ordinals": (_i32, [_i64, ctypes.POINTER(ctypes.c_int32), _i32]),
    "jaxcomm_nccl_set_library": (None, [_str]),
}


def library() -> ctypes.CDLL:
    """Returns the loaded jaxcomm FFI library, loading it (and UCX) on first use.

    Its plain C functions carry the prototypes of :data:`C_FUNCTIONS`.
    """
    global _library
    with _lock:
        if _library is None:
            path = pathlib.Path(__file__).with_name(_LIBRARY_NAME)
            if not path.exists():
                raise ImportError(
                    f"jaxcomm's compiled library {path} is missing: install the package with "
                    "`python -m pip install .` from the repository root (it builds the C++ code)."
                )
            _preload_ucx()
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
            for name, (restype, argtypes) in C_FUNCTIONS.items():
                if hasattr(lib, name):  # the CUDA functions exist in CUDA builds only
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = restype, argtypes
            _library = lib
        return _library


def _preload_ucx() -> None:
    # The library links libucp/libucs from the libucx-cu12 wheel without an absolute rpath;
    # loading them first satisfies the dependency from the loader's cache.
    try:
        import libucx
    except ImportError:  # a system UCX (or a build without UCX) needs nothing here
        return
    libucx.load_library()


def register(target: str, symbol: str, platform: str = "cpu") -> None:
    """Registers handler `symbol` of the library as XLA FFI target `target` (once)."""
    key = (target, platform)
    if key in _registered:
        return
    lib = library()
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform=platform)
    _registered.add(key)


def register_gpu(target: str, symbol: str) -> None:
    """Registers GPU handler `symbol` as target `target` on platform "CUDA", when built.

    Libraries built without CUDA (``JAXCOMM_ENABLE_CUDA=OFF``) lack the symbol; then nothing is
    registered and the op runs on CPU only (XLA reports a missing custom call on a GPU).
    """
    if hasattr(library(), symbol):
        register(target, symbol, platform="CUDA")


def read_json(symbol: str) -> Any:
    """Calls one of the library's JSON readers (``int64 fn(char*, int64)``) and parses it."""
    import json

    fn = getattr(library(), symbol)
    size = fn(None, 0)
    buffer = ctypes.create_string_buffer(size + 1)
    fn(buffer, size + 1)
    return json.loads(buffer.value.decode())


def register_all() -> None:
    """Registers every target of :data:`TARGETS` (CPU, and CUDA where built), once."""
    for target, (symbol, has_gpu) in TARGETS.items():
        register(target, symbol)
        if has_gpu:
            register_gpu(target, symbol + "Cuda")


def has_gpu_kernels() -> bool:
    """Whether the loaded library was built with the CUDA kernels."""
    return hasattr(library(), "JaxcommTopKAbsCuda")


def result_like(x: Any, shape: Sequence[int], dtype: Any) -> Any:
    """Result type for an ffi_call output that keeps `x`'s sharding-related typing.

    Inside shard_map, plain ShapeDtypeStructs lose the varying-axes type of the operands;
    deriving the result from ``jax.typeof(x)`` keeps it.
    """
    aval = jax.typeof(x)
    try:
        return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False)
    except TypeError:
        return jax.ShapeDtypeStruct(tuple(shape), dtype)


def compress_call(target: str, x: Any, residual: Any, words: int, **attributes: Any) -> Any:
    """Calls a compress handler: (x, residual) -> (packed uint32[words], new_residual).

    The residual is aliased to new_residual, so a donated residual is updated in place.
    """
    import jax.numpy as jnp

    return jax.ffi.ffi_call(
        target,
        (result_like(x, (words,), jnp.uint32), result_like(x, x.shape, jnp.float32)),
        input_output_aliases={1: 1},
    )(x, residual, **attributes)


def decompress_call(target: str, packed: Any, shape: Any, **attributes: Any) -> Any:
    """Calls a decompress handler: packed uint32 words -> float32 array of `shape`."""
    import jax.numpy as jnp

    return jax.ffi.ffi_call(target, result_like(packed, tuple(shape), jnp.float32))(
        packed, **attributes
    )
