"""Optax gradient transformations that average gradients with jaxcomm's collectives.

``allreduce_gradients`` goes first in an ``optax.chain`` inside a jitted, shard_mapped
training step: it sums every rank's gradient over the data-parallel axis with a dense UCX ring
(``algorithm=None``) or a compressed allreduce with error feedback, divides by the number of
ranks, and hands the average to the rest of the chain. ``diloco`` trains with DiLoCo: local
steps, then an outer step on the averaged change.

Layout (each module one job; the ``algorithm`` argument is followed downward through them):

* :mod:`jaxcomm.optax.plan`: the bucket plan (which leaves share a collective, in which
  order, and each phase of a density schedule);
* :mod:`jaxcomm.optax.reduce`: ``allreduce_gradients`` and the bucketed reduction;
* :mod:`jaxcomm.optax.leafwise`: leaf-shaped algorithms (PowerSGD);
* :mod:`jaxcomm.optax.state`: the states and :func:`partition_specs` (saving them:
  :mod:`jaxcomm.checkpoints`, whose ``save_state`` and ``restore_state`` are re-exported here);
* :mod:`jaxcomm.optax.diloco_steps` and :mod:`jaxcomm.optax.diloco_outer`: DiLoCo, and the
  outer step of one of its fragments.

auto's choices, per bucket and per phase, are the cost model's (:mod:`jaxcomm.cost`).
"""

from jaxcomm.checkpoints import restore_state, save_state
from jaxcomm.optax.diloco_steps import (
    DILOCO_OUTER_LR,
    DILOCO_OUTER_MOMENTUM,
    DILOCO_STREAM,
    STREAMING_MIX,
    DiLoCo,
    diloco,
)
from jaxcomm.optax.plan import (
    DEFAULT_BUCKET_SIZE,
    GTOPK_WARMUP,
    AxisName,
    gtopk_warmup_schedule,
)
from jaxcomm.optax.reduce import allreduce_gradients
from jaxcomm.optax.state import AllreduceGradientsState, DiLoCoState, partition_specs

# Internals that tests and jaxcomm/examples/_loop.py read by these names.
from jaxcomm.optax.diloco_steps import _fragments as _fragments  # isort: skip
from jaxcomm.optax.plan import _buckets as _buckets  # isort: skip
from jaxcomm.optax.plan import _normalize_schedule as _normalize_schedule  # isort: skip

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "DILOCO_OUTER_LR",
    "DILOCO_OUTER_MOMENTUM",
    "DILOCO_STREAM",
    "GTOPK_WARMUP",
    "STREAMING_MIX",
    "AllreduceGradientsState",
    "AxisName",
    "DiLoCo",
    "DiLoCoState",
    "allreduce_gradients",
    "diloco",
    "gtopk_warmup_schedule",
    "partition_specs",
    "restore_state",
    "save_state",
]
