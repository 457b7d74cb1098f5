"""Collectives that run as XLA FFI custom calls inside ``jax.jit`` + ``jax.shard_map``."""

from jaxcomm.collectives.allreduce import allreduce
from jaxcomm.collectives.compressed import compressed_allreduce
from jaxcomm.collectives.handles import Pending, start_allreduce, wait

__all__ = ["Pending", "allreduce", "compressed_allreduce", "start_allreduce", "wait"]
