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

The cost model's interface is one call on ``n`` elements, which knows no shape: it models the
``n`` elements as one near-square matrix (:func:`matrix_of`), the shape whose factors are
smallest for its size. :func:`tree_bytes` counts the exact bytes of a model's leaf shapes, as
``jaxcomm.metrics()`` reports them (tests/test_powersgd.py checks both).

Standard library only (the launcher loads the registry without JAX).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from .. import _checks
from . import dense
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
"""PowerSGD's fields of ``cost.Options`` (:func:`_spec` builds the spec from them)."""


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


def matrix_of(n: int) -> tuple[int, int]:
    """The near-square matrix the cost model assumes for ``n`` elements: ``(rows, columns)``
    with ``rows = floor(sqrt(n))`` and ``columns = ceil(n / rows)``.

    Example:
      >>> matrix_of(1000)
      (31, 33)
    """
    rows = max(1, math.isqrt(n))
    return rows, -(-n // rows)


def tree_sizes(shapes: Sequence[Sequence[int]], spec: PowerSGD) -> tuple[int, int, int]:
    """Elements of the three allreduces of one compressed step over leaves of ``shapes``.

    Args:
      shapes: the gradient leaves' shapes.
      spec: the PowerSGD settings.

    Returns:
      ``(p, q, dense)``: elements of the P allreduce, of the Q allreduce and of the dense one.

    Example:
      >>> tree_sizes([(64, 4096), (4096,), (4096, 10)], PowerSGD(rank=4))
      (16640, 16424, 4096)
    """
    p = q = dense = 0
    for shape in shapes:
        plan = spec.plan(shape)
        if plan is None:
            dense += math.prod(shape)
        else:
            rows, columns, r = plan
            p, q = p + rows * r, q + columns * r
    return p, q, dense


def _calls(sizes: tuple[int, int, int], options: Any) -> list[tuple[int, Any]]:
    """``(elements, options)`` of the three dense allreduces of a compressed step: P and Q in
    float32, the dense leaves on the gradient's own wire (``options.element_bytes``)."""
    p, q, dense = sizes
    f32 = dataclasses.replace(options, element_bytes=4)
    return [(m, o) for m, o in ((dense, options), (p, f32), (q, f32)) if m]


def _charge_leaf(t: Any, rows: int, columns: int, r: int) -> None:
    # M = g + error, M - P Qᵀ, and the output: three passes over the leaf.
    t.kernel("sum", 3 * rows * columns)
    # P = M Q, Q = Mᵀ P and P Qᵀ: rows × columns × r multiply-adds each, plus the two
    # Gram-Schmidt passes (about 2 (rows + columns) r² multiply-adds).
    t.kernel("matmul", 3 * rows * columns * r + 2 * (rows + columns) * r * r)


def tree_bytes(shapes: Sequence[Sequence[int]], world: Any, options: Any, world_rank: int) -> int:
    """Bytes world rank ``world_rank`` sends in one compressed step over leaves of ``shapes``.

    Three dense allreduces (float32 P and Q; the dense leaves on their own wire, 16-bit for
    16-bit gradients: ``options.element_bytes``), each with the schedule ``jaxcomm.allreduce``
    picks for its size (the ``dense`` record's byte ledger). The record's ``tree_bytes``.

    Args:
      shapes: the gradient leaves' shapes.
      world: a ``jaxcomm.cost.World`` (a flat group over all its ranks).
      options: a ``jaxcomm.cost.Options`` (rank, min_compression_rate, element_bytes).
      world_rank: the rank.

    Returns:
      Bytes sent.

    Example:
      >>> from jaxcomm import cost
      >>> tree_bytes([(64, 4096)], cost.World(2, 1, "across_hosts"), cost.Options(rank=4), 0)
      66560
    """
    if world.ranks == 1:
        return 0
    sizes = tree_sizes(shapes, _spec(options))
    return sum(
        dense.ALGORITHM.bytes_sent(m, world, o, world_rank) for m, o in _calls(sizes, options)
    )


def tree_time(t: Any, shapes: Sequence[Sequence[int]], world: Any, options: Any) -> None:
    """Adds one compressed step over leaves of ``shapes`` to the cost model's tally: each
    compressed leaf's passes and thin products, then the dense, P and Q allreduces (one call
    each, in sequence: Q depends on P, each with the profile's per-call overhead). The
    record's ``tree_time``.

    Args:
      t: a ``jaxcomm.cost.Tally``.
      shapes: the gradient leaves' shapes.
      world: a ``jaxcomm.cost.World``.
      options: a ``jaxcomm.cost.Options``.

    Example:
      >>> from jaxcomm import cost
      >>> t = cost.Tally(cost.DEFAULT_PROFILE)
      >>> tree_time(t, [(64, 4096), (4096,)], cost.World(2), cost.Options())
      >>> t.compute > 0 and t.comm > 0
      True
    """
    calls = _tree_time(t, shapes, world, options)
    t.compute += t.profile.call * calls


def _tree_time(t: Any, shapes: Sequence[Sequence[int]], world: Any, options: Any) -> int:
    spec = _spec(options)
    for shape in shapes:
        plan = spec.plan(shape)
        if plan is not None:
            _charge_leaf(t, *plan)
    calls = _calls(tree_sizes(shapes, spec), options)
    for m, o in calls:
        dense.ALGORITHM.time(t, m, world, o)
    return len(calls)


def _spec(options: Any) -> PowerSGD:
    return PowerSGD(
        rank=options.rank,
        start_step=options.start_step,
        min_compression_rate=options.min_compression_rate,
    )


def _bytes(n: int, world: Any, options: Any, rank: int) -> int:
    # One call of n elements: a near-square matrix (matrix_of), or dense when it does not gain.
    return tree_bytes([matrix_of(n)], world, options, rank)


def _time(t: Any, n: int, world: Any, options: Any) -> None:
    # cost.predict charges one call's overhead itself.
    _tree_time(t, [matrix_of(n)], world, options)


ALGORITHM = Algorithm(
    name="powersgd",
    summary="PowerSGD: rank-r factors P, Q of each 2-D gradient leaf, error feedback "
    "(allreduce_gradients only)",
    order=62,
    spec=PowerSGD,
    build=_spec,
    settings=SETTINGS,
    bytes_sent=_bytes,
    time=_time,
    tree_bytes=tree_bytes,
    tree_time=tree_time,
    residual=True,
    leafwise="powersgd",
    # Per multiply-add of the thin products; `jaxcomm probe` measures it as gamma.matmul.
    kernels=("matmul",),
)
