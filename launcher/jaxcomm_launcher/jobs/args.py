"""The ``args`` each bundled job takes, declared once.

The recipe validator checks a recipe's ``args`` against its job's model before any rank starts
(an unknown or ill-typed key exits 2 naming ``args.<key>``), and the jobs read their values,
defaults included, through the same model. The training jobs (``digits``, ``lbann-mlp``,
``bytes-lm``) hand ``args`` to an example's ``train``, so their keys are the fields of that
example's config dataclass (the example checks the values). Those are read from the example
itself, which imports JAX: ``jaxcomm plan`` skips that check (:func:`check_args`, ``examples``)
to answer without JAX. A job given as ``module:function`` declares nothing here; its ``args``
reach it unchecked.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

Elements = Annotated[int, Field(ge=1)]
"""A positive element count."""

PROBE_SIZES = [1 << 12, 1 << 16, 1 << 20, 1 << 22]
"""The probe's ring/psum sizes, elements per rank."""
ALLREDUCE_SIZES = [1 << 20, 1 << 22, 25_000_000]
"""The allreduce job's sizes, float32 elements per device."""


class JobArgs(BaseModel):
    """Base of a job's ``args``: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class SmokeArgs(JobArgs):
    """``smoke``: a few checked allreduces, and failures on purpose for the launcher's tests."""

    size: Elements = Field(4096, description="float32 elements per device")
    fail_rank: int | None = Field(None, ge=0, description="the rank that fails on purpose")
    fail_at_step: int = Field(0, ge=0, description="the step at which it fails")
    fail_mode: Literal["raise", "exit", "kill"] = Field(
        "raise", description="raise, exit (os._exit(3)) or kill (SIGKILL itself)"
    )
    fail_once: bool = Field(False, description="fail only in a run's first attempt")
    sleep_s: float = Field(0.0, ge=0.0, description="seconds to sleep per step")


class ProbeArgs(JobArgs):
    """``probe``: what ``jaxcomm probe`` measures (jaxcomm/cost/probe.py)."""

    sizes: list[Elements] = Field(
        default_factory=lambda: list(PROBE_SIZES),
        min_length=1,
        description="ring/psum sizes, elements per rank",
    )
    kernel_elements: int = Field(1 << 22, ge=64, description="elements per kernel timing")
    repeats: int = Field(5, ge=1, description="timed calls per point (the median is kept)")
    out: str | None = Field(None, description="a path rank 0 also writes the profile to")


def _cost_options() -> dict[str, Any]:
    # Every algorithm setting of the cost model (density, tau, proportion, bits, ...), as the
    # algorithm registry declares it: the allreduce job passes them to cost.Options.from_args.
    from jaxcomm import cost

    return {
        s.name: (s.type | None, Field(None, description=f"algorithm setting ({s.type.__name__})"))
        for s in cost.SETTINGS
    }


class _AllreduceBase(JobArgs):
    sizes: list[Elements] = Field(
        default_factory=lambda: list(ALLREDUCE_SIZES),
        min_length=1,
        description="float32 elements per device",
    )
    repeats: int = Field(5, ge=1, description="timed calls per size")
    chain: int = Field(1, ge=1, description="allreduces per timed call")
    algorithms: list[str] | None = Field(
        None, description="names or variants (blockquant:bits=4); default: every planned one"
    )
    allowed: list[str] | None = Field(None, description="auto: the algorithms it may pick")
    profile: str | None = Field(None, description="auto: a profile from `jaxcomm probe`")


AllreduceArgs = create_model(
    "AllreduceArgs",
    __base__=_AllreduceBase,
    __doc__="``allreduce``: time and bytes of each algorithm per size (jobs/allreduce.py).",
    __module__=__name__,
    **_cost_options(),
)


EXAMPLE_CONFIGS = {
    "digits": ("digits", "DigitsConfig"),
    "lbann-mlp": ("digits", "DigitsConfig"),
    "bytes-lm": ("bytes_lm", "BytesLMConfig"),
}
"""The training jobs' ``args``: ``(module of jaxcomm.examples, its config dataclass)``."""

DECLARED: dict[str, type[JobArgs]] = {
    "smoke": SmokeArgs,
    "probe": ProbeArgs,
    "allreduce": AllreduceArgs,
}


def example_fields(module: str, name: str) -> list[str]:
    """The field names of the config dataclass ``jaxcomm.examples.<module>.<name>``.

    Imports the example (and so JAX and Flax): only a launch of a training job pays it, and a
    rank imports them anyway.

    Args:
        module: The module of ``jaxcomm.examples``, e.g. ``"digits"``.
        name: The dataclass, e.g. ``"DigitsConfig"``.

    Returns:
        The names, in ``dataclasses.fields`` order.

    Example:
        >>> "density" in example_fields("digits", "DigitsConfig")
        True
    """
    config = getattr(importlib.import_module(f"jaxcomm.examples.{module}"), name)
    return [f.name for f in dataclasses.fields(config)]


@functools.cache
def args_model(job: str) -> type[JobArgs] | None:
    """Returns the model of a bundled job's ``args`` (None for a ``module:function`` job).

    Args:
        job: The recipe's ``job``.

    Returns:
        The model class; a training job's takes its example config's fields (any value: the
        example checks the values).

    Example:
        >>> args_model("smoke")(size=8).size
        8
        >>> args_model("mymodule:train") is None
        True
    """
    if job in DECLARED:
        return DECLARED[job]
    if job not in EXAMPLE_CONFIGS:
        return None
    module, name = EXAMPLE_CONFIGS[job]
    fields: dict[str, Any] = {f: (Any, None) for f in example_fields(module, name)}
    return create_model(
        f"{name}Args",
        __base__=JobArgs,
        __doc__=f"``{job}``: fields of jaxcomm.examples.{module}.{name}.",
        __module__=__name__,
        **fields,
    )


def check_args(job: str, args: dict[str, Any], examples: bool = True) -> None:
    """Raises ValueError naming each bad ``args.<key>`` of a recipe whose job is `job`.

    Args:
        job: The recipe's ``job``.
        args: The recipe's ``args``.
        examples: Also check a training job's, whose keys come from its example (imports
            JAX; False: only the light models of :data:`DECLARED`).

    Raises:
        ValueError: One line per bad key, with the keys the job takes for an unknown one.

    Example:
        >>> try:
        ...     check_args("smoke", {"sise": 8})
        ... except ValueError as e:
        ...     print(str(e)[:45])
        args.sise: unknown key for job smoke; allowed
    """
    if job not in DECLARED and not examples:
        return
    model = args_model(job)
    if model is None:
        return
    try:
        model.model_validate(args)
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            key = "args." + ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                allowed = ", ".join(model.model_fields)
                lines.append(f"{key}: unknown key for job {job}; allowed: {allowed}")
            else:
                lines.append(f"{key}: {e['input']!r} is not allowed ({e['msg']})")
        raise ValueError("\n  ".join(lines)) from None


def job_args(job: str, args: dict[str, Any]) -> Any:
    """Returns a bundled job's ``args`` as its model (defaults filled in), for the job.

    Example:
        >>> job_args("probe", {"repeats": 3}).kernel_elements
        4194304
    """
    model = args_model(job)
    if model is None:
        raise ValueError(f"job {job!r} declares no args model")
    return model.model_validate(args)
