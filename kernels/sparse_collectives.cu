// Dense-side kernels of the sparse collectives (declared in kernels/cuda_kernels.h). Each kernel
// is a grid-stride loop with one thread per sparse entry and no cross-thread communication; the
// comment on each names the CPU code whose float operations it replays.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda_common.cuh"
#include "kernels/cuda_kernels.h"

namespace jaxcomm::kernels::cuda {
namespace {

using detail::GridFor;

constexpr int kThreads = 256;

using detail::LowerBound;

// std::binary_search over ascending a[0, n).
__device__ bool Contains(const int32_t* a, int64_t n, int32_t v) {
  const int64_t p = LowerBound(a, n, v);
  return p < n && a[p] == v;
}

// kernels::ScatterAdd (add) / the CPU gTop-k's `out[index] = value` (set).
__global__ void ScatterKernel(const int32_t* idx, const float* val, int64_t k, float* dense,
                              int64_t n, uint32_t* bad, bool add) {
  JAXCOMM_GRID_STRIDE(j, k) {
    const int32_t index = idx[j];
    if (index < 0 || index >= n) {
      *bad = 1;
      continue;
    }
    if (add) {
      dense[index] += val[j];
    } else {
      dense[index] = val[j];
    }
  }
}

// CollectDropped of ffi/gtopk.cc, one slot per input entry instead of a compacted list.
__global__ void CollectDroppedKernel(const int32_t* idx_a, const float* val_a, int64_t ka,
                                     const int32_t* idx_b, const float* val_b, int64_t kb,
                                     const int32_t* out_idx, int64_t k_out, int32_t* dropped_idx,
                                     float* dropped_val) {
  JAXCOMM_GRID_STRIDE(t, ka + kb) {
    int32_t index;
    float value;
    if (t < ka) {
      index = idx_a[t];
      value = val_a[t];
      const int64_t j = LowerBound(idx_b, kb, index);
      if (j < kb && idx_b[j] == index) value = val_a[t] + val_b[j];  // as SparseMergeTopK
    } else {
      index = idx_b[t - ka];
      value = val_b[t - ka];
      if (Contains(idx_a, ka, index)) {  // summed into a's slot
        dropped_idx[t] = -1;
        dropped_val[t] = 0.0f;
        continue;
      }
    }
    const bool kept = Contains(out_idx, k_out, index);
    dropped_idx[t] = kept ? -1 : index;
    dropped_val[t] = kept ? 0.0f : value;
  }
}

// The residual fix-ups at the end of GTopKImpl (ffi/gtopk.cc): `r_out[index] += value` for
// the entries whose index is (inside) or is not (!inside) in the global set.
__global__ void AddWhereKernel(const int32_t* idx, const float* val, int64_t count,
                               const int32_t* set_idx, int64_t set_k, float* dense, int64_t n,
                               bool inside) {
  JAXCOMM_GRID_STRIDE(j, count) {
    const int32_t index = idx[j];
    if (index < 0 || index >= n) continue;
    if (Contains(set_idx, set_k, index) == inside) dense[index] += val[j];
  }
}

}  // namespace

cudaError_t ScatterAddSparse(const int32_t* idx, const float* val, int64_t k, float* dense,
                             int64_t n, uint32_t* bad, cudaStream_t stream) {
  ScatterKernel<<<GridFor(k, kThreads), kThreads, 0, stream>>>(idx, val, k, dense, n, bad, true);
  return cudaGetLastError();
}

cudaError_t ScatterSetSparse(const int32_t* idx, const float* val, int64_t k, float* dense,
                             int64_t n, uint32_t* bad, cudaStream_t stream) {
  ScatterKernel<<<GridFor(k, kThreads), kThreads, 0, stream>>>(idx, val, k, dense, n, bad, false);
  return cudaGetLastError();
}

cudaError_t CollectDropped(const int32_t* idx_a, const float* val_a, int64_t ka,
                           const int32_t* idx_b, const float* val_b, int64_t kb,
                           const int32_t* out_idx, int64_t k_out, int32_t* dropped_idx,
                           float* dropped_val, cudaStream_t stream) {
  CollectDroppedKernel<<<GridFor(ka + kb, kThreads), kThreads, 0, stream>>>(
      idx_a, val_a, ka, idx_b, val_b, kb, out_idx, k_out, dropped_idx, dropped_val);
  return cudaGetLastError();
}

cudaError_t AddBySet(SetSide side, const int32_t* idx, const float* val, int64_t count,
                     const int32_t* set_idx, int64_t set_k, float* dense, int64_t n,
                     cudaStream_t stream) {
  AddWhereKernel<<<GridFor(count, kThreads), kThreads, 0, stream>>>(
      idx, val, count, set_idx, set_k, dense, n, side == SetSide::kInside);
  return cudaGetLastError();
}

}  // namespace jaxcomm::kernels::cuda
