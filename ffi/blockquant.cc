// XLA FFI handlers for BlockQuant compression (block-wise int8/int4 quantization with error
// feedback, kernels/blockquant.h) and its decompression on one device: jaxcomm.ops.compress /
// decompress. The collective is the shared quantized allreduce (ffi/quantized_allreduce.cc).
// Parameters arrive as attributes; the packed length is checked against them, so a buffer
// from another compressor is rejected instead of misread.
#include "kernels/blockquant.h"

#include <string>

#include "ffi/common.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::blockquant_ops {
namespace {

namespace ffi = xla::ffi;
using ffi_common::InvalidArgument;
using ffi_common::NumElements;

constexpr char kCompressOp[] = "jaxcomm.ops.compress(BlockQuant)";
constexpr char kDecompressOp[] = "jaxcomm.ops.decompress(BlockQuant)";

// The kernel parameters from the attributes, checked, and the packed length they imply.
ffi::Error ReadParams(const char* op, int64_t n, int64_t bits, int64_t block, bool stochastic,
                      int64_t seed, int64_t step, int64_t words, kernels::BlockQuantParams* p) {
  JAXCOMM_RETURN_IF_ERROR(ffi_common::CheckElementCount(op, n));
  p->bits = bits;
  p->block = block;
  p->stochastic = stochastic;
  p->seed = static_cast<uint32_t>(seed);
  p->step = static_cast<uint32_t>(step);
  const std::string bad = kernels::CheckBlockQuantParams(*p);
  if (!bad.empty()) return InvalidArgument(op, bad);
  const int64_t expected = kernels::BlockQuantPackedWords(n, block, bits);
  if (words != expected) {
    return InvalidArgument(op, "packed has " + std::to_string(words) + " words, BlockQuant(bits=" +
                                   std::to_string(bits) + ", block=" + std::to_string(block) +
                                   ") of " + std::to_string(n) + " elements needs " +
                                   std::to_string(expected));
  }
  return ffi::Error::Success();
}

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
  const kernels::QuantizeStatus status =
      kernels::BlockQuantCompress(x.typed_data(), residual.typed_data(), n, p, packed->typed_data(),
                                  new_residual->typed_data(), ffi_common::PoolRunner(&pool));
  if (!status.ok()) return ffi_common::NonFinite(kCompressOp, status.nonfinite_index);
  return ffi::Error::Success();
}

JAXCOMM_DEFINE_HANDLER("jaxcomm_blockquant_compress", CompressImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::Buffer<ffi::F32>>()  // x
                           .Arg<ffi::Buffer<ffi::F32>>()  // residual
                           .Attr<int64_t>("bits")         // 8 or 4
                           .Attr<int64_t>("block")        // elements per scale
                           .Attr<bool>("stochastic")      // rounding
                           .Attr<int64_t>("seed")         // stochastic rounding's counter
                           .Attr<int64_t>("step")
                           .Ret<ffi::Buffer<ffi::U32>>()    // packed
                           .Ret<ffi::Buffer<ffi::F32>>());  // new residual

ffi::Error DecompressImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> packed, int64_t bits,
                          int64_t block, ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  kernels::BlockQuantParams p;
  JAXCOMM_RETURN_IF_ERROR(ReadParams(kDecompressOp, n, bits, block, false, 0, 0, words, &p));
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
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<ffi::Buffer<ffi::U32>>()    // packed
                           .Attr<int64_t>("bits")           // 8 or 4
                           .Attr<int64_t>("block")          // elements per scale
                           .Ret<ffi::Buffer<ffi::F32>>());  // x_hat

}  // namespace
}  // namespace jaxcomm::blockquant_ops
