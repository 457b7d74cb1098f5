"""Every private JAX API jaxcomm uses, in one place (jax>=0.10,<0.13).

When JAX moves one of these, this module is the only one to change.
"""

from __future__ import annotations

from typing import Any


def current_trace() -> object:
    """The trace JAX is tracing into now (the body of one jit, shard_map, scan, ...)."""
    from jax._src import core

    return core.trace_ctx.trace


def distributed_client() -> Any:
    """The jax.distributed key-value store client, or None before jax.distributed.initialize."""
    from jax._src import distributed

    return distributed.global_state.client


def forget_runtime_tokens() -> None:
    """Drops JAX's per-device runtime tokens of side-effecting computations.

    After a step failed, every later step failed behind it, and JAX would wait for (and raise
    the whole chain of) those tokens again at interpreter exit. The failure was already
    reported once; nothing is left to wait for.
    """
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()


def cpu_backend_started() -> bool:
    """Whether JAX already created its CPU client (settings read at creation come too late)."""
    from jax._src import xla_bridge

    return "cpu" in xla_bridge._backends


def cpu_device_count_setting() -> int:
    """CPU devices per process JAX will create: jax_num_cpu_devices, else the XLA flag, else 1."""
    import os
    import re

    from jax._src import xla_bridge

    if xla_bridge.num_cpu_devices.value >= 0:
        return int(xla_bridge.num_cpu_devices.value)
    match = re.search(
        r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    return int(match.group(1)) if match else 1


def before_cpu_backend(hook: Any) -> bool:
    """Runs ``hook()`` right before JAX creates its CPU client, whenever that happens.

    Returns:
      False when the CPU client exists already (the hook is not installed).
    """
    from jax._src import xla_bridge

    if cpu_backend_started():
        return False
    registration = xla_bridge._backend_factories.get("cpu")
    if registration is None or getattr(registration.factory, "_jaxcomm_hook", False):
        return registration is not None
    original = registration.factory

    def factory(*args: Any, **kwargs: Any) -> Any:
        hook()
        return original(*args, **kwargs)

    factory._jaxcomm_hook = True  # type: ignore[attr-defined]
    xla_bridge.register_backend_factory(
        "cpu",
        factory,
        priority=registration.priority,
        fail_quietly=registration.fail_quietly,
        experimental=registration.experimental,
        c_api=registration.c_api,
    )
    return True


def dict_attribute(**values: Any) -> dict[str, Any]:
    """An FFI dictionary attribute (a struct on the C++ side) whose arrays JAX can hash.

    jax.ffi.ffi_call hashes its attributes; arrays at the top level are wrapped for that, arrays
    inside a dictionary are not, so they are wrapped here (lowered like top-level arrays).
    """
    import numpy as np
    from jax._src.hashable_array import HashableArray

    return {k: HashableArray(v) if isinstance(v, np.ndarray) else v for k, v in values.items()}


class _AfterImport:
    # A meta path finder that runs hooks once `module` has executed: it finds the module's
    # spec through the other finders and wraps its loader.
    def __init__(self, module: str, hook: Any) -> None:
        self.module, self.hook = module, hook

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.module:
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)  # once: the module is imported (or failed) after this
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRun(spec.loader, self.hook)
        return spec


class _ThenRun:
    # A loader that runs `hook()` after `loader` executed the module; everything else (resource
    # readers, get_code, ...) is the wrapped loader's.
    def __init__(self, loader: Any, hook: Any) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._hook()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def after_jax_import(hook: Any) -> None:
    """Runs ``hook()`` once ``jax`` is imported: now if it is, else right after its import.

    Lets ``import jaxcomm`` stay without JAX and still act before JAX creates a client (no
    client exists before ``import jax`` has finished).
    """
    import sys

    if "jax" in sys.modules:
        hook()
    elif not any(isinstance(f, _AfterImport) and f.hook is hook for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("jax", hook))
