// XLA FFI handlers for OneBit compression (one-bit quantization with error feedback) and its
// decompression. Parameters arrive as attributes; the packed length is checked against them,
// so a buffer from another compressor is rejected instead of misread.
#include "kernels/onebit.h"

#include <string>

#include "ffi/common.h"
#include "ffi/compress_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::compress_checks {
namespace {

ffi::Error OneBitCompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> residual, int64_t column_size,
                              int64_t sample_size, ffi::ResultBuffer<ffi::U32> packed,
                              ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  JAXCOMM_RETURN_IF_ERROR(OneBitCompress(n, column_size, sample_size, NumElements(residual),
                                         NumElements(*new_residual), NumElements(*packed)));
  const kernels::OneBitParams params{column_size, sample_size};
  const kernels::QuantizeStatus status = kernels::OneBitCompress(
      x.typed_data(), residual.typed_data(), n, params, packed->typed_data(),
      new_residual->typed_data(), ffi_common::PoolRunner(&pool));
  if (!status.ok()) return ffi_common::NonFinite(kOneBitCompressOp, status.nonfinite_index);
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_onebit_compress", OneBitCompressImpl,
                       BindOneBitCompress(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

ffi::Error OneBitDecompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> packed,
                                int64_t column_size, int64_t sample_size,
                                ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  JAXCOMM_RETURN_IF_ERROR(OneBitDecompress(n, column_size, sample_size, words));
  const kernels::OneBitParams params{column_size, sample_size};
  if (packed.typed_data()[0] != static_cast<uint32_t>(words)) {
    return InvalidArgument(kOneBitDecompressOp,
                           "packed[0] = " + std::to_string(packed.typed_data()[0]) +
                               " but a OneBit buffer of this size holds " + std::to_string(words) +
                               "; was it produced by compress with the same compressor?");
  }
  kernels::OneBitDecompress(packed.typed_data(), n, params, x_hat->typed_data(),
                            ffi_common::PoolRunner(&pool));
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_onebit_decompress", OneBitDecompressImpl,
                       BindOneBitDecompress(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace
}  // namespace jaxcomm::compress_checks
