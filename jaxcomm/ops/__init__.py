"""Single-device ops backed by the C++ kernels: selection, compression, sparse merge."""

from jaxcomm.ops.compress import compress, decompress
from jaxcomm.ops.sparse_merge import sparse_merge
from jaxcomm.ops.topk import topk_abs

__all__ = ["compress", "decompress", "sparse_merge", "topk_abs"]
