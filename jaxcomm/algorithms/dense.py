"""``dense``: jaxcomm's own allreduce (``jaxcomm.allreduce``), and its 16-bit wire.

C++: ffi/allreduce.h picks the schedule by where the ranks are and by size: over a transport
the pipelined ring (large vectors) or recursive doubling (small ones); through shared memory
(every rank of the group on one host) the direct reduce-scatter + allgather or the one-shot
read. bfloat16 and float16 inputs travel as 16-bit words (ffi/allreduce_half.cc, CPU only).
Its hierarchical form is ``jaxcomm.allreduce(..., hierarchical=True)``.
"""

from __future__ import annotations

from ._base import Algorithm

ALGORITHM = Algorithm(
    name="dense",
    summary="jaxcomm's allreduce (ring / recursive doubling; shared memory on one host)",
    order=10,
    targets={
        "flat": "jaxcomm_allreduce",
        "hierarchical": "jaxcomm_hierarchical_allreduce",
        # 16-bit wire (ffi/allreduce_half.cc): 2 bytes per element, float32 sums rounded once.
        "bfloat16": "jaxcomm_allreduce_bf16",
        "float16": "jaxcomm_allreduce_f16",
    },
    cpu_only_targets=frozenset({"jaxcomm_allreduce_bf16", "jaxcomm_allreduce_f16"}),
    metric_labels=(
        "dense",
        "dense_doubling",
        "dense_direct",
        "dense_direct_oneshot",
        "dense_bf16",
        "dense_f16",
        "dense_bf16_direct",
        "dense_f16_direct",
    ),
    hierarchical_planned=("multi_leader", "leader"),
)
