"""The data-parallel training machinery the examples share (digits MLP/CNN, bytes LM).

The run configs' reduction settings (:class:`Reduction`, :class:`Stopping`), the step
(:class:`Step`: :func:`jaxcomm.data_parallel_step` for jaxcomm's reductions and DiLoCo, XLA's
own ``lax.pmean`` for the ``psum`` baseline) over a ``dp`` mesh, and the loop around it
(:func:`train_loop`): the step keeps at most ``max_in_flight`` steps queued (no sync per
step), the loop waits for them when it evaluates, every ``eval_every`` steps, and records
loss/metric against training wall clock; the summary reports bytes and collective time per
step from ``jaxcomm.metrics()``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxcomm
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxcomm import algorithms, checkpoints, cost, learning
from jaxcomm import optax as jc_optax
from jaxcomm.cost import learn, measure
from jaxcomm.examples import _trials

AXIS = "dp"
# DiLoCo over sites (Reduction.diloco_sites): a process is a site, its devices the inner axis.
SITE_AXES = ("node", "local")
ALGORITHMS = (*algorithms.names(), algorithms.AUTO)  # the registry's names (recipes use them)
GRAD_DTYPES = ("float32", "bfloat16")

AUTO_SETTINGS = tuple(f.name for f in dataclasses.fields(cost.Auto) if f.name != "options")
"""The settings of ``auto`` that :class:`Reduction` takes: the fields of :class:`jaxcomm.cost.Auto`
(declared, checked and documented there) but ``options``, which :meth:`Reduction.options`
builds from the algorithm settings."""


def _with_auto_settings(cls: type) -> type:
    # Each setting of cost.Auto becomes a field of the class, default None (= Auto's own
    # default), appended after the fields written in the class body. Its annotation is Auto's
    # (a string), from which command_line picks the option's parser.
    for f in dataclasses.fields(cost.Auto):
        if f.name in AUTO_SETTINGS:
            kind = str(f.type)
            cls.__annotations__[f.name] = kind if kind.endswith("| None") else f"{kind} | None"
            setattr(cls, f.name, None)
    return cls


@dataclasses.dataclass(frozen=True)
@_with_auto_settings
class Reduction:
    """How gradients are reduced over ``dp``.

    The examples' run configs (``DigitsConfig``, ``BytesLMConfig``) extend it, so these
    settings are declared here once.

    Attributes:
      algorithm: one of :data:`ALGORITHMS`.
      density: ρ of the sparse algorithms after warm-up.
      warmup: the gTop-k paper's warm-up densities (0.25, 0.0725, 0.015, 0.004), one per
        epoch, for the sparse algorithms (``auto``'s sparse candidates too).
      proportion: π of ``adaptive``.
      tau: threshold of ``threshold``.
      grad_dtype: ``"bfloat16"``: the gradient is reduced in bf16 (``psum``: a bf16
        ``lax.pmean``; jaxcomm: what goes dense goes on its 16-bit wire, ``dense_dtype`` of
        :func:`jaxcomm.optax.allreduce_gradients`, while a compressor takes the float32
        gradient as it is); parameters and optimizer stay float32.
      bucket_size: most elements per jaxcomm collective call.
      allowed, profile, compute_seconds, steps_factor, dense_steps, steps_factor_no_warmup:
        ``auto``'s settings (:data:`AUTO_SETTINGS`), the fields of :class:`jaxcomm.cost.Auto`
        as documented there, added to this class from it (the last fields); None: Auto's
        default. With ``warmup``, ``dense_steps`` and ``steps_factor_no_warmup`` let auto
        decide whether the warm-up pays; a learning auto reads ``dense_steps`` as its run's
        length (:meth:`learn_settings`).
      diloco_every: > 0: train with DiLoCo (:func:`jaxcomm.optax.diloco`): the optimizer
        runs this many local steps on every rank, then ``algorithm`` (``dense``, in
        ``grad_dtype`` on the wire, or a compressed one, with error feedback) averages the
        pseudo-gradient for the outer step; no gradient is reduced per step. 0: reduce the
        gradient every step.
      diloco_outer_lr, diloco_outer_momentum: the outer SGD's learning rate and Nesterov
        momentum (DiLoCo: 0.7 and 0.9).
      diloco_delay: inner steps between an outer allreduce's start and its application
        (Streaming DiLoCo's overlap: it runs detached on jaxcomm's engine meanwhile).
      diloco_fragments: parameter fragments synced at staggered steps.
      diloco_sites: DiLoCo over sites: each process is one worker whose devices train it
        data-parallel (their gradients averaged every step), and the outer step crosses only
        between processes, each device sending its share of the change (the mesh is
        :data:`SITE_AXES`, :func:`data_parallel_mesh`).
      bits, block: ``blockquant``: bits per element (8 or 4) and elements per scale
        (:class:`jaxcomm.BlockQuant`).
      rank: ``powersgd``: the approximation rank (:class:`jaxcomm.PowerSGD`).
      min_compression_rate: ``powersgd``: the least gain for which a leaf is compressed.
      start_step: ``powersgd``: steps of dense allreduce first; None: one warm-up phase
        (``warmup_phase_steps``, an epoch) when ``warmup`` is on, else 0.
      learn: ``auto`` without ``steps_factor`` and with dense allowed: learn what each
        compressor costs in steps from the run (:mod:`jaxcomm.cost.learn`): every candidate
        is compiled into the step (:mod:`jaxcomm.learning`) and timed at start; the prior
        picks on those seconds, and once the run is long enough to pay for them the training
        loop runs the proposed ones in interleaved windows, then keeps the one whose loss
        falls fastest per second (dense unless a compressor beats it). The warm-up schedule
        does not apply.
        False: auto decides once, at trace time, from the model and its prior steps factors.
    """

    algorithm: str = "dense"
    density: float = 0.01
    warmup: bool = True
    proportion: float = 64.0
    tau: float = 0.001
    grad_dtype: str = "float32"
    bucket_size: int = jc_optax.DEFAULT_BUCKET_SIZE
    diloco_every: int = 0
    diloco_outer_lr: float = jc_optax.DILOCO_OUTER_LR
    diloco_outer_momentum: float = jc_optax.DILOCO_OUTER_MOMENTUM
    diloco_delay: int = 0
    diloco_fragments: int = 1
    diloco_sites: bool = False
    # Defaults declared once, by their algorithms' modules (cost.Options holds them).
    bits: int = cost.Options.bits
    block: int = cost.Options.block
    rank: int = cost.Options.rank
    min_compression_rate: float = cost.Options.min_compression_rate
    start_step: int | None = None
    learn: bool = True

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype must be one of {GRAD_DTYPES}, got {self.grad_dtype!r}")
        if self.diloco_every < 0:
            raise ValueError(f"diloco_every must be >= 0 (0: off), got {self.diloco_every}")
        if self.diloco_every and self.algorithm in ("psum", algorithms.AUTO):
            raise ValueError(
                f"diloco_every needs a jaxcomm algorithm for the outer allreduce (dense or a "
                f"compressed one), not {self.algorithm!r}"
            )
        if self.diloco_sites and not self.diloco_every:
            raise ValueError("diloco_sites needs diloco_every > 0 (DiLoCo over sites)")
        if self.diloco_every and algorithms.get(self.algorithm).leafwise is not None:
            raise ValueError(
                f"diloco_every: DiLoCo's outer allreduce is one flat vector, and "
                f"{self.algorithm!r} compresses gradient leaves by shape; use dense or a flat "
                "compressor (e.g. blockquant)"
            )

    def options(self, warmup_phase_steps: int) -> cost.Options:
        """The algorithm settings of this reduction, for :func:`jaxcomm.algorithms.build`.

        Args:
          warmup_phase_steps: steps per warm-up density; PowerSGD's dense warm-up
            (``start_step`` None) lasts one such phase when :attr:`warmup` is on.

        Returns:
          The :class:`jaxcomm.cost.Options`.

        Example:
          >>> Reduction("powersgd", rank=2).options(100).start_step
          100
          >>> Reduction("blockquant", bits=4).options(100).bits
          4
        """
        start_step = self.start_step
        if start_step is None:  # PowerSGD's dense warm-up: one phase of the sparse warm-up
            start_step = warmup_phase_steps if self.warmup else 0
        return cost.Options(
            density=self.density,
            proportion=self.proportion,
            tau=self.tau,
            bits=self.bits,
            block=self.block,
            rank=self.rank,
            start_step=start_step,
            min_compression_rate=self.min_compression_rate,
        )

    def reducer(
        self, warmup_phase_steps: int, fixed: int | None = None, flush: bool = True
    ) -> optax.GradientTransformation | None:
        """The jaxcomm gradient transformation (None for the ``psum`` baseline).

        Args:
          warmup_phase_steps: steps per warm-up density (the paper: an epoch).
          fixed: a learning ``auto``'s arm compiled alone (``learned_gradients``' ``fixed``).
          flush: with ``fixed=0``, whether dense sends the residuals (``learned_gradients``).

        Returns:
          ``jaxcomm.optax.allreduce_gradients(...)`` or None.

        Example:
          >>> Reduction("psum").reducer(100) is None  # psum: the step calls lax.pmean
          True
          >>> Reduction("gtopk", density=0.01).reducer(100) is not None
          True
        """
        a = self.algorithm
        if a == "psum":
            return None
        options = self.options(warmup_phase_steps)
        if self.learns():
            arms = self.auto_arms(options)
            measure.expect(arms)  # the world's measurement times every arm's kernels at once
            return learning.learned_gradients(
                AXIS,
                [None, *arms.values()],
                fixed,
                flush,
                bucket_size=self.bucket_size,
                dense_dtype=jnp.dtype(self.grad_dtype),
            )
        schedule = None
        if a == algorithms.AUTO:
            given = {n: getattr(self, n) for n in AUTO_SETTINGS if getattr(self, n) is not None}
            algorithm: Any = cost.Auto(options=options, **given)
            sparse = any(algorithms.get(n).uses_density for n in algorithm.allowed)
        else:
            algorithm = algorithms.build(a, options)  # None: the dense allreduce
            sparse = algorithms.get(a).uses_density
        # The sparse algorithms follow the gTop-k paper's warm-up, chosen by auto or not (auto
        # then chooses each phase's algorithms with that phase's density).
        if sparse and self.warmup:
            schedule = jc_optax.gtopk_warmup_schedule(warmup_phase_steps, self.density)
        return jc_optax.allreduce_gradients(
            AXIS,
            algorithm,
            density_schedule=schedule,
            bucket_size=self.bucket_size,
            dense_dtype=jnp.dtype(self.grad_dtype),
        )

    def learns(self) -> bool:
        """Whether ``auto`` learns its choice from the run (:attr:`learn`; not with measured
        ``steps_factor``, nor DiLoCo, nor without dense among ``allowed``: dense is the
        trials' guard).

        Example:
          >>> Reduction("auto").learns(), Reduction("auto", steps_factor={"gtopk": 2.0}).learns()
          (True, False)
          >>> Reduction("auto", allowed=("gtopk", "onebit")).learns()
          False
        """
        return (
            self.algorithm == algorithms.AUTO
            and self.learn
            and self.steps_factor is None
            and not self.diloco_every
            and "dense" in (self.allowed or cost.DEFAULT_ALLOWED)
        )

    def learn_settings(self) -> learn.Learning:
        """A learning ``auto``'s settings: the learner's defaults, its prior on a compressor's
        extra steps a delay over ``dense_steps`` where given
        (:meth:`jaxcomm.cost.learn.Learning.for_run`).

        Example:
          >>> [Reduction("auto", dense_steps=n).learn_settings().prior_steps for n in (None, 2000)]
          [2.5, 1.089]
        """
        return learn.Learning().for_run(self.dense_steps)

    def auto_arms(self, options: cost.Options) -> dict[str, cost.Auto]:
        """The compressors a learning ``auto`` compiles, each as auto between dense and it
        (a bucket too small for the compressor to pay goes dense; the steps it costs are what
        the trials measure, so none is charged here), in the order of ``allowed``.

        Example:
          >>> list(Reduction("auto", allowed=("dense", "gtopk")).auto_arms(cost.Options()))
          ['gtopk']
        """
        given = {n: getattr(self, n) for n in AUTO_SETTINGS if getattr(self, n) is not None}
        allowed = given.pop("allowed", cost.DEFAULT_ALLOWED)
        given.pop("steps_factor", None)
        return {
            name: cost.Auto(
                **{**given, "allowed": ("dense", name), "steps_factor": {name: 1.0}},
                options=options,
            )
            for name in allowed
            if name != "dense" and algorithms.get(name).leafwise is None
        }

    def gradient_buckets(self, leaf_sizes: list[int]) -> list[int]:
        """Elements of each collective call that reduces a step's gradient.

        jaxcomm's reductions: the buckets of ``jaxcomm.optax.allreduce_gradients`` (last leaf
        first, at most :attr:`bucket_size` elements each, a larger leaf alone). ``psum``: each
        leaf (XLA:CPU runs the one all-reduce of the tree as one collective per operand). A
        leaf-shaped algorithm (``powersgd``) has no buckets: it sends by leaf shape
        (:func:`jaxcomm.cost.predict_tree`).

        Args:
          leaf_sizes: elements of each gradient leaf, in the pytree's order.

        Returns:
          Elements per call.

        Example:
          >>> Reduction("dense", bucket_size=100).gradient_buckets([60, 30, 20, 500])
          [500, 50, 60]
          >>> Reduction("psum").gradient_buckets([60, 30, 20, 500])
          [60, 30, 20, 500]
        """
        if self.algorithm == "psum":
            return [n for n in leaf_sizes if n]
        groups = jc_optax._buckets(leaf_sizes, self.bucket_size)
        return [sum(leaf_sizes[i] for i in group) for group in groups]

    def metric_collectives(self) -> list[tuple[str, int]]:
        """The collectives with which every step averages its loss and metric
        (:class:`Step`), besides the gradient's.

        Returns:
          ``(algorithm, elements)`` of each call: two one-element ``lax.pmean`` for ``psum``,
          one jaxcomm allreduce of both for every jaxcomm reduction.

        Example:
          >>> Reduction("psum").metric_collectives(), Reduction("gtopk").metric_collectives()
          ([('psum', 1), ('psum', 1)], [('dense', 2)])
        """
        return [("psum", 1), ("psum", 1)] if self.algorithm == "psum" else [("dense", 2)]

    def diloco(self, optimizer: optax.GradientTransformation) -> jc_optax.DiLoCo | None:
        """The DiLoCo trainer with ``optimizer`` as its inner optimizer (None: per-step
        reduction, ``diloco_every == 0``).

        Example:
          >>> Reduction("gtopk", diloco_every=20).diloco(optax.adamw(1e-3)) is not None
          True
        """
        if not self.diloco_every:
            return None
        options = self.options(0)
        outer = optax.sgd(
            self.diloco_outer_lr, momentum=self.diloco_outer_momentum or None, nesterov=True
        )
        return jc_optax.diloco(
            optimizer,
            outer,
            every=self.diloco_every,
            algorithm=algorithms.build(self.algorithm, options),  # None: dense
            delay=self.diloco_delay,
            fragments=self.diloco_fragments,
            dense_dtype=jnp.dtype(self.grad_dtype),
            **(
                {"axis_name": SITE_AXES[0], "inner_axis": SITE_AXES[1]}
                if self.diloco_sites
                else {"axis_name": AXIS}
            ),
        )

    def uses_density(self) -> bool:
        """Whether :attr:`density` configures the algorithm (the sparse ones).

        Example:
          >>> Reduction("gtopk").uses_density(), Reduction("onebit").uses_density()
          (True, False)
        """
        return self.algorithm != algorithms.AUTO and algorithms.get(self.algorithm).uses_density

    def label(self) -> str:
        """Short name for files and tables, e.g. ``"gtopk"``, ``"psum-bf16"`` or
        ``"diloco20-gtopk-delay2"``."""
        name = f"{self.algorithm}-bf16" if self.grad_dtype == "bfloat16" else self.algorithm
        if not self.diloco_every:
            return name
        name = f"diloco{self.diloco_every}-{name}"
        if self.diloco_delay:
            name += f"-delay{self.diloco_delay}"
        if self.diloco_fragments > 1:
            name += f"-frag{self.diloco_fragments}"
        if self.diloco_sites:
            name += "-sites"
        return name


@dataclasses.dataclass(frozen=True)
class Stopping:
    """When a run stops before its last step (the examples' configs extend it, as they extend
    :class:`Reduction`).

    Attributes:
      target: stop at the first evaluation that reaches this value of the example's metric
        (test accuracy: at least; validation bits per byte: at most). None: run every step.
      time_cap_s: stop at the first evaluation after this many seconds of training.
    """

    target: float | None = None
    time_cap_s: float | None = None

    def loop_options(self, higher_is_better: bool) -> dict[str, Any]:
        """The keyword arguments of :func:`train_loop` that carry these settings.

        Example:
          >>> Stopping(target=0.9).loop_options(True)["target"]
          0.9
        """
        if self.time_cap_s is not None and self.time_cap_s <= 0:
            raise ValueError(f"time_cap_s must be > 0, got {self.time_cap_s}")
        return {
            "target": self.target,
            "higher_is_better": higher_is_better,
            "time_cap_s": self.time_cap_s,
        }


def stop_summary(loop: LoopResult, config: Stopping) -> dict[str, Any]:
    """The result fields that say how a run ended: steps run, why it stopped, its target and
    the training seconds at which it reached it.

    Example:
      >>> stop_summary(result, cfg)["stopped"]  # doctest: +SKIP
      'target'
    """
    return {
        "steps": loop.steps,
        "stopped": loop.stopped,
        "target": config.target,
        "time_cap_s": config.time_cap_s,
        "time_to_target_s": loop.time_to_target_s,
    }


def diloco_summary(config: Reduction) -> dict[str, Any] | None:
    """The DiLoCo settings of a run for its result JSON (None: per-step reduction).

    Example:
      >>> diloco_summary(Reduction("gtopk", diloco_every=20))["every"]
      20
    """
    if not config.diloco_every:
        return None
    return {
        "every": config.diloco_every,
        "outer_lr": config.diloco_outer_lr,
        "outer_momentum": config.diloco_outer_momentum,
        "delay": config.diloco_delay,
        "fragments": config.diloco_fragments,
        "sites": config.diloco_sites,
    }


def reduction_of(config: Any) -> Reduction:
    """The :class:`Reduction` of a run config that holds its fields (by name; a config without
    ``allowed`` or ``profile`` gets their defaults).

    Args:
      config: a dataclass instance with at least ``algorithm``, ``density``, ``warmup``,
        ``proportion``, ``tau``, ``grad_dtype`` and ``bucket_size``.

    Returns:
      The checked :class:`Reduction` (ValueError for an unknown algorithm or grad_dtype).

    Example:
      >>> reduction_of(Reduction(algorithm="gtopk")).algorithm
      'gtopk'
    """
    names = [f.name for f in dataclasses.fields(Reduction) if hasattr(config, f.name)]
    return Reduction(**{name: getattr(config, name) for name in names})


def data_parallel_mesh(sites: bool = False) -> Mesh:
    """A 1-D mesh named ``dp`` over every device of every process; ``sites``: the same devices
    as :data:`SITE_AXES`, a row per process (DiLoCo over sites)."""
    if not sites:
        return Mesh(np.asarray(jax.devices()), (AXIS,))
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.asarray(devices).reshape(jax.process_count(), -1), SITE_AXES)


def batch_spec(mesh: Mesh) -> P:
    """The batch's PartitionSpec: its first axis split over every device of ``mesh``."""
    return P(tuple(mesh.axis_names))


