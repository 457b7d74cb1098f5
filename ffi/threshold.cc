// XLA FFI handlers for Threshold compression (Strom's threshold quantization with error
// feedback) and its decompression. capacity is not an attribute: it is the packed length the
// caller asked for, minus the header word.
#include "kernels/threshold.h"

#include <string>

#include "ffi/common.h"
#include "ffi/compress_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {
namespace {

namespace ffi = xla::ffi;
using ffi_common::InvalidArgument;
using ffi_common::NumElements;

constexpr const char* kCompressOp = compress_checks::kThresholdCompressOp;
constexpr const char* kDecompressOp = compress_checks::kThresholdDecompressOp;

ffi::Error ThresholdCompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                 ffi::Buffer<ffi::F32> residual, float tau,
                                 ffi::ResultBuffer<ffi::U32> packed,
                                 ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  const int64_t words = NumElements(*packed);
  JAXCOMM_RETURN_IF_ERROR(compress_checks::ThresholdCompress(n, tau, words, NumElements(residual),
                                                             NumElements(*new_residual)));
  const kernels::QuantizeStatus status = kernels::ThresholdCompress(
      x.typed_data(), residual.typed_data(), n, {tau, words - 1}, packed->typed_data(),
      new_residual->typed_data(), ffi_common::PoolRunner(&pool));
  if (!status.ok()) return ffi_common::NonFinite(kCompressOp, status.nonfinite_index);
  return ffi::Error::Success();
}

ffi::Error ThresholdDecompressImpl(ffi::Buffer<ffi::U32> packed, float tau,
                                   ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  JAXCOMM_RETURN_IF_ERROR(compress_checks::ThresholdDecompress(n, tau, words));
  const uint32_t used = packed.typed_data()[0];
  if (used < 1 || used > words) {
    return InvalidArgument(kDecompressOp, "packed[0] = " + std::to_string(used) +
                                              " is outside [1, " + std::to_string(words) +
                                              "]; was it produced by compress(Threshold)?");
  }
  const int64_t bad =
      kernels::ThresholdDecompress(packed.typed_data(), n, tau, x_hat->typed_data());
  if (bad >= 0) {
    return InvalidArgument(kDecompressOp, "entry " + std::to_string(bad) + " (packed word " +
                                              std::to_string(bad + 1) +
                                              ") has an index >= " + std::to_string(n) +
                                              " or not above the previous entry's");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomm

JAXCOMM_EXPORT_HANDLER(JaxcommThresholdCompress);
JAXCOMM_EXPORT_HANDLER(JaxcommThresholdDecompress);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommThresholdCompress, jaxcomm::ThresholdCompressImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()  // intra-op threads for the scan
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x: any shape, n elems
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // residual: x's shape
                                  .Attr<float>("tau")  // threshold and reconstruction magnitude
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()  // packed: 1 + capacity
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // new_residual
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommThresholdDecompress, jaxcomm::ThresholdDecompressImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // packed: 1 + capacity
                                  .Attr<float>("tau")                      // as given to compress
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // x_hat: n elements
);
