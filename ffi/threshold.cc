// XLA FFI handlers for Threshold compression (Strom's threshold quantization with error
// feedback) and its decompression. capacity is not an attribute: it is the packed length the
// caller asked for, minus the header word.
#include "kernels/threshold.h"

#include <cmath>
#include <string>

#include "ffi/common.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {
namespace {

namespace ffi = xla::ffi;
using ffi_common::InvalidArgument;
using ffi_common::NumElements;

constexpr char kCompressOp[] = "jaxcomm.ops.compress(Threshold)";
constexpr char kDecompressOp[] = "jaxcomm.ops.decompress(Threshold)";
constexpr int64_t kMaxElements = (int64_t{1} << 31) - 1;  // 31-bit indices on the wire

// Checks n, tau and the packed length (1 + capacity, 1 <= capacity <= n) of both handlers.
ffi::Error CheckShapes(const char* op, int64_t n, float tau, int64_t words) {
  if (n < 1 || n > kMaxElements) {
    return InvalidArgument(op, "needs 1 to 2**31 - 1 elements, got " + std::to_string(n));
  }
  if (!(std::isfinite(tau) && tau > 0.0f)) {
    return InvalidArgument(op, "tau must be finite and > 0, got " + std::to_string(tau));
  }
  if (words < 2 || words - 1 > n) {
    return InvalidArgument(op, "packed must hold 1 + capacity words with 1 <= capacity <= " +
                                   std::to_string(n) + ", got " + std::to_string(words));
  }
  return ffi::Error::Success();
}

ffi::Error ThresholdCompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                 ffi::Buffer<ffi::F32> residual, float tau,
                                 ffi::ResultBuffer<ffi::U32> packed,
                                 ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  const int64_t words = NumElements(*packed);
  if (ffi::Error error = CheckShapes(kCompressOp, n, tau, words); error.failure()) return error;
  if (NumElements(residual) != n || NumElements(*new_residual) != n) {
    return InvalidArgument(kCompressOp, "residual must have x's shape");
  }
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
  if (ffi::Error error = CheckShapes(kDecompressOp, n, tau, words); error.failure()) return error;
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
