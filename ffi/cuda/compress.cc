// XLA FFI handlers of the compression ops for platform "CUDA": the same targets, attributes and
// static checks (ffi/compress_checks.h, shared with the CPU handlers in ffi/*.cc), running the
// kernels of kernels/cuda_kernels.h on XLA's stream. They never synchronize the stream: checks that
// need the data (a NaN for a quantizer, a corrupt packed buffer) happen on the device and show up
// in the outputs, as described in kernels/cuda_kernels.h. Working memory comes from XLA's
// ScratchAllocator.
//
// Only the OneBit handlers are marked command-buffer (CUDA graph) compatible: they launch a
// fixed sequence of kernels and allocate nothing. The others take ScratchAllocator memory,
// whose address XLA does not promise to keep stable across graph replays.
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/common.h"
#include "ffi/compress_checks.h"
#include "kernels/adaptive.h"
#include "kernels/cuda_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm {
namespace {

namespace ffi = xla::ffi;
namespace gpu = kernels::cuda;
using ffi_common::NumElements;
namespace checks = compress_checks;  // op names and static checks shared with the CPU handlers

ffi::Error Launched(const char* op, cudaError_t error) {
  if (error == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) +
                              ": CUDA launch failed: " + cudaGetErrorString(error));
}

// The contexts the handlers open with: XLA's stream, and scratch memory for the kernels that
// need working memory. Each op's own binding follows (ffi/compress_checks.h, shared with the CPU
// handler).
using Stream = ffi::PlatformStream<cudaStream_t>;
auto OnStream() { return ffi::Ffi::Bind().Ctx<Stream>(); }
auto WithScratch() { return OnStream().Ctx<ffi::ScratchAllocator>(); }

// ---- TopK -------------------------------------------------------------------------------

