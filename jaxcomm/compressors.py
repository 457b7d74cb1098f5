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

Error feedback: every compressor returns ``new_residual = (x + residual) - decompress(packed)``
exactly (it is computed from the very float values that were encoded), so nothing is lost,
only delayed.
"""

from __future__ import annotations

import dataclasses
import math

from jaxcomm import _validate


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class TopK:
    """Sparse top-k by magnitude with error feedback (Strom/Aji & Heafield; Shi et al.).

    Args:
      density: fraction of elements sent, in (0, 1]; ``k = max(1, ceil(density * n))``.

    Example:
      >>> import jaxcomm
      >>> jaxcomm.TopK(0.001).k(25_000_000)
      25000
    """

    density: float

    def __post_init__(self) -> None:
        density = _validate.finite_float(self.density, "density")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}; e.g. TopK(0.001)")
        object.__setattr__(self, "density", density)

    def k(self, n: int) -> int:
        """Number of entries selected out of ``n``."""
        return min(n, max(1, math.ceil(self.density * n)))

    def packed_words(self, n: int) -> int:
        """Length of the packed uint32 buffer for ``n`` elements."""
        return 1 + 2 * self.k(n)


@dataclasses.dataclass(frozen=True)
class OneBit:
    """One-bit quantization with error feedback (Seide et al.; Dryden et al. §3.1).

    Each column of ``column_size`` consecutive elements is encoded as one bit per element plus
    the means of its non-negative and of its negative values.

    Args:
      column_size: elements per column, a positive multiple of 32.
      sample_size: 0 computes exact column means; a positive value estimates each mean from
        that many sampled entries per column (fewer operations, error feedback absorbs the bias).

    Example:
      >>> import jaxcomm
      >>> jaxcomm.OneBit().packed_words(1024)
      35
    """

    column_size: int = 1024
    sample_size: int = 0

    def __post_init__(self) -> None:
        column_size = _validate.positive_int(self.column_size, "column_size", low=32)
        if column_size % 32:
            raise ValueError(f"column_size must be a multiple of 32, got {column_size}")
        _validate.positive_int(self.sample_size, "sample_size", low=0)

    def num_columns(self, n: int) -> int:
        """Number of columns that ``n`` elements form."""
        return _ceil_div(n, self.column_size)

    def packed_words(self, n: int) -> int:
        """Length of the packed uint32 buffer for ``n`` elements."""
        return 1 + 2 * self.num_columns(n) + _ceil_div(n, 32)


@dataclasses.dataclass(frozen=True)
class Threshold:
    """Threshold quantization with error feedback (Strom 2015; Dryden et al. §3.2).

    Entries with ``acc > tau`` are sent as ``+tau``, ``acc < -tau`` as ``-tau``; the rest stay in
    the residual. In ``compressed_allreduce`` each slice's owner requantizes the sum with the
    same strict test, as in the paper, so an entry that only one rank sent (a sum of exactly
    ``+-tau``) goes back to the owner's residual; over one rank nothing is ever sent.

    Args:
      tau: the threshold, > 0.
      max_density: at most ``ceil(max_density * n)`` entries are sent per call (fixed buffer
        size for XLA); the lowest indices win and the others stay in the residual.

    Example:
      >>> import jaxcomm
      >>> jaxcomm.Threshold(0.01, max_density=0.1).packed_words(1000)
      101
    """

    tau: float
    max_density: float = 1.0

    def __post_init__(self) -> None:
        tau = _validate.finite_float(self.tau, "tau")
        if tau <= 0.0:
            raise ValueError(f"tau must be > 0, got {tau}; e.g. Threshold(0.01)")
        max_density = _validate.finite_float(self.max_density, "max_density")
        if not 0.0 < max_density <= 1.0:
            raise ValueError(f"max_density must be in (0, 1], got {max_density}")
        object.__setattr__(self, "tau", tau)
        object.__setattr__(self, "max_density", max_density)

    def capacity(self, n: int) -> int:
        """Largest number of entries one call can send for ``n`` elements."""
        return min(n, max(1, math.ceil(self.max_density * n)))

    def packed_words(self, n: int) -> int:
        """Length of the packed uint32 buffer for ``n`` elements."""
        return 1 + self.capacity(n)


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Adaptive quantization with error feedback (Dryden et al. 2016, §3.3).

    Per column, the ``min(k+, ceil((k+ + k0) / proportion))`` largest positive and
    ``min(k-, ceil((k- + k0) / proportion))`` most negative values are sent (k+/k-/k0: the
    column's positive/negative/zero counts), each decoded to the mean of the values of its
    sign that were sent. Zeros are never sent, but they count: the paper takes k as the
    number of *non-negative* values (§3.3), mirrored here for the negative sign. On a dense
    gradient this is ``ceil(k± / proportion)``; on the sparse sum that the quantized
    allreduce requantizes (§3.4) it keeps about 1/π of the column instead of 1/π of the
    sum's few nonzeros, which is what keeps the owners' residuals bounded.

    Args:
      proportion: π >= 1; about 1/π of each sign's values are sent per column.
      column_size: elements per column.
      sample_size: 0 selects exactly; a positive value estimates each column's thresholds
        from that many sampled entries (the paper's fast variant).

    Example:
      >>> import jaxcomm
      >>> jaxcomm.Adaptive(proportion=64).capacity(1024)
      34
    """

    proportion: float = 64.0
    column_size: int = 1024
    sample_size: int = 0

    def __post_init__(self) -> None:
        proportion = _validate.finite_float(self.proportion, "proportion")
        if proportion < 1.0:
            raise ValueError(f"proportion must be >= 1, got {proportion}; e.g. Adaptive(64)")
        object.__setattr__(self, "proportion", proportion)
        _validate.positive_int(self.column_size, "column_size", low=1)
        _validate.positive_int(self.sample_size, "sample_size", low=0)

    def num_columns(self, n: int) -> int:
        """Number of columns that ``n`` elements form."""
        return _ceil_div(n, self.column_size)

    def column_capacity(self, length: int) -> int:
        """Largest number of entries sent from one column of ``length`` elements."""
        return min(length, 2 * math.ceil(length / self.proportion) + 2)

    def capacity(self, n: int) -> int:
        """Largest number of entries one call can send for ``n`` elements."""
        full, tail = divmod(n, self.column_size)
        return full * self.column_capacity(self.column_size) + (
            self.column_capacity(tail) if tail else 0
        )

    def packed_words(self, n: int) -> int:
        """Length of the packed uint32 buffer for ``n`` elements."""
        return 1 + 2 * self.num_columns(n) + self.capacity(n)


Compressor = TopK | OneBit | Threshold | Adaptive


@dataclasses.dataclass(frozen=True)
class TopKAllgather:
    """Sparse allreduce baseline: local top-k, allgather of (index, value), sum — O(kP).

    Args:
      density: fraction of elements each rank contributes, in (0, 1].

    Example:
      >>> import jaxcomm
      >>> jaxcomm.TopKAllgather(0.001).k(1_000_000)
      1000
    """

    density: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "density", TopK(self.density).density)

    def k(self, n: int) -> int:
        """Entries each rank contributes out of ``n``."""
        return TopK(self.density).k(n)


@dataclasses.dataclass(frozen=True)
class GTopK:
    """gTop-k sparse allreduce (Shi et al. 2019): a tree of ⊤ merges, O(k log P).

    The result holds the k entries of largest magnitude of the (tree-merged) sum; local values
    that did not make it stay in the residuals, so nothing is lost.

    Args:
      density: fraction of elements selected, in (0, 1].

    Example:
      >>> import jaxcomm
      >>> jaxcomm.GTopK(0.01).k(1000)
      10
    """

    density: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "density", TopK(self.density).density)

    def k(self, n: int) -> int:
        """Entries of the global result out of ``n``."""
        return TopK(self.density).k(n)
