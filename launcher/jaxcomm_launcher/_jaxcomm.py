"""jaxcomm's standard-library-only modules (``cost``, ``config``, ``algorithms``) without the rest.

The launcher's own process needs neither JAX nor the C++ library: ``jaxcomm plan`` answers from
the cost model in well under 2 s, the recipe schema lists the algorithm registry's names, and
the launcher reads its environment settings from ``jaxcomm.config``'s one table.

Without importing the ``jaxcomm`` package (whose ``__init__`` checks the environment and hooks
the launch-pool sizing into JAX's import; it loads JAX's API lazily), the light modules are
loaded under a stand-in parent package, :data:`LIGHT_PACKAGE`, that points at jaxcomm's
directory: they reach each other by relative imports (``from .. import algorithms``), which
resolve inside the stand-in (``tests/test_cost.py`` checks that they import nothing else).
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import types

STANDALONE = ("cost", "config", "algorithms", "checkpoints")
"""The jaxcomm modules that import only the standard library (and each other)."""

LIGHT_PACKAGE = "jaxcomm_launcher._jaxcomm_light"
"""The stand-in parent package of the light copies."""


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
    if "jaxcomm" in sys.modules:
        return importlib.import_module(f"jaxcomm.{name}")
    if LIGHT_PACKAGE not in sys.modules:
        package = importlib.util.find_spec("jaxcomm")  # locates the package without importing it
        if package is None or not package.submodule_search_locations:
            raise ModuleNotFoundError("jaxcomm is not installed: python -m pip install .")
        stand_in = types.ModuleType(LIGHT_PACKAGE, "jaxcomm's light modules (see _jaxcomm.py)")
        stand_in.__path__ = [str(pathlib.Path(p)) for p in package.submodule_search_locations]
        sys.modules[LIGHT_PACKAGE] = stand_in
    return importlib.import_module(f"{LIGHT_PACKAGE}.{name}")