class Step:
    """The examples' training step of a loss over a data-parallel mesh.

    A jaxcomm reduction or DiLoCo trains through :func:`jaxcomm.data_parallel_step` (placement,
    pacing, the global mean loss and metric); the ``psum`` baseline is :class:`XlaStep`, XLA
    alone. A learning ``auto`` also gets its :attr:`trials`, which the loop consults every step.

    Args:
      loss_fn: ``(params, *batch) -> (loss, metric)`` on this rank's shard of the batch
        (``metric``: a scalar such as the accuracy; averaged over ranks).
      optimizer: the optimizer applied to the averaged float32 gradient.
      reduction: how gradients are reduced.
      warmup_phase_steps: steps per density of the gTop-k warm-up.
      mesh: the data-parallel mesh (:func:`data_parallel_mesh`).
      max_in_flight: steps queued ahead of the devices (:func:`jaxcomm.paced`; 0 waits for
        every step).

    Example:
      >>> step = Step(loss_and_metric, optax.sgd(0.05), Reduction("gtopk"), 100, mesh)
      >>> params, state = step.init(params)
      >>> rows = jax.sharding.NamedSharding(mesh, P("dp"))  # the batch is sharded over dp
      >>> params, state, loss, metric = step(
      ...     params, state, jax.device_put(x, rows), jax.device_put(y, rows))
      >>> step.wait()  # every step in flight done
    """

    def __init__(
        self,
        loss_fn: Callable[..., tuple[jax.Array, jax.Array]],
        optimizer: optax.GradientTransformation,
        reduction: Reduction,
        warmup_phase_steps: int,
        mesh: Mesh,
        max_in_flight: int = jaxcomm.pacing.DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        self.mesh = mesh
        self.trials: _trials.Trials | None = None  # a learning auto: the loop sets each arm
        if reduction.algorithm == "psum":
            self._step: Any = XlaStep(loss_fn, optimizer, reduction, mesh, max_in_flight)
            return
        options = {"has_aux": True, "donate": True, "max_in_flight": max_in_flight}
        diloco = reduction.diloco(optimizer)
        if diloco is not None:
            # Each rank's own loss and metric: averaging them would be a collective per step,
            # which DiLoCo exists to avoid (the evaluation uses the global parameters).
            self._step = jaxcomm.data_parallel_step(
                loss_fn, diloco, mesh, tuple(mesh.axis_names), average_metrics=False, **options
            )
            return
        # The reduced gradient goes on in float32 (a bf16 momentum trace loses small updates).
        widen = optax.stateless(lambda u, p: jax.tree.map(lambda g: g.astype(jnp.float32), u))

        def program(fixed: int | None = None, flush: bool = True) -> jaxcomm.DataParallelStep:
            # The loss and metric average in one jaxcomm allreduce (metric_collectives), so
            # every cross-process wait of a jaxcomm step is bounded by JAXCOMM_TIMEOUT_S:
            # XLA's CPU collectives (Gloo) have no such deadline and sat through a 60 s
            # partition (docs/faults.md).
            tx = optax.chain(reduction.reducer(warmup_phase_steps, fixed, flush), widen, optimizer)
            return jaxcomm.data_parallel_step(loss_fn, tx, mesh, AXIS, **options)

        if not reduction.learns():
            self._step = program()
            return
        self._arms = _trials.ArmPrograms(program)
        self._step = self._arms.ready[0, True]
        settings = reduction.options(warmup_phase_steps)
        self.trials = _trials.Trials(reduction, settings, self._arms, _AgreedMax(mesh), host_scalar)

    @property
    def traces(self) -> int:
        """Times the per-rank step was traced (compilations)."""
        return sum(p.traces for p in self._programs())

    def _programs(self) -> list[Any]:
        """The step's programs: its one, or every compiled arm's of a learning auto."""
        return [self._step] if self.trials is None else list(self._arms.ready.values())

    def init(self, params: Any) -> tuple[Any, Any]:
        """Replicates `params` on the mesh and builds the optimizer state (residuals per rank).

        Returns:
          ``(params, state)`` placed on the mesh.
        """
        return self._step.replicate(params), self._step.init(params)

    def __call__(self, params: Any, state: Any, *batch: jax.Array) -> tuple:
        """One paced step: ``(params, state, loss, metric)`` (a learning auto: by the program
        of the arm the trials set)."""
        if self.trials is None:
            return self._step(params, state, *batch)
        program = self._arms(self.trials.program, (params, state, *batch))
        return program(params, state, *batch)

    def wait(self) -> None:
        """Waits for every step in flight."""
        for program in self._programs():
            program.wait()

    def restart(self, state: Any) -> Any:
        """A restored state, ready to continue (DiLoCo: re-sends the outer allreduces that
        were in flight when it was saved; others: ``state``)."""
        return self._step.restart(state)

    def finish(self, params: Any, state: Any) -> tuple[Any, Any]:
        """After the last step: waits for it and applies every outer gradient in flight
        (DiLoCo with a delay), so that no detached collective is left open."""
        self.wait()
        return self._step.finish(params, state)


class XlaStep:
    """The ``psum`` baseline's step: XLA's own ``lax.pmean`` of the gradient (in
    ``grad_dtype``) and of the loss and metric, no jaxcomm at all. It has the methods of
    :class:`jaxcomm.DataParallelStep` that :class:`Step` calls, and is paced the same way."""

    def __init__(
        self,
        loss_fn: Callable[..., tuple[jax.Array, jax.Array]],
        optimizer: optax.GradientTransformation,
        reduction: Reduction,
        mesh: Mesh,
        max_in_flight: int,
    ) -> None:
        self.mesh, self.traces = mesh, 0
        # The reduced gradient goes on in float32 (a bf16 momentum trace loses small updates).
        widen = optax.stateless(lambda u, p: jax.tree.map(lambda g: g.astype(jnp.float32), u))
        self._tx = optax.chain(widen, optimizer)
        grad_dtype = reduction.grad_dtype

        def local_step(params: Any, state: Any, *batch: jax.Array) -> tuple:
            self.traces += 1  # runs at trace time only
            (loss, metric), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
            if grad_dtype != "float32":
                grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)
            updates, state = self._tx.update(lax.pmean(grads, AXIS), state, params)
            params = optax.apply_updates(params, updates)
            return params, state, lax.pmean(loss, AXIS), lax.pmean(metric, AXIS)

        self._local_step = local_step
        self._compiled: Any = None
        self._paced = jaxcomm.paced(self._run, max_in_flight)

    def _run(self, params: Any, state: Any, *batch: jax.Array) -> tuple:
        if self._compiled is None:
            rows = batch_spec(self.mesh)
            self._compiled = jax.jit(
                jax.shard_map(
                    self._local_step,
                    mesh=self.mesh,
                    in_specs=(P(), P(), *(rows,) * len(batch)),
                    out_specs=(P(), P(), P(), P()),
                    check_vma=False,
                ),
                donate_argnums=(0, 1),
            )
        return self._compiled(params, state, *batch)

    def replicate(self, params: Any) -> Any:
        """``params`` replicated on every device of the mesh."""
        return jax.device_put(params, NamedSharding(self.mesh, P()))

    def init(self, params: Any) -> Any:
        """The optimizer state of ``params``, replicated."""
        replicated = NamedSharding(self.mesh, P())
        return jax.jit(self._tx.init, out_shardings=replicated)(self.replicate(params))

    def __call__(self, params: Any, state: Any, *batch: jax.Array) -> tuple:
        return self._paced(params, state, *batch)

    def wait(self) -> None:
        """Waits for every step in flight."""
        self._paced.wait()

    def restart(self, state: Any) -> Any:
        """``state``: nothing of the baseline is in flight across a save."""
        return state

    def finish(self, params: Any, state: Any) -> tuple[Any, Any]:
        """Waits for every step in flight; ``(params, state)``."""
        self.wait()
        return params, state


