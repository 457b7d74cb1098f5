// Elementwise helpers of the GPU quantized and hierarchical allreduces
// (ffi/cuda/quantized_allreduce.cc); each does one float operation per element, the same one
// as the CPU code it mirrors, so results are bit-identical.
#include "kernels/cuda_common.cuh"
#include "kernels/cuda_kernels.h"

namespace jaxcomm::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Mirrors kernels::AddInto (kernels/reduce.cc): dst[i] += src[i].
__global__ void AddIntoKernel(float* dst, const float* src, int64_t n) {
  JAXCOMM_GRID_STRIDE(i, n) { dst[i] = dst[i] + src[i]; }
}

// Mirrors `out[i] = xs[i] + rs[i]` of HierarchicalQuantizedImpl (ffi/quantized_allreduce.cc).
// Each element is read and written by one thread, so out may alias a or b.
__global__ void AddVectorsKernel(const float* a, const float* b, int64_t n, float* out) {
  JAXCOMM_GRID_STRIDE(i, n) { out[i] = a[i] + b[i]; }
}

}  // namespace

cudaError_t AddInto(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AddIntoKernel<<<detail::GridFor(n, kThreads), kThreads, 0, stream>>>(dst, src, n);
  return cudaGetLastError();
}

cudaError_t AddVectors(const float* a, const float* b, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  AddVectorsKernel<<<detail::GridFor(n, kThreads), kThreads, 0, stream>>>(a, b, n, out);
  return cudaGetLastError();
}

}  // namespace jaxcomm::kernels::cuda
