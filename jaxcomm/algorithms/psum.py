"""``psum``: XLA's own allreduce (``lax.psum``; Gloo on CPU, NCCL on GPU), the baseline.

jaxcomm does not run it, so it has no spec, no FFI target and no metrics; its cost model is
:mod:`jaxcomm.cost.algorithm_costs.psum`.
"""

from __future__ import annotations

from ._base import Algorithm

ALGORITHM = Algorithm(
    name="psum",
    summary="XLA's lax.psum, the baseline",
    order=0,
)