def host_scalar(x: jax.Array) -> float:
    """A replicated (or this process's first) value of a global array as a float."""
    return float(np.asarray(x.addressable_data(0)).reshape(-1)[0])


@dataclasses.dataclass
class LoopResult:
    """What :func:`train_loop` measured.

    Attributes:
      params: the final parameters.
      loss: the last synchronized training loss.
      evaluation: the last evaluation's value.
      history: ``{"step", "seconds", "loss", "<eval name>"}`` at every evaluation.
      seconds: training wall clock from the end of the first (compiling) step, evaluations
        excluded.
      timed_steps: steps inside ``seconds``.
      steps: optimizer steps run (fewer than asked when the run stopped at its target or
        time cap).
      stopped: why the loop ended: ``"target"``, ``"time_cap"`` or ``"steps"``.
      time_to_target_s: ``seconds`` at the first evaluation that reached the target (None:
        no target, or not reached).
      resumed_from: steps already done by the checkpoint the run resumed from (0: none).
    """

    params: Any
    loss: float
    evaluation: float
    history: list[dict[str, float]]
    seconds: float
    timed_steps: int
    steps: int = 0
    stopped: str = "steps"
    time_to_target_s: float | None = None
    resumed_from: int = 0


def reached(value: float, target: float | None, higher_is_better: bool) -> bool:
    """Whether `value` reaches `target` (at least, or at most when lower is better).

    Args:
      value: the evaluation.
      target: the target (None: never reached).
      higher_is_better: accuracy-like (True) or loss-like (False) metric.

    Returns:
      True when the target is reached; NaN never reaches it.

    Example:
      >>> reached(0.981, 0.98, True), reached(2.1, 2.0, False)
      (True, False)
    """
    if target is None or value != value:
        return False
    return value >= target if higher_is_better else value <= target


