"""Data-parallel Flax training on scikit-learn's 8x8 digits with jaxcomm gradient allreduce.

An MLP (64 → hidden → 10) or a small CNN is trained with SGD (or AdamW) over every device of
every process (one mesh axis ``dp``). ``data="teacher"`` swaps the digits for a synthetic task
of the same shape: 64 Gaussian inputs labelled by a fixed random linear teacher, 60,000 to
train on and 4,000 to test, a task that takes hundreds of steps rather than tens. Gradients
are averaged by ``jaxcomm.optax.allreduce_gradients`` chained before the optimizer:

- ``dense``: jaxcomm's UCX ring allreduce (no compression);
- ``psum``: XLA's own ``lax.pmean`` (the baseline without jaxcomm);
- ``gtopk`` / ``topk_allgather``: sparse allreduce with error feedback, density ρ, optionally
  with the gTop-k paper's warm-up densities (one per epoch: 0.25, 0.0725, 0.015, 0.004);
- ``adaptive`` / ``onebit`` / ``threshold``: quantized allreduce with error feedback.

Use it from Python (``train(algorithm="gtopk", density=0.01)``), from the command line
(``python -m jaxcomm.examples.digits --devices 4 --algorithm gtopk``) or through the launcher
(``job: digits``: ``launcher/jaxcomm_launcher/jobs/digits.py`` turns the recipe into these
keyword arguments; this module knows nothing of the launcher).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxcomm
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxcomm import cost
from jaxcomm.examples import _loop
from jaxcomm.examples._loop import ALGORITHMS, GRAD_DTYPES
from jaxcomm.pacing import DEFAULT_MAX_IN_FLIGHT

__all__ = ["ALGORITHMS", "GRAD_DTYPES", "DigitsConfig", "Trainer", "build", "train"]
TEST_SIZE = 297  # of 1797 images; the other 1500 train
SPLIT_SEED = 1234  # the file is ordered by writer: shuffle once, the same way everywhere
TEACHER_SIZES = (60_000, 4_000)  # train, test
TEACHER_SEED = 7  # the teacher and its inputs: one task, the same on every process
DATA = ("digits", "teacher")
OPTIMIZERS = ("sgd", "adamw")


@dataclasses.dataclass(frozen=True)
class DigitsConfig(_loop.Reduction, _loop.Stopping):
    """Settings of one training run.

    Attributes:
      algorithm, density, warmup, tau, grad_dtype, bucket_size, allowed, profile: the gradient
        reduction (:class:`jaxcomm.examples._loop.Reduction`, whose fields these are).
      proportion: π of ``adaptive`` (about 1/π of each sign's values sent per column); 16
        keeps the 4810-parameter MLP within 0.4 points of dense in 20 epochs, 64 (the
        :class:`~jaxcomm.examples._loop.Reduction` default) does not (91 %: too few entries
        per step for so small a model).
      model: ``"mlp"`` or ``"cnn"``.
      data: ``"digits"`` or ``"teacher"`` (:func:`load_split`).
      optimizer: ``"sgd"`` (with ``momentum``) or ``"adamw"`` (with ``weight_decay``).
      weight_decay: AdamW's decoupled weight decay.
      warmup_phase_steps: steps per warm-up density (None: one epoch, as in the paper; short
        runs scale the warm-up down with it).
      epochs: passes over the 1500 training images (ignored when ``steps`` is set).
      steps: total optimizer steps (overrides ``epochs``).
      batch_size: global batch, split evenly across all devices.
      learning_rate: the optimizer's learning rate.
      momentum: SGD's momentum (0 for none).
      hidden: MLP hidden width (CNN: channels of the second conv layer).
      layers: number of hidden layers of the MLP (LBANN's MNIST model: 3 of width 4096).
      max_in_flight: training steps queued ahead of the devices (``jaxcomm.paced``; 0 waits
        for every step).
      seed: parameter initialization and batch order (identical on every process).
      eval_every: steps between test-accuracy evaluations (the last step is always one).
      checkpoint_every: steps between checkpoints (0: none); a run resumes from the newest
        complete checkpoint in ``checkpoint_dir`` (:func:`jaxcomm.examples._loop.train_loop`).
      checkpoint_dir: directory of the checkpoints (None: ``<run_dir>/checkpoints`` when
        ``checkpoint_every`` is set and a ``run_dir`` is given).
      target, time_cap_s: stop at this test accuracy or after this much training
        (:class:`jaxcomm.examples._loop.Stopping`).
    """

    proportion: float = 16.0
    model: str = "mlp"
    data: str = "digits"
    optimizer: str = "sgd"
    weight_decay: float = 1e-4
    warmup_phase_steps: int | None = None
    epochs: int = 20
    steps: int | None = None
    batch_size: int = 64
    learning_rate: float = 0.05
    momentum: float = 0.9
    hidden: int = 64
    layers: int = 1
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    seed: int = 0
    eval_every: int = 25
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None

    def __post_init__(self) -> None:
        if self.model not in ("mlp", "cnn"):
            raise ValueError(f"model must be 'mlp' or 'cnn', got {self.model!r}")
        if self.data not in DATA:
            raise ValueError(f"data must be one of {DATA}, got {self.data!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        self.reduction()  # checks algorithm and grad_dtype
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {self.max_in_flight}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")

    def reduction(self) -> _loop.Reduction:
        """How this run reduces gradients."""
        return _loop.reduction_of(self)


class MLP(nn.Module):
    """64 → hidden (× layers) → 10 with ReLU."""

    hidden: int = 64
    layers: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.layers):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(10)(x)


class CNN(nn.Module):
    """Two 3x3 convolutions (the second with stride 2) and a dense classifier."""

    channels: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[:-1] + (8, 8, 1))
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(self.channels, (3, 3), strides=(2, 2))(x))
        return nn.Dense(10)(x.reshape(x.shape[:-3] + (-1,)))


def load_digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns (x_train, y_train, x_test, y_test): float32 pixels in [0, 1], int32 labels.

    Returns:
      Images of shape (n, 64) and labels of shape (n,); 1500 train and 297 test images.

    Example:
      >>> x_train, y_train, x_test, y_test = load_digits_split()
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(data.target))
    x = (data.data[order] / 16.0).astype(np.float32)
    y = data.target[order].astype(np.int32)
    return x[:-TEST_SIZE], y[:-TEST_SIZE], x[-TEST_SIZE:], y[-TEST_SIZE:]


@functools.cache
def load_teacher_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns (x_train, y_train, x_test, y_test) of the synthetic task: standard normal
    inputs of 64 features, labelled by the arg max of a fixed random linear map to 10 classes.

    No label is noisy, so accuracy keeps rising slowly as the boundaries sharpen: a 2M
    parameter MLP needs hundreds of steps where the digits take tens.

    Example:
      >>> x_train, y_train, x_test, y_test = load_teacher_split()
      >>> x_train.shape, x_test.shape
      ((60000, 64), (4000, 64))
    """
    rng = np.random.default_rng(TEACHER_SEED)
    weights = rng.standard_normal((64, 10))
    x = rng.standard_normal((sum(TEACHER_SIZES), 64)).astype(np.float32)
    y = np.argmax(x @ weights, -1).astype(np.int32)
    n = TEACHER_SIZES[0]
    return x[:n], y[:n], x[n:], y[n:]


def load_split(config: DigitsConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The run's (x_train, y_train, x_test, y_test): its ``data``."""
    return load_teacher_split() if config.data == "teacher" else load_digits_split()


def steps_per_epoch(config: DigitsConfig) -> int:
    """Optimizer steps in one pass over the training set."""
    return (len(load_split(config)[0])) // config.batch_size


def warmup_phase_steps(config: DigitsConfig) -> int:
    """Steps per density of the gTop-k warm-up: ``warmup_phase_steps``, else an epoch."""
    return config.warmup_phase_steps or steps_per_epoch(config)


def total_steps(config: DigitsConfig) -> int:
    """Steps of the run: ``config.steps``, or ``epochs`` full passes."""
    return config.steps if config.steps is not None else config.epochs * steps_per_epoch(config)


class Trainer(NamedTuple):
    """Compiled pieces of a run (see :func:`build`).

    Attributes:
      mesh: the ``dp`` mesh over all devices.
      init: ``() -> (params, opt_state)``, placed on the mesh (params replicated, residuals
        sharded per rank).
      step: the paced :class:`jaxcomm.examples._loop.Step`, ``(params, opt_state, x, y) ->
        (params, opt_state, loss, accuracy)``.
      accuracy: jitted ``(params, x, y) -> accuracy``.
      batch: ``(global step) -> (x, y)``: this process's slice of the global batch, placed.
      trace_count: ``() -> int``, how often ``step`` was traced (compilations).
      loss: ``(params, x, y) -> (cross-entropy, accuracy)`` (not jitted).
    """

    mesh: Mesh
    init: Callable[[], tuple[Any, Any]]
    step: _loop.Step
    accuracy: Callable[..., Any]
    batch: Callable[[int], tuple[jax.Array, jax.Array]]
    trace_count: Callable[[], int]
    loss: Callable[..., Any]


def build(config: DigitsConfig, mesh: Mesh | None = None) -> Trainer:
    """Builds the model, optimizer, placement and the jitted shard_mapped step.

    Args:
      config: the run's settings.
      mesh: a 1-D mesh with axis ``dp`` over all devices (default: all devices).

    Returns:
      A :class:`Trainer`.

    Example:
      >>> t = build(DigitsConfig(algorithm="gtopk"))
      >>> params, state = t.init()
      >>> params, state, loss, acc = t.step(params, state, *t.batch(0))
    """
    mesh = mesh if mesh is not None else _loop.data_parallel_mesh(config.diloco_sites)
    n_dev = mesh.size
    if config.batch_size % n_dev:
        raise ValueError(f"batch_size={config.batch_size} must be a multiple of {n_dev} devices")
    x_train, y_train, _, _ = load_split(config)
    model = MLP(config.hidden, config.layers) if config.model == "mlp" else CNN(config.hidden // 2)

    def loss_fn(p: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = model.apply(p, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == y)

    step = _loop.Step(
        loss_fn,
        _optimizer(config),
        config.reduction(),
        warmup_phase_steps(config),
        mesh,
        config.max_in_flight,
    )

    def init() -> tuple[Any, Any]:
        return step.init(model.init(jax.random.key(config.seed), jnp.zeros((1, 64), jnp.float32)))

    accuracy = jax.jit(lambda p, x, y: jnp.mean(jnp.argmax(model.apply(p, x), -1) == y))

    per_process = config.batch_size // jax.process_count()
    batches_per_epoch = len(x_train) // config.batch_size
    data_sharding = NamedSharding(mesh, _loop.batch_spec(mesh))

    def batch(global_step: int) -> tuple[jax.Array, jax.Array]:
        # Every process draws the same epoch permutation and feeds its contiguous slice.
        epoch, i = divmod(global_step, batches_per_epoch)
        order = np.random.default_rng([config.seed, epoch]).permutation(len(x_train))
        idx = order[i * config.batch_size : (i + 1) * config.batch_size]
        mine = idx[jax.process_index() * per_process : (jax.process_index() + 1) * per_process]
        return (
            jax.make_array_from_process_local_data(data_sharding, x_train[mine]),
            jax.make_array_from_process_local_data(data_sharding, y_train[mine]),
        )

    return Trainer(mesh, init, step, accuracy, batch, lambda: step.traces, loss_fn)


def _optimizer(config: DigitsConfig) -> optax.GradientTransformation:
    """The run's optimizer, applied after the gradients are averaged."""
    if config.optimizer == "adamw":
        return optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    return optax.sgd(config.learning_rate, momentum=config.momentum or None)


def train(*, logger: Any = None, run_dir: str | None = None, **config: Any) -> dict[str, Any]:
    """Trains on the digits and returns the final metrics.

    Args:
      logger: optional metrics sink with ``log(step, force=..., **fields)`` (the launcher
        passes its per-rank logger); it receives loss, accuracy, step and collective time and
        bytes at every evaluation.
      run_dir: optional directory; rank 0 writes ``digits-<model>-<label>.json`` there.
      **config: :class:`DigitsConfig` fields, e.g. ``algorithm="gtopk", density=0.01``.

    Returns:
      ``{"algorithm", "model", "grad_dtype", "steps", "test_accuracy", "train_loss",
      "bytes_sent_per_step", "dense_bytes_per_step", "comm_seconds_per_step",
      "step_seconds", "seconds", "history", "compilations"}``; bytes are per rank and step,
      from ``jaxcomm.metrics()`` (``psum``: a ring's bytes at the gradient dtype's width);
      ``comm_seconds_per_step`` is the time inside jaxcomm's collectives (None for ``psum``,
      whose time XLA does not report); ``seconds`` is training wall clock from the end of the
      first (compiling) step, evaluations excluded (a resumed run: since it resumed);
      ``resumed_from`` the steps its checkpoint had done (0: none); ``params_sha256`` a digest
      of the final parameters' bytes (equal digests: bit-identical models); ``history`` lists ``{"step", "seconds",
      "loss", "test_accuracy"}`` at every evaluation.

    Raises:
      TypeError: a keyword that is not a :class:`DigitsConfig` field.

    Example:
      >>> result = train(algorithm="gtopk", density=0.01, epochs=5)
      >>> result["test_accuracy"]  # doctest: +SKIP
    """
    cfg = _loop.make_config(DigitsConfig, config, "digits")
    trainer = build(cfg)
    n_dev = trainer.mesh.size
    _, _, x_test, y_test = load_split(cfg)
    x_test_d = jax.device_put(x_test, NamedSharding(trainer.mesh, P()))
    y_test_d = jax.device_put(y_test, NamedSharding(trainer.mesh, P()))
    params, state = trainer.init()
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    steps = total_steps(cfg)
    loop = _loop.train_loop(
        trainer.step,
        params,
        state,
        trainer.batch,
        lambda p: _loop.host_scalar(trainer.accuracy(p, x_test_d, y_test_d)),
        steps=steps,
        eval_every=cfg.eval_every,
        logger=logger,
        **_loop.checkpoint_options(cfg, run_dir),
        **cfg.loop_options(higher_is_better=True),
    )
    reduction = cfg.reduction()
    comm = _loop.communication_summary(reduction, n_params, n_dev, loop.timed_steps)
    result = {
        "workload": "digits",
        "algorithm": cfg.algorithm,
        "label": reduction.label(),
        "model": cfg.model,
        "data": cfg.data,
        "optimizer": cfg.optimizer,
        "grad_dtype": cfg.grad_dtype,
        "density": cfg.density if cfg.uses_density() else None,
        "proportion": cfg.proportion if cfg.algorithm == "adaptive" else None,
        **_loop.stop_summary(loop, cfg),
        "devices": n_dev,
        "parameters": n_params,
        "test_accuracy": loop.evaluation,
        "train_loss": loop.loss,
        **comm,
        "step_seconds": loop.seconds / loop.timed_steps,
        "seconds": loop.seconds,
        "history": loop.history,
        "compilations": trainer.trace_count(),
        "resumed_from": loop.resumed_from,
        "params_sha256": _loop.params_digest(loop.params),
    }
    if cfg.algorithm == "auto":  # what the cost model chose for each bucket
        result["auto_choices"] = cost.auto_decisions()
        result["auto"] = jaxcomm.metrics()["auto"]  # measurements and learning
    if run_dir is not None and jax.process_index() == 0:
        path = pathlib.Path(run_dir) / f"digits-{cfg.model}-{reduction.label()}.json"
        path.write_text(json.dumps(result, indent=2))
    if logger is not None:
        logger.log(
            loop.steps - 1,
            force=True,
            bytes_sent=result["bytes_sent_per_step"],
            compression_ratio=result["dense_bytes_per_step"]
            / max(1.0, result["bytes_sent_per_step"]),
        )
    return result


def main() -> None:
    """Command line: ``python -m jaxcomm.examples.digits --devices 4 --algorithm gtopk``."""
    _loop.command_line(__doc__.splitlines()[0], DigitsConfig, train)


if __name__ == "__main__":
    main()
