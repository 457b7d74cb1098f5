// XLA FFI handlers of the compression ops for platform "CUDA": the same targets, attributes and
// static checks as the CPU handlers in ffi/*.cc, running the kernels of kernels/cuda_kernels.h
// on XLA's stream. They never synchronize the stream: checks that need the data (a NaN for a
// quantizer, a corrupt packed buffer) happen on the device and show up in the outputs, as
// described in kernels/cuda_kernels.h. Working memory comes from XLA's ScratchAllocator.
//
// Only the OneBit handlers are marked command-buffer (CUDA graph) compatible: they launch a
// fixed sequence of kernels and allocate nothing. The others take ScratchAllocator memory,
// whose address XLA does not promise to keep stable across graph replays.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "ffi/common.h"
#include "kernels/cuda_kernels.h"
#include "kernels/onebit.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {
namespace {

namespace ffi = xla::ffi;
namespace gpu = kernels::cuda;
using ffi_common::InvalidArgument;
using ffi_common::NumElements;

constexpr int64_t kMaxElements = (int64_t{1} << 31) - 1;  // 31-bit indices on the wire

ffi::Error Launched(const char* op, cudaError_t error) {
  if (error == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) +
                              ": CUDA launch failed: " + cudaGetErrorString(error));
}

// Device scratch of `bytes` (256-aligned), or an error naming the op.
std::optional<void*> Scratch(ffi::ScratchAllocator& scratch, size_t bytes) {
  return scratch.Allocate(bytes, 256);
}
ffi::Error NoScratch(const char* op, size_t bytes) {
  return ffi::Error(ffi::ErrorCode::kResourceExhausted, std::string(op) + ": could not allocate " +
                                                            std::to_string(bytes) +
                                                            " bytes of GPU scratch memory");
}

// ---- TopK -------------------------------------------------------------------------------

constexpr char kTopKOp[] = "jaxcomm.ops.topk_abs";
constexpr char kTopKCompressOp[] = "jaxcomm.ops.compress(TopK)";
constexpr char kTopKDecompressOp[] = "jaxcomm.ops.decompress(TopK)";

ffi::Error TopKAbsCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::F32> x,
                       ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> indices) {
  const int64_t n = NumElements(x);
  const int64_t k = NumElements(*values);
  if (n > kMaxElements) return InvalidArgument(kTopKOp, "x must have fewer than 2**31 elements");
  if (k < 1 || k > n) return InvalidArgument(kTopKOp, "k must be in [1, x.size]");
  if (NumElements(*indices) != k) return InvalidArgument(kTopKOp, "values/indices size mismatch");
  const size_t bytes = gpu::TopKScratchBytes(n);
  auto work = Scratch(scratch, bytes);
  if (!work) return NoScratch(kTopKOp, bytes);
  return Launched(kTopKOp, gpu::TopKAbs(x.typed_data(), nullptr, n, k, indices->typed_data(),
                                        values->typed_data(), nullptr, *work, stream));
}

ffi::Error TopKCompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                            ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                            ffi::ResultBuffer<ffi::U32> packed,
                            ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  const int64_t words = NumElements(*packed);
  const int64_t k = (words - 1) / 2;
  if (NumElements(residual) != n || NumElements(*new_residual) != n) {
    return InvalidArgument(kTopKCompressOp, "residual must have x's shape");
  }
  if (n > kMaxElements) {
    return InvalidArgument(kTopKCompressOp, "x must have fewer than 2**31 elements");
  }
  if (words % 2 != 1 || k < 1 || k > n) return InvalidArgument(kTopKCompressOp, "bad packed size");
  const size_t bytes = gpu::TopKScratchBytes(n);
  auto work = Scratch(scratch, bytes);
  if (!work) return NoScratch(kTopKCompressOp, bytes);
  uint32_t* out = packed->typed_data();
  // The header is static (1 + 2k) but lives in device memory: a one-thread kernel writes it.
  if (cudaError_t error = gpu::WriteWord(out, static_cast<uint32_t>(words), stream);
      error != cudaSuccess) {
    return Launched(kTopKCompressOp, error);
  }
  return Launched(kTopKCompressOp, gpu::TopKAbs(x.typed_data(), residual.typed_data(), n, k,
                                                reinterpret_cast<int32_t*>(out + 1),
                                                reinterpret_cast<float*>(out + 1 + k),
                                                new_residual->typed_data(), *work, stream));
}

ffi::Error TopKDecompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                              ffi::Buffer<ffi::U32> packed, ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  const int64_t k = (words - 1) / 2;
  if (words % 2 != 1 || k < 1 || k > n) {
    return InvalidArgument(kTopKDecompressOp, "bad packed size");
  }
  const size_t bytes = gpu::TopKDecompressScratchBytes();
  auto work = Scratch(scratch, bytes);
  if (!work) return NoScratch(kTopKDecompressOp, bytes);
  return Launched(kTopKDecompressOp, gpu::TopKDecompress(packed.typed_data(), words, n,
                                                         x_hat->typed_data(), *work, stream));
}

