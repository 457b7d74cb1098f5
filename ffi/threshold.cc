// XLA FFI handlers for Threshold compression (Strom's threshold quantization with error
// feedback) and its decompression. capacity is not an attribute: it is the packed length the
// caller asked for, minus the header word.
#include "kernels/threshold.h"

#include <string>

#include "ffi/common.h"
#include "ffi/compress_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::compress_checks {
namespace {

ffi::Error ThresholdCompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                 ffi::Buffer<ffi::F32> residual, float tau,
                                 ffi::ResultBuffer<ffi::U32> packed,
                                 ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  const int64_t words = NumElements(*packed);
  JAXCOMM_RETURN_IF_ERROR(
      ThresholdCompress(n, tau, words, NumElements(residual), NumElements(*new_residual)));
  const kernels::QuantizeStatus status = kernels::ThresholdCompress(
      x.typed_data(), residual.typed_data(), n, {tau, words - 1}, packed->typed_data(),
      new_residual->typed_data(), ffi_common::PoolRunner(&pool));
  if (!status.ok()) return ffi_common::NonFinite(kThresholdCompressOp, status.nonfinite_index);
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_threshold_compress", ThresholdCompressImpl,
                       BindThresholdCompress(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

ffi::Error ThresholdDecompressImpl(ffi::Buffer<ffi::U32> packed, float tau,
                                   ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  JAXCOMM_RETURN_IF_ERROR(ThresholdDecompress(n, tau, words));
  const uint32_t used = packed.typed_data()[0];
  if (used < 1 || used > words) {
    return InvalidArgument(kThresholdDecompressOp,
                           "packed[0] = " + std::to_string(used) + " is outside [1, " +
                               std::to_string(words) +
                               "]; was it produced by compress(Threshold)?");
  }
  const int64_t bad =
      kernels::ThresholdDecompress(packed.typed_data(), n, tau, x_hat->typed_data());
  if (bad >= 0) {
    return InvalidArgument(kThresholdDecompressOp, "entry " + std::to_string(bad) +
                                                       " (packed word " + std::to_string(bad + 1) +
                                                       ") has an index >= " + std::to_string(n) +
                                                       " or not above the previous entry's");
  }
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_threshold_decompress", ThresholdDecompressImpl,
                       BindThresholdDecompress(ffi::Ffi::Bind()));

}  // namespace
}  // namespace jaxcomm::compress_checks