class _AgreedMax:
    """The largest of every rank's value, the same on all ranks (a jitted ``lax.pmax``).

    A time cap decided from each rank's own clock could stop one rank a step before the
    other, which would then wait in its next collective until its deadline; the ranks stop
    on the agreed value instead.
    """

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        axes = tuple(mesh.axis_names)
        self.sharding = NamedSharding(mesh, batch_spec(mesh))
        self.fn = jax.jit(
            jax.shard_map(
                lambda x: lax.pmax(x, axes), mesh=mesh, in_specs=batch_spec(mesh), out_specs=P()
            )
        )

    def __call__(self, value: float) -> float:
        local = np.full((len(self.mesh.local_devices),), value, np.float32)
        return host_scalar(self.fn(jax.make_array_from_process_local_data(self.sharding, local)))


def train_loop(
    step: Step,
    params: Any,
    state: Any,
    batch: Callable[[int], tuple[jax.Array, ...]],
    evaluate: Callable[[Any], float],
    *,
    steps: int,
    eval_every: int,
    eval_name: str = "test_accuracy",
    metric_name: str = "accuracy",
    logger: Any = None,
    target: float | None = None,
    higher_is_better: bool = True,
    time_cap_s: float | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
) -> LoopResult:
    """Runs `steps` training steps, synchronizing and evaluating as asked; stops early at
    the first evaluation that reaches `target`, or once training took `time_cap_s`.

    With a `checkpoint_dir` the loop first resumes from its newest complete checkpoint (if
    any: params, optimizer state with every rank's residual, the evaluation history and the
    training seconds so far) and then, with ``checkpoint_every > 0``, writes one every
    `checkpoint_every` steps through :mod:`jaxcomm.checkpoints` (atomic: a process killed
    mid-write leaves the previous checkpoint the newest). Batches depend only on the global
    step, so a resumed run repeats exactly the steps an uninterrupted one takes.

    Args:
      step: the training step (paced: it keeps its ``max_in_flight`` steps queued).
      params, state: from ``step.init``.
      batch: ``global step -> batch arrays`` (placed, sharded over ``dp``).
      evaluate: ``params -> float`` (e.g. test accuracy, validation bits per byte).
      steps: optimizer steps.
      eval_every: steps between evaluations (step 0 and the last step always evaluate).
      eval_name: key of the evaluation in ``history`` and in the logged metrics.
      metric_name: key of the step's training metric in the logged metrics.
      logger: optional launcher metrics logger (``log(step, force=..., **fields)``; when it
        has ``progress(steps_dispatched)``, that is called after every step).
      target: stop at the first evaluation reaching this value (None: run every step).
      higher_is_better: whether the evaluation reaches `target` from below (accuracy) or
        from above (bits per byte).
      time_cap_s: stop at the first evaluation after this many seconds of training (every
        rank stops at the same step: the ranks agree on the largest of their clocks).
      checkpoint_dir: directory of the checkpoints (shared by every process); None: none.
      checkpoint_every: steps between checkpoints (0: only resume, never write).

    Returns:
      A :class:`LoopResult`.

    Example:
      >>> step = Step(loss_and_metric, optax.sgd(0.05), Reduction("gtopk"), 100, mesh)
      >>> params, state = step.init(params)
      >>> rows = jax.sharding.NamedSharding(mesh, P("dp"))
      >>> batch = lambda i: (jax.device_put(x, rows), jax.device_put(y, rows))
      >>> result = train_loop(step, params, state, batch, lambda p: 0.0, steps=4, eval_every=2)
      >>> [h["step"] for h in result.history]  # and always the last step
      [0, 2, 3]
    """
    jaxcomm.reset_metrics()
    run = _resume(step, params, state, steps, checkpoint_dir, eval_name)
    stop = _Stop(target, higher_is_better, time_cap_s, step.mesh)
    for i in range(run.start, steps):
        loss_d, metric_d = _advance(step, run, batch, i, logger)
        evaluate_now = i % eval_every == 0 or i == steps - 1
        if i == run.start or evaluate_now:
            step.wait()  # every queued step, this one included
            run.loss = host_scalar(loss_d)
        if i == run.start:
            jaxcomm.reset_metrics()  # the compiling step is not counted
            run.clock.open(i + 1)
        if evaluate_now:
            _evaluate(step, run, i, evaluate, logger, (eval_name, metric_name, metric_d))
            if stop(run, i):
                break
            run.clock.open(i + 1)
        if _checkpoint_due(checkpoint_dir, checkpoint_every, i + 1, steps):
            _save(step, run, checkpoint_dir, i + 1)
    step.wait()
    jax.block_until_ready(step.finish(run.params, run.state))  # no detached collective open
    return run.result()


