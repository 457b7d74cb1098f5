"""Data-parallel byte-level language model on the Python standard library's own source.

A small decoder-only transformer (default 6 layers of width 384: about 10.9M parameters) learns
to predict the next byte of the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``, a
corpus every machine has offline. The last 5 % of the corpus (files in sorted path order) is
held out; the validation loss is reported in bits per byte. Gradients are reduced like the
digits example's (:mod:`jaxcomm.examples._loop`): ``psum`` (XLA), ``dense`` (jaxcomm's ring),
``gtopk`` / ``topk_allgather`` (with the gTop-k warm-up), ``adaptive``, ``onebit``,
``threshold``, each optionally on bf16 gradients.

Use it from Python (``train(algorithm="gtopk", steps=200)``), from the command line
(``python -m jaxcomm.examples.bytes_lm --devices 4 --algorithm dense --steps 50``) or as the
launcher job ``bytes-lm``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import sysconfig
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
from jaxcomm import algorithms, cost
from jaxcomm.examples import _loop
from jaxcomm.pacing import DEFAULT_MAX_IN_FLIGHT

VALIDATION_FRACTION = 0.05


@dataclasses.dataclass(frozen=True)
class BytesLMConfig(_loop.Reduction, _loop.Stopping):
    """Settings of one run.

    Attributes:
      algorithm, density, warmup, proportion, tau, grad_dtype, bucket_size, allowed, profile:
        the gradient reduction (:class:`jaxcomm.examples._loop.Reduction`, whose fields these
        are).
      warmup_phase_steps: steps per gTop-k warm-up density (the paper uses one epoch; an
        epoch of this corpus is thousands of steps, so short runs set it).
      steps: optimizer steps.
      batch_size: global batch in sequences, split evenly across all devices.
      seq_len: bytes of context per sequence.
      width, layers, heads: the transformer (MLP width 4 x ``width``).
      learning_rate: AdamW's learning rate.
      weight_decay: AdamW's decoupled weight decay (0: Adam).
      max_corpus_bytes: the corpus is cut to this many bytes (memory).
      eval_every: steps between validation evaluations.
      eval_sequences: validation windows per evaluation (fixed positions).
      max_in_flight: training steps queued ahead of the devices (``jaxcomm.paced``; 0 waits
        for every step).
      seed: initialization, batch order and validation windows.
      checkpoint_every, checkpoint_dir: as in :class:`jaxcomm.examples.digits.DigitsConfig`.
      target, time_cap_s: stop at this validation bits per byte or after this much training
        (:class:`jaxcomm.examples._loop.Stopping`).
    """

    warmup_phase_steps: int = 50
    steps: int = 200
    batch_size: int = 32
    seq_len: int = 128
    width: int = 384
    layers: int = 6
    heads: int = 6
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    max_corpus_bytes: int = 16 << 20
    eval_every: int = 50
    eval_sequences: int = 64
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    seed: int = 0
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None

    def reduction(self) -> _loop.Reduction:
        """How this run reduces gradients."""
        return _loop.reduction_of(self)

    def __post_init__(self) -> None:
        self.reduction()
        if self.width % self.heads:
            raise ValueError(f"width={self.width} must be a multiple of heads={self.heads}")
        for name in ("steps", "batch_size", "seq_len", "layers", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {self.max_in_flight}")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))


class ByteTransformer(nn.Module):
    """Decoder-only transformer over bytes: logits of the next byte at every position."""

    width: int = 384
    layers: int = 6
    heads: int = 6
    seq_len: int = 128

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(256, self.width)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.width))
        x = x + pos[: tokens.shape[-1]]
        for _ in range(self.layers):
            x = Block(self.width, self.heads)(x)
        return nn.Dense(256)(nn.LayerNorm()(x))


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of the standard library's ``.py`` files: (train, validation) uint8 arrays.

    Files are read in sorted path order (site-packages excluded) until ``max_bytes``; the last
    5 % is the validation split. Every process of a run computes the same arrays.

    Args:
      max_bytes: most bytes read.

    Returns:
      ``(train, validation)``.

    Example:
      >>> train_bytes, val_bytes = load_corpus(1 << 20)
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or not path.is_file():
            continue
        data = path.read_bytes()
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks), np.uint8)
    split = int(len(corpus) * (1 - VALIDATION_FRACTION))
    return corpus[:split], corpus[split:]


def _windows(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    return np.stack([data[s : s + length] for s in starts]).astype(np.int32)


class Trainer(NamedTuple):
    """Compiled pieces of a run (see :func:`build`).

    Attributes:
      mesh: the ``dp`` mesh over all devices.
      init: ``() -> (params, opt_state)``, placed on the mesh.
      step: the paced :class:`jaxcomm.examples._loop.Step`, ``(params, opt_state, windows)
        -> (params, opt_state, loss, bits per byte)``.
      loss: ``(params, windows) -> (loss in nats, bits per byte)`` (not jitted).
      batch: ``(global step) -> (windows,)``: this process's slice of the global batch.
      corpus: ``(train bytes, validation bytes)``.
    """

    mesh: Mesh
    init: Callable[[], tuple[Any, Any]]
    step: _loop.Step
    loss: Callable[..., Any]
    batch: Callable[[int], tuple[jax.Array]]
    corpus: tuple[np.ndarray, np.ndarray]


def build(cfg: BytesLMConfig) -> Trainer:
    """Builds the model, optimizer, placement, data and the jitted shard_mapped step.

    Example:
      >>> t = build(BytesLMConfig(algorithm="dense", steps=1, width=64, layers=2, heads=2))
      >>> params, state = t.init()  # doctest: +SKIP
      >>> params, state, loss, bits = t.step(params, state, *t.batch(0))  # doctest: +SKIP
    """
    mesh = _loop.data_parallel_mesh(cfg.diloco_sites)
    if cfg.batch_size % mesh.size:
        raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of {mesh.size} devices")
    train_bytes, val_bytes = load_corpus(cfg.max_corpus_bytes)
    model = ByteTransformer(cfg.width, cfg.layers, cfg.heads, cfg.seq_len)
    loss_fn = functools.partial(_loss_and_bits, model)
    optimizer = optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay)
    step = _loop.Step(
        loss_fn, optimizer, cfg.reduction(), cfg.warmup_phase_steps, mesh, cfg.max_in_flight
    )

    def init() -> tuple[Any, Any]:
        tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
        return step.init(model.init(jax.random.key(cfg.seed), tokens))

    batch = _batches(cfg, mesh, train_bytes)
    return Trainer(mesh, init, step, loss_fn, batch, (train_bytes, val_bytes))


def train(*, logger: Any = None, run_dir: str | None = None, **config: Any) -> dict[str, Any]:
    """Trains the byte LM and returns the final metrics.

    Args:
      logger: optional metrics sink with ``log(step, force=..., **fields)`` (see
        :func:`jaxcomm.examples.digits.train`).
      run_dir: optional directory; rank 0 writes ``bytes-lm-<label>.json`` there.
      **config: :class:`BytesLMConfig` fields.

    Returns:
      ``{"workload", "algorithm", "label", "steps", "devices", "parameters",
      "validation_bits_per_byte", "train_loss", "bytes_sent_per_step",
      "dense_bytes_per_step", "comm_seconds_per_step", "step_seconds", "seconds",
      "history"}``.

    Raises:
      TypeError: a keyword that is not a :class:`BytesLMConfig` field.

    Example:
      >>> result = train(algorithm="dense", steps=20, width=64, layers=2, heads=2)
      >>> result["validation_bits_per_byte"]  # doctest: +SKIP
    """
    cfg = _loop.make_config(BytesLMConfig, config, "bytes-lm")
    t = build(cfg)
    train_bytes, val_bytes = t.corpus
    params, state = t.init()
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    loop = _loop.train_loop(
        t.step,
        params,
        state,
        t.batch,
        _validation(cfg, t.mesh, val_bytes, t.loss),
        steps=cfg.steps,
        eval_every=cfg.eval_every,
        eval_name="validation_bits_per_byte",
        metric_name="train_bits_per_byte",
        logger=logger,
        **_loop.checkpoint_options(cfg, run_dir),
        **cfg.loop_options(higher_is_better=False),
    )
    result = _result(cfg, loop, t.step, n_params, len(train_bytes) + len(val_bytes))
    if run_dir is not None and jax.process_index() == 0:
        path = pathlib.Path(run_dir) / f"bytes-lm-{result['label']}.json"
        path.write_text(json.dumps(result, indent=2))
    return result


def _loss_and_bits(
    model: ByteTransformer, p: Any, window: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The next-byte cross-entropy of ``window`` (nats) and the same in bits per byte."""
    logits = model.apply(p, window[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, window[:, 1:]).mean()
    return loss, loss / math.log(2)


def _batches(
    cfg: BytesLMConfig, mesh: Mesh, train_bytes: np.ndarray
) -> Callable[[int], tuple[jax.Array]]:
    """``global step -> (windows,)``: ``batch_size`` random training windows of
    ``seq_len + 1`` bytes, drawn from the seed and the step (the same on every process), each
    process feeding its contiguous slice."""
    per_process = cfg.batch_size // jax.process_count()
    sharding = NamedSharding(mesh, _loop.batch_spec(mesh))
    span = cfg.seq_len + 1

    def batch(global_step: int) -> tuple[jax.Array]:
        starts = np.random.default_rng([cfg.seed, global_step]).integers(
            0, len(train_bytes) - span, cfg.batch_size
        )
        mine = starts[jax.process_index() * per_process : (jax.process_index() + 1) * per_process]
        return (
            jax.make_array_from_process_local_data(sharding, _windows(train_bytes, mine, span)),
        )

    return batch


def _validation(
    cfg: BytesLMConfig, mesh: Mesh, val_bytes: np.ndarray, loss_fn: Callable[..., Any]
) -> Callable[[Any], float]:
    """``params -> validation bits per byte`` on ``eval_sequences`` fixed windows."""
    span = cfg.seq_len + 1
    val_starts = np.random.default_rng([cfg.seed, 1 << 30]).integers(
        0, len(val_bytes) - span, cfg.eval_sequences
    )
    val = jax.device_put(_windows(val_bytes, val_starts, span), NamedSharding(mesh, P()))
    val_bits = jax.jit(lambda p, w: loss_fn(p, w)[1])
    return lambda p: _loop.host_scalar(val_bits(p, val))


def _result(
    cfg: BytesLMConfig, loop: _loop.LoopResult, step: _loop.Step, n_params: int, corpus: int
) -> dict[str, Any]:
    """The run's result JSON (see :func:`train`)."""
    reduction = cfg.reduction()
    n_dev = step.mesh.size
    result = {
        "workload": "bytes-lm",
        "algorithm": cfg.algorithm,
        "label": reduction.label(),
        "grad_dtype": cfg.grad_dtype,
        "density": cfg.density if cfg.uses_density() else None,
        "proportion": cfg.proportion if cfg.algorithm == "adaptive" else None,
        "diloco": _loop.diloco_summary(cfg),
        **_loop.stop_summary(loop, cfg),
        "devices": n_dev,
        "parameters": n_params,
        "corpus_bytes": int(corpus),
        "validation_bits_per_byte": loop.evaluation,
        "train_loss": loop.loss,
        **_loop.communication_summary(reduction, n_params, n_dev, loop.timed_steps),
        "step_seconds": loop.seconds / loop.timed_steps,
        "seconds": loop.seconds,
        "history": loop.history,
        "compilations": step.traces,
        "resumed_from": loop.resumed_from,
        "params_sha256": _loop.params_digest(loop.params),
    }
    if cfg.algorithm == algorithms.AUTO:  # what the cost model chose for each bucket
        result["auto_choices"] = cost.auto_decisions()
        result["auto"] = jaxcomm.metrics()["auto"]  # measurements and learning
    return result


def main() -> None:
    """Command line: ``python -m jaxcomm.examples.bytes_lm --devices 4 --algorithm gtopk``."""
    _loop.command_line(__doc__.splitlines()[0], BytesLMConfig, train)


if __name__ == "__main__":
    main()
