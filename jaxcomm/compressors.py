"""Compressor specifications and the packed wire format they produce.

A compressor is an immutable, hashable description (safe as a static argument of ``jax.jit``);
the work happens in the C++ kernels behind :mod:`jaxcomm.ops`. Construction validates every
parameter, so a bad value fails where it was written, not inside a jitted step.

Wire format
-----------
``jaxcomm.ops.compress`` returns ``packed``: a 1-D ``uint32`` array whose length
``compressor.packed_words(n)`` depends only on the compressor and the element count ``n``
(XLA needs static shapes). Word 0 always holds ``used``, the number of meaningful words
including word 0; the words after ``used`` are zero. Collectives send ``packed[:used]`` only.
Floats are stored as their IEEE-754 bits; words are in host byte order (little-endian on every
supported platform). Element indices refer to the row-major flattening of ``x`` and must fit
in 31 bits (``n < 2**31``).

``TopK(density)``, ``k = max(1, ceil(density * n))``::

    [used = 1 + 2k] [k indices, ascending] [k float32 values]

``OneBit(column_size, sample_size)``, ``ncols = ceil(n / column_size)``::

    [used = 1 + 2*ncols + ceil(n / 32)] [ncols x (mean_nonneg f32, mean_neg f32)] [bits]

  bit ``i % 32`` of bit word ``i // 32`` is 1 when ``acc[i] >= 0`` (decodes to the column's
  ``mean_nonneg``) and 0 otherwise (decodes to ``mean_neg``). ``column_size`` is a multiple of
  32, so a column's bits start on a word boundary.

``Threshold(tau, max_density)``, ``capacity = max(1, ceil(max_density * n))``::

    [used = 1 + m] [m entries, ascending index] [zeros up to 1 + capacity]

  entry = ``sign << 31 | index``; sign 1 decodes to ``+tau`` (``acc > tau``), sign 0 to ``-tau``
  (``acc < -tau``). When more than ``capacity`` entries pass the threshold, those of the lowest
  indices are sent and the rest stay in the residual.

``Adaptive(proportion, column_size, sample_size)``::

    [used = 1 + 2*ncols + m] [ncols x (mean_pos f32, mean_neg f32)] [m entries] [zeros]

  entry = ``sign << 31 | index`` as for ``Threshold``; sign 1 decodes to the column's
  ``mean_pos``, 0 to ``mean_neg``. Capacity per column of length ``L`` is
  ``min(L, 2 * ceil(L / proportion) + 2)``.

``BlockQuant(bits, block)``, ``nblocks = ceil(n / block)``::

    [used = 1 + nblocks + ceil(n * bits / 32)] [nblocks x scale f32] [codes]

  codes: n two's-complement integers of ``bits`` bits in [-qmax, qmax] (qmax = 127 or 7),
  element i at byte i (int8) or nibble i (int4: low nibble of byte i // 2 for even i), bytes
  little-endian in their words, unused trailing bits zero. Element i decodes to
  ``code[i] * scale[i // block]``; ``scale = absmax / qmax`` of its block (0 for a block whose
  scale would be below the smallest normal float).

Error feedback: every compressor returns ``new_residual = (x + residual) - decompress(packed)``
exactly (it is computed from the very float values that were encoded), so nothing is lost,
only delayed.
"""

from __future__ import annotations

# Each spec lives with its algorithm (jaxcomm/algorithms/); this module keeps the names and the
# wire format in one place for users of jaxcomm.ops.compress.
from jaxcomm.algorithms._sparse import TopK
from jaxcomm.algorithms.adaptive import Adaptive
from jaxcomm.algorithms.blockquant import BlockQuant
from jaxcomm.algorithms.gtopk import GTopK
from jaxcomm.algorithms.onebit import OneBit
from jaxcomm.algorithms.threshold import Threshold
from jaxcomm.algorithms.topk_allgather import TopKAllgather

Compressor = TopK | OneBit | Threshold | Adaptive | BlockQuant
"""What ``jaxcomm.ops.compress`` accepts: the compressors with a packed wire format."""

__all__ = [
    "Adaptive",
    "BlockQuant",
    "Compressor",
    "GTopK",
    "OneBit",
    "Threshold",
    "TopK",
    "TopKAllgather",
]
