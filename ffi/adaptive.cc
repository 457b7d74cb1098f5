// XLA FFI handlers for adaptive quantization (jaxcomm.Adaptive): compress with error feedback
// and decompress. The compressor's parameters arrive as attributes; the packed length must be
// exactly Adaptive.packed_words(n), which the handlers recompute to catch a mismatched call.
#include "kernels/adaptive.h"

#include <cstdint>
#include <exception>
#include <string>

#include "ffi/common.h"
#include "ffi/compress_checks.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::compress_checks {
namespace {

ffi::Error AdaptiveCompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::U32> packed,
                                ffi::ResultBuffer<ffi::F32> new_residual, double proportion,
                                int64_t column_size, int64_t sample_size) {
  const int64_t n = NumElements(x);
  kernels::AdaptiveLayout layout{};
  JAXCOMM_RETURN_IF_ERROR(AdaptiveCompress(n, NumElements(residual), NumElements(*new_residual),
                                           proportion, column_size, sample_size,
                                           NumElements(*packed), &layout));
  int64_t bad = -1;
  try {
    bad = kernels::AdaptiveCompress(x.typed_data(), residual.typed_data(), layout, sample_size,
                                    packed->typed_data(), new_residual->typed_data(),
                                    ffi_common::PoolRunner(&pool));
  } catch (const std::exception&) {
    // Scratch grows with column_size and sample_size; an absurd value must not abort XLA
    // (bad_alloc or length_error).
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(kAdaptiveCompressOp) +
                          ": out of memory for the per-column scratch "
                          "(column_size/sample_size too large?)");
  }
  if (bad >= 0) return ffi_common::NonFinite(kAdaptiveCompressOp, bad);
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_adaptive_compress", AdaptiveCompressImpl,
                       BindAdaptiveCompress(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

ffi::Error AdaptiveDecompressImpl(ffi::Buffer<ffi::U32> packed, ffi::ResultBuffer<ffi::F32> x_hat,
                                  double proportion, int64_t column_size) {
  const int64_t words = NumElements(packed);
  kernels::AdaptiveLayout layout{};
  JAXCOMM_RETURN_IF_ERROR(
      AdaptiveDecompress(NumElements(*x_hat), proportion, column_size, words, &layout));
  const std::string problem =
      kernels::AdaptiveDecompress(packed.typed_data(), words, layout, x_hat->typed_data());
  if (!problem.empty()) return InvalidArgument(kAdaptiveDecompressOp, problem);
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_adaptive_decompress", AdaptiveDecompressImpl,
                       BindAdaptiveDecompress(ffi::Ffi::Bind()));

}  // namespace
}  // namespace jaxcomm::compress_checks
