"""jaxcomm's standard-library-only modules (``cost``, ``config``) without the rest of jaxcomm.

``import jaxcomm`` imports JAX and loads the C++ library (about 1.5 s here); the launcher's
own process needs neither: ``jaxcomm plan`` answers from the cost model in well under 2 s, and
the launcher reads its environment settings from ``jaxcomm.config``'s one table.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

STANDALONE = ("cost", "config", "checkpoints")
"""The jaxcomm modules that import only the standard library."""


def standalone(name: str) -> types.ModuleType:
    """Returns ``jaxcomm.<name>`` without importing the rest of jaxcomm.

    When jaxcomm is already imported, its module is returned.

    Args:
        name: one of :data:`STANDALONE`.

    Returns:
        The module (or a standalone copy of it).

    Raises:
        ModuleNotFoundError: jaxcomm is not installed.

    Example:
        >>> standalone("cost").ALGORITHMS[0]
        'psum'
    """
    if name not in STANDALONE:
        raise ValueError(f"jaxcomm.{name} is not standalone; known: {STANDALONE}")
    if f"jaxcomm.{name}" in sys.modules:
        return sys.modules[f"jaxcomm.{name}"]
    key = f"jaxcomm_launcher._jaxcomm_{name}"
    if key in sys.modules:
        return sys.modules[key]
    package = importlib.util.find_spec("jaxcomm")  # locates the package without importing it
    if package is None or package.origin is None:
        raise ModuleNotFoundError("jaxcomm is not installed: python -m pip install .")
    spec = importlib.util.spec_from_file_location(
        key, pathlib.Path(package.origin).parent / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module
