"""Trains the wide MLP of issue 11 with Adaptive(π = 64) and with the dense ring (4 CPU devices)
and writes their results (tests/test_adaptive_training.py)."""

from __future__ import annotations

import argparse
import json
import sys

# The setting: 64 -> 1024 -> 1024 -> 1024 -> 10, SGD lr 0.05 momentum 0.9, batch 40.
MODEL = {"layers": 3, "hidden": 1024, "batch_size": 40, "learning_rate": 0.05, "momentum": 0.9}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    from jaxcomm.examples import digits

    runs = {}
    for algorithm in ("adaptive", "dense"):
        runs[algorithm] = digits.train(
            algorithm=algorithm, proportion=64.0, steps=args.steps, eval_every=10, **MODEL
        )
    with open(args.out, "w") as f:
        json.dump(runs, f)
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    sys.exit(main())
