"""Collectives that run as XLA FFI custom calls inside ``jax.jit`` + ``jax.shard_map``."""

from jaxcomm.collectives.allreduce import allreduce
from jaxcomm.collectives.compressed import compressed_allreduce

__all__ = ["allreduce", "compressed_allreduce"]
