"""Helpers shared by the bundled jobs: the mesh, explicit placement, the recipe's settings as
the keyword arguments of the examples' ``train`` functions, and running one of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:
    from jaxcomm_launcher.context import JobContext

AXIS = "dp"

# Recipe fields the training examples (jaxcomm.examples.*) take as keyword arguments.
TRAIN_FIELDS = (
    "steps",
    "batch_size",
    "learning_rate",
    "momentum",
    "hidden",
    "eval_every",
    "seed",
    "target",
    "time_cap_s",
    "checkpoint_every",
)
JAXCOMM_FIELDS = (
    "algorithm",
    "density",
    "grad_dtype",
    "allowed",
    "profile",
    "compute_seconds",
    "steps_factor",
    "dense_steps",
    "steps_factor_no_warmup",
    "diloco",
)


def example_settings(
    ctx: JobContext,
    train_fields: Sequence[str] = TRAIN_FIELDS,
    jaxcomm_fields: Sequence[str] = JAXCOMM_FIELDS,
) -> dict[str, Any]:
    """The recipe entry of this rank as keyword arguments of an example's ``train``.

    The launcher adapts to the library: ``jaxcomm.examples.digits.train(**settings)`` knows
    nothing of recipes or :class:`JobContext`.

    Args:
        ctx: The job context.
        train_fields: ``recipe.train`` fields passed on (those that are set).
        jaxcomm_fields: ``jaxcomm`` settings passed on (those that are set).

    Returns:
        ``{field: value}``: the ``train`` fields, then the ``jaxcomm`` settings, then
        ``args`` (which win).

    Example:
        >>> train(logger=ctx.metrics, run_dir=ctx.run_dir, **example_settings(ctx))  # doctest: +SKIP
    """
    out: dict[str, Any] = {}
    for name in train_fields:
        if getattr(ctx.train, name, None) is not None:
            out[name] = getattr(ctx.train, name)
    for name in jaxcomm_fields:
        value = getattr(ctx.jaxcomm, name)
        if name == "diloco":  # the examples' flat diloco_* fields
            if value is not None:
                out.update({f"diloco_{k}": v for k, v in value.model_dump().items()})
            continue
        if name in ("algorithm", "density") or value:
            out[name] = tuple(value) if isinstance(value, list) else value
    out.update(ctx.args or {})
    return out


def train_example(
    ctx: JobContext,
    train: Callable[..., dict[str, Any]],
    settings: dict[str, Any],
    name: str,
    quality: Callable[[dict[str, Any]], str],
) -> dict[str, Any]:
    """Runs an example's ``train`` with this rank's metrics and run directory; rank 0 prints
    ``<name> <label>: <quality> after S steps, T s/step, B MB sent per rank and step``.

    Args:
        ctx: The job context.
        train: The example's ``train`` (e.g. ``jaxcomm.examples.bytes_lm.train``).
        settings: Its keyword arguments (:func:`example_settings`).
        name: The job's name, first on the printed line.
        quality: The result's model quality in words, e.g. ``"test accuracy 0.9812"``.

    Returns:
        ``train``'s result.

    Example:
        >>> train_example(ctx, train, example_settings(ctx), "digits",
        ...               lambda r: f"test accuracy {r['test_accuracy']:.4f}")  # doctest: +SKIP
    """
    result = train(logger=ctx.metrics, run_dir=str(ctx.run_dir), **settings)
    if ctx.is_main:
        ctx.print(
            f"{name} {result['label']}: {quality(result)} after {result['steps']} steps, "
            f"{result['step_seconds']:.3f} s/step, "
            f"{result['bytes_sent_per_step'] / 1e6:.2f} MB sent per rank and step"
        )
    return result


def print_auto(ctx: JobContext, result: dict[str, Any], name: str) -> None:
    """Logs, on every rank (so that a run shows they agree), what ``algorithm: auto`` measured
    and decided: each bucket's choice with the link numbers it read, the warm-up decision,
    the world's measurement and the learner's decisions (``result["auto"]``,
    ``jaxcomm.metrics()["auto"]``).

    Args:
        ctx: The job context.
        result: The example's result (nothing is logged without ``auto_choices``).
        name: The job's name, first on each line.

    Example:
        >>> print_auto(ctx, result, "digits")  # doctest: +SKIP
    """
    for d in result.get("auto_choices", []):
        if "warmup_decision" in d:  # jaxcomm.cost.warmup_pays: the schedule's warm-up or not
            w = d["warmup_decision"]
            ctx.print(
                f"{name} auto: {'keeps' if w['warmup'] else 'drops'} the warm-up "
                f"(predicted {w['with_s']:.1f} s with it, {w['without_s']:.1f} s without)"
            )
            continue
        link = d.get("link", {})
        ctx.print(
            f"{name} auto: bucket of {d['elements']} elements -> {d['choice']} "
            f"(allowed {', '.join(d['allowed'])}; profile: {d['profile']}; "
            f"link {link.get('class')} alpha {link.get('alpha', 0.0):.6g} s "
            f"beta {link.get('beta', 0.0):.6g} s/B)"
        )
    report = result.get("auto") or {}
    measured = report.get("measured")
    if measured:
        ctx.print(f"{name} auto: measured the world in {sum(measured['seconds']):.1f} s: "
                  f"{measured['summary']}")  # fmt: skip
    for d in report.get("learned", []):
        if d["event"] == "arms":
            prior = d.get("prior_steps")
            prior = f", a compressor's prior {prior:.3g}x dense's steps" if prior else ""
            ctx.print(f"{name} auto: trials of {', '.join(d['arms'])} from step {d['step']}{prior}")
        elif d["event"] == "timed":
            steps = ", ".join(f"{a} {t * 1e3:.3g} ms" for a, t in d["seconds_per_step"].items())
            ctx.print(f"{name} auto: timed each arm's step in {d['seconds']:.1f} s before step "
                      f"{d['step']}: {steps}")  # fmt: skip
        elif d["event"] == "compiled":
            ctx.print(f"{name} auto: compiled the programs of {', '.join(d['arms'])} in "
                      f"{d['seconds']:.1f} s before step {d['step']}")  # fmt: skip
        elif d["event"] == "skipped":
            why = ", ".join(
                f"{a} (predicted {t * 1e3:.0f} ms)" for a, t in d["predicted_s"].items()
            )
            ctx.print(f"{name} auto: no trial of {why}: far slower per step than a safe compressor")
        elif d["event"] == "window" and d.get("cut"):
            ctx.print(f"{name} auto: step {d['last_step']} ends the trial of {d['arm']} after "
                      f"{d['last_step'] - d['first_step'] + 1} steps (its loss rose above the "
                      "level before it)")  # fmt: skip
        elif d["event"] in ("unbracketed", "outpaced"):
            what = "closes the round" if d["event"] == "unbracketed" else "runs no more trials"
            ctx.print(f"{name} auto: step {d['step']} {what} without {d['arm']} "
                      f"({d['seconds_per_step'] * 1e3:.3g} ms a step against "
                      f"{d['cheapest'] * 1e3:.3g} ms: it could not win)")  # fmt: skip
        elif d["event"] == "pruned":
            ctx.print(f"{name} auto: step {d['step']} stops trying {', '.join(d['arms'])} "
                      "(too slow per step to win)")  # fmt: skip
        elif d["event"] == "decision":
            costs = d.get("seconds_per_dense_step") or {}
            rates = ", ".join(f"{a} {c * 1e3:.3g} ms" for a, c in costs.items())
            why = f"expected s per dense step: {rates}" if rates else "no compressor proposed"
            if d.get("prior"):
                why = f"on the prior, {why}; trials from step {d['explores_at']}"
            ctx.print(f"{name} auto: step {d['step']} -> {d['choice']} ({why})")


def data_parallel_mesh() -> Mesh:
    """Returns a 1-D mesh named ``dp`` over every device of every process.

    Returns:
        The mesh (process-major device order).

    Example:
        >>> data_parallel_mesh().axis_names
        ('dp',)
    """
    return Mesh(np.asarray(jax.devices()), (AXIS,))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places identical host values on every device of `mesh` as global arrays.

    Replicating explicitly matters: a shard_mapped step fed a tree that still sits on one
    device hangs in XLA's all-reduce rendezvous (docs/DESIGN.md §2).

    Args:
        tree: A pytree of NumPy/JAX arrays, equal on every process.
        mesh: The mesh.

    Returns:
        The same tree of global arrays with ``NamedSharding(mesh, P())``.

    Example:
        >>> params = replicate({"w": np.zeros((2, 2), np.float32)}, data_parallel_mesh())
        >>> params["w"].sharding.spec == P()
        True
    """
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree
    )