// ---- sparse merge -----------------------------------------------------------------------

constexpr char kSparseMergeOp[] = "jaxcomm.ops.sparse_merge";

ffi::Error SparseMergeCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                           ffi::Buffer<ffi::S32> idx_a, ffi::Buffer<ffi::F32> val_a,
                           ffi::Buffer<ffi::S32> idx_b, ffi::Buffer<ffi::F32> val_b,
                           ffi::ResultBuffer<ffi::S32> idx, ffi::ResultBuffer<ffi::F32> val) {
  const int64_t ka = NumElements(idx_a);
  const int64_t kb = NumElements(idx_b);
  const int64_t k = NumElements(*idx);
  if (NumElements(val_a) != ka) {
    return InvalidArgument(kSparseMergeOp, "val_a has " + std::to_string(NumElements(val_a)) +
                                               " elements but idx_a has " + std::to_string(ka));
  }
  if (NumElements(val_b) != kb) {
    return InvalidArgument(kSparseMergeOp, "val_b has " + std::to_string(NumElements(val_b)) +
                                               " elements but idx_b has " + std::to_string(kb));
  }
  if (NumElements(*val) != k) return InvalidArgument(kSparseMergeOp, "idx/val size mismatch");
  if (k < 1 || k > std::max(ka, kb)) {
    return InvalidArgument(kSparseMergeOp,
                           "k = " + std::to_string(k) + " must be in [1, max(ka, kb)] = [1, " +
                               std::to_string(std::max(ka, kb)) +
                               "] so that the union of the inputs always holds k entries");
  }
  if (ka + kb > kMaxElements) {
    return InvalidArgument(kSparseMergeOp, "ka + kb must be below 2**31");
  }
  const size_t bytes = gpu::SparseMergeScratchBytes(ka, kb);
  auto work = Scratch(scratch, bytes);
  if (!work) return NoScratch(kSparseMergeOp, bytes);
  return Launched(kSparseMergeOp,
                  gpu::SparseMergeTopK(idx_a.typed_data(), val_a.typed_data(), ka,
                                       idx_b.typed_data(), val_b.typed_data(), kb, k,
                                       idx->typed_data(), val->typed_data(), *work, stream));
}

// ---- OneBit -----------------------------------------------------------------------------

constexpr char kOneBitCompressOp[] = "jaxcomm.ops.compress(OneBit)";
constexpr char kOneBitDecompressOp[] = "jaxcomm.ops.decompress(OneBit)";

ffi::Error CheckOneBit(const char* op, int64_t n, int64_t column_size, int64_t sample_size,
                       int64_t words) {
  if (n < 1 || n > kMaxElements) {
    return InvalidArgument(op, "needs 1 to 2**31 - 1 elements, got " + std::to_string(n));
  }
  if (column_size < 32 || column_size % 32 != 0) {
    return InvalidArgument(
        op, "column_size must be a positive multiple of 32, got " + std::to_string(column_size));
  }
  if (sample_size < 0) {
    return InvalidArgument(op, "sample_size must be >= 0, got " + std::to_string(sample_size));
  }
  const int64_t expected = kernels::OneBitPackedWords(n, column_size);
  if (words != expected) {
    return InvalidArgument(op, "packed has " + std::to_string(words) + " words, OneBit(" +
                                   std::to_string(column_size) + ") packs " + std::to_string(n) +
                                   " elements into " + std::to_string(expected));
  }
  return ffi::Error::Success();
}

ffi::Error OneBitCompressCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> residual, int64_t column_size,
                              int64_t sample_size, ffi::ResultBuffer<ffi::U32> packed,
                              ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  if (ffi::Error error =
          CheckOneBit(kOneBitCompressOp, n, column_size, sample_size, NumElements(*packed));
      error.failure()) {
    return error;
  }
  if (NumElements(residual) != n || NumElements(*new_residual) != n) {
    return InvalidArgument(kOneBitCompressOp, "residual must have x's shape");
  }
  return Launched(
      kOneBitCompressOp,
      gpu::OneBitCompress(x.typed_data(), residual.typed_data(), n, column_size, sample_size,
                          packed->typed_data(), new_residual->typed_data(), stream));
}

ffi::Error OneBitDecompressCuda(cudaStream_t stream, ffi::Buffer<ffi::U32> packed,
                                int64_t column_size, int64_t sample_size,
                                ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  if (ffi::Error error = CheckOneBit(kOneBitDecompressOp, n, column_size, sample_size, words);
      error.failure()) {
    return error;
  }
  return Launched(kOneBitDecompressOp,
                  gpu::OneBitDecompress(packed.typed_data(), words, n, column_size,
                                        x_hat->typed_data(), stream));
}

// ---- Threshold --------------------------------------------------------------------------

