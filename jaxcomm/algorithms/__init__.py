"""The algorithm registry: one module per allreduce algorithm, and the lookups everything reads.

Each public module here (``dense``, ``gtopk``, ``topk_allgather``, ``onebit``, ``threshold``,
``adaptive``, ``blockquant``, ``powersgd``, ``psum``) defines ``ALGORITHM``, an
:class:`Algorithm` record of what running it takes: its spec (the user-facing class, e.g.
``jaxcomm.GTopK``), its XLA FFI target names, its FFI attribute builder, its name in recipes,
benchmarks and metrics, and the cost-model settings it reads (``Algorithm.settings``: each a
:class:`Setting` declared once, by the module that owns it; :func:`settings`). The
hierarchical forms (``hier_dense``, ``hier_adaptive_leader``, ...) are derived from the
algorithms that have one. A leaf-shaped algorithm (``powersgd``: factors of each 2-D gradient
leaf) names the module of :mod:`jaxcomm.collectives` that reduces a gradient tree
(``Algorithm.leafwise``), which ``jaxcomm.optax.allreduce_gradients`` runs instead of its
buckets.

What the cost model knows of each algorithm (its byte ledger, time model, local kernels and
place among ``algorithm="auto"``'s candidates) is a separate record under the same name,
:mod:`jaxcomm.cost.algorithm_costs`; nothing here needs :mod:`jaxcomm.cost` to run.

The rest of jaxcomm reads this registry: ``jaxcomm.compressed_allreduce`` (targets and
attributes), ``jaxcomm.cost``, the examples, the launcher's recipe schema and jobs, and the
benchmarks. Adding an algorithm is one module here (found by its name: any module not starting
with ``_``), its cost module in :mod:`jaxcomm.cost.algorithm_costs`, its kernels and its tests;
a new setting of it is a :class:`Setting` in its module here, which becomes a field of
``jaxcomm.cost.Options``.

This package imports only the standard library (the launcher loads it without JAX); an
algorithm's FFI attribute builder imports NumPy when it is called.

Example:
  >>> from jaxcomm import algorithms
  >>> algorithms.names()
  ('psum', 'dense', 'topk_allgather', 'gtopk', 'adaptive', 'blockquant', 'onebit', 'threshold',
   'powersgd')
  >>> algorithms.get("gtopk").targets["flat"]
  'jaxcomm_gtopk'
"""

from __future__ import annotations

from typing import Any

from . import _hierarchical
from ._base import Algorithm, Setting, collect_settings, module_records

AUTO = "auto"
"""The name that asks the cost model to choose per bucket (``jaxcomm.cost.Auto``)."""


def _discover() -> dict[str, Algorithm]:
    flat = module_records(__name__, __path__, "ALGORITHM")
    records = sorted(flat + _hierarchical.variants(flat), key=lambda a: a.order)
    by_name = {a.name: a for a in records}
    if len(by_name) != len(records) or AUTO in by_name:
        raise ImportError(f"duplicate or reserved algorithm names in {[a.name for a in records]}")
    return by_name


_REGISTRY: dict[str, Algorithm] = _discover()
_SETTINGS: dict[str, Setting] = collect_settings((a.name, a.settings) for a in _REGISTRY.values())
_BY_SPEC: dict[type, Algorithm] = {
    a.spec: a for a in _REGISTRY.values() if a.spec is not None and a.in_recipes
}


def registered() -> tuple[Algorithm, ...]:
    """Every algorithm, flat ones first, each group in its ``order``.

    Example:
      >>> registered()[0].name
      'psum'
    """
    return tuple(_REGISTRY.values())


