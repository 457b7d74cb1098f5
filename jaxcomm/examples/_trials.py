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
        self.learner = learn.Learner(arms, learning, step, learn.first_arm(arms), skip)

    def before(self, step: int, state: Any, wait: Callable[[], None]) -> Any:
        """The state with ``step``'s arm; starts a window's clock at its first step."""
        if self.learner is None:
            return state
        name = self.learner.arms[self.learner.arm_at(step)]
        arm = self.names.index(name)
        if arm != self.current:
            state = learning.set_arm(state, arm, self.sharding)
            self.current = arm
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
