"""The training loop's side of a learning ``auto`` (:attr:`Reduction.learn`): which arm each
step runs, each arm's own compiled program, and each trial window's losses and seconds for
:class:`jaxcomm.cost.learn.Learner`.

The first (compiling) step runs dense's program. After it, ``auto`` without a profile
measures the world, the cost model proposes the arms worth a trial
(:func:`jaxcomm.cost.learn.propose`), rules out dense's window where it predicts dense far
slower than a safe compressor (:func:`jaxcomm.cost.learn.skipped`), every proposed arm's
program compiles (outside the training clock, as the first step's compilation is; the ranks
then agree on its seconds, so that they open the clock together) and is timed on a copy of
the next step's arguments (outside the clock too), and the learner decides on those seconds
and the prior, then schedules the windows. A window's seconds are its training wall clock (its
evaluations excluded), the largest over the ranks, and its losses the steps' losses averaged
over the ranks: every rank switches at the same steps to the same arm.

Each arm runs a program of its own (``learned_gradients(..., fixed=arm)``, one state for
all) rather than one ``lax.switch`` over every arm: on XLA:CPU a switched step ran slower than
the same reduction alone, which made the trial windows mis-time the cheap arms; an arm's own
program runs at the reduction's own speed (``benchmarks/arm_step.py`` measures the three).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxcomm import cost
from jaxcomm.cost import learn, measure

TIMED_STEPS = 3  # timed steps of each arm's program at start, after an untimed one


class Trials:
    """Drives a :class:`~jaxcomm.cost.learn.Learner` from the loop.

    Args:
      reduction: the run's ``Reduction`` (a learning ``auto``).
      options: the candidates' settings.
      programs: the arms' programs (:class:`ArmPrograms`).
      agreed_max: ``seconds -> the largest over the ranks`` (a collective every rank calls).
      read: ``device scalar -> float``.
    """

    def __init__(
        self,
        reduction: Any,
        options: cost.Options,
        programs: ArmPrograms,
        agreed_max: Callable[[float], float],
        read: Callable[[Any], float],
    ) -> None:
        self.reduction = reduction
        self.arms = reduction.auto_arms(options)
        self.names = ["dense", *self.arms]  # the arms' numbers (``fixed`` of their programs)
        self.options = options
        self.programs = programs
        self.agreed_max, self.read = agreed_max, read
        self.learner: learn.Learner | None = None
        self.previous: int | None = None  # the arm of the last step (None: unknown)
        self.program: tuple[int, bool] = (0, True)  # the next step's (ArmPrograms' key)
        self.losses: list[Any] = []
        self.read_losses: list[float] = []  # the first of :attr:`losses`, read
        self.clock = 0.0
        self.paused = 0.0

    def _start(
        self,
        step: int,
        params: Any,
        wait: Callable[[], None],
        upcoming: Callable[[], tuple] | None = None,
    ) -> None:
        """After the compiling step: measures the world (no profile given), proposes the arms,
        compiles their programs and times each on ``upcoming()``, the next step's arguments
        (:meth:`_time`; None: untimed, the learner explores at once)."""
        wait()  # the measurement's collectives must not meet the first step's in flight
        leaves = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)]
        sizes = self.reduction.gradient_buckets(leaves)
        auto = next(iter(self.arms.values()), None)
        if auto is not None:  # (dense's program traced no auto, which would have measured)
            measure.prepare(auto, sizes)
        profile = auto.resolved_profile() if auto is not None else cost.DEFAULT_PROFILE
        processes, local = jax.process_count(), jax.local_device_count()
        inter = profile.inter_process if processes > 1 else "same_host"
        world = cost.World(processes, local, inter)
        wide = 2 if self.reduction.grad_dtype == "bfloat16" else 4
        options = dataclasses.replace(self.options, element_bytes=wide)
        arms = learn.propose(sizes, world, profile, ["dense", *self.arms], options)
        learning = self.reduction.learn_settings()
        skip = learn.skipped(arms, sizes, world, profile, options, learning.dense_over)
        first = learn.first_arm(arms, skip)
        # Dense's flushing program ran the first step; dense after dense needs no flush.
        keys = [] if "dense" in skip else [(0, False)]
        keys += [(self.names.index(a), True) for a in arms[1:] if a not in skip]
        seconds = self.programs.compile(keys)  # each arm traced records its buckets' choices
        # A barrier as well: a rank that compiled sooner would wait for the slower one inside
        # its next step's collective, on the training clock (0-3 s on 2 emulated nodes).
        seconds = self.agreed_max(seconds)
        learn.compiled(step, [self.names[k] for k, _ in keys], seconds)
        timed = {} if upcoming is None else self._time(step, arms, skip, upcoming)
        predicted = learn.warmup_seconds(arms, skip, sizes, world, profile, options)
        predicted.update(timed)
        guard = learn.fastest_safe(timed)
        if guard is not None:  # the warm-up runs the safe arm timed fastest
            first = arms.index(guard)
        led = learn.leading(arms, first, predicted, learning, skip) is not None
        fastest = min(predicted.values(), default=None)
        opens = learning.opens_at(predicted.get(arms[first]), fastest, led)
        self.learner = learn.Learner(arms, learning, step + opens, first, skip, predicted, timed)
        untried = [a for name, a in self.arms.items() if name not in arms]
        for arm in untried:  # their choices too, in the decisions (metrics)
            for n in sizes:
                cost.resolve_auto(arm, n, jax.device_count(), processes, local, element_bytes=wide)

    def _time(
        self, step: int, arms: list[str], skip: dict[str, float], upcoming: Callable[[], tuple]
    ) -> dict[str, float]:
        """Each arm not ``skip``-ped: its program's seconds a step (the largest over the
        ranks), run from a copy of the next step's arguments (the programs donate what they
        are given) and its results dropped, outside the training clock as the compilation
        is. The first step of each waits alone (its buffers' first allocation); the timed
        ones follow in flight, as the loop dispatches them: waited for one by one they read
        a dispatch's latency on top of every cheap arm's step. Every rank runs the same
        programs in the same order (they hold collectives)."""
        params, state, *batch = upcoming()
        copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
        began, timed = time.perf_counter(), {}
        for name in arms:
            if name in skip:
                continue
            program = self.programs.ready[(self.names.index(name), True)]
            out = jax.block_until_ready(program(*copy((params, state)), *batch))
            clock = time.perf_counter()
            for _ in range(TIMED_STEPS):  # dispatched as the loop does, steps in flight
                out = program(out[0], out[1], *batch)
            jax.block_until_ready(out)
            timed[name] = self.agreed_max((time.perf_counter() - clock) / TIMED_STEPS)
        learn.timed(step, timed, self.agreed_max(time.perf_counter() - began))
        return timed

    def before(self, step: int, wait: Callable[[], None]) -> None:
        """Sets :attr:`program` for ``step``: its arm, and whether dense flushes the
        residuals (not after a dense step: they are zero; a restored state's may not be);
        starts a window's clock at its first step."""
        arm = 0
        if self.learner is not None:
            arm = self.names.index(self.learner.arms[self.learner.arm_at(step)])
        self.program = (arm, not (arm == 0 and self.previous == 0))
        self.previous = arm
        if self.learner is not None and self.learner.window_start(step):
            wait()
            self.clock, self.paused = time.perf_counter(), 0.0
            self.losses, self.read_losses = [], []

    def after(
        self,
        step: int,
        params: Any,
        loss: Any,
        wait: Callable[[], None],
        upcoming: Callable[[], tuple] | None = None,
    ) -> None:
        """Records ``step``'s loss; closes its window when it is the last. After the first
        step, ``upcoming()`` gives the next step's ``(params, state, *batch)``, on which each
        arm is timed (:meth:`_time`)."""
        if self.learner is None:
            self._start(step + 1, params, wait, upcoming)
            return
        if not self.learner.in_window(step):
            return
        self.losses.append(loss)
        end = self.learner.window_end(step)
        if not end and self.learner.cut_due(step, len(self.losses)):
            wait()  # the window's losses so far, to end a compressor that sets training back
            end = self.learner.cut(step, self._read())
        if end:
            wait()
            seconds = self.agreed_max(time.perf_counter() - self.clock - self.paused)
            losses = self._read()
            self.losses, self.read_losses = [], []
            self.learner.close(step, losses, seconds)

    def _read(self) -> list[float]:
        """The open window's losses so far, as floats (each read from its device once)."""
        self.read_losses += [self.read(v) for v in self.losses[len(self.read_losses) :]]
        return list(self.read_losses)

    def pause(self, seconds: float) -> None:
        """Time spent outside training (an evaluation) inside the current window."""
        self.paused += seconds


class ArmPrograms:
    """Each arm's own program (``learned_gradients(..., fixed=arm, flush=...)``: one state for
    all, no switch), compiled for the shapes and shardings of the first step's arguments.
    A program's key is ``(arm, flush)``; ``flush`` is True but for dense after dense.

    Args:
      build: ``(arm, flush) -> DataParallelStep`` (not compiled yet).
    """

    def __init__(self, build: Callable[[int, bool], Any]) -> None:
        self.build = build
        # Dense's flushing program: the first step compiles it.
        self.ready: dict[tuple[int, bool], Any] = {(0, True): build(0, True)}
        self.like: tuple | None = None

    def __call__(self, key: tuple[int, bool], args: tuple) -> Any:
        """The program of ``key`` for a step of ``args`` (compiled now if it is not yet)."""
        if self.like is None:
            self.like = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args
            )
        if key not in self.ready:  # (every step asks: only a missing program compiles)
            self.compile([key])
        return self.ready[key]

    def compile(self, keys: list[tuple[int, bool]]) -> float:
        """Compiles the programs of ``keys`` not compiled yet (after the first step); returns
        the seconds it took."""
        start = time.perf_counter()
        for key in keys:
            if key not in self.ready:
                program = self.build(*key)
                program.compile(*self.like)
                self.ready[key] = program
        return time.perf_counter() - start
