"""Timing each local kernel the cost model charges, through ``jaxcomm.ops``, for
:func:`jaxcomm.cost.probe.probe_world`: top-k compress (``topk``; at :data:`WIDE_DENSITY` too,
whose extra time per extra selected entry is ``topk.entry``), each quantizer's compress and
decompress (``quantize.*``, ``decode.*``), the sparse merge of two k-entry sets (``merge``, per
input entry), PowerSGD's thin product (``matmul``, per multiply-add) and an in-place float32
add (``sum``). The kernels' gamma is then rescaled inside their collectives
(:func:`jaxcomm.cost.fit.calibrate_gamma`). ``auto``'s measurement at start
(:mod:`jaxcomm.cost.measure`) times the call overhead and ``sum`` with the same steps
(:func:`call_step`, :func:`sum_step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .model import KERNELS, Options
from .timing import per_device

__all__ = ["Kernels", "add_kernels", "call_step", "fit_gamma", "sum_step"]

TOPK_DENSITY = 0.001  # top-k's density of the kernel timings and of the algorithms built
WIDE_DENSITY = 0.25  # top-k at the warm-up's first density, for gamma["topk.entry"]
MATMUL_RANK = 4  # PowerSGD's thin products are timed at this rank (a typical one)


@dataclasses.dataclass
class Kernels:
    """What the kernel timings were taken with, for their fits and the calibrations."""

    options: Options  # of every algorithm built here
    quantizers: dict[str, Any]  # registry name -> its quantizer spec
    merge_entries: int  # entries of each of the two sets the merge timing merges
    matmul_elements: int  # elements of the matrix the thin product multiplies


def call_step(mesh: Any) -> Callable[[], Any]:
    """The per-call overhead's step on every device of ``mesh``: a jitted shard_mapped step
    that adds 1 to one element (dispatch and synchronization, which every call pays)."""
    import numpy as np

    return per_device(mesh, lambda v: v + 1.0, np.ones((mesh.local_mesh.size, 1), np.float32))


def sum_step(mesh: Any, rows: Any) -> Callable[[], Any]:
    """``sum`` on every device of ``mesh``: ``rows`` (one per local device) added in place into
    an accumulator that is donated and fed back, as the C++ reductions add into their buffer
    (a fresh output per call would time page faults instead)."""
    import numpy as np

    return per_device(mesh, lambda a, b: a + b, np.zeros_like(rows), rows, donate=True)


def add_kernels(rounds: Any, n: int) -> Kernels:
    """Adds the call overhead and each local kernel on ``n`` elements to ``rounds`` (a
    :class:`jaxcomm.cost.timing.Rounds`)."""
    import numpy as np

    import jaxcomm

    from .. import algorithms
    from .algorithm_costs.powersgd import matrix_of

    local = rounds.local
    rounds.add("call", call_step(rounds.mesh))
    x = rounds.normal(n)
    zeros = np.zeros_like(x)
    rounds.add("gamma.sum", sum_step(rounds.mesh, x))
    # matmul: PowerSGD's thin products, a near-square matrix of the kernel's elements times a
    # (columns x rank) one.
    _, columns = matrix_of(n)
    rows = n // columns
    thin = rounds.rng.standard_normal((local, columns, MATMUL_RANK)).astype(np.float32)
    rounds.add(
        "gamma.matmul",
        rounds.per_device(lambda a, q: a[: rows * columns].reshape(rows, -1) @ q, x, thin),
    )
    for name, density in (("gamma.topk", TOPK_DENSITY), ("topk.wide", WIDE_DENSITY)):
        topk = jaxcomm.TopK(density)
        rounds.add(name, rounds.per_device(
            lambda a, r, c=topk: jaxcomm.ops.compress(a, r, c), x, zeros))  # fmt: skip
    # Every quantizer of the registry, as `options` configures it.
    options = Options(density=TOPK_DENSITY, tau=3.0, threshold_fraction=0.0027)
    quantizers = {q.name: q.build(options) for q in algorithms.quantizers()}
    for kind, q in quantizers.items():
        rounds.add(f"gamma.quantize.{kind}", rounds.per_device(
            lambda a, r, q=q: jaxcomm.ops.compress(a, r, q), x, zeros))  # fmt: skip
        packed = _packed(q, x, zeros)
        rounds.add(f"gamma.decode.{kind}", rounds.per_device(
            lambda p, q=q: jaxcomm.ops.decompress(p, q, n), packed))  # fmt: skip
    merge_entries = _add_merge(rounds, n)
    return Kernels(options, quantizers, merge_entries, rows * columns)


def _packed(q: Any, x: Any, zeros: Any) -> Any:
    """The first device's compressed block, one copy per local device: what decode reads."""
    import jax
    import numpy as np

    import jaxcomm

    packed, _ = jax.jit(lambda a, r: jaxcomm.ops.compress(a, r, q))(x[0], zeros[0])
    return np.tile(np.asarray(packed), (x.shape[0], 1))


def _add_merge(rounds: Any, n: int) -> int:
    """Adds the sparse merge of two sets of 1/64 of ``n`` entries; returns their size."""
    import numpy as np

    import jaxcomm

    local, rng = rounds.local, rounds.rng
    k = max(1, n // 64)
    idx = np.stack([np.sort(rng.choice(n, k, replace=False)) for _ in range(2 * local)])
    idx = idx.astype(np.int32)
    val = rng.standard_normal((2 * local, k)).astype(np.float32)
    merge = rounds.per_device(
        lambda ia, va, ib, vb: jaxcomm.ops.sparse_merge(ia, va, ib, vb, k),
        idx[:local], val[:local], idx[local:], val[local:],
    )  # fmt: skip
    rounds.add("gamma.merge", merge)
    return k


def fit_gamma(t: Mapping[str, float], n: int, kernels: Kernels) -> dict[str, float]:
    """Each kernel's time per element (per entry for the merge, per multiply-add for matmul)
    from the medians ``t`` of :func:`add_kernels`' calls on ``n`` elements.

    Example:
      >>> ks = Kernels(Options(), {}, 16, 1024)
      >>> t = {"gamma.sum": 1e-3, "gamma.topk": 2e-3, "topk.wide": 4e-3,
      ...      "gamma.merge": 3.2e-5, "gamma.matmul": 4.096e-6}
      >>> fit_gamma(t, 1 << 20, ks)["merge"]
      1e-06
    """
    import jaxcomm

    # Kernels with no timing here (an algorithm's own new kernel) keep the registry's
    # default: Profile.from_json fills them in and `measured` does not list them.
    per_element = [k for k in KERNELS if k not in ("merge", "matmul") and f"gamma.{k}" in t]
    gamma = {k: t[f"gamma.{k}"] / n for k in per_element}
    extra = jaxcomm.TopK(WIDE_DENSITY).k(n) - jaxcomm.TopK(TOPK_DENSITY).k(n)
    gamma["topk.entry"] = max(0.0, t["topk.wide"] - t["gamma.topk"]) / extra
    gamma["merge"] = t["gamma.merge"] / (2 * kernels.merge_entries)
    gamma["matmul"] = t["gamma.matmul"] / (kernels.matmul_elements * MATMUL_RANK)
    return gamma
