"""Data-parallel training of an MLP on scikit-learn's digits: ``jax.jit``, a batch placed
with ``NamedSharding`` over the ``dp`` axis, Optax.

``adopt_plain.py`` is the plain JAX loop, ``adopt_jaxcomm.py`` the same loop with jaxcomm;
``diff adopt_plain.py adopt_jaxcomm.py`` shows every line that changes. Run:
``python -m jaxcomm.examples.adopt_plain --devices 2`` (or ``adopt_jaxcomm``).
"""

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits


def init_params(key: jax.Array, sizes: tuple = (64, 128, 10)) -> list:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (n, m)) * np.sqrt(2.0 / n), jnp.zeros(m))
        for k, n, m in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def predict(params: list, x: jax.Array) -> jax.Array:
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss_fn(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(predict(params, x), y).mean()


def train(steps: int = 400, batch_size: int = 64, seed: int = 0) -> dict[str, float]:
    digits = load_digits()
    order = np.random.default_rng(1234).permutation(len(digits.target))
    x, y = (digits.data[order] / 16.0).astype(np.float32), digits.target[order].astype(np.int32)
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

    mesh = jax.make_mesh((jax.device_count(),), ("dp",), axis_types=(AxisType.Auto,))
    rows = NamedSharding(mesh, P("dp"))  # each device takes its rows of the batch
    params = init_params(jax.random.key(seed))
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params: list, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = rng.choice(len(x_train), batch_size, replace=False)
        xb, yb = jax.device_put((x_train[batch], y_train[batch]), rows)
        params, opt_state, loss = train_step(params, opt_state, xb, yb)
    accuracy = float(jnp.mean(jnp.argmax(predict(params, x_test), -1) == y_test))
    return {"loss": float(loss), "test_accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="CPU devices in this process")
    jax.config.update("jax_num_cpu_devices", parser.parse_args().devices)
    print(train())
