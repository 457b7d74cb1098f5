"""The arm-step benchmark's job: what a learning ``auto``'s way of running an arm costs a step.

A learning ``auto`` (``jaxcomm.examples._loop.Reduction.learns``) runs every candidate
reduction ("arm") over one shared state (:mod:`jaxcomm.learning`). This job trains a digits
model three ways with the same compressor, in turns, on the same batches:

* ``alone``: the reduction's own step, as its end-to-end cells run it
  (``DigitsConfig(algorithm=arm)``); its first ``steps`` steps (way ``first``) run before the
  learning auto is built, as in a cell of its own: the auto's start (measuring the world,
  compiling every arm) is then not yet in the process;
* ``arm``: the arm's own program, as the examples' loop runs it
  (``learned_gradients(..., fixed=arm)`` over the shared state, compiled ahead by
  :class:`jaxcomm.examples._trials.ArmPrograms`);
* ``switched``: one program over every arm, the arm chosen by ``lax.switch`` on the state's
  ``arm`` (``learned_gradients`` without ``fixed``), set to the same arm.

Each round times ``steps`` steps of each way, dispatched as the loop dispatches them (in
flight, paced), after the steps of the way before have finished. Metrics lines:
``kind="time"`` (way, round, step_s) and ``kind="sent"`` (way, the algorithm labels of the
collectives its first round ran, from ``jaxcomm.metrics()``).

Recipe ``args`` (:class:`ArmStepArgs`): arm, rounds, steps and the digits model's settings.
``benchmarks/arm_step.py`` runs this job (``job: arm_step_job:run``) and draws the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs.args import JobArgs
from pydantic import Field

WAYS = ("first", "alone", "arm", "switched")


class ArmStepArgs(JobArgs):
    """The job's recipe ``args``: the compressor, how long each way runs, and the model."""

    arm: str = Field("topk_allgather", description="the compressor every way runs")
    rounds: int = Field(4, ge=1, description="rounds: each way's steps once per round")
    steps: int = Field(150, ge=10, description="timed steps of each way per round")
    hidden: int = Field(640, ge=1, description="MLP width")
    layers: int = Field(5, ge=1, description="MLP hidden layers")
    data: str = Field("teacher", description="digits or teacher")
    batch_size: int = Field(64, ge=1, description="global batch")
    learning_rate: float = Field(0.01, gt=0.0)
    momentum: float = Field(0.9, ge=0.0)


class _Way:
    """One way of running the arm: its step, the trainer that feeds it, and its state."""

    def __init__(self, trainer: Any, call: Callable[..., tuple], params: Any, state: Any):
        self.trainer, self.call = trainer, call
        self.params, self.state = params, state

    def run(self, first: int, steps: int) -> float:
        """Seconds a step over ``steps`` steps from batch ``first``, dispatched in flight."""
        batches = [self.trainer.batch(first + i) for i in range(steps)]
        jax.block_until_ready((self.params, self.state))
        start = time.perf_counter()
        for b in batches:
            self.params, self.state, loss, _ = self.call(self.params, self.state, *b)
        jax.block_until_ready((self.params, self.state, loss))
        return (time.perf_counter() - start) / steps


def _base(a: ArmStepArgs) -> dict[str, Any]:
    """The digits model's settings every way shares."""
    model = {k: getattr(a, k) for k in ("hidden", "layers", "data", "batch_size", "momentum")}
    return dict(model, learning_rate=a.learning_rate, proportion=64, warmup=False, seed=0)


def _alone(a: ArmStepArgs) -> _Way:
    """The reduction's own step, after one step (which compiles it)."""
    from jaxcomm.examples import digits

    trainer = digits.build(digits.DigitsConfig(algorithm=a.arm, **_base(a)))
    way = _Way(trainer, trainer.step, *trainer.init())
    way.run(0, 1)
    return way


def _learned(a: ArmStepArgs) -> dict[str, _Way]:
    """The arm's two ways in a learning auto, each after one step of its own (their programs
    compiled ahead by :class:`jaxcomm.examples._trials.ArmPrograms`, as the loop's are)."""
    from jaxcomm.examples import digits
    from jaxcomm.learning import set_arm

    base = _base(a)
    # The learning auto of the held-out cells (auto-bf16): dense on a 16-bit wire, no profile.
    auto = digits.build(digits.DigitsConfig(algorithm="auto", grad_dtype="bfloat16", **base))
    trials = auto.step.trials
    if trials is None or a.arm not in trials.names:
        raise ValueError(f"args.arm: {a.arm!r} is not an arm of a learning auto ({trials})")
    k = trials.names.index(a.arm)
    # One step of dense's program, as the loop's first: ArmPrograms records the arguments'
    # shapes and shardings, which every arm's program is then compiled ahead for.
    auto.step(*auto.init(), *auto.batch(0))
    auto.step.wait()  # tracing an arm measures the world (collectives): not beside a step
    trials.programs.compile([(k, True)])
    switched = trials.programs.build(None, True)  # no ``fixed``: the lax.switch over every arm
    switched.compile(*trials.programs.like)
    ways = {}
    for name, program in (("arm", trials.programs.ready[(k, True)]), ("switched", switched)):
        params, state = auto.init()
        if name == "switched":
            state = set_arm(state, k, NamedSharding(auto.mesh, P()))
        way = _Way(auto, program, params, state)
        way.run(0, 1)
        ways[name] = way
    return ways


def _sent(totals_before: list[dict], totals_after: list[dict]) -> list[str]:
    """The algorithm labels whose calls grew between two readings of the metrics' totals."""
    calls = {(t["name"], t["algorithm"]): t["calls"] for t in totals_before}
    grew = [t for t in totals_after if t["calls"] > calls.get((t["name"], t["algorithm"]), 0)]
    return sorted({t["algorithm"] for t in grew})


def run(ctx: JobContext) -> None:
    """Times each way ``rounds`` times, in turns.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; metrics lines (see the module docstring). Rank 0 prints each round.

    Example:
        >>> # python benchmarks/arm_step.py   (generates a recipe with job: arm_step_job:run)
    """
    import jaxcomm

    a = ArmStepArgs.model_validate(ctx.args)  # a module:function job: the model checks them
    alone = _alone(a)
    seconds = alone.run(1, a.steps)  # before the learning auto exists in the process
    ctx.metrics.log(1, force=True, kind="time", way="first", round=0, step_s=seconds)
    ways = {"alone": alone, **_learned(a)}
    first = 1 + a.steps
    for r in range(a.rounds):
        times = {}
        for name, way in ways.items():
            before = jaxcomm.metrics()["totals"]
            times[name] = way.run(first, a.steps)
            first += a.steps
            if r == 0:
                sent = _sent(before, jaxcomm.metrics()["totals"])
                ctx.metrics.log(first, force=True, kind="sent", way=name, algorithms=sent)
            ctx.metrics.log(first, force=True, kind="time", way=name, round=r, step_s=times[name])
        if ctx.is_main:
            ctx.print(f"round {r}: " + ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in times.items()))
