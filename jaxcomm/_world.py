"""Bootstrap of the UCX transport world that jaxcomm's collectives run on.

The world has one rank per global JAX CPU device: world rank = position of the device in the
list of all devices sorted by ``device.id``. This process hosts the ranks of its own devices
(``device.process_index == jax.process_index()``), each with its own UCX worker. With several
processes (``jax.distributed.initialize``), every process publishes its local ranks' worker
addresses through the coordinator's key-value store, reads everybody's, connects, and meets the
others at a barrier.

FFI collective handlers find the world through its integer :attr:`World.handle` (pass it as an
attribute of the ``ffi_call``) and the rank of a device through :meth:`World.rank_of_device`.

There is one world per platform: ``world("cpu")`` over the CPU devices, and ``world("gpu")``
over the GPUs, where UCX is only the control plane (group discovery, NCCL unique ids) and the
data moves over NCCL (ffi/cuda/gpu_collective.h). A GPU world also tells the library each local
rank's CUDA ordinal, because a GPU handler knows its device only by that ordinal.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxcomm import _ffi, _jax_compat

# Status codes of ffi/world_api.cc.
_ERRORS = {
    -1: "invalid argument",
    -2: "transport error",
    -3: "deadline exceeded",
    -4: "peer failed",
}

_lock = threading.Lock()
_worlds: dict[str, World] = {}
_generation = 0  # distinguishes key-value keys of successive worlds in one job


class WorldError(RuntimeError):
    """A failure of the UCX transport bootstrap or of a transport call."""


@dataclass(frozen=True)
class Counters:
    """Traffic of one local rank since the world was created (completed operations)."""

    bytes_sent: int
    bytes_received: int
    messages_sent: int
    messages_received: int


def _check(code: int, what: str) -> int:
    if code < 0:
        message = _ffi.library().jaxcomm_world_last_error().decode(errors="replace")
        raise WorldError(f"{what} failed ({_ERRORS.get(code, code)}): {message}")
    return code


def default_timeout_s() -> float:
    """The transport's default timeout in seconds (env ``JAXCOMM_TIMEOUT_S``, default 120)."""
    return float(_ffi.library().jaxcomm_world_default_timeout_s())


@dataclass
class World:
    """This process's part of the connected UCX world (see the module docstring)."""

    handle: int
    world_size: int
    local_ranks: tuple[int, ...]
    device_ids: tuple[int, ...]  # device id of each world rank
    _rank_of_device: dict[int, int] = field(repr=False, default_factory=dict)

    def rank_of_device(self, device: Any) -> int:
        """World rank of a JAX device (or of a device id)."""
        device_id = device if isinstance(device, int) else device.id
        return self._rank_of_device[device_id]

    @property
    def device_to_rank(self) -> dict[int, int]:
        """Mapping device id -> world rank (a copy)."""
        return dict(self._rank_of_device)

    def counters(self, rank: int) -> Counters:
        """Traffic counters of local rank `rank`."""
        out = (ctypes.c_uint64 * 4)()
        _check(
            _ffi.library().jaxcomm_world_counters(self.handle, rank, out), "jaxcomm_world_counters"
        )
        return Counters(*(int(v) for v in out))

    def sendrecv(
        self,
        rank: int,
        send_peer: int,
        send: bytes,
        recv_peer: int,
        recv_capacity: int,
        seq: int = 0,
        timeout_s: float = 0.0,
    ) -> bytes:
        """Test/diagnostic exchange on the control tag channel (never mixes with collectives).

        Local rank `rank` sends `send` to `send_peer` while receiving at most `recv_capacity`
        bytes from `recv_peer` (-1 skips either half). Blocks the calling thread; ranks of one
        process must call it from different threads. Returns the received bytes.
        """
        out = ctypes.create_string_buffer(max(recv_capacity, 1))
        received = ctypes.c_int64(0)
        _check(
            _ffi.library().jaxcomm_world_sendrecv(
                self.handle,
                rank,
                send_peer,
                send,
                len(send),
                recv_peer,
                out,
                recv_capacity,
                ctypes.byref(received),
                seq,
                timeout_s,
            ),
            "jaxcomm_world_sendrecv",
        )
        return out.raw[: received.value]


def _address(lib: ctypes.CDLL, handle: int, rank: int) -> bytes:
    length = _check(lib.jaxcomm_world_address(handle, rank, None, 0), "jaxcomm_world_address")
    buffer = ctypes.create_string_buffer(length)
    _check(lib.jaxcomm_world_address(handle, rank, buffer, length), "jaxcomm_world_address")
    return buffer.raw[:length]


