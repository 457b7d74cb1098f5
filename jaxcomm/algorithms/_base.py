"""The record every algorithm module fills in, and the helpers their modules share.

Standard library only: the launcher and :mod:`jaxcomm.cost` read the registry without JAX.
An algorithm's JAX side (its FFI attributes) is a function of the record that imports NumPy
and jaxcomm's JAX helpers when it is called, never when the module loads. What the cost model
knows of an algorithm (its bytes, time and kernels) is a separate record,
:mod:`jaxcomm.cost.algorithm_costs`, so the import graph runs one way:
``jaxcomm.cost`` -> ``jaxcomm.algorithms``.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def module_records(package: str, path: Iterable[str], attribute: str) -> list[Any]:
    """``attribute`` of every public module of ``package`` (a name not starting with ``_``):
    the registry's way of finding its records, one module per algorithm name.

    Args:
      package: the package's name (``__name__``).
      path: its ``__path__``.
      attribute: the record each module defines (``"ALGORITHM"``, ``"COST"``).

    Returns:
      The records, in the modules' name order.

    Raises:
      ImportError: a record named otherwise than its module.
    """
    records = []
    for module in pkgutil.iter_modules(path):
        if module.name.startswith("_"):
            continue
        record = getattr(importlib.import_module(f"{package}.{module.name}"), attribute)
        if record.name != module.name:
            raise ImportError(f"{package}.{module.name} registers {record.name!r}: use one name")
        records.append(record)
    return records


def collect_settings(owners: Iterable[tuple[str, Iterable[Setting]]]) -> dict[str, Setting]:
    """Every setting of ``owners`` (``(name, settings)`` pairs), each once, by name, in the order
    first met.

    A setting read by several algorithms is one object, imported from the module that declares
    it; two different declarations of one name would give ``cost.Options`` two defaults.

    Raises:
      ImportError: two different declarations of one name.
    """
    found: dict[str, tuple[Setting, str]] = {}
    for owner, declared in owners:
        for setting in declared:
            first = found.setdefault(setting.name, (setting, owner))
            if first[0] is not setting:
                raise ImportError(
                    f"setting {setting.name!r} is declared by both {first[1]!r} and "
                    f"{owner!r}: declare it once and import it where it is read"
                )
    return {name: setting for name, (setting, _) in found.items()}


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers.

    Example:
      >>> ceil_div(5, 2)
      3
    """
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of the cost model's ``jaxcomm.cost.Options``, declared by the algorithm module
    that owns it.

    Each setting is declared once: the module whose algorithm it configures creates it, lists it
    in its record's ``settings``, and any other algorithm that reads it imports that object and
    lists it too (``density``: :mod:`jaxcomm.algorithms._sparse`, read by ``topk_allgather``
    and ``gtopk``). ``jaxcomm.cost.Options`` has one keyword-only field per setting of the
    registry (:func:`jaxcomm.algorithms.settings`), with its default, its check and its doc.

    Attributes:
      name: the ``Options`` field, as algorithms read it (``options.density``).
      type: its Python type (``float``, ``int``).
      default: its default value.
      check: ``value -> bool``, whether ``value`` is allowed.
      allowed: the allowed values in words, for the error message (``"in (0, 1]"``).
      doc: one line for ``Options``' docstring.

    Example:
      >>> rank = Setting("rank", int, 4, lambda v: v >= 1, ">= 1", "the approximation rank.")
      >>> rank.problem(0)
      'rank=0 is out of range: it must be >= 1, e.g. rank=4'
      >>> rank.problem(2) is None
      True
    """

    name: str
    type: type
    default: Any
    check: Callable[[Any], bool]
    allowed: str
    doc: str

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` for this setting, or None when it is allowed.

        Args:
          value: a candidate value.

        Returns:
          ``"<name>=<value> is out of range: it must be <allowed>, e.g. <name>=<default>"``
          (a value the check cannot even compare counts as out of range), or None.

        Example:
          >>> Setting("bits", int, 8, lambda v: v in (4, 8), "8 or 4", "bits.").problem(3)
          'bits=3 is out of range: it must be 8 or 4, e.g. bits=8'
        """
        try:
            ok = bool(self.check(value))
        except TypeError:  # a string where a number belongs: out of range too, said alike
            ok = False
        if ok:
            return None
        return (
            f"{self.name}={value!r} is out of range: it must be {self.allowed}, "
            f"e.g. {self.name}={self.default!r}"
        )


