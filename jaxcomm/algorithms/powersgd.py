"""``powersgd``: PowerSGD low-rank gradient compression (Vogels et al., NeurIPS 2019), with the
semantics of PyTorch DDP's ``powerSGD_hook``.

PowerSGD is *leaf-shaped*: it compresses each 2-D (or reshaped to 2-D) gradient leaf M into two
thin factors, P = M Q (rows × rank) and Q = Mᵀ P (columns × rank), so it cannot run on the flat
float32 buckets the other algorithms reduce. Its record names a gradient-tree implementation
(``Algorithm.leafwise``: :mod:`jaxcomm.collectives.powersgd`) that
``jaxcomm.optax.allreduce_gradients`` calls instead of bucketing. Its collectives are three
dense ``jaxcomm.allreduce`` calls per step: every compressed leaf's P in one, every Q in one,
and the leaves not worth compressing (1-D ones, and those whose factors would not be
``min_compression_rate`` times smaller) in one.

Its cost model, one call of ``n`` elements and one step over a model's leaf shapes, is
:mod:`jaxcomm.cost.algorithm_costs.powersgd`.

Standard library only (the launcher loads the registry without JAX).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .. import _checks
from ._base import Algorithm, Setting

LAYOUTS = ("jax", "torch")
"""How :class:`PowerSGD` views a leaf of three or more dimensions as a matrix."""

START_STEP = 1000
"""Default dense warm-up steps: PyTorch's ``start_powerSGD_iter`` default."""

MIN_COMPRESSION_RATE = 2.0
"""Default least compression a leaf must gain to be compressed (PyTorch's default)."""

