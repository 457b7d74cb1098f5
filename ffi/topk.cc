// XLA FFI handlers for magnitude top-k: plain selection and TopK compression with error
// feedback. k is not an attribute: it is the length of the output buffers the caller asked for.
#include "kernels/topk.h"

#include <algorithm>
#include <string>

#include "ffi/common.h"
#include "ffi/compress_checks.h"
#include "kernels/wire.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::compress_checks {
namespace {

ffi::Error TopKAbsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> indices) {
  const int64_t n = NumElements(x);
  const int64_t k = NumElements(*values);
  JAXCOMM_RETURN_IF_ERROR(TopKAbs(n, k, NumElements(*indices)));
  kernels::TopKAbs(x.typed_data(), nullptr, n, k, indices->typed_data(), values->typed_data(),
                   nullptr, ffi_common::PoolRunner(&pool));
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_topk_abs", TopKAbsImpl,
                       BindTopKAbs(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

// packed = [used][k indices][k value bits]; new_residual = (x + residual) with the selected
// entries zeroed.
ffi::Error TopKCompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> residual, ffi::ResultBuffer<ffi::U32> packed,
                            ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  const int64_t words = NumElements(*packed);
  const int64_t k = (words - 1) / 2;
  JAXCOMM_RETURN_IF_ERROR(
      TopKCompress(n, NumElements(residual), NumElements(*new_residual), words));
  uint32_t* out = packed->typed_data();
  out[0] = static_cast<uint32_t>(words);
  auto* out_indices = reinterpret_cast<int32_t*>(out + 1);
  auto* out_values = reinterpret_cast<float*>(out + 1 + k);
  kernels::TopKAbs(x.typed_data(), residual.typed_data(), n, k, out_indices, out_values,
                   new_residual->typed_data(), ffi_common::PoolRunner(&pool));
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_topk_compress", TopKCompressImpl,
                       BindTopKCompress(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

ffi::Error TopKDecompressImpl(ffi::Buffer<ffi::U32> packed, ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  const int64_t k = (words - 1) / 2;
  JAXCOMM_RETURN_IF_ERROR(TopKDecompress(n, words));
  const uint32_t* in = packed.typed_data();
  if (in[0] != static_cast<uint32_t>(words)) {
    return InvalidArgument(kTopKDecompressOp,
                           "packed[0] does not match the TopK packed length; "
                           "was it produced by compress with the same compressor?");
  }
  float* out = x_hat->typed_data();
  std::fill(out, out + n, 0.0f);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t index = static_cast<int32_t>(in[1 + j]);
    if (index < 0 || index >= n) {
      return InvalidArgument(kTopKDecompressOp, "index " + std::to_string(index) + " out of range");
    }
    out[index] += kernels::wire::BitsFloat(in[1 + k + j]);
  }
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_topk_decompress", TopKDecompressImpl,
                       BindTopKDecompress(ffi::Ffi::Bind()));

}  // namespace
}  // namespace jaxcomm::compress_checks
