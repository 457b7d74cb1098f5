"""The cost of ``adaptive`` in the shared quantized allreduce (:mod:`._quantized`).

Its bytes depend on the data: the cost model assumes balanced signs and
``Options.selection_overlap`` between the ranks' picks.
"""

from __future__ import annotations

import math
from typing import Any

from ...algorithms._base import ceil_div, fraction
from ._quantized import Schedule

SELECTION_OVERLAP = fraction(
    "selection_overlap",
    0.0,
    "in [0, 1], how much the ranks' adaptive selections coincide: 1 = the same positions on "
    "every rank (the sum has as many nonzeros as one rank sent), 0 = independent positions "
    "(the sum's nonzeros are the expected union). An assumed prior, not a measurement.",
)
"""``cost.Options.selection_overlap``: what adaptive's byte count assumes of the data."""


def _keep(count: float, zeros: float, proportion: float) -> int:
    """Entries adaptive sends for one sign (kernels/adaptive.cc's AdaptiveSignKeep): 1/π of the
    sign's values counting the column's zeros, at most the sign's nonzero values."""
    if count <= 0:
        return 0
    return min(math.ceil(count), math.ceil(round((count + zeros) / proportion, 9)))


def _words(m: int, options: Any, parts: int, stage: str) -> int:
    # Per column and sign, min(k±, ceil((k± + k0)/π)) entries (kernels/adaptive.cc, k0 = the
    # column's zeros); signs are assumed balanced (k+ = ceil(L/2), k- = floor(L/2)).
    cs, pi = options.column_size, options.proportion
    words = 1
    for length, count in ((cs, m // cs), (m % cs, 1 if m % cs else 0)):
        if not count:
            continue
        signs = (ceil_div(length, 2), length // 2)
        kept = [_keep(sign_count, 0, pi) for sign_count in signs]
        if stage == "sum":
            # Nonzeros of the sum at each sign: `keep` when every rank picked the same
            # positions, the expected union of `parts` independent picks otherwise; the rest
            # of the column is zeros, which count toward each sign's share.
            nonzeros = []
            for sign_count, keep in zip(signs, kept, strict=True):
                union = sign_count * (1.0 - (1.0 - keep / sign_count) ** parts) if keep else 0
                overlap = options.selection_overlap
                nonzeros.append(round(overlap * keep + (1 - overlap) * union, 6))
            zeros = length - sum(nonzeros)
            kept = [_keep(nz, zeros, pi) for nz in nonzeros]
        words += count * (2 + sum(kept))
    return words


COST = Schedule("adaptive", _words, unit=lambda options: options.column_size).cost(
    settings=(SELECTION_OVERLAP,),
    kernels=("quantize.adaptive", "decode.adaptive"),
    auto_rank=3,
    auto_default=True,
)
