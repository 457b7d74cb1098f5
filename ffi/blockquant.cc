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

ffi::Error CompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> residual, int64_t bits, int64_t block,
                        bool stochastic, int64_t seed, int64_t step,
                        ffi::ResultBuffer<ffi::U32> packed,
                        ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  kernels::BlockQuantParams p;
  JAXCOMM_RETURN_IF_ERROR(
      ReadParams(kCompressOp, n, bits, block, stochastic, seed, step, NumElements(*packed), &p));
  if (NumElements(residual) != n || NumElements(*new_residual) != n) {
    return InvalidArgument(kCompressOp, "residual must have x's shape");
  }
  // XLA hands out fresh output memory: huge pages make its first touch cheap (reduce.h).
  kernels::AdviseHugePages(packed->typed_data(), sizeof(uint32_t) * NumElements(*packed));
  const kernels::QuantizeStatus status =
      kernels::BlockQuantCompress(x.typed_data(), residual.typed_data(), n, p, packed->typed_data(),
                                  new_residual->typed_data(), ffi_common::PoolRunner(&pool));
  if (!status.ok()) return ffi_common::NonFinite(kCompressOp, status.nonfinite_index);
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_blockquant_compress", CompressImpl,
                       BindCompress(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

ffi::Error DecompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> packed, int64_t bits,
                          int64_t block, ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  kernels::BlockQuantParams p;
  JAXCOMM_RETURN_IF_ERROR(ReadParams(kDecompressOp, n, bits, block, false, 0, 0, words, &p));
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