class _Clock:
    """The training wall clock: seconds trained, and the window since the last evaluation
    (its first step and the collective seconds when it began)."""

    def __init__(self, before: float) -> None:
        self.before = before  # earlier attempts' seconds (a resumed run)
        self.seconds = 0.0  # this attempt's
        self.start, self.first, self.comm = time.perf_counter(), 0, None

    def open(self, first: int) -> None:
        """Starts a window at step ``first``."""
        self.start, self.first, self.comm = time.perf_counter(), first, _collective_seconds()

    def close(self, last: int) -> tuple[float, float | None]:
        """Ends the window after step ``last``: its seconds and collective seconds per step
        (None: no jaxcomm collective ran, e.g. ``psum``)."""
        elapsed = time.perf_counter() - self.start
        self.seconds += elapsed
        steps = max(1, last + 1 - self.first)
        comm = _collective_seconds()
        base = self.comm or 0.0  # nothing had run when this window began
        return elapsed / steps, None if comm is None else (comm - base) / steps

    def total(self, running: bool = False) -> float:
        """Seconds trained, this attempt's and earlier ones'; ``running``: with the open
        window's."""
        extra = time.perf_counter() - self.start if running else 0.0
        return self.before + self.seconds + extra


@dataclasses.dataclass
class _Run:
    """What the loop carries from step to step."""

    params: Any
    state: Any
    start: int  # the first step of this attempt (a resumed run: the checkpoint's)
    clock: _Clock
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    loss: float = float("nan")
    evaluation: float = float("nan")
    stopped: str = "steps"
    time_to_target: float | None = None
    done: int = 0

    def result(self) -> LoopResult:
        return LoopResult(
            self.params,
            self.loss,
            self.evaluation,
            self.history,
            self.clock.seconds,
            max(1, self.done - self.start - 1),
            steps=self.done,
            stopped=self.stopped,
            time_to_target_s=self.time_to_target,
            resumed_from=self.start,
        )


