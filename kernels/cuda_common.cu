// The small kernels that the other .cu files and the GPU handlers (ffi/cuda/) share: writing one
// word whose value the host knows, and turning a device-side error flag into NaN outputs.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda_common.cuh"
#include "kernels/cuda_kernels.h"

namespace jaxcomm::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void WriteWordKernel(uint32_t* dst, uint32_t value) { *dst = value; }

__global__ void PoisonKernel(const uint32_t* bad, float* dense, int64_t n) {
  if (*bad == 0) return;
  JAXCOMM_GRID_STRIDE(i, n) { dense[i] = __uint_as_float(0x7fc00000u); }  // quiet NaN
}

}  // namespace

cudaError_t WriteWord(uint32_t* dst, uint32_t value, cudaStream_t stream) {
  WriteWordKernel<<<1, 1, 0, stream>>>(dst, value);
  return cudaGetLastError();
}

cudaError_t PoisonIfBad(const uint32_t* bad, float* dense, int64_t n, cudaStream_t stream) {
  PoisonKernel<<<detail::GridFor(n, kThreads), kThreads, 0, stream>>>(bad, dense, n);
  return cudaGetLastError();
}

}  // namespace jaxcomm::kernels::cuda
