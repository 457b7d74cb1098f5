"""XLA:CPU's launch pool, sized before JAX creates its CPU client (jaxcomm/pacing.py says why).

Imports no JAX: ``import jaxcomm`` runs :func:`size_cpu_launch_pool` from a hook inside JAX's
own import, where importing a module that itself imports JAX would be circular.
"""

from __future__ import annotations

import os

from jaxcomm import _jax_compat

__all__ = ["cpu_launch_threads", "size_cpu_launch_pool"]


# Threads the CPU launch pool needs: every device's running execution, every device's launch
# waiting for an in-flight slot, and the host's transfers.
def cpu_launch_threads(devices: int) -> int:
    """Threads XLA:CPU's launch pool needs so that ``devices`` devices cannot starve it.

    Args:
      devices: CPU devices of this process.

    Returns:
      ``max(cores, 2 * devices + 2)``.

    Example:
      >>> cpu_launch_threads(4) >= 10
      True
    """
    return max(os.cpu_count() or 1, 2 * int(devices) + 2)


def _set_launch_pool_size() -> None:
    devices = _jax_compat.cpu_device_count_setting()
    if devices > 1 and "PJRT_NPROC" not in os.environ:
        os.environ["PJRT_NPROC"] = str(cpu_launch_threads(devices))


def size_cpu_launch_pool() -> bool:
    """Sizes XLA:CPU's launch pool for the process's CPU devices when JAX creates its client.

    Sets ``PJRT_NPROC`` to :func:`cpu_launch_threads` right before the CPU client is created,
    unless the process has a single CPU device or ``PJRT_NPROC`` is already set. Importing
    jaxcomm calls this as soon as JAX is imported (at once when JAX came first).

    Returns:
      False when JAX's CPU client already existed (nothing can be changed; use :func:`paced`).

    Example:
      >>> import jaxcomm  # calls size_cpu_launch_pool()
    """
    return _jax_compat.before_cpu_backend(_set_launch_pool_size)
