"""``digits``: a data-parallel MLP on scikit-learn's bundled 8x8 digits (no download).

Plain JAX + optax. Every process holds the same data and the same initial parameters; each
step draws one global batch (same seed everywhere), each process feeds its slice, and the
gradients are averaged over all devices of all processes inside one
``jax.jit(shard_map(...))`` step:

- ``jaxcomm.algorithm: dense`` → ``lax.pmean(grads, "dp")``;
- any other algorithm → ``jaxcomm.optax.allreduce_gradients(...)`` chained before SGD, once
  that module exists; until then the job stops with a "not available in this build" error.

Recipe ``train`` fields used: steps, batch_size (global), learning_rate, momentum, hidden,
eval_every, seed.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import (
    AXIS,
    data_parallel_mesh,
    host_scalar,
    jaxcomm_module,
    replicate,
    ring_allreduce_bytes,
    shard_batch,
)

TEST_SIZE = 297  # 297 of the 1797 images are held out; the other 1500 are for training
SPLIT_SEED = 1234  # a fixed shuffle: the file is ordered by writer, its tail is atypical


def load_digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns (x_train, y_train, x_test, y_test) of the 8x8 digits, pixels scaled to [0, 1].

    Returns:
        float32 images of shape (n, 64) and int32 labels.

    Example:
        >>> x_train, y_train, x_test, y_test = load_digits_split()
        >>> x_train.shape, x_test.shape
        ((1500, 64), (297, 64))
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(data.target))
    x = (data.data[order] / 16.0).astype(np.float32)
    y = data.target[order].astype(np.int32)
    return x[:-TEST_SIZE], y[:-TEST_SIZE], x[-TEST_SIZE:], y[-TEST_SIZE:]


def init_params(seed: int, hidden: int) -> dict[str, Any]:
    """Returns MLP parameters 64 → hidden → 10 (He-scaled normal weights, zero biases).

    Args:
        seed: PRNG seed; equal on every process so the replicas start identical.
        hidden: Width of the hidden layer.

    Returns:
        A dict of NumPy arrays.

    Example:
        >>> sorted(init_params(0, 32))
        ['b1', 'b2', 'w1', 'w2']
    """
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((64, hidden)) * np.sqrt(2.0 / 64)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 10)) * np.sqrt(2.0 / hidden)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def _logits(params: dict[str, Any], x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def _gradient_transform(ctx: JobContext) -> optax.GradientTransformation | None:
    """Returns jaxcomm's gradient allreduce for non-dense algorithms (None for dense)."""
    s = ctx.jaxcomm
    if s.algorithm == "dense":
        return None
    module = jaxcomm_module("optax", "allreduce_gradients", s.algorithm)
    return module.allreduce_gradients(
        axis_name=AXIS,
        algorithm=s.algorithm,
        compressor=s.compressor,
        density=s.density,
        hierarchical=s.hierarchical,
    )


def run(ctx: JobContext) -> None:
    """Trains the MLP and logs loss, accuracy, step time and (estimated) bytes per step.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; metrics go to ``ctx.metrics``, the final test accuracy is printed by rank 0.

    Example:
        >>> # recipes/digits-dense.yaml: {job: digits, world: {processes: 2}, ...}
    """
    t = ctx.train
    reducer = _gradient_transform(ctx)  # fails early and clearly if not available
    mesh = data_parallel_mesh()
    n_dev = mesh.size
    if t.batch_size % n_dev:
        raise ValueError(
            f"train.batch_size={t.batch_size} must be a multiple of the {n_dev} devices "
            f"(world.processes x world.devices_per_process); try {n_dev * max(1, t.batch_size // n_dev)}"
        )
    per_process = t.batch_size // ctx.world_size

    x_train, y_train, x_test, y_test = load_digits_split()
    sgd = optax.sgd(t.learning_rate, momentum=t.momentum or None)
    optimizer = optax.chain(reducer, sgd) if reducer is not None else sgd

    params = replicate(init_params(t.seed, t.hidden), mesh)
    replicated = jax.sharding.NamedSharding(mesh, P())
    opt_state = jax.jit(optimizer.init, out_shardings=replicated)(params)

    def local_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        def loss_fn(p: Any) -> jax.Array:
            logits = _logits(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if reducer is None:
            grads = lax.pmean(grads, AXIS)  # the dense baseline
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        acc = jnp.mean(jnp.argmax(logits, -1) == y)
        return params, opt_state, lax.pmean(loss, AXIS), lax.pmean(acc, AXIS)

    step_fn = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(P(), P(), P(AXIS), P(AXIS)),
            out_specs=(P(), P(), P(), P()),
        ),
        donate_argnums=(0, 1),
    )
    # Collective time of the dense gradient allreduce alone, measured at eval points.
    pmean_only = jax.jit(
        jax.shard_map(lambda g: lax.pmean(g, AXIS), mesh=mesh, in_specs=P(), out_specs=P())
    )
    test_acc_fn = jax.jit(
        lambda p: jnp.mean(jnp.argmax(_logits(p, jnp.asarray(x_test)), -1) == y_test)
    )

    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    bytes_step = ring_allreduce_bytes(n_params * 4, n_dev) * ctx.devices_per_process
    ctx.print(
        f"digits: {ctx.jaxcomm.display_label()}, {n_dev} devices, {n_params} parameters, "
        f"global batch {t.batch_size}, {t.steps} steps"
    )
    rng = np.random.default_rng(t.seed + 1)
    acc_test = float("nan")
    for step in range(t.steps):
        # Same global batch on every process; each keeps its contiguous slice.
        idx = rng.choice(len(x_train), t.batch_size, replace=False)
        mine = idx[ctx.rank * per_process : (ctx.rank + 1) * per_process]
        xb = shard_batch(x_train[mine], mesh)
        yb = shard_batch(y_train[mine], mesh)
        t0 = time.perf_counter()
        params, opt_state, loss, acc = step_fn(params, opt_state, xb, yb)
        loss_v = host_scalar(loss)  # blocks: the step time includes the allreduce
        dt = time.perf_counter() - t0
        record: dict[str, Any] = {
            "loss": loss_v,
            "accuracy": host_scalar(acc),
            "step_time_s": dt,
            "bytes_sent": bytes_step if reducer is None else None,
            "bytes_received": bytes_step if reducer is None else None,
            "compression_ratio": 1.0 if reducer is None else None,
        }
        last = step == t.steps - 1
        if step % t.eval_every == 0 or last:
            acc_test = host_scalar(test_acc_fn(params))
            c0 = time.perf_counter()
            jax.block_until_ready(pmean_only(params))
            record["collective_time_s"] = time.perf_counter() - c0
            record["test_accuracy"] = acc_test
            if ctx.is_main:
                ctx.print(f"step {step:4d}  loss {loss_v:.4f}  test accuracy {acc_test:.4f}")
        ctx.metrics.log(step, force=last or "test_accuracy" in record, **record)
    if ctx.is_main:
        ctx.print(f"digits: final test accuracy {acc_test:.4f}")
