// XLA FFI handlers for BlockQuant compression (block-wise int8/int4 quantization with error
// feedback, kernels/blockquant.h) and its decompression on one device: jaxcomm.ops.compress /
// decompress (CUDA: ffi/cuda/blockquant.cc). The collective is the shared quantized allreduce
// (ffi/quantized_allreduce.cc). Parameters arrive as attributes; the packed length is checked
// against them, so a buffer from another compressor is rejected instead of misread.
#include "kernels/blockquant.h"

#include <string>

#include "ffi/blockquant_checks.h"
#include "ffi/common.h"
#include "kernels/reduce.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::blockquant_checks {
namespace {

using ffi_common::InvalidArgument;
using ffi_common::NumElements;

// Compress's kernel call on XLA's intra-op threads.
ffi::Error CompressOnPool(ffi::ThreadPool pool, const float* x, const float* residual, int64_t n,
                          const kernels::BlockQuantParams& p, uint32_t* packed,
                          float* new_residual) {
  // XLA hands out fresh output memory: huge pages make its first touch cheap (reduce.h).
  kernels::AdviseHugePages(packed,
                           sizeof(uint32_t) * kernels::BlockQuantPackedWords(n, p.block, p.bits));
  const kernels::QuantizeStatus status = kernels::BlockQuantCompress(
      x, residual, n, p, packed, new_residual, ffi_common::PoolRunner(&pool));
  if (!status.ok()) return ffi_common::NonFinite(kCompressOp, status.nonfinite_index);
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_blockquant_compress", (Compress<&CompressOnPool, ffi::ThreadPool>),
                       BindCompress(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

ffi::Error DecompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> packed, int64_t bits,
                          int64_t block, ffi::ResultBuffer<ffi::F32> x_hat) {
  kernels::BlockQuantParams p;
  JAXCOMM_RETURN_IF_ERROR(CheckDecompress(packed, bits, block, x_hat, &p));
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  kernels::AdviseHugePages(x_hat->typed_data(), sizeof(float) * n);
  const std::string bad =
      kernels::BlockQuantDecompress(packed.typed_data(), words, n, p, x_hat->typed_data(),
                                    /*accumulate=*/false, ffi_common::PoolRunner(&pool));
  if (!bad.empty()) {
    return InvalidArgument(kDecompressOp,
                           bad + "; was it produced by compress with the same compressor?");
  }
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_blockquant_decompress", DecompressImpl,
                       BindDecompress(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace
}  // namespace jaxcomm::blockquant_checks
