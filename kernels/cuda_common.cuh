// Device-side helpers shared by the .cu kernels: the key and wire encodings of kernels/wire.h
// and kernels/topk.h, as __device__ functions (those headers use std::memcpy on the host).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

namespace jaxcomm::kernels::cuda::detail {

constexpr uint32_t kSignBit = 0x80000000u;
constexpr uint32_t kIndexMask = 0x7fffffffu;
constexpr uint32_t kNonFiniteKey = 0x7f800000u;  // kernels/quantize_status.h
constexpr uint32_t kNoIndex = 0xffffffffu;

// kernels::MagnitudeKey: NaN > Inf > finite, finite ordered by |v|.
__device__ __forceinline__ uint32_t MagnitudeKey(float v) {
  return __float_as_uint(v) & kIndexMask;
}

__device__ __forceinline__ uint32_t Entry(bool positive, int64_t index) {
  return (positive ? kSignBit : 0u) | (static_cast<uint32_t>(index) & kIndexMask);
}

// kernels::wire::Mix / SamplePosition (splitmix64), so GPU samples equal the CPU's.
__device__ __forceinline__ uint64_t Mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ int64_t SamplePosition(int64_t column, int64_t j, int64_t length) {
  return static_cast<int64_t>(
      Mix((static_cast<uint64_t>(column) << 32) | static_cast<uint64_t>(j)) %
      static_cast<uint64_t>(length));
}

inline size_t AlignUp(size_t bytes) { return (bytes + 255) & ~size_t{255}; }

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
