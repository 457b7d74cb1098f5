"""What the cost model knows of each algorithm: one :class:`AlgorithmCost` per registry name.

Each public module here is named as the algorithm of :mod:`jaxcomm.algorithms` it prices and
defines ``COST``: its byte ledger and time model (following the C++ schedule message by
message), its own local kernels (whose seconds per element are measured data,
jaxcomm/cost/default_profile.json) and its place among ``algorithm="auto"``'s candidates. The
hierarchical forms' costs are derived from their bases' (:mod:`._hierarchical`). Every
registered algorithm has exactly one cost, and every cost an algorithm.

Standard library only; it reads :mod:`jaxcomm.algorithms`, never the other way.

Example:
  >>> get("gtopk").kernels
  ('merge',)
  >>> auto_choices()[0]
  'dense'
"""

from __future__ import annotations

from ... import algorithms
from ...algorithms import Setting
from ...algorithms._base import collect_settings, module_records
from . import _hierarchical
from ._base import AlgorithmCost

SHARED_KERNELS: tuple[str, ...] = ("topk", "topk.entry", "sum")
"""Local kernels several algorithms use: the top-k selection with error feedback (per element,
and per selected entry beyond that pass) and one elementwise pass over float32 memory (a
reduction, a copy, a memset, a scatter)."""


def _discover() -> dict[str, AlgorithmCost]:
    found = {c.name: c for c in module_records(__name__, __path__, "COST")}
    for form in algorithms.registered():
        if form.hierarchy is not None and form.hierarchy[0] in found:
            found[form.name] = _hierarchical.variant(form, found[form.hierarchy[0]])
    known = {a.name for a in algorithms.registered()}
    if set(found) != known:
        raise ImportError(
            f"algorithms without a cost: {sorted(known - set(found))}; costs without an "
            f"algorithm: {sorted(set(found) - known)}; add one module per algorithm here"
        )
    return {a.name: found[a.name] for a in algorithms.registered()}


_COSTS: dict[str, AlgorithmCost] = _discover()
_SETTINGS: dict[str, Setting] = collect_settings(
    (a.name, a.settings + _COSTS[a.name].settings) for a in algorithms.registered()
)


def get(name: str) -> AlgorithmCost:
    """The cost record of algorithm ``name``.

    Raises:
      ValueError: an unknown name (the message lists the known ones).

    Example:
      >>> get("dense").auto_rank
      0
    """
    try:
        return _COSTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(_COSTS)}") from None


def auto_choices() -> tuple[str, ...]:
    """What ``algorithm="auto"`` may choose from, in its tie-breaking order.

    Example:
      >>> auto_choices()[0]
      'dense'
    """
    ranked = [c for c in _COSTS.values() if c.auto_rank is not None]
    return tuple(c.name for c in sorted(ranked, key=lambda c: c.auto_rank))


def default_allowed() -> tuple[str, ...]:
    """``auto``'s default candidates: every choice whose bytes do not hang on a tuned setting.

    Example:
      >>> "threshold" in default_allowed()
      False
    """
    return tuple(n for n in auto_choices() if _COSTS[n].auto_default)


def kernels() -> tuple[str, ...]:
    """Every local kernel a time model uses, by name (the shared ones first, each once).

    Example:
      >>> {"sum", "merge", "quantize.onebit"} <= set(kernels())
      True
    """
    names = list(SHARED_KERNELS)
    for c in _COSTS.values():
        names += [k for k in c.kernels if k not in names]
    return tuple(names)


def settings() -> tuple[Setting, ...]:
    """Every setting an algorithm or its cost model reads (the fields of ``cost.Options`` but
    ``element_bytes``), each once, in the order the listing first meets them: an algorithm's
    own (:func:`jaxcomm.algorithms.settings`), then its cost model's.

    Example:
      >>> [s.name for s in settings()][:4]
      ['density', 'proportion', 'column_size', 'selection_overlap']
    """
    return tuple(_SETTINGS.values())


__all__ = [
    "SHARED_KERNELS",
    "AlgorithmCost",
    "auto_choices",
    "default_allowed",
    "get",
    "kernels",
    "settings",
]
