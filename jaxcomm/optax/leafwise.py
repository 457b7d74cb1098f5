"""``allreduce_gradients`` for a leaf-shaped algorithm (PowerSGD): the algorithm's module of
:mod:`jaxcomm.collectives` sees the whole tree, leaf by leaf, instead of flat buckets.

The module named by the algorithm's registry record (``leafwise``) provides ``init(leaves,
spec, names) -> (residuals, shared)`` and ``reduce(leaves, residuals, shared, count,
axis_name, spec, names=, mean=, hierarchical=) -> (outs, residuals, shared)``.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomm import algorithms, cost
from jaxcomm.optax.plan import AxisName
from jaxcomm.optax.state import AllreduceGradientsState


def module_of(algorithm: Any) -> Any:
    """The module of jaxcomm.collectives that runs a leaf-shaped algorithm (PowerSGD), else None.

    Everything else (None, "auto", a flat compressor, or a wrong type, which the bucket path
    rejects with its own message) goes through the buckets.
    """
    if algorithm is None or isinstance(algorithm, (str, cost.Auto)):
        return None
    try:
        record = algorithms.of(algorithm)
    except TypeError:
        return None
    if record.leafwise is None:
        return None
    return importlib.import_module(f"jaxcomm.collectives.{record.leafwise}")


def transformation(
    module: Any,
    spec: Any,
    axis_name: AxisName,
    mean: bool,
    hierarchical: bool,
    dense_dtype: Any = None,
) -> optax.GradientTransformation:
    """The ``optax.GradientTransformation`` of a leaf-shaped algorithm.

    ``dense_dtype``: the tree is cast to it first, so the leaves sent dense travel in it (the
    factors are float32 either way); the state keeps its type.
    """
    init = functools.partial(_init, module, spec)
    update = functools.partial(_update, module, spec, axis_name, mean, hierarchical, dense_dtype)
    return optax.GradientTransformation(init, update)


def _flatten(tree: Any) -> tuple[list, list[str], Any]:
    """(leaves, each leaf's path as a name, treedef)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [jax.tree_util.keystr(path) for path, _ in pairs]
    return [leaf for _, leaf in pairs], names, treedef


def _init(module: Any, spec: Any, params: Any) -> AllreduceGradientsState:
    leaves, names, treedef = _flatten(params)
    residuals, shared = module.init(leaves, spec, names)
    return AllreduceGradientsState(
        count=jnp.zeros((), jnp.int32),
        residuals=treedef.unflatten(residuals),
        shared=treedef.unflatten(shared),
    )


def _update(
    module: Any,
    spec: Any,
    axis_name: AxisName,
    mean: bool,
    hierarchical: bool,
    dense_dtype: Any,
    updates: Any,
    state: AllreduceGradientsState,
    params: Any = None,
) -> tuple[Any, AllreduceGradientsState]:
    del params
    if dense_dtype is not None:
        updates = jax.tree.map(lambda g: g.astype(dense_dtype), updates)
    leaves, names, treedef = _flatten(updates)
    outs, residuals, shared = module.reduce(
        leaves,
        treedef.flatten_up_to(state.residuals),
        treedef.flatten_up_to(state.shared),
        state.count,
        axis_name,
        spec,
        names=names,
        mean=mean,
        hierarchical=hierarchical,
    )
    count = optax.safe_int32_increment(state.count)
    new_state = AllreduceGradientsState(
        count, treedef.unflatten(residuals), treedef.unflatten(shared)
    )
    return treedef.unflatten(outs), new_state
