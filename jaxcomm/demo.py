"""A small tour of jaxcomm's ops: top-k, every compressor with error feedback, sparse merge.

Run with ``jaxcomm-demo`` (installed console script) or ``python -m jaxcomm.demo``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm


def main() -> None:
    """Runs every op once on random data and prints what it did.

    Example:
      $ jaxcomm-demo
    """
    n = 1_000_000
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(n).astype(np.float32))
    residual = jnp.zeros_like(x)

    k = 1000
    topk = jax.jit(jaxcomm.ops.topk_abs, static_argnums=1)
    jax.block_until_ready(topk(x, k))
    start = time.perf_counter()
    values, indices = jax.block_until_ready(topk(x, k))
    print(
        f"topk_abs: {k} of {n} in {1e3 * (time.perf_counter() - start):.2f} ms; "
        f"largest |x| = {float(jnp.max(jnp.abs(values))):.3f} at index "
        f"{int(indices[jnp.argmax(jnp.abs(values))])}"
    )

    compress = jax.jit(jaxcomm.ops.compress, static_argnums=2)
    for compressor in (
        jaxcomm.TopK(0.001),
        jaxcomm.OneBit(),
        jaxcomm.Threshold(2.5),
        jaxcomm.Adaptive(64),
    ):
        packed, new_residual = compress(x, residual, compressor)
        x_hat = jaxcomm.ops.decompress(packed, compressor, n)
        used_bytes = 4 * int(packed[0])
        error = float(jnp.max(jnp.abs(x + residual - x_hat - new_residual)))
        print(
            f"{compressor}: {used_bytes} bytes on the wire ({4 * n / used_bytes:.1f}x smaller), "
            f"error-feedback identity off by {error:.2e}"
        )


if __name__ == "__main__":
    main()
