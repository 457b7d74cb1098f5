"""Flax Linen with jaxcomm: an MLP on scikit-learn's digits, data-parallel over every device.

The ``params`` collection is the pytree the step trains; the step is
:func:`jaxcomm.data_parallel_step`, which averages the gradients with jaxcomm's reduction.
Run: ``python -m jaxcomm.examples.flax_linen --devices 2``.
"""

from __future__ import annotations

import argparse
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxcomm
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxcomm.examples.digits import load_digits_split


class MLP(nn.Module):
    hidden: int = 128

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))


def train(
    steps: int = 400, batch_size: int = 64, seed: int = 0, algorithm: Any = "auto"
) -> dict[str, float]:
    """Trains the MLP; returns the last step's global loss and the test accuracy."""
    x_train, y_train, x_test, y_test = load_digits_split()
    mesh = jax.make_mesh((jax.device_count(),), ("dp",))
    rows = NamedSharding(mesh, P("dp"))
    model = MLP()
    params = model.init(jax.random.key(seed), x_train[:1])["params"]

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> tuple:
        logits = model.apply({"params": params}, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}

    tx = optax.adam(1e-3)
    step = jaxcomm.data_parallel_step(loss_fn, tx, mesh, algorithm=algorithm, has_aux=True)
    opt_state = tx.init(params)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = rng.choice(len(x_train), batch_size, replace=False)
        xb, yb = jax.device_put((x_train[batch], y_train[batch]), rows)
        params, opt_state, loss, metrics = step(params, opt_state, xb, yb)
    params, opt_state = step.finish(params, opt_state)
    logits = model.apply({"params": params}, x_test)
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
    return {
        "loss": float(loss),
        "train_accuracy": float(metrics["accuracy"]),
        "test_accuracy": accuracy,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU devices in this process")
    jax.config.update("jax_num_cpu_devices", parser.parse_args().devices)
    print(train())
