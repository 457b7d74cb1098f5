"""jaxcomm_launcher: the ``jaxcomm`` CLI that launches recipes and collects their metrics.

Example:
    $ jaxcomm launch recipes/digits-dense.yaml
"""

import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("jaxcomm")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"

# Modules of the `launch` extra (pyproject.toml) -> the distribution that provides each.
LAUNCH_REQUIREMENTS = {
    "typer": "typer",
    "rich": "rich",
    "yaml": "pyyaml",
    "pydantic": "pydantic",
    "matplotlib": "matplotlib",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # e.g. a parent package that cannot be imported
        return False


def main() -> None:
    """The ``jaxcomm`` command; without the ``launch`` extra, one line saying how to get it.

    Returns:
        None (exits with the command's status; 2 when the extra is missing).

    Example:
        $ jaxcomm launch recipes/digits-dense.yaml
    """
    missing = [d for m, d in LAUNCH_REQUIREMENTS.items() if not _installed(m)]
    if missing:
        print(
            f"jaxcomm: the command needs the launch extra (missing: {', '.join(missing)}): "
            "python -m pip install 'jaxcomm[launch]' (from a checkout: "
            "python -m pip install '.[launch]')",
            file=sys.stderr,
        )
        sys.exit(2)
    from jaxcomm_launcher.cli import app

    app()


__all__ = ["LAUNCH_REQUIREMENTS", "__version__", "main"]