def get(name: str) -> Algorithm:
    """The algorithm called ``name``.

    Args:
      name: a registered name (``"gtopk"``, ``"hier_dense_leader"``, ...).

    Returns:
      Its :class:`Algorithm` record.

    Raises:
      ValueError: an unknown name (the message lists the known ones).

    Example:
      >>> get("onebit").targets["flat"]
      'jaxcomm_quantized_allreduce'
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(_REGISTRY)}") from None


def names() -> tuple[str, ...]:
    """The algorithm names a recipe's ``jaxcomm.algorithm`` (and a benchmark) may use.

    ``"auto"`` (:data:`AUTO`) is accepted besides these; hierarchical forms are chosen with
    ``hierarchical: true``, not by name.

    Returns:
      The names, in listing order.

    Example:
      >>> names()[:3]
      ('psum', 'dense', 'topk_allgather')
    """
    return tuple(a.name for a in _REGISTRY.values() if a.in_recipes)


def planned() -> tuple[str, ...]:
    """The names ``jaxcomm plan``, the cost model and the allreduce benchmark list by default.

    Example:
      >>> planned()[-3:]
      ('hier_dense_leader', 'hier_adaptive', 'hier_blockquant')
    """
    return tuple(a.name for a in _REGISTRY.values() if a.planned)


def of(spec: Any) -> Algorithm:
    """The algorithm a spec object (``jaxcomm.GTopK(0.01)``, ``jaxcomm.OneBit()``, ...) runs.

    Args:
      spec: an instance of a registered spec class.

    Returns:
      Its (flat) :class:`Algorithm` record.

    Raises:
      TypeError: not a registered algorithm's spec (the message lists them).

    Example:
      >>> from jaxcomm.algorithms.gtopk import GTopK
      >>> of(GTopK(0.01)).name
      'gtopk'
    """
    try:
        return _BY_SPEC[type(spec)]
    except (KeyError, TypeError):
        known = ", ".join(f"jaxcomm.{cls.__name__}" for cls in _BY_SPEC)
        raise TypeError(f"algorithm must be one of {known}; got {spec!r}") from None


def build(name: str, options: Any) -> Any:
    """The spec of algorithm ``name`` configured from cost-model options.

    Args:
      name: a registered name.
      options: a ``jaxcomm.cost.Options`` (density, proportion, column_size, tau, ...).

    Returns:
      The spec (``jaxcomm.GTopK(options.density)``, ...), or None for ``dense`` (the dense
      allreduce) and ``psum``.

    Example:
      >>> from jaxcomm import cost
      >>> build("gtopk", cost.Options(density=0.01))
      GTopK(density=0.01)
    """
    return get(name).build(options)


def quantizers() -> tuple[Algorithm, ...]:
    """The quantizers of the quantized allreduce (``onebit``, ``threshold``, ``adaptive``,
    ``blockquant``), in listing order: the records whose ``quantizer`` names an entry of the
    C++ quantizer table (kernels/quantizer_table.h).

    Example:
      >>> sorted(q.name for q in quantizers())
      ['adaptive', 'blockquant', 'onebit', 'threshold']
    """
    flat = (a for a in _REGISTRY.values() if a.in_recipes)
    return tuple(a for a in flat if a.quantizer is not None)


def settings() -> tuple[Setting, ...]:
    """Every algorithm's settings, each once, in the order the listing first meets them: the
    fields of ``jaxcomm.cost.Options`` that configure a spec or that several cost models read
    (the cost model's data assumptions and ``element_bytes`` are :mod:`jaxcomm.cost`'s).

    Returns:
      The :class:`Setting` declarations.

    Example:
      >>> [s.name for s in settings()][:3]
      ['density', 'proportion', 'column_size']
      >>> {s.name for s in get("gtopk").settings} == {"density"}
      True
    """
    return tuple(_SETTINGS.values())


def spec_classes() -> tuple[type, ...]:
    """The user-facing spec classes, in listing order.

    Example:
      >>> [c.__name__ for c in spec_classes()][:2]
      ['TopKAllgather', 'GTopK']
    """
    return tuple(_BY_SPEC)


__all__ = [
    "AUTO",
    "Algorithm",
    "Setting",
    "build",
    "get",
    "names",
    "of",
    "planned",
    "quantizers",
    "registered",
    "settings",
    "spec_classes",
]