constexpr char kThresholdCompressOp[] = "jaxcomm.ops.compress(Threshold)";
constexpr char kThresholdDecompressOp[] = "jaxcomm.ops.decompress(Threshold)";

ffi::Error CheckThreshold(const char* op, int64_t n, float tau, int64_t words) {
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

ffi::Error ThresholdCompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                 ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual, float tau,
                                 ffi::ResultBuffer<ffi::U32> packed,
                                 ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  const int64_t words = NumElements(*packed);
  if (ffi::Error error = CheckThreshold(kThresholdCompressOp, n, tau, words); error.failure()) {
    return error;
  }
  if (NumElements(residual) != n || NumElements(*new_residual) != n) {
    return InvalidArgument(kThresholdCompressOp, "residual must have x's shape");
  }
  const size_t bytes = gpu::ThresholdScratchBytes(n);
  auto work = Scratch(scratch, bytes);
  if (!work) return NoScratch(kThresholdCompressOp, bytes);
  return Launched(
      kThresholdCompressOp,
      gpu::ThresholdCompress(x.typed_data(), residual.typed_data(), n, tau, words - 1,
                             packed->typed_data(), new_residual->typed_data(), *work, stream));
}

ffi::Error ThresholdDecompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                   ffi::Buffer<ffi::U32> packed, float tau,
                                   ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  if (ffi::Error error = CheckThreshold(kThresholdDecompressOp, n, tau, words); error.failure()) {
    return error;
  }
  const size_t bytes = gpu::ThresholdDecompressScratchBytes();
  auto work = Scratch(scratch, bytes);
  if (!work) return NoScratch(kThresholdDecompressOp, bytes);
  return Launched(kThresholdDecompressOp,
                  gpu::ThresholdDecompress(packed.typed_data(), words, n, tau, x_hat->typed_data(),
                                           *work, stream));
}

}  // namespace
}  // namespace jaxcomm

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;

JAXCOMM_EXPORT_HANDLER(JaxcommTopKAbsCuda);
JAXCOMM_EXPORT_HANDLER(JaxcommTopKCompressCuda);
JAXCOMM_EXPORT_HANDLER(JaxcommTopKDecompressCuda);
JAXCOMM_EXPORT_HANDLER(JaxcommSparseMergeCuda);
JAXCOMM_EXPORT_HANDLER(JaxcommOneBitCompressCuda);
JAXCOMM_EXPORT_HANDLER(JaxcommOneBitDecompressCuda);
JAXCOMM_EXPORT_HANDLER(JaxcommThresholdCompressCuda);
JAXCOMM_EXPORT_HANDLER(JaxcommThresholdDecompressCuda);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommTopKAbsCuda, jaxcomm::TopKAbsCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x: n-vector
                                  .Ret<ffi::Buffer<ffi::F32>>()  // values: k
                                  .Ret<ffi::Buffer<ffi::S32>>()  // indices: k, ascending
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommTopKCompressCuda, jaxcomm::TopKCompressCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual: x's shape
                                  .Ret<ffi::Buffer<ffi::U32>>()  // packed: 1 + 2k words
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new_residual
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommTopKDecompressCuda, jaxcomm::TopKDecompressCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // packed: 1 + 2k words
                                  .Ret<ffi::Buffer<ffi::F32>>()  // x_hat: n elements
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommSparseMergeCuda, jaxcomm::SparseMergeCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // idx_a: ka, ascending
                                  .Arg<ffi::Buffer<ffi::F32>>()  // val_a: ka
                                  .Arg<ffi::Buffer<ffi::S32>>()  // idx_b: kb, ascending
                                  .Arg<ffi::Buffer<ffi::F32>>()  // val_b: kb
                                  .Ret<ffi::Buffer<ffi::S32>>()  // idx: k, ascending
                                  .Ret<ffi::Buffer<ffi::F32>>()  // val: k
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommOneBitCompressCuda, jaxcomm::OneBitCompressCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual: x's shape
                                  .Attr<int64_t>("column_size")
                                  .Attr<int64_t>("sample_size")
                                  .Ret<ffi::Buffer<ffi::U32>>()   // packed: OneBit words
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // new_residual
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommOneBitDecompressCuda, jaxcomm::OneBitDecompressCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // packed: OneBit words
                                  .Attr<int64_t>("column_size")
                                  .Attr<int64_t>("sample_size")
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // x_hat: n elements
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommThresholdCompressCuda, jaxcomm::ThresholdCompressCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // residual: x's shape
                                  .Attr<float>("tau")
                                  .Ret<ffi::Buffer<ffi::U32>>()  // packed: 1 + capacity
                                  .Ret<ffi::Buffer<ffi::F32>>()  // new_residual
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommThresholdDecompressCuda, jaxcomm::ThresholdDecompressCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // packed: 1 + capacity
                                  .Attr<float>("tau")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // x_hat: n elements
);
