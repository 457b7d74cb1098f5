"""When values exist on a device, on the same clock as the collectives' timestamps.

``jaxcomm.metrics()["recent"]`` gives each collective's ``started`` and ``finished`` times (when
the engine started and finished it). :func:`mark` records when a value inside a jitted step
exists, so compute and communication land on one timeline: this is how the tests show that a
bucket's allreduce starts before the backward pass has produced the first layer's gradient,
and how ``benchmarks/overlap.py`` draws its timeline. All times are seconds of
``time.monotonic()``'s clock.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxcomm import _ffi


def mark(x: jax.Array, label: str) -> jax.Array:
    """Returns ``x`` unchanged and records, per device, when it was computed.

    Use the result in place of ``x`` so the mark cannot be removed or scheduled late: the
    record is taken when the value exists and before anything that consumes the result runs.

    Args:
      x: any array (inside ``jit``/``shard_map`` or not); its buffer is passed through.
      label: name of the mark in :func:`marks`.

    Returns:
      ``x`` (aliased, no copy).

    Example:
      >>> g = jax.grad(loss)(params, x, y)
      >>> g["layer0"]["w"] = jaxcomm.timeline.mark(g["layer0"]["w"], "grad/layer0")
    """
    if not isinstance(label, str) or not label or '"' in label or "\\" in label:
        raise ValueError(f"label must be a non-empty string without quotes, got {label!r}")
    return jax.ffi.ffi_call(
        "jaxcomm_mark", jax.typeof(x), has_side_effect=True, input_output_aliases={0: 0}
    )(x, label=label)


def marks() -> list[dict[str, Any]]:
    """Returns every mark recorded in this process (the last 16384).

    Returns:
      ``[{"label", "device_id", "time"}, ...]`` in the order they were taken; ``time`` is in
      seconds of ``time.monotonic()``'s clock.

    Example:
      >>> times = [m["time"] for m in jaxcomm.timeline.marks() if m["label"] == "grad/layer0"]
    """
    return _ffi.read_json("jaxcomm_marks_json")


def reset_marks() -> None:
    """Forgets every recorded mark.

    Example:
      >>> jaxcomm.timeline.reset_marks()
    """
    _ffi.library().jaxcomm_marks_reset()