def _exchange_addresses(local: dict[int, bytes], world_size: int, prefix: str) -> list[bytes]:
    """Publishes this process's addresses in the jax.distributed KV store; reads all."""
    client = _jax_compat.distributed_client()
    if client is None:
        raise WorldError(
            "jax.process_count() > 1 but jax.distributed has no client; call "
            "jax.distributed.initialize(...) before using jaxcomm collectives"
        )
    timeout_ms = int(default_timeout_s() * 1000)
    for rank, address in local.items():
        client.key_value_set_bytes(f"{prefix}/addr/{rank}", address)
    addresses = []
    for rank in range(world_size):
        if rank in local:
            addresses.append(local[rank])
            continue
        try:
            addresses.append(
                client.blocking_key_value_get_bytes(f"{prefix}/addr/{rank}", timeout_ms)
            )
        except Exception as e:  # the runtime raises its own XlaRuntimeError types
            raise WorldError(
                f"jaxcomm world bootstrap: no UCX address from world rank {rank} within "
                f"{timeout_ms / 1000:.0f} s (JAXCOMM_TIMEOUT_S): {e}"
            ) from e
    return addresses


def create_world(devices: Sequence[Any] | None = None) -> World:
    """Creates and connects a new world over `devices` (default: all JAX CPU devices).

    Collective over all processes when ``jax.process_count() > 1``. Prefer :func:`world`,
    which does this once per process.
    """
    global _generation
    lib = _ffi.library()
    devices = sorted(devices if devices is not None else jax.devices("cpu"), key=lambda d: d.id)
    me = jax.process_index()
    local_ranks = [r for r, d in enumerate(devices) if d.process_index == me]
    if not local_ranks:
        raise WorldError(f"process {me} hosts none of the {len(devices)} world devices")
    world_size = len(devices)
    ranks = (ctypes.c_int * len(local_ranks))(*local_ranks)
    handle = ctypes.c_int64(0)
    _check(
        lib.jaxcomm_world_create(world_size, ranks, len(local_ranks), ctypes.byref(handle)),
        "jaxcomm_world_create",
    )
    try:
        local = {r: _address(lib, handle.value, r) for r in local_ranks}
        multi = jax.process_count() > 1
        _generation += 1
        prefix = f"jaxcomm/ucx/world{_generation}"
        addresses = (
            _exchange_addresses(local, world_size, prefix)
            if multi
            else [local[r] for r in range(world_size)]
        )
        lengths = (ctypes.c_int64 * world_size)(*(len(a) for a in addresses))
        _check(
            lib.jaxcomm_world_connect(handle.value, b"".join(addresses), lengths, world_size),
            "jaxcomm_world_connect",
        )
        if multi:
            # Nobody sends before every process has its endpoints (UCX would still buffer
            # messages, but a process failing to connect should fail all of them here).
            _jax_compat.distributed_client().wait_at_barrier(
                f"{prefix}/connected", int(default_timeout_s() * 1000)
            )
    except BaseException:
        lib.jaxcomm_world_destroy(handle.value)
        raise
    return World(
        handle=handle.value,
        world_size=world_size,
        local_ranks=tuple(local_ranks),
        device_ids=tuple(d.id for d in devices),
        _rank_of_device={d.id: r for r, d in enumerate(devices)},
    )


def world(platform: str = "cpu") -> World:
    """The process's connected world for `platform`, created on first use (thread-safe).

    Args:
      platform: ``"cpu"`` (ranks = ``jax.devices("cpu")``) or ``"gpu"`` (ranks =
        ``jax.devices("gpu")``).

    Returns:
      The :class:`World`.

    Example:
      >>> jaxcomm._world.world().world_size == len(jax.devices("cpu"))
      True
    """
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"platform must be 'cpu' or 'gpu', got {platform!r}")
    with _lock:
        if platform not in _worlds:
            if not _worlds:
                atexit.register(_destroy_at_exit)
            if platform == "cpu":
                _worlds[platform] = create_world()
            else:
                _worlds[platform] = _create_gpu_world()
        return _worlds[platform]


def _create_gpu_world() -> World:
    lib = _ffi.library()
    if not _ffi.has_gpu_kernels():
        raise WorldError(
            "jaxcomm was built without CUDA; reinstall with "
            "CMAKE_ARGS=-DJAXCOMM_ENABLE_CUDA=ON to run collectives on GPUs"
        )
    from jaxcomm import config

    config.configure_nccl()
    devices = sorted(jax.devices("gpu"), key=lambda d: d.id)
    created = create_world(devices)
    me = jax.process_index()
    ordinals = [d.local_hardware_id if d.process_index == me else -1 for d in devices]
    array = (ctypes.c_int32 * len(ordinals))(*ordinals)
    _check(
        lib.jaxcomm_gpu_world_ordinals(created.handle, array, len(ordinals)),
        "jaxcomm_gpu_world_ordinals",
    )
    return created


def destroy_world() -> None:
    """Tears down the process's worlds (if any); a later :func:`world` creates new ones.

    Collective in spirit: call it in every process, after the last collective.
    """
    with _lock:
        while _worlds:
            _, w = _worlds.popitem()
            _check(_ffi.library().jaxcomm_world_destroy(w.handle), "jaxcomm_world_destroy")


def _destroy_at_exit() -> None:
    # Flushes and closes the endpoints while the interpreter (and the peers) are still up.
    try:
        destroy_world()
    except Exception:  # noqa: BLE001 - never fail interpreter shutdown
        pass