SETTINGS = (
    Setting(
        "rank",
        int,
        4,
        lambda v: v >= 1,
        ">= 1",
        "PowerSGD's approximation rank (``jaxcomm.PowerSGD.rank``; not a process rank).",
    ),
    Setting(
        "start_step",
        int,
        START_STEP,
        lambda v: v >= 0,
        ">= 0",
        "PowerSGD's dense warm-up steps (only used to build the spec).",
    ),
    Setting(
        "min_compression_rate",
        float,
        MIN_COMPRESSION_RATE,
        lambda v: v >= 1.0,
        ">= 1",
        "the least gain for which PowerSGD compresses a leaf.",
    ),
)
"""PowerSGD's fields of ``cost.Options``, named as the fields of :class:`PowerSGD` they set."""


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """PowerSGD (Vogels et al. 2019) as PyTorch DDP's ``powerSGD_hook`` runs it, for
    ``jaxcomm.optax.allreduce_gradients``.

    Each gradient leaf of two or more dimensions is viewed as a matrix M (its output
    features as the columns, see ``layout``) and, with this rank's error added (error feedback),
    sent as two low-rank factors: P = M Q (all leaves' P in one allreduce), P orthogonalized
    (Gram-Schmidt, per leaf), Q = Mᵀ P (all leaves' Q in one allreduce, then divided by the
    number of ranks), and the average is approximated by P Qᵀ. Each rank keeps
    ``M - P Qᵀ`` as its error for the next step (``error_feedback``); Q is kept too and reused
    (``warm_start``, orthogonalized before each use). The first Q is drawn from a normal
    distribution seeded by ``seed``, the same on every rank. 1-D leaves, and leaves whose factors would not be at
    least ``min_compression_rate`` times smaller than the leaf, are averaged densely, all in
    one allreduce. For the first ``start_step`` steps every leaf is averaged densely and no
    error accumulates (the hook's ``start_powerSGD_iter``).

    Differences from the hook: the factors and errors are float32 whatever the gradient's
    dtype; the leaves sent dense keep no error (the hook keeps ``M - mean(M)`` for them too,
    whose mean over ranks is zero, so the average it sends is the same up to rounding); a
    column of P or Q that is all zero stays zero instead of becoming NaN; orthogonalization is
    always Gram-Schmidt (recent hooks switch to QR above rank 2 in float32, which differs in
    the columns' signs only, and those cancel in P Qᵀ); the random Qs come from JAX's
    generator, not torch's.

    Args:
      rank: the approximation rank r (PyTorch's ``matrix_approximation_rank``), an integer
        >= 1; a leaf of R x C uses ``min(R, C, rank)``.
      start_step: steps of dense allreduce before compression starts, >= 0 (PyTorch's
        ``start_powerSGD_iter``, default 1000).
      min_compression_rate: a leaf is compressed only if ``R * C`` exceeds
        ``min_compression_rate * (R + C) * rank``; >= 1 (default 2, as PyTorch's).
      seed: seed of the first Q (the same on every rank).
      error_feedback: add each rank's error of the last step to its gradient before
        compressing (PyTorch's ``use_error_feedback``, default True). False keeps no error
        state (the residuals are ``(1,)`` placeholders).
      warm_start: start each step's power iteration from the last step's Q (PyTorch's
        ``warm_start``, default True). False draws a new Q every compressed step, from
        ``seed`` and the step count (the same on every rank).
      orthogonalization_epsilon: added to each column's norm before dividing by it in the
        Gram-Schmidt (PyTorch's ``orthogonalization_epsilon``, default 0: a zero column
        stays zero).
      layout: how a leaf of three or more dimensions becomes a matrix. ``"jax"`` (default):
        ``(prod(shape[:-1]), shape[-1])``, the output features last as Flax and Haiku store
        kernels (Dense ``(in, out)``, Conv ``(H, W, in, out)``); ``"torch"``: the hook's
        ``(shape[0], prod(shape[1:]))``, for PyTorch's ``(out, in, H, W)``. Both are the same
        matrix of a model, transposed; 2-D leaves are ``shape`` either way.

    Example:
      >>> import jaxcomm
      >>> spec = jaxcomm.PowerSGD(rank=4, start_step=100)
      >>> spec.plan((4096, 4096))  # (rows, columns, rank) of a compressed leaf
      (4096, 4096, 4)
      >>> spec.plan((4096,)) is None  # 1-D: dense
      True
    """

    rank: int
    start_step: int = START_STEP
    min_compression_rate: float = MIN_COMPRESSION_RATE
    seed: int = 0
    layout: str = "jax"
    error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0

    def __post_init__(self) -> None:
        try:
            rank = _checks.positive_int(self.rank, "rank")
        except (TypeError, ValueError) as e:
            raise type(e)(
                f"PowerSGD: {e}; pass the approximation rank, e.g. PowerSGD(rank=4)"
            ) from None
        try:
            start = _checks.positive_int(self.start_step, "start_step", low=0)
        except (TypeError, ValueError) as e:
            raise type(e)(f"PowerSGD: {e}; 0 compresses from the first step") from None
        rate = _checks.finite_float(self.min_compression_rate, "min_compression_rate")
        if rate < 1.0:
            raise ValueError(
                f"PowerSGD: min_compression_rate must be >= 1 (a leaf is compressed only when "
                f"its factors are that many times smaller), got {rate}; the default is "
                f"{MIN_COMPRESSION_RATE:g}"
            )
        seed = _checks.positive_int(self.seed, "seed", low=0)
        if self.layout not in LAYOUTS:
            raise ValueError(
                f'PowerSGD: layout must be one of {LAYOUTS}, got {self.layout!r} ("jax": '
                'output features on the last axis, "torch": on the first)'
            )
        for name in ("error_feedback", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"PowerSGD: {name} must be True or False, got {getattr(self, name)!r}"
                )
        epsilon = _checks.finite_float(self.orthogonalization_epsilon, "orthogonalization_epsilon")
        if epsilon < 0.0:
            raise ValueError(
                f"PowerSGD: orthogonalization_epsilon must be >= 0, got {epsilon}; PyTorch's "
                "default is 0 (a small positive value such as 1e-8 avoids dividing by a zero "
                "norm in half precision)"
            )
        object.__setattr__(self, "orthogonalization_epsilon", epsilon)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "start_step", start)
        object.__setattr__(self, "min_compression_rate", rate)
        object.__setattr__(self, "seed", seed)

    def plan(self, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """How a leaf of ``shape`` is sent.

        Args:
          shape: the leaf's shape (at least one dimension).

        Returns:
          ``(rows, columns, rank)`` of its factors when it is compressed, None when it goes
          dense (1-D, or not ``min_compression_rate`` times smaller).

        Raises:
          ValueError: a 0-d shape.

        Example:
          >>> PowerSGD(rank=2).plan((3, 3, 8, 16))  # Flax conv (H, W, in, out): 72 x 16
          (72, 16, 2)
          >>> PowerSGD(rank=2, layout="torch").plan((16, 8, 3, 3))  # (out, in, H, W)
          (16, 72, 2)
        """
        return leaf_plan(shape, self.rank, self.min_compression_rate, self.layout)


def leaf_plan(
    shape: Sequence[int], rank: int, min_compression_rate: float, layout: str = "jax"
) -> tuple[int, int, int] | None:
    """``(rows, columns, rank)`` of a compressed leaf, or None for a dense one.

    The hook's ``_should_compress``: a leaf of two or more dimensions is a matrix
    (``layout="jax"``: ``(prod(shape[:-1]), shape[-1])``; ``"torch"``: the hook's
    ``(shape[0], prod(shape[1:]))``) and is compressed when ``rows * columns`` exceeds
    ``min_compression_rate * (rows + columns) * r``, with ``r = min(rows, columns, rank)``.

    Args:
      shape: the leaf's shape.
      rank: the approximation rank.
      min_compression_rate: the least gain.
      layout: ``"jax"`` or ``"torch"`` (:class:`PowerSGD`).

    Returns:
      ``(rows, columns, r)`` or None.

    Raises:
      ValueError: a 0-d shape (PowerSGD has no matrix for it).

    Example:
      >>> leaf_plan((8, 8), 4, 2.0) is None  # 64 elements against 2 * 64 of factors
      True
      >>> leaf_plan((64, 64), 4, 2.0)
      (64, 64, 4)
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        raise ValueError(
            "PowerSGD needs leaves of at least one dimension, got a 0-d (scalar) leaf; give "
            "that parameter shape (1,)"
        )
    if len(shape) == 1:
        return None
    if layout == "torch":
        rows, columns = shape[0], math.prod(shape[1:])
    else:
        rows, columns = math.prod(shape[:-1]), shape[-1]
    r = min(rows, columns, rank)
    if rows * columns > min_compression_rate * (rows + columns) * r and r > 0:
        return rows, columns, r
    return None


ALGORITHM = Algorithm(
    name="powersgd",
    summary="PowerSGD: rank-r factors P, Q of each 2-D gradient leaf, error feedback "
    "(allreduce_gradients only)",
    order=62,
    spec=PowerSGD,
    settings=SETTINGS,
    residual=True,
    leafwise="powersgd",
)
