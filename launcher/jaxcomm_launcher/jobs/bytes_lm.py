"""``bytes-lm``: a byte-level decoder-only transformer on the Python standard library's source.

The training code is :mod:`jaxcomm.examples.bytes_lm` (default: 6 layers of width 384, about
10.9M parameters, 128-byte context); the validation loss is reported in bits per byte. The
recipe's ``jaxcomm`` settings pick the gradient reduction; ``args`` may set any
``BytesLMConfig`` field (steps, batch_size, seq_len, width, layers, heads, learning_rate,
eval_every, warmup_phase_steps, max_corpus_bytes, proportion, ...). ``train.steps`` and
``train.batch_size`` are used unless ``args`` sets them.
"""

from __future__ import annotations

from jaxcomm_launcher.context import JobContext
from jaxcomm_launcher.jobs._common import (
    JAXCOMM_FIELDS,
    example_settings,
    print_auto,
    train_example,
)


def run(ctx: JobContext) -> None:
    """Trains the byte LM on this rank and logs loss/validation bits per byte.

    Args:
        ctx: The job context of this rank.

    Returns:
        None; rank 0 also writes ``bytes-lm-<label>.json`` to the run directory.

    Example:
        >>> # jaxcomm launch recipes/bytes-lm.yaml
    """
    from jaxcomm.examples.bytes_lm import train

    # recipe.train's steps, batch_size, eval_every, seed and stopping rule, unless args sets
    # them.
    settings = example_settings(
        ctx,
        ("steps", "batch_size", "eval_every", "seed", "target", "time_cap_s", "checkpoint_every"),
        JAXCOMM_FIELDS,
    )
    result = train_example(
        ctx,
        train,
        settings,
        "bytes-lm",
        lambda r: f"validation {r['validation_bits_per_byte']:.3f} bits/byte",
    )
    print_auto(ctx, result, "bytes-lm")
