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

// Compress's kernel launch on XLA's stream. The step is an attribute here (a host value): no
// device pointer.
ffi::Error CompressOnStream(cudaStream_t stream, const float* x, const float* residual, int64_t n,
                            const kernels::BlockQuantParams& p, uint32_t* packed,
                            float* new_residual) {
  return Launched(kCompressOp, gpu::BlockQuantCompress(
                                   x, residual, n, p.block, p.bits, p.stochastic, p.seed, p.step,
                                   /*device_step=*/nullptr, /*stream_id=*/0,
                                   /*first_index=*/0, packed, new_residual, stream));
}

JAXCOMM_DEFINE_CUDA_HANDLER("jaxcomm_blockquant_compress",
                            (Compress<&CompressOnStream, cudaStream_t>),
                            BindCompress(ffi::Ffi::Bind().Ctx<Stream>()));

ffi::Error DecompressCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                          ffi::Buffer<ffi::U32> packed, int64_t bits, int64_t block,
                          ffi::ResultBuffer<ffi::F32> x_hat) {
  kernels::BlockQuantParams p;
  JAXCOMM_RETURN_IF_ERROR(CheckDecompress(packed, bits, block, x_hat, &p));
  const int64_t n = NumElements(*x_hat);
  const int64_t words = NumElements(packed);
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