def shard_batch(local: np.ndarray, mesh: Mesh) -> jax.Array:
    """Builds a global array sharded over ``dp`` from this process's slice of the batch.

    Args:
        local: This process's rows (its share of the global batch).
        mesh: The mesh.

    Returns:
        A global array with ``NamedSharding(mesh, P("dp"))``.

    Example:
        >>> x = shard_batch(np.ones((8, 4), np.float32), data_parallel_mesh())
        >>> x.sharding.spec == P("dp"), x.shape  # one process: the global batch is its rows
        (True, (8, 4))
    """
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P(AXIS)), local)


def host_scalar(x: jax.Array) -> float:
    """Reads a replicated (or this process's first) value of a global array as a float."""
    return float(np.asarray(x.addressable_data(0)).reshape(-1)[0])


def ring_allreduce_bytes(payload_bytes: int, devices: int) -> int:
    """Bytes each device sends (and receives) in a ring allreduce of `payload_bytes`.

    Used as the byte count of dense steps, where XLA does not report its traffic.

    Args:
        payload_bytes: Size of the reduced buffer on one device.
        devices: Devices taking part.

    Returns:
        ``2 * (devices - 1) / devices * payload_bytes``, rounded.

    Example:
        >>> ring_allreduce_bytes(1000, 2)
        1000
    """
    if devices <= 1:
        return 0
    return round(2 * (devices - 1) / devices * payload_bytes)
