"""``digits``: data-parallel Flax model on scikit-learn's bundled 8x8 digits (no download).

The training code lives in :mod:`jaxcomm.examples.digits` (one implementation for the
launcher, the tests and users); this job hands it the rank's context. The recipe's
``jaxcomm.algorithm`` picks how gradients are reduced through ``jaxcomm.optax``:
``psum`` (``lax.pmean``, the XLA baseline), ``dense`` (jaxcomm's UCX ring), ``gtopk``,
``topk_allgather``, ``adaptive``, ``onebit``, ``threshold``, ``auto`` (per bucket,
from the cost model; ``jaxcomm.allowed`` and ``jaxcomm.profile`` steer it). Recipe ``train`` fields:
steps, batch_size (global), learning_rate, momentum, hidden, eval_every, seed; ``args`` may
set model (mlp/cnn), data (digits/teacher), optimizer (sgd/adamw), weight_decay,
warmup, proportion, tau, epochs.
"""

from __future__ import annotations

from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import example_settings, print_auto


def run(ctx: JobContext) -> None:
    """Trains on this rank and logs loss/accuracy/bytes through ``ctx.metrics``.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; rank 0 also writes ``digits-<model>-<algorithm>.json`` to the run directory.

    Example:
        >>> # jaxcomm launch recipes/digits-dense.yaml
    """
    from jaxcomm.examples.digits import train

    result = train(logger=ctx.metrics, run_dir=str(ctx.run_dir), **example_settings(ctx))
    if ctx.is_main:
        ctx.print(
            f"digits {result['algorithm']}: test accuracy {result['test_accuracy']:.4f}, "
            f"{result['bytes_sent_per_step']:.0f} bytes sent per rank and step"
        )
    print_auto(ctx, result, "digits")
