// The static checks and bindings of BlockQuant's single-device ops (jaxcomm.ops.compress /
// decompress), shared by the CPU handlers (ffi/blockquant.cc) and the CUDA ones
// (ffi/cuda/blockquant.cc) so one ffi_call lowers to either platform unchanged.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "ffi/common.h"
#include "kernels/blockquant.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::blockquant_checks {

namespace ffi = xla::ffi;

constexpr char kCompressOp[] = "jaxcomm.ops.compress(BlockQuant)";
constexpr char kDecompressOp[] = "jaxcomm.ops.decompress(BlockQuant)";

// The kernel parameters from the attributes, checked, and the packed length they imply.
inline ffi::Error ReadParams(const char* op, int64_t n, int64_t bits, int64_t block,
                             bool stochastic, int64_t seed, int64_t step, int64_t words,
                             kernels::BlockQuantParams* p) {
  JAXCOMM_RETURN_IF_ERROR(ffi_common::CheckElementCount(op, n));
  p->bits = bits;
  p->block = block;
  p->stochastic = stochastic;
  p->seed = static_cast<uint32_t>(seed);
  p->step = static_cast<uint32_t>(step);
  const std::string bad = kernels::CheckBlockQuantParams(*p);
  if (!bad.empty()) return ffi_common::InvalidArgument(op, bad);
  const int64_t expected = kernels::BlockQuantPackedWords(n, block, bits);
  if (words != expected) {
    return ffi_common::InvalidArgument(
        op, "packed has " + std::to_string(words) + " words, BlockQuant(bits=" +
                std::to_string(bits) + ", block=" + std::to_string(block) + ") of " +
                std::to_string(n) + " elements needs " + std::to_string(expected));
  }
  return ffi::Error::Success();
}

// The compress handler of either platform: the checks (the parameters and packed's length,
// ReadParams; a residual and new residual of x's size), then `launch`, the platform's kernel
// call over the checked buffers: launch(ctx, x, residual, n, params, packed, new_residual). Ctx
// is the context the platform binds first (CPU: ffi::ThreadPool; CUDA: its stream).
template <auto launch, typename Ctx>
ffi::Error Compress(Ctx ctx, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual, int64_t bits,
                    int64_t block, bool stochastic, int64_t seed, int64_t step,
                    ffi::ResultBuffer<ffi::U32> packed, ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = ffi_common::NumElements(x);
  kernels::BlockQuantParams p;
  JAXCOMM_RETURN_IF_ERROR(ReadParams(kCompressOp, n, bits, block, stochastic, seed, step,
                                     ffi_common::NumElements(*packed), &p));
  if (ffi_common::NumElements(residual) != n || ffi_common::NumElements(*new_residual) != n) {
    return ffi_common::InvalidArgument(kCompressOp, "residual must have x's shape");
  }
  return launch(ctx, x.typed_data(), residual.typed_data(), n, p, packed->typed_data(),
                new_residual->typed_data());
}

// decompress's opening checks (CPU and CUDA): the parameters and packed's length for x_hat's
// size (ReadParams; no rounding).
inline ffi::Error CheckDecompress(const ffi::Buffer<ffi::U32>& packed, int64_t bits, int64_t block,
                                  ffi::ResultBuffer<ffi::F32> x_hat, kernels::BlockQuantParams* p) {
  return ReadParams(kDecompressOp, ffi_common::NumElements(*x_hat), bits, block, false, 0, 0,
                    ffi_common::NumElements(packed), p);
}

// compress: x and residual in, the attributes, packed and the new residual out.
template <typename Binding>
auto BindCompress(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()  // x
      .template Arg<ffi::Buffer<ffi::F32>>()  // residual
      .template Attr<int64_t>("bits")         // 8 or 4
      .template Attr<int64_t>("block")        // elements per scale
      .template Attr<bool>("stochastic")      // rounding
      .template Attr<int64_t>("seed")         // the stochastic rounding's counter
      .template Attr<int64_t>("step")
      .template Ret<ffi::Buffer<ffi::U32>>()   // packed
      .template Ret<ffi::Buffer<ffi::F32>>();  // new residual
}

// decompress: packed in, the attributes, x_hat out.
template <typename Binding>
auto BindDecompress(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::U32>>()   // packed
      .template Attr<int64_t>("bits")          // 8 or 4
      .template Attr<int64_t>("block")         // elements per scale
      .template Ret<ffi::Buffer<ffi::F32>>();  // x_hat
}

}  // namespace jaxcomm::blockquant_checks
