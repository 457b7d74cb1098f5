// XLA FFI handlers of BlockQuant's single-device ops for platform "CUDA": the targets,
// attributes and static checks of the CPU handlers (ffi/blockquant.cc, ffi/blockquant_checks.h)
// running kernels/blockquant.cu on XLA's stream. Nothing synchronizes: a NaN/Inf in x +
// residual gives packed[0] = 0, and a bad message decodes to all-NaN (kernels/cuda_kernels.h).
#include <cuda_runtime_api.h>

#include <string>

#include "ffi/blockquant_checks.h"
#include "ffi/common.h"
#include "kernels/cuda_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::blockquant_checks {
namespace {

namespace gpu = kernels::cuda;
using ffi_common::NumElements;
using Stream = ffi::PlatformStream<cudaStream_t>;

ffi::Error Launched(const char* op, cudaError_t error) {
  if (error == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) +
                              ": CUDA launch failed: " + cudaGetErrorString(error));
}

ffi::Error CompressCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> residual, int64_t bits, int64_t block,
                        bool stochastic, int64_t seed, int64_t step,
                        ffi::ResultBuffer<ffi::U32> packed,
                        ffi::ResultBuffer<ffi::F32> new_residual) {
  const int64_t n = NumElements(x);
  kernels::BlockQuantParams p;
  JAXCOMM_RETURN_IF_ERROR(
      ReadParams(kCompressOp, n, bits, block, stochastic, seed, step, NumElements(*packed), &p));
  if (NumElements(residual) != n || NumElements(*new_residual) != n) {
    return ffi_common::InvalidArgument(kCompressOp, "residual must have x's shape");
  }
  // The step is an attribute here (a host value): no device pointer.
  return Launched(kCompressOp, gpu::BlockQuantCompress(x.typed_data(), residual.typed_data(), n,
                                                       block, bits, stochastic, p.seed, p.step,
                                                       /*device_step=*/nullptr, /*stream_id=*/0,
                                                       /*first_index=*/0, packed->typed_data(),
                                                       new_residual->typed_data(), stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_blockquant_compress", CompressCuda,
                            BindCompress(ffi::Ffi::Bind().Ctx<Stream>()));

ffi::Error DecompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                          ffi::Buffer<ffi::U32> packed, int64_t bits, int64_t block,
                          ffi::ResultBuffer<ffi::F32> x_hat) {
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
  kernels::BlockQuantParams p;
  JAXCOMM_RETURN_IF_ERROR(ReadParams(kDecompressOp, n, bits, block, false, 0, 0, words, &p));
  void* work = nullptr;
  JAXCOMM_RETURN_IF_ERROR(ffi_common::AllocateScratch(
      scratch, kDecompressOp, gpu::BlockQuantDecompressScratchBytes(), &work));
  return Launched(kDecompressOp, gpu::BlockQuantDecompress(packed.typed_data(), words, n, block,
                                                           bits, x_hat->typed_data(),
                                                           /*accumulate=*/false, work, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER(
    "jaxcomm_blockquant_decompress", DecompressCuda,
    BindDecompress(ffi::Ffi::Bind().Ctx<Stream>().Ctx<ffi::ScratchAllocator>()));

}  // namespace
}  // namespace jaxcomm::blockquant_checks
