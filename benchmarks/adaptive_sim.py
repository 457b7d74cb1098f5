"""NumPy simulation of LBANN's adaptive-quantized allreduce inside a data-parallel training loop.

Dryden et al. 2016 §3.3-3.4: every replica quantizes ``gradient + residual`` per column (the
largest k/π values of each sign, decoded to their mean; error feedback), the column-aligned
slices go to their owners, which decode, sum, requantize with the same π (their
requantization error joins their own residual), and the quantized sums are allgathered. This
script runs that scheme in NumPy on P simulated replicas (gradients from JAX, vmapped over the
replicas on one device) with SGD + momentum, to compare two ways of counting k:

- ``nonzero``: k = the number of values of the sign (what jaxcomm did before issue 11): the
  owner's requantization of the sparse sum keeps 1/π of its few nonzeros;
- ``paper``: k = the non-negative (non-positive) values, zeros included, as the paper words
  it; zeros are never sent (what jaxcomm does now, kernels/adaptive.h AdaptiveSignKeep);
- ``dense``: plain averaging, the reference.

Prints, every 10 steps, the loss, test accuracy, the norm of the applied update relative to
the dense average, the residuals' norm and the fraction of nonzero entries in the update.

Usage:
  python benchmarks/adaptive_sim.py --rule nonzero --steps 100
  python benchmarks/adaptive_sim.py --rule paper --steps 400 --out sim.json
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from jaxcomm.examples.digits import MLP, load_digits_split


def adaptive_quantize(acc: np.ndarray, proportion: float, column: int, rule: str) -> np.ndarray:
    """Decoded adaptive quantization of `acc`, column by column (ties: any order)."""
    n = acc.size
    pad = (-n) % column
    a = np.concatenate([acc, np.zeros(pad, acc.dtype)]).reshape(-1, column).astype(np.float64)
    valid = (np.arange(a.size) < n).reshape(a.shape)
    out = np.zeros_like(a)
    for sign in (1.0, -1.0):
        v = sign * a
        mine = v > 0
        count = mine.sum(1)
        base = ((v >= 0) & valid).sum(1) if rule == "paper" else count
        keep = np.minimum(count, np.ceil(base / proportion).astype(np.int64))
        ranked = np.sort(np.where(mine, v, -np.inf), axis=1)[:, ::-1]
        tau = ranked[np.arange(len(ranked)), np.maximum(keep - 1, 0)]
        chosen = mine & (v >= tau[:, None]) & (keep[:, None] > 0)
        sent = chosen.sum(1)
        mean = np.where(sent > 0, (v * chosen).sum(1) / np.maximum(sent, 1), 0.0)
        out += np.where(chosen, sign * mean[:, None], 0.0)
    return out.reshape(-1)[:n].astype(np.float32)


def quantized_allreduce(grads, residuals, proportion, column, rule):
    """Sum over replicas through the quantized allreduce; returns (sum, new residuals)."""
    parts = len(grads)
    n = grads[0].size
    accs = [g + r for g, r in zip(grads, residuals, strict=True)]
    decoded = [adaptive_quantize(a, proportion, column, rule) for a in accs]
    new_residuals = [a - d for a, d in zip(accs, decoded, strict=True)]
    total = np.sum(decoded, axis=0, dtype=np.float32)
    units = -(-n // column)
    result = np.zeros(n, np.float32)
    for s in range(parts):  # owner s requantizes its column-aligned slice
        b = min(n, (s * (units // parts) + min(s, units % parts)) * column)
        e = min(n, ((s + 1) * (units // parts) + min(s + 1, units % parts)) * column)
        requantized = adaptive_quantize(total[b:e], proportion, column, rule)
        result[b:e] = requantized
        new_residuals[s][b:e] += total[b:e] - requantized
    return result, new_residuals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rule", choices=["nonzero", "paper", "dense"], required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--proportion", type=float, default=64.0)
    parser.add_argument("--column-size", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=40, help="global batch")
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON of the records")
    args = parser.parse_args()

    x_train, y_train, x_test, y_test = load_digits_split()
    model = MLP(args.hidden, args.layers)
    flat, unravel = ravel_pytree(model.init(jax.random.key(0), jnp.zeros((1, 64))))

    def loss_fn(f, x, y):
        logits = model.apply(unravel(f), x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grads_of = jax.jit(jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0, 0)))
    accuracy = jax.jit(
        lambda f: jnp.mean(jnp.argmax(model.apply(unravel(f), x_test), -1) == y_test)
    )
    tx = optax.sgd(args.learning_rate, momentum=args.momentum)
    state = tx.init(flat)
    residuals = [np.zeros(flat.size, np.float32) for _ in range(args.replicas)]
    per_epoch = len(x_train) // args.batch_size
    records = []
    for i in range(args.steps):
        epoch, j = divmod(i, per_epoch)
        idx = np.random.default_rng([0, epoch]).permutation(len(x_train))
        idx = idx[j * args.batch_size : (j + 1) * args.batch_size]
        loss, g = grads_of(
            flat,
            x_train[idx].reshape(args.replicas, -1, 64),
            y_train[idx].reshape(args.replicas, -1),
        )
        g = np.asarray(g)
        dense = g.mean(0)
        if args.rule == "dense":
            update = dense
        else:
            summed, residuals = quantized_allreduce(
                list(g), residuals, args.proportion, args.column_size, args.rule
            )
            update = summed / args.replicas
        u, state = tx.update(jnp.asarray(update), state)
        flat = flat + u
        if i % 10 == 0 or i == args.steps - 1:
            record = {
                "rule": args.rule,
                "step": i,
                "loss": float(loss.mean()),
                "test_accuracy": float(accuracy(flat)),
                "update_norm_vs_dense": float(np.linalg.norm(update) / np.linalg.norm(dense)),
                "residual_norm": float(
                    np.sqrt(sum(float((r.astype(np.float64) ** 2).sum()) for r in residuals))
                ),
                "update_nonzero_fraction": float(np.count_nonzero(update) / update.size),
            }
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
