"""jaxcomm_launcher: the ``jaxcomm`` CLI that launches recipes and collects their metrics.

Example:
    $ jaxcomm launch recipes/digits-dense.yaml
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("jaxcomm")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
