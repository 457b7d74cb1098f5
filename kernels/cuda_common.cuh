// Device-side helpers shared by the .cu kernels. The wire encodings (entries, sample positions)
// are kernels/wire.h's own, compiled for the device; the magnitude key of kernels/topk.h is
// restated with __float_as_uint (topk.h uses std::memcpy).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "kernels/quantize_status.h"
#include "kernels/wire.h"

namespace jaxcomm::kernels::cuda::detail {

using kernels::kNonFiniteKey;
using wire::Entry;
using wire::kIndexMask;
using wire::kSignBit;
using wire::SamplePosition;
constexpr uint32_t kNoIndex = 0xffffffffu;

// kernels::MagnitudeKey: NaN > Inf > finite, finite ordered by |v|.
__device__ __forceinline__ uint32_t MagnitudeKey(float v) {
  return __float_as_uint(v) & kIndexMask;
}

// Grid-stride loop over [0, count): `for` header binding int64_t `i` in each thread.
#define JAXCOMM_GRID_STRIDE(i, count)                                                        \
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (count); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// First position p in ascending a[0, n) with a[p] >= v (std::lower_bound).
__device__ __forceinline__ int64_t LowerBound(const int32_t* a, int64_t n, int32_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Grid for a grid-stride loop over n elements: enough blocks to fill any current GPU, no more.
inline unsigned GridFor(int64_t n, int threads, int64_t max_blocks = 4096) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > max_blocks) blocks = max_blocks;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

// Called by all kThreads threads of one block: offsets[i] = counts[0] + ... + counts[i - 1] for
// i < count (any count, kThreads at a time); returns the sum of all counts to every thread.
template <int kThreads>
__device__ uint32_t BlockExclusiveScan(const uint32_t* counts, int64_t count, uint32_t* offsets) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ uint32_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < count; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const uint32_t value = i < count ? counts[i] : 0u;
    uint32_t before, total;
    Scan(temp).ExclusiveSum(value, before, total);
    if (i < count) offsets[i] = carry + before;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  return carry;
}

}  // namespace jaxcomm::kernels::cuda::detail
