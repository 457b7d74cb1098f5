"""Loads libjaxcomm_ffi.so once: its XLA FFI targets and its plain C functions, one table each.

The library exports its own registration table (ffi/registrations.h: target name -> CPU
handler and, in a CUDA build, CUDA handler, each row added where its handler is defined);
:func:`registrations` reads it and importing this module registers every row
(:func:`register_all`, idempotent), so no Python code names a C++ symbol. :data:`C_FUNCTIONS` holds the ctypes
prototype of every plain C function (the table, metrics, marks, the UCX world, the GPU world,
NCCL); :func:`library` applies them when it loads the library, so no other module declares a
prototype. ``tests/test_ffi_prototypes.py`` reads every exported definition in ffi/ and checks
each row against its C types, and that every exported function has a row.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from jaxcomm import config

_LIBRARY_NAME = "libjaxcomm_ffi.so"
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_registered: set[tuple[str, str]] = set()


class _Registration(ctypes.Structure):
    # struct JaxcommRegistration of ffi/registrations.cc, field for field.
    _fields_ = [
        ("target", ctypes.c_char_p),
        ("cpu", ctypes.c_void_p),
        ("cuda", ctypes.c_void_p),
        ("flags", ctypes.c_int32),
    ]


# Row flags, as ffi/registrations.h defines them.
_GPU_SPLIT = 1  # kGpuSplit
_DUPLICATE = 2  # kDuplicate


class Registration(NamedTuple):
    """One row of the library's registration table (ffi/registrations.h).

    Attributes:
        target: the XLA FFI target name that ``jax.ffi.ffi_call`` uses, e.g. "jaxcomm_gtopk".
        cpu: address of the CPU handler.
        cuda: address of the CUDA handler, or None (CPU-only target, or a build without CUDA).
        gpu_split: whether the CUDA handler may run split (start/done) on jaxcomm's own stream
            (it takes no XLA scratch memory); every CPU collective may split.
    """

    target: str
    cpu: int
    cuda: int | None
    gpu_split: bool


_i32, _i64, _u32, _f64 = ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_double
_str, _ptr = ctypes.c_char_p, ctypes.c_void_p
_rows = ctypes.POINTER(ctypes.POINTER(_Registration))

# Every plain C function of the library: name -> (restype, argtypes), as declared in C++.
# Functions of a CUDA build only (``cuda``: ffi/cuda/gpu_collective.cc) are absent otherwise.
C_FUNCTIONS: dict[str, tuple[Any, list[Any]]] = {
    # ffi/registrations.cc: the registration table (int64 fn(const JaxcommRegistration** rows))
    "jaxcomm_registrations": (_i64, [_rows]),
    # ffi/metrics.cc, ffi/mark.cc: JSON readers (int64 fn(char* buffer, int64 capacity)) and resets
    "jaxcomm_metrics_json": (_i64, [_str, _i64]),
    "jaxcomm_metrics_reset": (None, []),
    "jaxcomm_marks_json": (_i64, [_str, _i64]),
    "jaxcomm_marks_reset": (None, []),
    # ffi/handle_wait.cc: the open detached handles, one per line (int64 fn(char*, int64))
    "jaxcomm_open_handles": (_i64, [_str, _i64]),
    "jaxcomm_process_epoch": (_i32, []),
    # ffi/quantized_allreduce.cc: the quantizer table as JSON {name: kind} (int64 fn(char*, int64))
    "jaxcomm_quantizers_json": (_i64, [_str, _i64]),
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
            # The C++ library reads some JAXCOMM_* settings: a bad value fails here, before it
            # is loaded, naming the variable (jaxcomm/config.py SETTINGS).
            config.check_environment()
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


def read_registrations(lib: ctypes.CDLL) -> dict[str, Registration]:
    """Reads the registration table of a loaded jaxcomm library, in the table's order.

    Args:
        lib: the library, as :func:`library` returns it (or another build of it, loaded with
            ctypes: tests/test_cuda_build.py reads a CUDA build's table this way).

    Returns:
        target name -> :class:`Registration`.

    Raises:
        ImportError: the library defines two handlers for one target and platform.
    """
    fn = lib.jaxcomm_registrations
    fn.restype, fn.argtypes = C_FUNCTIONS["jaxcomm_registrations"]
    rows = ctypes.POINTER(_Registration)()
    count = fn(ctypes.byref(rows))
    table = {}
    for i in range(count):
        row = rows[i]
        target = row.target.decode()
        if row.flags & _DUPLICATE:
            raise ImportError(
                f"jaxcomm's library defines two handlers for target {target!r} on one platform "
                "(JAXCOMM_DEFINE_* with the same target in two places): rename one"
            )
        table[target] = Registration(target, row.cpu, row.cuda, bool(row.flags & _GPU_SPLIT))
    return table


@functools.cache
def registrations() -> dict[str, Registration]:
    """The registration table of jaxcomm's library: target name -> :class:`Registration`.

    Returns:
        Every XLA FFI target of the library, e.g. ``registrations()["jaxcomm_gtopk"].cuda`` is
        None in a build without CUDA.
    """
    return read_registrations(library())


def __getattr__(name: str) -> Any:
    # GPU_SPLIT_TARGETS is read from the library's table on first use (PEP 562), so that
    # importing this module does not load the library.
    if name == "GPU_SPLIT_TARGETS":
        # Collectives whose CUDA handler may run split (start/done) on jaxcomm's own stream
        # (ffi/cuda/gpu_collective.h, JAXCOMM_DEFINE_GPU_COLLECTIVE_SPLITTABLE; the others refuse
        # `split`). Every CPU collective may split.
        return _gpu_split_targets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _gpu_split_targets() -> frozenset[str]:
    return frozenset(t for t, row in registrations().items() if row.gpu_split)


def _register(target: str, handler: int, platform: str) -> None:
    key = (target, platform)
    if key in _registered:
        return
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform=platform)
    _registered.add(key)


def read_text(symbol: str) -> str:
    """Calls one of the library's text readers (``int64 fn(char*, int64)``, returning the
    text's full length) and returns the text."""
    fn = getattr(library(), symbol)
    size = fn(None, 0)
    while True:
        # The text may grow between the calls (collectives still finishing on the engine's
        # thread): a return of at least the capacity means it was cut, so read it again.
        buffer = ctypes.create_string_buffer(size + 1)
        size = fn(buffer, size + 1)
        if size < len(buffer):
            return buffer.value.decode()


def read_json(symbol: str) -> Any:
    """Calls one of the library's JSON readers (:func:`read_text`) and parses it."""
    import json

    return json.loads(read_text(symbol))


@functools.cache
def quantizer_kinds() -> dict[str, int]:
    """The library's quantizer table (kernels/quantizer_table.h): name -> kind number.

    The number is what the ``quantizer`` FFI attribute carries; each quantizer's C++ entry sets
    it, so no Python module spells it.

    Example:
        >>> quantizer_kinds()["onebit"]
        0
    """
    return read_json("jaxcomm_quantizers_json")


def quantizer_kind(name: str) -> int:
    """The kind number of quantizer ``name`` (:func:`quantizer_kinds`).

    Raises:
        ValueError: the loaded library has no such quantizer (a registry module without its
            C++ entry, or a library built before the entry was added: rebuild it).
    """
    kinds = quantizer_kinds()
    try:
        return kinds[name]
    except KeyError:
        raise ValueError(
            f"jaxcomm's library has no quantizer {name!r} (its table: {', '.join(kinds)}); "
            "add its entry to kernels/quantizer_table.cc, or rebuild the library"
        ) from None


def register_all() -> None:
    """Registers every row of :func:`registrations`: CPU, and CUDA where built; once.

    A library built without CUDA (``JAXCOMM_ENABLE_CUDA=OFF``) has no CUDA handlers; its ops
    then run on CPU only (XLA reports a missing custom call on a GPU).
    """
    for target, row in registrations().items():
        _register(target, row.cpu, "cpu")
        if row.cuda is not None:
            _register(target, row.cuda, "CUDA")


def has_gpu_kernels() -> bool:
    """Whether the loaded library was built with the CUDA kernels."""
    return any(row.cuda is not None for row in registrations().values())


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


# Every module that calls a jaxcomm target imports this one (ops, collectives, timeline,
# metrics, the world), so importing it registers the whole table once, before any call is
# lowered; ``import jaxcomm`` alone loads neither the library nor JAX.
register_all()
