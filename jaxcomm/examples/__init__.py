"""Runnable examples of jaxcomm (importable, e.g. as launcher jobs)."""
