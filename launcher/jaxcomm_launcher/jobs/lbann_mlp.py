"""``lbann-mlp``: the LBANN paper's MNIST model on scikit-learn's digits (no download).

Dryden et al. (2016) train three 4096-wide fully connected layers with ReLU and a 10-way
softmax for 20 epochs, 4-way data parallel with 10 images per replica (Table 1: normal
98.51 %, one-bit 98.49 %, threshold 98.12 %, adaptive π = 64 98.53 %). This job trains that
architecture on the 8x8 digits (64 inputs: 64·4096 + 2·4096² + 4096·10 weights, about 33.9M
parameters, a 136 MB float32 gradient) with :mod:`jaxcomm.examples.digits`. Recipe fields as for
``digits`` (``train.hidden`` should be 4096, ``train.batch_size`` 10 per rank); ``args`` may
set ``layers`` (default 3), ``proportion`` (default 64, LBANN's), ``epochs`` (overrides
``train.steps``), ``warmup``, ``warmup_phase_steps`` (steps per warm-up density; default an
epoch), ``max_in_flight``.
"""

from __future__ import annotations

from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import example_settings, train_example

LAYERS = 3
PROPORTION = 64.0


def run(ctx: JobContext) -> None:
    """Trains the LBANN MLP on this rank and logs loss/accuracy/bytes through ``ctx.metrics``.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; rank 0 also writes ``digits-mlp-<label>.json`` (with the accuracy-vs-time
        history) to the run directory.

    Example:
        >>> # jaxcomm launch recipes/lbann-mlp.yaml
    """
    from jaxcomm.examples.digits import train

    args = ctx.args or {}
    overrides = {
        **example_settings(ctx),
        "model": "mlp",
        "layers": args.get("layers", LAYERS),
        "proportion": args.get("proportion", PROPORTION),
    }
    if "epochs" in args:
        overrides["steps"] = None  # epochs decide
    train_example(
        ctx, train, overrides, "lbann-mlp", lambda r: f"test accuracy {r['test_accuracy']:.4f}"
    )
