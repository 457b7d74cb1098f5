"""Single-device ops backed by the C++ kernels: selection, compression, sparse merge."""

from jaxcomm.ops.compress import compress, decompress
from jaxcomm.ops.topk import topk_abs

__all__ = ["compress", "decompress", "topk_abs"]