def _resume(
    step: Step, params: Any, state: Any, steps: int, checkpoint_dir: str | None, eval_name: str
) -> _Run:
    """The run from the newest complete checkpoint in ``checkpoint_dir``, if any: params,
    optimizer state, history and training seconds so far; otherwise from the start."""
    resumed = None if checkpoint_dir is None else checkpoints.latest(checkpoint_dir)
    if resumed is None:
        return _Run(params, state, 0, _Clock(0.0), done=steps)
    (params, state), loop_state = checkpoints.restore(checkpoint_dir, resumed, (params, state))
    history = list(loop_state.get("history", []))
    run = _Run(params, step.restart(state), min(resumed, steps), _Clock(0.0), history, done=steps)
    run.clock.before = float(loop_state.get("seconds", 0.0))
    if history:
        run.loss, run.evaluation = history[-1]["loss"], history[-1][eval_name]
    return run


def _advance(step: Step, run: _Run, batch: Callable[[int], tuple], i: int, logger: Any) -> tuple:
    """Dispatches step ``i`` (with a learning auto's arm); its device loss and metric."""
    trials = step.trials
    if trials is not None:
        trials.before(i, step.wait)
    run.params, run.state, loss, metric = step(run.params, run.state, *batch(i))
    if trials is not None:
        trials.after(i, run.params, loss, step.wait, lambda: (run.params, run.state, *batch(i + 1)))
    progress = getattr(logger, "progress", None)
    if progress is not None:
        progress(i + 1)
    return loss, metric


