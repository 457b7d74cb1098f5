"""Runnable examples of jaxcomm (importable, e.g. as launcher jobs).

They need the ``examples`` extra (Flax, and scikit-learn for the digits):
``python -m pip install 'jaxcomm[examples]'``.
"""

import importlib.util

# Distributions of the `examples` extra (pyproject.toml), by module name.
_EXTRA = {"flax": "flax", "sklearn": "scikit-learn"}
_missing = [d for m, d in _EXTRA.items() if importlib.util.find_spec(m) is None]
if _missing:
    raise ImportError(
        f"jaxcomm.examples needs the examples extra (missing: {', '.join(_missing)}): "
        "python -m pip install 'jaxcomm[examples]'"
    )
