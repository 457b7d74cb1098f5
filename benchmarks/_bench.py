"""What the benchmark scripts share: the launcher backend they run their recipe on.

The scripts run as ``python benchmarks/<name>.py``, so this folder is on ``sys.path``.
"""

from __future__ import annotations

import argparse


def recipe_backend(args: argparse.Namespace) -> dict | str:
    """The recipe ``backend`` for ``--backend local`` or ``--backend emulated``.

    The emulated cluster (docs/DESIGN.md §5, root needed) gets ``--bandwidth`` links with a
    128 KiB tbf burst (smaller bursts make the CPU the bottleneck), an IPC namespace per node and
    UCX over TCP, so that ranks on different "nodes" cannot use shared memory.

    Args:
      args: the script's arguments, with ``backend`` and (emulated) ``bandwidth``.

    Returns:
      ``"local"`` or the emulated backend's mapping.

    Example:
      >>> recipe_backend(argparse.Namespace(backend="local"))
      'local'
    """
    if args.backend != "emulated":
        return "local"
    return {
        "kind": "emulated",
        "bandwidth": args.bandwidth,
        "burst": "128kb",
        "ipc_isolation": True,
        "ucx_tls": "tcp",
    }