def _evaluate(
    step: Step,
    run: _Run,
    i: int,
    evaluate: Callable[[Any], float],
    logger: Any,
    names: tuple[str, str, Any],
) -> None:
    """Closes the clock's window at step ``i``, evaluates, records the history row and logs
    it with the window's step and collective seconds (``names``: the evaluation's and the
    metric's keys, and the step's device metric)."""
    eval_name, metric_name, metric = names
    step_time, comm = run.clock.close(i)
    paused = time.perf_counter()
    run.evaluation = float(evaluate(run.params))
    if step.trials is not None:  # the evaluation is no part of a trial window's seconds
        step.trials.pause(time.perf_counter() - paused)
    total = run.clock.total()
    run.history.append({"step": i, "seconds": total, "loss": run.loss, eval_name: run.evaluation})
    if logger is not None:
        logger.log(
            i,
            force=True,
            loss=run.loss,
            step_time_s=step_time,
            train_seconds=total,
            # What jaxcomm.metrics() measured per step of this window (None: psum, whose time
            # XLA does not report).
            collective_time_s=comm,
            **{eval_name: run.evaluation, metric_name: host_scalar(metric)},
        )


class _Stop:
    """Whether the run stops after an evaluation: at its target, or at its time cap (every
    rank at the same step: the ranks agree on the largest of their clocks)."""

    def __init__(
        self, target: float | None, higher_is_better: bool, cap_s: float | None, mesh: Mesh
    ) -> None:
        self.target, self.higher_is_better, self.cap_s = target, higher_is_better, cap_s
        self.agreed_max = _AgreedMax(mesh) if cap_s is not None else None

    def __call__(self, run: _Run, i: int) -> bool:
        total = run.clock.total()
        if reached(run.evaluation, self.target, self.higher_is_better):
            run.time_to_target, run.stopped = total, "target"
        elif self.agreed_max is not None and i > 0 and self.agreed_max(total) >= self.cap_s:
            # (Step 0 compiles and is not timed: its evaluation never ends a run.)
            run.stopped = "time_cap"
        if run.stopped == "steps":
            return False
        run.done = i + 1
        return True


def _checkpoint_due(checkpoint_dir: str | None, every: int, done: int, steps: int) -> bool:
    """Whether a checkpoint is due after ``done`` steps (never after the last step)."""
    return checkpoint_dir is not None and every > 0 and not done % every and done < steps


def _save(step: Step, run: _Run, checkpoint_dir: str, done: int) -> None:
    """Saves the checkpoint after ``done`` steps; the save is not training time."""
    loop_state = {"seconds": run.clock.total(running=True), "history": run.history}
    paused = time.perf_counter()
    step.wait()
    checkpoints.save(checkpoint_dir, done, (run.params, run.state), loop_state)
    run.clock.start += time.perf_counter() - paused


def _collective_seconds() -> float | None:
    """Seconds inside jaxcomm's collectives so far, per rank of this process.

    None before any jaxcomm collective ran (e.g. the ``psum`` baseline).
    """
    totals = [t for t in jaxcomm.metrics()["totals"] if t["calls"]]
    if not totals:
        return None
    return sum(t["seconds"] for t in totals) / len({t["world_rank"] for t in totals})