ffi::Error TopKAbsCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::F32> x,
                       ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> indices) {
  const int64_t n = NumElements(x);
  const int64_t k = NumElements(*values);
  JAXCOMM_RETURN_IF_ERROR(checks::TopKAbs(n, k, NumElements(*indices)));
  const size_t bytes = gpu::TopKScratchBytes(n);
  void* work = nullptr;
  JAXCOMM_RETURN_IF_ERROR(ffi_common::AllocateScratch(scratch, checks::kTopKAbsOp, bytes, &work));
  return Launched(checks::kTopKAbsOp,
                  gpu::TopKAbs(x.typed_data(), nullptr, n, k, indices->typed_data(),
                               values->typed_data(), nullptr, work, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_topk_abs", TopKAbsCuda, checks::BindTopKAbs(WithScratch()));

ffi::Error TopKCompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                            ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                            ffi::ResultBuffer<ffi::U32> packed,
                            ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  const int64_t words = NumElements(*packed);
  const int64_t k = (words - 1) / 2;
  JAXCOMM_RETURN_IF_ERROR(
      checks::TopKCompress(n, NumElements(residual), NumElements(*new_residual), words));
  const size_t bytes = gpu::TopKScratchBytes(n);
  void* work = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      ffi_common::AllocateScratch(scratch, checks::kTopKCompressOp, bytes, &work));
  uint32_t* out = packed->typed_data();
  // The header is static (1 + 2k) but lives in device memory: a one-thread kernel writes it.
  if (cudaError_t error = gpu::WriteWord(out, static_cast<uint32_t>(words), stream);
      error != cudaSuccess) {
    return Launched(checks::kTopKCompressOp, error);
  }
  return Launched(checks::kTopKCompressOp, gpu::TopKAbs(x.typed_data(), residual.typed_data(), n, k,
                                                        reinterpret_cast<int32_t*>(out + 1),
                                                        reinterpret_cast<float*>(out + 1 + k),
                                                        new_residual->typed_data(), work, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_topk_compress", TopKCompressCuda,
                            checks::BindTopKCompress(WithScratch()));

ffi::Error TopKDecompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                              ffi::Buffer<ffi::U32> packed, ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  JAXCOMM_RETURN_IF_ERROR(checks::TopKDecompress(n, words));
  const size_t bytes = gpu::TopKDecompressScratchBytes();
  void* work = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      ffi_common::AllocateScratch(scratch, checks::kTopKDecompressOp, bytes, &work));
  return Launched(
      checks::kTopKDecompressOp,
      gpu::TopKDecompress(packed.typed_data(), words, n, x_hat->typed_data(), work, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_topk_decompress", TopKDecompressCuda,
                            checks::BindTopKDecompress(WithScratch()));

// ---- sparse merge -----------------------------------------------------------------------

ffi::Error SparseMergeCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                           ffi::Buffer<ffi::S32> idx_a, ffi::Buffer<ffi::F32> val_a,
                           ffi::Buffer<ffi::S32> idx_b, ffi::Buffer<ffi::F32> val_b,
                           ffi::ResultBuffer<ffi::S32> idx, ffi::ResultBuffer<ffi::F32> val) {
  checks::SparseMergeSizes size;
  JAXCOMM_RETURN_IF_ERROR(checks::CheckSparseMerge(idx_a, val_a, idx_b, val_b, idx, val, &size));
  const auto [ka, kb, k] = size;
  JAXCOMM_RETURN_IF_ERROR(checks::SparseMergeDeviceLimit(ka, kb));
  const size_t bytes = gpu::SparseMergeScratchBytes(ka, kb);
  void* work = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      ffi_common::AllocateScratch(scratch, checks::kSparseMergeOp, bytes, &work));
  return Launched(checks::kSparseMergeOp,
                  gpu::SparseMergeTopK(idx_a.typed_data(), val_a.typed_data(), ka,
                                       idx_b.typed_data(), val_b.typed_data(), kb, k,
                                       idx->typed_data(), val->typed_data(), work, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_sparse_merge", SparseMergeCuda,
                            checks::BindSparseMerge(WithScratch()));

// ---- OneBit -----------------------------------------------------------------------------

ffi::Error OneBitCompressCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> residual, int64_t column_size,
                              int64_t sample_size, ffi::ResultBuffer<ffi::U32> packed,
                              ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  JAXCOMM_RETURN_IF_ERROR(checks::OneBitCompress(n, column_size, sample_size, NumElements(residual),
                                                 NumElements(*new_residual), NumElements(*packed)));
  return Launched(
      checks::kOneBitCompressOp,
      gpu::OneBitCompress(x.typed_data(), residual.typed_data(), n, column_size, sample_size,
                          packed->typed_data(), new_residual->typed_data(), stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_onebit_compress", OneBitCompressCuda,
                            checks::BindOneBitCompress(OnStream()),
                            {ffi::Traits::kCmdBufferCompatible});

ffi::Error OneBitDecompressCuda(cudaStream_t stream, ffi::Buffer<ffi::U32> packed,
                                int64_t column_size, int64_t sample_size,
                                ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  JAXCOMM_RETURN_IF_ERROR(checks::OneBitDecompress(n, column_size, sample_size, words));
  return Launched(checks::kOneBitDecompressOp,
                  gpu::OneBitDecompress(packed.typed_data(), words, n, column_size,
                                        x_hat->typed_data(), stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_onebit_decompress", OneBitDecompressCuda,
                            checks::BindOneBitDecompress(OnStream()),
                            {ffi::Traits::kCmdBufferCompatible});

// ---- Threshold --------------------------------------------------------------------------

ffi::Error ThresholdCompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                 ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual, float tau,
                                 ffi::ResultBuffer<ffi::U32> packed,
                                 ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  const int64_t words = NumElements(*packed);
  JAXCOMM_RETURN_IF_ERROR(
      checks::ThresholdCompress(n, tau, words, NumElements(residual), NumElements(*new_residual)));
  const size_t bytes = gpu::ThresholdScratchBytes(n);
  void* work = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      ffi_common::AllocateScratch(scratch, checks::kThresholdCompressOp, bytes, &work));
  return Launched(
      checks::kThresholdCompressOp,
      gpu::ThresholdCompress(x.typed_data(), residual.typed_data(), n, tau, words - 1,
                             packed->typed_data(), new_residual->typed_data(), work, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_threshold_compress", ThresholdCompressCuda,
                            checks::BindThresholdCompress(WithScratch()));

ffi::Error ThresholdDecompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                   ffi::Buffer<ffi::U32> packed, float tau,
                                   ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  JAXCOMM_RETURN_IF_ERROR(checks::ThresholdDecompress(n, tau, words));
  const size_t bytes = gpu::ThresholdDecompressScratchBytes();
  void* work = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      ffi_common::AllocateScratch(scratch, checks::kThresholdDecompressOp, bytes, &work));
  return Launched(checks::kThresholdDecompressOp,
                  gpu::ThresholdDecompress(packed.typed_data(), words, n, tau, x_hat->typed_data(),
                                           work, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_threshold_decompress", ThresholdDecompressCuda,
                            checks::BindThresholdDecompress(WithScratch()));

// ---- Adaptive ---------------------------------------------------------------------------

ffi::Error AdaptiveCompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual,
                                ffi::ResultBuffer<ffi::U32> packed,
                                ffi::ResultBuffer<ffi::F32> new_residual, double proportion,
                                int64_t column_size, int64_t sample_size) {
  const int64_t n = NumElements(x);
  kernels::AdaptiveLayout layout{};
  JAXCOMM_RETURN_IF_ERROR(
      checks::AdaptiveCompress(n, NumElements(residual), NumElements(*new_residual), proportion,
                               column_size, sample_size, NumElements(*packed), &layout));
  JAXCOMM_RETURN_IF_ERROR(checks::AdaptiveDeviceSampleLimit(sample_size));
  const size_t bytes = gpu::AdaptiveCompressScratchBytes(n, column_size, proportion, sample_size);
  void* work = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      ffi_common::AllocateScratch(scratch, checks::kAdaptiveCompressOp, bytes, &work));
  return Launched(checks::kAdaptiveCompressOp,
                  gpu::AdaptiveCompress(x.typed_data(), residual.typed_data(), n, column_size,
                                        proportion, sample_size, packed->typed_data(),
                                        new_residual->typed_data(), work, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_adaptive_compress", AdaptiveCompressCuda,
                            checks::BindAdaptiveCompress(WithScratch()));

ffi::Error AdaptiveDecompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                  ffi::Buffer<ffi::U32> packed, ffi::ResultBuffer<ffi::F32> x_hat,
                                  double proportion, int64_t column_size) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  kernels::AdaptiveLayout layout{};
  JAXCOMM_RETURN_IF_ERROR(checks::AdaptiveDecompress(n, proportion, column_size, words, &layout));
  const size_t bytes = gpu::AdaptiveDecompressScratchBytes();
  void* work = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      ffi_common::AllocateScratch(scratch, checks::kAdaptiveDecompressOp, bytes, &work));
  return Launched(checks::kAdaptiveDecompressOp,
                  gpu::AdaptiveDecompress(packed.typed_data(), words, n, column_size, proportion,
                                          x_hat->typed_data(), /*accumulate=*/false, work, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_adaptive_decompress", AdaptiveDecompressCuda,
                            checks::BindAdaptiveDecompress(WithScratch()));

}  // namespace
}  // namespace jaxcomm
