"""Runnable examples of jaxcomm (importable, e.g. as launcher jobs).

They need the ``examples`` extra (Flax, and scikit-learn for the digits):
``python -m pip install 'jaxcomm[examples]'``.
"""

import importlib.util

# Distributions of the `examples` extra (pyproject.toml), by module name.
_EXTRA = {"flax": "flax", "sklearn": "scikit-learn"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # e.g. a parent package that cannot be imported
        return False


_missing = [d for m, d in _EXTRA.items() if not _installed(m)]
if _missing:
    raise ImportError(
        f"jaxcomm.examples needs the examples extra (missing: {', '.join(_missing)}): "
        "python -m pip install 'jaxcomm[examples]'"
    )
