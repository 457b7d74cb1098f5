"""The training loop's side of a learning ``auto`` (:attr:`Reduction.learn`): which arm each
step runs, and each trial window's losses and seconds for :class:`jaxcomm.cost.learn.Learner`.

The first (compiling) step runs dense and measures the world (``auto`` without a profile);
then the cost model proposes the arms worth a trial (:func:`jaxcomm.cost.learn.propose`),
rules out dense's window where it predicts dense far slower than a safe compressor
(:func:`jaxcomm.cost.learn.skipped`), and the learner schedules the windows. A window's seconds are its training wall clock (its
evaluations excluded), the largest over the ranks, and its losses the steps' losses averaged
over the ranks: every rank switches at the same steps to the same arm.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxcomm import cost, learning
from jaxcomm.cost import learn


class Trials:
    """Drives a :class:`~jaxcomm.cost.learn.Learner` from the loop.

    Args:
      reduction: the run's ``Reduction`` (a learning ``auto``).
      options: the candidates' settings.
      mesh: the ``dp`` mesh.
      agreed_max: ``seconds -> the largest over the ranks`` (a collective every rank calls).
      read: ``device scalar -> float``.
    """

    def __init__(
        self,
        reduction: Any,
        options: cost.Options,
        mesh: Any,
        agreed_max: Callable[[float], float],
        read: Callable[[Any], float],
    ) -> None:
        self.reduction = reduction
        self.arms = reduction.auto_arms(options)
        self.names = ["dense", *self.arms]  # the order of the compiled branches
        self.options = options
        self.sharding = NamedSharding(mesh, P())
        self.agreed_max, self.read = agreed_max, read
        self.learner: learn.Learner | None = None
        self.current: int | None = None  # unknown until set (a restored state keeps its own)
        # The decided arm outside the trials' windows (the step may run it compiled alone),
        # and the step it was set for.
        self.settled: int | None = None
        self.step = 0
        self.losses: list[Any] = []
        self.clock = 0.0
        self.paused = 0.0

    def _start(self, step: int, params: Any) -> None:
        """After the compiling step: the proposed arms from the (now measured) profile."""
        leaves = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)]
        sizes = self.reduction.gradient_buckets(leaves)
        auto = next(iter(self.arms.values()), None)
        profile = auto.resolved_profile() if auto is not None else cost.DEFAULT_PROFILE
        processes, local = jax.process_count(), jax.local_device_count()
        inter = profile.inter_process if processes > 1 else "same_host"
        world = cost.World(processes, local, inter)
        wide = 2 if self.reduction.grad_dtype == "bfloat16" else 4
        options = dataclasses.replace(self.options, element_bytes=wide)
        arms = learn.propose(sizes, world, profile, ["dense", *self.arms], options)
        learning = learn.Learning()
        skip = learn.skipped(arms, sizes, world, profile, options, learning.dense_over)
        first = learn.first_arm(arms)
        self.learner = learn.Learner(arms, learning, step + learning.warmup, first, skip)

    def before(self, step: int, state: Any, wait: Callable[[], None]) -> Any:
        """The state with ``step``'s arm; starts a window's clock at its first step."""
        if self.learner is None:
            return state
        name = self.learner.arms[self.learner.arm_at(step)]
        arm = self.names.index(name)
        if arm != self.current:
            state = learning.set_arm(state, arm, self.sharding)
            self.current = arm
        decided = self.learner.chosen is not None and not self.learner.in_window(step)
        self.settled, self.step = (arm if decided else None), step
        if self.learner.window_start(step):
            wait()
            self.clock, self.paused, self.losses = time.perf_counter(), 0.0, []
        return state

    def after(self, step: int, params: Any, loss: Any, wait: Callable[[], None]) -> None:
        """Records ``step``'s loss; closes its window when it is the last."""
        if self.learner is None:
            self._start(step + 1, params)
            return
        if not self.learner.in_window(step):
            return
        self.losses.append(loss)
        if self.learner.window_end(step):
            wait()
            seconds = self.agreed_max(time.perf_counter() - self.clock - self.paused)
            losses = [self.read(v) for v in self.losses]
            self.losses = []
            self.learner.close(step, losses, seconds)

    def pause(self, seconds: float) -> None:
        """Time spent outside training (an evaluation) inside the current window."""
        self.paused += seconds


class ArmPrograms:
    """The decided arm's own program (``learned_gradients(..., fixed=arm)``: the same state,
    without the switch, which cost XLA:CPU about 8 ms a step), for the steps between trials.

    Compiling it takes seconds, so it compiles in a thread from the first step the arm is
    settled while the switched program goes on training, and takes over ``AHEAD`` steps
    later, waiting for the compilation if it is not done: every rank changes programs at the
    same step, whatever its compiler's speed.

    Args:
      build: ``arm -> DataParallelStep`` (not compiled yet).
    """

    AHEAD = 40

    def __init__(self, build: Callable[[int], Any]) -> None:
        self.build = build
        self.ready: dict[int, Any] = {}
        self.pending: dict[int, tuple[Any, threading.Thread, int]] = {}

    def program(self, arm: int | None, step: int, args: tuple) -> Any:
        """The program for ``step`` (None: the switched one). ``args``: the step's arguments,
        whose shapes and shardings the compilation takes."""
        if arm is None:
            return None
        if arm in self.ready:
            return self.ready[arm]
        if arm not in self.pending:
            program = self.build(arm)
            like = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args
            )
            thread = threading.Thread(target=program.compile, args=like, daemon=True)
            thread.start()
            self.pending[arm] = (program, thread, step + self.AHEAD)
        program, thread, due = self.pending[arm]
        if step < due:
            return None
        thread.join()
        self.ready[arm] = program
        del self.pending[arm]
        return program

    def close(self) -> None:
        """Waits for the compilations still running (none may outlive the run)."""
        for _, thread, _ in self.pending.values():
            thread.join()
