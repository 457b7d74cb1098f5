"""The path every compressor's single-device ops share (``jaxcomm.ops.<name>.compress`` /
``decompress``): the compressor's type, the inputs' checks, then the compressor's FFI target.

Each op module keeps its public functions (their docstrings and examples) and its attributes;
what they check and how they call the kernel lives here once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxcomm import _ffi, _validate


def compress(
    target: str,
    spec: type,
    x: jax.Array,
    residual: jax.Array,
    compressor: Any,
    attributes: Callable[[Any], dict[str, Any]],
) -> tuple[jax.Array, jax.Array]:
    """``(packed, new_residual)`` from the compress handler `target`.

    Args:
      target: the FFI target, e.g. ``"jaxcomm_onebit_compress"``.
      spec: the compressor class the op takes (TypeError for another).
      x, residual: checked by :func:`jaxcomm._validate.compress_inputs`.
      compressor: the spec instance.
      attributes: the target's attributes of `compressor` (called once its type is checked).

    Returns:
      ``(packed, new_residual)``, as :func:`jaxcomm.ops.compress` documents.

    Example:
      >>> import numpy as np
      >>> packed, r = compress("jaxcomm_threshold_compress", jaxcomm.Threshold,
      ...     jnp.array([0.5, 2.0]), jnp.zeros(2), jaxcomm.Threshold(1.0),
      ...     lambda c: {"tau": np.float32(c.tau)})
      >>> r.tolist()
      [0.5, 1.0]
    """
    _validate.compressor_of(compressor, spec)
    x, residual, words = _validate.compress_inputs(x, residual, compressor)
    return _ffi.compress_call(target, x, residual, words, **attributes(compressor))


def decompress(
    target: str,
    spec: type,
    packed: jax.Array,
    compressor: Any,
    shape: int | Sequence[int],
    attributes: Callable[[Any], dict[str, Any]],
    *,
    checked: bool = False,
) -> jax.Array:
    """The float32 array of `shape` that the decompress handler `target` decodes.

    Unless `checked`, `packed` reaches the handler as it is: the handler checks it against the
    compressor (:func:`jaxcomm.ops.decompress` also checks it at trace time first).

    Args:
      target: the FFI target, e.g. ``"jaxcomm_onebit_decompress"``.
      spec: the compressor class the op takes (TypeError for another).
      packed: uint32 words from :func:`compress`.
      compressor: the spec instance that produced them.
      shape: the shape of the original ``x`` (or, when `checked`, its element count).
      attributes: the target's attributes of `compressor` (called once its type is checked).
      checked: check `packed` against `compressor` at trace time
        (:func:`jaxcomm._validate.packed_input`).

    Returns:
      float32 array of `shape`.

    Example:
      >>> import numpy as np
      >>> tau = lambda c: {"tau": np.float32(c.tau)}
      >>> c = jaxcomm.Threshold(1.0)
      >>> packed, _ = compress("jaxcomm_threshold_compress", jaxcomm.Threshold,
      ...     jnp.array([0.5, 2.0]), jnp.zeros(2), c, tau)
      >>> decompress("jaxcomm_threshold_decompress", jaxcomm.Threshold, packed, c, (2,),
      ...     tau).tolist()
      [0.0, 1.0]
    """
    _validate.compressor_of(compressor, spec)
    if checked:
        packed, shape = _validate.packed_input(packed, compressor, shape)
    return _ffi.decompress_call(target, packed, shape, **attributes(compressor))
