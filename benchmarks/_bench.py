"""What the benchmark scripts share: the launcher backend they run their recipe on, and the
launcher's command line.

The scripts run as ``python benchmarks/<name>.py``, so this folder is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import sys


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


def jaxcomm_cli(*argv: str) -> list[str]:
    """The command line of ``jaxcomm ARGV...`` with this interpreter.

    ``python -m jaxcomm_launcher`` instead of the ``jaxcomm`` script: the script lives in the
    venv's ``bin``, which need not be on ``PATH`` when the venv's python runs a benchmark.

    Args:
      *argv: the CLI's arguments, e.g. ``"launch", "recipe.yaml"``.

    Returns:
      The argv list for ``subprocess.run``.

    Example:
      >>> jaxcomm_cli("launch", "r.yaml")[1:]
      ['-m', 'jaxcomm_launcher', 'launch', 'r.yaml']
    """
    return [sys.executable, "-m", "jaxcomm_launcher", *argv]
