"""Flax NNX with jaxcomm: an MLP on scikit-learn's digits, data-parallel over every device.

The module's parameters (``nnx.split``) are the pytree the step trains; the step is
:func:`jaxcomm.data_parallel_step`, which averages the gradients with jaxcomm's reduction.
Run: ``python -m jaxcomm.examples.flax_nnx --devices 2``.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import jaxcomm
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxcomm.examples.digits import load_digits_split


class MLP(nnx.Module):
    def __init__(self, hidden: int, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(64, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


def train(
    steps: int = 400, batch_size: int = 64, seed: int = 0, algorithm: Any = "auto"
) -> dict[str, float]:
    """Trains the MLP; returns the last step's global loss and the test accuracy."""
    x_train, y_train, x_test, y_test = load_digits_split()
    mesh = jax.make_mesh((jax.device_count(),), ("dp",))
    rows = NamedSharding(mesh, P("dp"))
    model = MLP(128, nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)  # the trainable state: a pytree

    def loss_fn(params: nnx.State, x: jax.Array, y: jax.Array) -> tuple:
        logits = nnx.merge(graphdef, params)(x)
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
    nnx.update(model, params)
    accuracy = float(jnp.mean(jnp.argmax(model(x_test), -1) == y_test))
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