def fraction(name: str, default: float, doc: str, *, zero: bool = True) -> Setting:
    """A float :class:`Setting` in [0, 1], or in (0, 1] without ``zero`` (a density).

    Example:
      >>> fraction("overlap", 0.0, "how much the picks coincide.").problem(1.5)
      'overlap=1.5 is out of range: it must be in [0, 1], e.g. overlap=0.0'
      >>> fraction("density", 0.5, "the share sent.", zero=False).problem(0.0)
      'density=0.0 is out of range: it must be in (0, 1], e.g. density=0.5'
    """
    if zero:
        return Setting(name, float, default, lambda v: 0.0 <= v <= 1.0, "in [0, 1]", doc)
    return Setting(name, float, default, lambda v: 0.0 < v <= 1.0, "in (0, 1]", doc)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One allreduce algorithm: what jaxcomm needs to run it.

    Its cost model (bytes, time, kernels, ``auto``'s ranking) is a separate record,
    :class:`jaxcomm.cost.algorithm_costs.AlgorithmCost`, registered under the same name.

    Attributes:
      name: its one name, in recipes, ``jaxcomm.cost``, benchmarks and metrics labels.
      summary: one line for help texts.
      order: position in listings (tables, ``jaxcomm plan``, recipe choices), ascending.
      spec: the user-facing class (``jaxcomm.GTopK``, ...); None when there is none (the
        dense allreduce is ``jaxcomm.allreduce``, ``psum`` is XLA's).
      targets: role -> XLA FFI target name, as registered (``"flat"``: the collective;
        ``"hierarchical"``: its (node, local) form; ``"bfloat16"``/``"float16"``: the dense
        16-bit wire).
      cpu_only_targets: targets with no CUDA handler.
      metric_labels: the ``algorithm`` labels ``jaxcomm.metrics()`` reports for it.
      attributes: ``(spec, n) -> FFI attributes`` of the flat and hierarchical calls (JAX side,
        imports NumPy when called).
      hierarchical_planned: the hierarchical schemes (``"multi_leader"``, ``"leader"``)
        ``jaxcomm plan`` and the benchmarks list by default.
      residual: it keeps an error-feedback residual.
      stepped: its collective takes the training step as an operand (a counter-based
        stochastic rounding: ``jaxcomm.compressed_allreduce(..., step=)``).
      uses_density: it is configured by a density (the sparse ones; warm-up schedules apply).
      quantizer: a quantizer's name in the C++ quantizer table (kernels/quantizer_table.h),
        else None; its hierarchical forms keep their base's.
      planned: ``jaxcomm plan`` and the benchmarks list it by default.
      in_recipes: a recipe's ``jaxcomm.algorithm`` may name it.
      ops: the module of ``jaxcomm.ops`` with its single-device ``compress(x, residual, spec)``
        and ``decompress(packed, spec, shape)`` (``jaxcomm.ops.compress`` dispatches to it),
        or None.
      hierarchy: ``(base name, scheme)`` of a hierarchical form (``("dense", "leader")`` for
        ``hier_dense_leader``); None for a flat algorithm.
      leafwise: the module of :mod:`jaxcomm.collectives` that reduces a whole gradient tree,
        for an algorithm that works on the leaves' shapes rather than on flat buckets
        (PowerSGD's per-matrix factors). ``jaxcomm.optax.allreduce_gradients`` calls its
        ``init(leaves, spec, names)`` and ``reduce(...)`` (see
        :mod:`jaxcomm.collectives.powersgd`) instead of bucketing, and keeps its state in
        ``residuals`` (per rank) and ``shared`` (identical on every rank). None: a flat
        compressor (``targets["flat"]``).
      settings: the ``jaxcomm.cost.Options`` fields it and its cost model read, as
        :class:`Setting` declarations: its own, and those of other modules it reads, as their
        objects (a setting is declared once). A setting named as a field of ``spec`` sets that
        field (:meth:`build`); the others are what its cost model assumes of the data. ``element_bytes``, the
        gradient's width, is the cost model's own (``jaxcomm.cost.COMMON_SETTINGS``).
    """

    name: str
    summary: str
    order: int
    spec: type | None = None
    targets: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cpu_only_targets: frozenset[str] = frozenset()
    metric_labels: tuple[str, ...] = ()
    attributes: Callable[[Any, int], dict[str, Any]] | None = None
    hierarchical_planned: tuple[str, ...] = ()
    residual: bool = False
    stepped: bool = False
    uses_density: bool = False
    quantizer: str | None = None
    planned: bool = True
    in_recipes: bool = True
    ops: str | None = None
    hierarchy: tuple[str, str] | None = None
    leafwise: str | None = None
    settings: tuple[Setting, ...] = ()

    def build(self, options: Any) -> Any:
        """The spec configured from cost-model ``options`` (``jaxcomm.cost.Options``): each
        field of :attr:`spec` named by one of :attr:`settings` takes that setting's value, the
        others keep their defaults.

        Returns:
          The spec, or None where there is none (the dense allreduce, psum).

        Example:
          >>> from jaxcomm.algorithms import get
          >>> get("threshold").build(type("Options", (), {"tau": 0.5, "max_density": 0.1})())
          Threshold(tau=0.5, max_density=0.1)
        """
        if self.spec is None:
            return None
        fields = {f.name for f in dataclasses.fields(self.spec)}
        return self.spec(
            **{s.name: getattr(options, s.name) for s in self.settings if s.name in fields}
        )

    @property
    def quantizer_kind(self) -> int | None:
        """The kind number of a quantizer's ``quantizer`` FFI attribute, else None.

        Read from the library's quantizer table (:func:`jaxcomm._ffi.quantizer_kinds`), where
        the C++ entry sets it, so no Python module spells it; loads the library (and JAX).
        """
        if self.quantizer is None:
            return None
        from .._ffi import quantizer_kind  # the JAX side only

        return quantizer_kind(self.quantizer)

    @property
    def hierarchical(self) -> bool:
        """Whether it has a hierarchical (node, local) form: a ``"hierarchical"`` target."""
        return "hierarchical" in self.targets