def communication_summary(
    reduction: Reduction, n_params: int, devices: int, timed_steps: int
) -> dict[str, Any]:
    """Bytes and collective seconds per rank and step, from ``jaxcomm.metrics()``.

    ``psum`` is not measured by jaxcomm: its bytes are a ring allreduce's at the gradient
    dtype's width and its time is None.

    Returns:
      ``{"bytes_sent_per_step", "dense_bytes_per_step", "comm_seconds_per_step"}``; dense
      bytes are a float32 ring's.
    """
    dense = round(2 * (devices - 1) / devices * n_params * 4) if devices > 1 else 0
    totals = [t for t in jaxcomm.metrics()["totals"] if t["calls"]]
    ranks = max(1, len({t["world_rank"] for t in totals}))
    if reduction.algorithm == "psum":
        sent: float = dense // (2 if reduction.grad_dtype == "bfloat16" else 1)
        comm = None
    else:
        sent = sum(t["bytes_sent"] for t in totals) / ranks / timed_steps
        comm = sum(t["seconds"] for t in totals) / ranks / timed_steps
    return {
        "bytes_sent_per_step": sent,
        "dense_bytes_per_step": dense,
        "comm_seconds_per_step": comm,
    }


def checkpoint_options(config: Any, run_dir: str | None) -> dict[str, Any]:
    """The checkpoint arguments of :func:`train_loop` from a run config's ``checkpoint_every``
    and ``checkpoint_dir`` (default ``<run_dir>/checkpoints``).

    Args:
      config: a config with ``checkpoint_every`` and ``checkpoint_dir``.
      run_dir: the run's directory, or None.

    Returns:
      ``{"checkpoint_dir", "checkpoint_every"}``; the directory is None when checkpointing
      is off and none was named.

    Example:
      >>> checkpoint_options(DigitsConfig(checkpoint_every=50), "/r")  # doctest: +SKIP
      {'checkpoint_dir': '/r/checkpoints', 'checkpoint_every': 50}
    """
    directory = config.checkpoint_dir
    if directory is None and config.checkpoint_every and run_dir is not None:
        directory = str(pathlib.Path(run_dir) / "checkpoints")
    return {"checkpoint_dir": directory, "checkpoint_every": config.checkpoint_every}


def params_digest(params: Any) -> str:
    """SHA-256 of the parameters' bytes (this process's first shard of each leaf, in tree
    order): equal digests mean bit-identical replicated parameters.

    Args:
      params: a tree of (replicated) arrays.

    Returns:
      The hex digest.

    Example:
      >>> params_digest({"w": np.zeros(2, np.float32)})[:8]
      'af5570f5'
    """
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        data = leaf.addressable_data(0) if hasattr(leaf, "addressable_data") else leaf
        h.update(np.ascontiguousarray(np.asarray(data)).tobytes())
    return h.hexdigest()


def make_config(config: type, fields: dict[str, Any], workload: str) -> Any:
    """``config(**fields)``, with an error listing the known fields for an unknown one.

    Args:
      config: an example's config dataclass (``DigitsConfig``, ``BytesLMConfig``).
      fields: its keyword arguments.
      workload: the example's name, for the error.

    Returns:
      The config.

    Raises:
      TypeError: a key of ``fields`` is not a field of ``config``.

    Example:
      >>> make_config(DigitsConfig, {"algorithm": "gtopk"}, "digits").algorithm  # doctest: +SKIP
      'gtopk'
    """
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unknown {workload} settings {unknown}; known: {sorted(known)}")
    return config(**fields)


def _parse_bool(text: str) -> bool:
    """``1/true/yes`` or ``0/false/no`` (any case), as ``--warmup 0`` takes."""
    value = text.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ValueError(f"expected 0/1 or true/false, got {text!r}")


def _option_parser(field: dataclasses.Field) -> Callable[[str], Any]:
    """How :func:`command_line` parses a config field's option, from its annotation (a string
    under ``from __future__ import annotations``): ``int``, ``float``, ``str``, ``bool``,
    ``tuple[str, ...]`` (comma-separated), ``dict[str, float]`` or ``Mapping[str, float]``
    (``name=value,...``); of a union (``X | None``, ``Profile | str | None``: the settings
    :class:`Reduction` takes from ``cost.Auto``), the first alternative it can parse."""
    parsers: dict[str, Callable[[str], Any]] = {
        "int": int,
        "float": float,
        "str": str,
        "bool": _parse_bool,
        "tuple[str, ...]": lambda text: tuple(v.strip() for v in text.split(",") if v.strip()),
        "dict[str, float]": _parse_float_map,
        "Mapping[str, float]": _parse_float_map,
    }
    for kind in str(field.type).split("|"):
        if kind.strip() in parsers:
            return parsers[kind.strip()]
    raise TypeError(f"command_line: no option parser for {field.name}: {field.type}")


def _parse_float_map(text: str) -> dict[str, float]:
    """``"adaptive=5.2,gtopk=2"`` -> ``{"adaptive": 5.2, "gtopk": 2.0}``."""
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"expected name=value pairs separated by commas, got {text!r}")
    return {name.strip(): float(value) for name, value in pairs}


def command_line(description: str, config: type, train: Callable[..., dict[str, Any]]) -> None:
    """The examples' command line: ``--devices N`` and one option per field of ``config``.

    Sets ``jax_num_cpu_devices`` (before JAX starts), runs ``train(**options)`` and prints the
    result without its history, as JSON.

    Args:
      description: the ``--help`` text.
      config: the example's config dataclass (e.g. ``DigitsConfig``); ``--hidden-size 64``
        sets ``hidden_size``; booleans take 0/1 (or true/false); tuples take comma-separated
        values (``--allowed dense,gtopk``), maps name=value pairs (``--steps-factor gtopk=2``).
      train: the example's ``train`` function.

    Returns:
      None.

    Example:
      >>> command_line(__doc__.splitlines()[0], DigitsConfig, train)  # doctest: +SKIP
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--devices", type=int, default=4, help="CPU devices in this process")
    for f in dataclasses.fields(config):
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=_option_parser(f), default=None, help=str(f.type)
        )
    args = vars(parser.parse_args())
    jax.config.update("jax_num_cpu_devices", args.pop("devices"))
    overrides = {k: v for k, v in args.items() if v is not None}
    result = train(**overrides)
    result.pop("history")
    print(json.dumps(result, indent=2))
