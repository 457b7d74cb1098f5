// One-bit and threshold quantization on the GPU, byte-identical to kernels/onebit.cc and
// kernels/threshold.cc (same wire format, same float and double operations in the same order).
#include <cstring>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda_common.cuh"
#include "kernels/cuda_kernels.h"
#include "kernels/cuda_quantizer_table.h"
#include "kernels/onebit.h"
#include "kernels/quantized_slices.h"
#include "kernels/threshold.h"

namespace jaxcomm::kernels::cuda {
namespace {

using detail::BlockExclusiveScan;
using detail::GridFor;
using detail::kNonFiniteKey;
using detail::MagnitudeKey;

constexpr int kThreads = 256;
constexpr int kLanes = 8;  // the CPU's summation lanes (kernels/onebit.cc)

// ---- OneBit -------------------------------------------------------------------------------

struct MaxOp {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
};

// Sign sums in the CPU's order (SignSums::Add): a branch-free add of the value or of 0.0.
struct SignSums {
  double nonneg = 0.0, neg = 0.0;
  int64_t count_nonneg = 0, count_neg = 0;
  __device__ void Add(float a) {
    const bool is_nonneg = a >= 0.0f;
    nonneg += is_nonneg ? static_cast<double>(a) : 0.0;
    neg += is_nonneg ? 0.0 : static_cast<double>(a);
    count_nonneg += is_nonneg;
    count_neg += !is_nonneg;
  }
};

// One block per column. Pass 1 stores acc into residual_out (read back by this block only) and
// finds the largest key; the means replay the CPU's summation exactly: lane l (thread l < 8)
// adds elements l, l + 8, ... of the first len - len % 8 in double, the lanes are then added
// in order and the tail elements one by one. Sampled means add the sampled acc in sample
// order. Pass 2 packs one 32-element group per warp step with a ballot.
__global__ void __launch_bounds__(kThreads)
    OneBitColumnKernel(const float* x, const float* r, int64_t n, int64_t column_size,
                       int64_t sample_size, uint32_t* packed, float* out) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ double lane_nonneg[kLanes], lane_neg[kLanes];
  __shared__ int64_t lane_count[kLanes];
  __shared__ float means[2];
  __shared__ uint32_t block_max;
  __shared__ float sampled[kThreads];
  const int64_t c = blockIdx.x;
  const int64_t ncols = (n + column_size - 1) / column_size;
  const int64_t begin = c * column_size;
  const int64_t len = min(column_size, n - begin);
  float* acc = out + begin;

  uint32_t max_key = 0;
  // Up to kColumnUnroll elements per thread are loaded before any is used, so that each thread
  // has that many loads of x and of r in flight (latency, not bandwidth, bounded the one-at-a-
  // time loop: ncu put this kernel at 27 % of an H200's memory throughput).
  constexpr int kColumnUnroll = 4;
  for (int64_t base = 0; base < len; base += kColumnUnroll * blockDim.x) {
    float xs[kColumnUnroll], rs[kColumnUnroll];
#pragma unroll
    for (int u = 0; u < kColumnUnroll; ++u) {
      const int64_t i = base + u * blockDim.x + threadIdx.x;
      xs[u] = i < len ? x[begin + i] : 0.0f;
      rs[u] = i < len ? r[begin + i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kColumnUnroll; ++u) {
      const int64_t i = base + u * blockDim.x + threadIdx.x;
      if (i < len) {
        const float a = xs[u] + rs[u];
        acc[i] = a;
        max_key = max(max_key, MagnitudeKey(a));
      }
    }
  }
  max_key = Reduce(temp).Reduce(max_key, MaxOp());
  if (threadIdx.x == 0) block_max = max_key;
  __syncthreads();  // also publishes acc to the whole block
  if (block_max >= kNonFiniteKey) {
    if (threadIdx.x == 0) packed[0] = 0;  // the header was written before: this failure wins
    return;
  }

  const int64_t len8 = len - len % kLanes;
  if (sample_size == 0 && threadIdx.x < kLanes) {
    double nonneg = 0.0, neg = 0.0;
    int64_t count = 0;
    for (int64_t i = threadIdx.x; i < len8; i += kLanes) {
      const float a = acc[i];
      const bool is_nonneg = a >= 0.0f;
      nonneg += is_nonneg ? static_cast<double>(a) : 0.0;
      neg += is_nonneg ? 0.0 : static_cast<double>(a);
      count += is_nonneg;
    }
    lane_nonneg[threadIdx.x] = nonneg;
    lane_neg[threadIdx.x] = neg;
    lane_count[threadIdx.x] = count;
  }
  __syncthreads();
  SignSums sums;  // thread 0 adds, in the CPU's order
  if (threadIdx.x == 0) {
    if (sample_size == 0) {
      for (int l = 0; l < kLanes; ++l) {
        sums.nonneg += lane_nonneg[l];
        sums.neg += lane_neg[l];
        sums.count_nonneg += lane_count[l];
      }
      sums.count_neg = len8 - sums.count_nonneg;
      for (int64_t i = len8; i < len; ++i) sums.Add(acc[i]);
    }
  }
  if (sample_size > 0) {
    // Sampled sums: the whole block draws kThreads positions at a time (a 64-bit hash and
    // modulo each) and fetches them; thread 0 then adds them in sample order, as the CPU does.
    // With thread 0 drawing and fetching alone, the sampled sums left most of the memory
    // bandwidth unused (ncu).
    for (int64_t chunk = 0; chunk < sample_size; chunk += kThreads) {
      const int64_t j = chunk + threadIdx.x;
      if (j < sample_size) sampled[threadIdx.x] = acc[detail::SamplePosition(c, j, len)];
      __syncthreads();
      if (threadIdx.x == 0) {
        const int64_t count = min(static_cast<int64_t>(kThreads), sample_size - chunk);
        for (int64_t t = 0; t < count; ++t) sums.Add(sampled[t]);
      }
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) {
    means[0] = sums.count_nonneg
                   ? static_cast<float>(sums.nonneg / static_cast<double>(sums.count_nonneg))
                   : 0.0f;
    means[1] =
        sums.count_neg ? static_cast<float>(sums.neg / static_cast<double>(sums.count_neg)) : 0.0f;
    packed[1 + 2 * c] = __float_as_uint(means[0]);
    packed[2 + 2 * c] = __float_as_uint(means[1]);
  }
  __syncthreads();
  const float mean_nonneg = means[0], mean_neg = means[1];
  uint32_t* bits = packed + 1 + 2 * ncols + begin / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t group = threadIdx.x / 32; group * 32 < len; group += blockDim.x / 32) {
    const int64_t i = group * 32 + lane;
    const bool valid = i < len;
    const float a = valid ? acc[i] : 0.0f;
    const bool nonneg = valid && a >= 0.0f;  // bits past the last element stay 0
    const uint32_t word = __ballot_sync(0xffffffffu, nonneg);
    if (valid) acc[i] = a - (nonneg ? mean_nonneg : mean_neg);
    if (lane == 0) bits[group] = word;
  }
}

// kAccumulate: x_hat[i] += decoded[i] instead of x_hat[i] = decoded[i] (one float add, the
// CPU's OneBitDecompress into scratch + AddInto, kernels/quantized_slices.cc
// DequantizeAccumulate). A bad header gives NaN either way.
template <bool kAccumulate>
__global__ void OneBitDecodeKernel(const uint32_t* packed, int64_t words, int64_t n,
                                   int64_t column_size, float* x_hat) {
  const bool header_ok = packed[0] == static_cast<uint32_t>(words);
  const int64_t ncols = (n + column_size - 1) / column_size;
  const uint32_t* bits = packed + 1 + 2 * ncols;
  JAXCOMM_GRID_STRIDE(i, n) {
    const int64_t c = i / column_size;
    const uint32_t mean = (bits[i / 32] >> (i % 32)) & 1u ? packed[1 + 2 * c] : packed[2 + 2 * c];
    if (!header_ok) {
      x_hat[i] = __uint_as_float(0x7fc00000u);
    } else if (kAccumulate) {
      x_hat[i] = x_hat[i] + __uint_as_float(mean);
    } else {
      x_hat[i] = __uint_as_float(mean);
    }
  }
}

// ---- Threshold ----------------------------------------------------------------------------

constexpr int kItems = 16;
constexpr int64_t kTile = kThreads * kItems;
constexpr int kScanThreads = 1024;

struct ThresholdState {
  uint32_t bad;  // lowest non-finite index, or kNoIndex
  uint32_t m;    // entries written
};

// Pass 1 per tile: residual_out = acc, entries passing (key > key(tau)), non-finite check.
__global__ void __launch_bounds__(kThreads)
    ThresholdCountKernel(const float* x, const float* r, int64_t n, uint32_t tau_key, float* out,
                         uint32_t* counts, ThresholdState* state) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t begin = blockIdx.x * kTile;
  uint32_t count = 0;
  for (int j = 0; j < kItems; ++j) {
    const int64_t i = begin + j * kThreads + threadIdx.x;
    if (i >= n) break;
    const float a = x[i] + r[i];
    out[i] = a;
    const uint32_t key = MagnitudeKey(a);
    if (key >= kNonFiniteKey) atomicMin(&state->bad, static_cast<uint32_t>(i));
    count += key > tau_key;
  }
  count = Reduce(temp).Sum(count);
  if (threadIdx.x == 0) counts[blockIdx.x] = count;
}

// One block: tile offsets (exclusive prefix sums) and the header.
__global__ void __launch_bounds__(kScanThreads)
    ThresholdScanKernel(int64_t tiles, int64_t capacity, const uint32_t* counts, uint32_t* offsets,
                        ThresholdState* state, uint32_t* packed) {
  const uint32_t carry = BlockExclusiveScan<kScanThreads>(counts, tiles, offsets);
  if (threadIdx.x == 0) {
    const uint32_t m = static_cast<uint32_t>(min(static_cast<int64_t>(carry), capacity));
    state->m = m;
    packed[0] = state->bad != detail::kNoIndex ? 0u : 1u + m;
  }
}

// Pass 2 per tile with entries: writes them at the tile's offset in index order while below
// capacity and subtracts the decoded value from the residual (which holds acc). Entries past
// capacity stay whole in the residual, as on the CPU.
__global__ void __launch_bounds__(kThreads)
    ThresholdWriteKernel(int64_t n, float tau, uint32_t tau_key, int64_t capacity,
                         const uint32_t* counts, const uint32_t* offsets,
                         const ThresholdState* state, uint32_t* entries, float* out) {
  if (state->bad != detail::kNoIndex || counts[blockIdx.x] == 0 ||
      offsets[blockIdx.x] >= capacity) {
    return;
  }
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t first = blockIdx.x * kTile + static_cast<int64_t>(threadIdx.x) * kItems;
  uint32_t mask = 0, mine = 0;
  for (int j = 0; j < kItems; ++j) {
    const bool pass = first + j < n && MagnitudeKey(out[first + j]) > tau_key;
    mask |= static_cast<uint32_t>(pass) << j;
    mine += pass;
  }
  uint32_t pos;
  Scan(temp).ExclusiveSum(mine, pos);
  int64_t slot = offsets[blockIdx.x] + static_cast<int64_t>(pos);
  for (int j = 0; j < kItems && slot < capacity; ++j) {
    if (!(mask >> j & 1u)) continue;
    const float a = out[first + j];
    const bool positive = a > 0.0f;
    entries[slot++] = detail::Entry(positive, first + j);
    out[first + j] = a - (positive ? tau : -tau);
  }
}

__global__ void ThresholdZeroTailKernel(const ThresholdState* state, int64_t capacity,
                                        uint32_t* entries) {
  for (int64_t j = state->m + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       j < capacity; j += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    entries[j] = 0u;
  }
}

// kAccumulate: x_hat[index] += +-tau (the CPU's DequantizeAccumulate, kernels/
// quantized_slices.cc); a valid message has strictly ascending indices, so no two threads touch
// one element. Either way a bad message sets *bad and PoisonKernel makes all of x_hat NaN.
template <bool kAccumulate>
__global__ void ThresholdScatterKernel(const uint32_t* packed, int64_t words, int64_t n, float tau,
                                       float* x_hat, uint32_t* bad) {
  const uint32_t used = packed[0];
  if (used < 1 || used > words) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *bad = 1;
    return;
  }
  const int64_t m = used - 1;
  JAXCOMM_GRID_STRIDE(j, m) {
    const uint32_t entry = packed[1 + j];
    const int64_t index = entry & detail::kIndexMask;
    const int64_t previous = j > 0 ? static_cast<int64_t>(packed[j] & detail::kIndexMask) : -1;
    if (index >= n || index <= previous) {
      *bad = 1;
      continue;
    }
    const float value = entry & detail::kSignBit ? tau : -tau;
    if (kAccumulate) {
      x_hat[index] = x_hat[index] + value;
    } else {
      x_hat[index] = value;
    }
  }
}

__global__ void ThresholdInitKernel(ThresholdState* state) {
  *state = ThresholdState{detail::kNoIndex, 0u};
}

}  // namespace

cudaError_t OneBitCompress(const float* x, const float* residual_in, int64_t n, int64_t column_size,
                           int64_t sample_size, uint32_t* packed, float* residual_out,
                           cudaStream_t stream) {
  const int64_t ncols = (n + column_size - 1) / column_size;
  if (cudaError_t error =
          WriteWord(packed, static_cast<uint32_t>(1 + 2 * ncols + (n + 31) / 32), stream);
      error != cudaSuccess) {
    return error;
  }
  OneBitColumnKernel<<<static_cast<unsigned>(ncols), kThreads, 0, stream>>>(
      x, residual_in, n, column_size, sample_size, packed, residual_out);
  return cudaGetLastError();
}

cudaError_t OneBitDecompress(const uint32_t* packed, int64_t words, int64_t n, int64_t column_size,
                             float* x_hat, cudaStream_t stream) {
  OneBitDecodeKernel<false>
      <<<GridFor(n, kThreads), kThreads, 0, stream>>>(packed, words, n, column_size, x_hat);
  return cudaGetLastError();
}

cudaError_t OneBitDecompressAccumulate(const uint32_t* packed, int64_t words, int64_t n,
                                       int64_t column_size, float* x_hat, cudaStream_t stream) {
  OneBitDecodeKernel<true>
      <<<GridFor(n, kThreads), kThreads, 0, stream>>>(packed, words, n, column_size, x_hat);
  return cudaGetLastError();
}

size_t ThresholdScratchBytes(int64_t n) {
  const size_t tiles = static_cast<size_t>((n + kTile - 1) / kTile);
  return AlignUp(sizeof(ThresholdState)) + 2 * AlignUp(tiles * sizeof(uint32_t));
}

cudaError_t ThresholdCompress(const float* x, const float* residual_in, int64_t n, float tau,
                              int64_t capacity, uint32_t* packed, float* residual_out,
                              void* scratch, cudaStream_t stream) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  char* p = static_cast<char*>(scratch);
  auto* state = reinterpret_cast<ThresholdState*>(p);
  p += AlignUp(sizeof(ThresholdState));
  auto* counts = reinterpret_cast<uint32_t*>(p);
  p += AlignUp(tiles * sizeof(uint32_t));
  auto* offsets = reinterpret_cast<uint32_t*>(p);
  uint32_t tau_key;
  std::memcpy(&tau_key, &tau, sizeof(tau_key));  // tau > 0: its bits are its key
  ThresholdInitKernel<<<1, 1, 0, stream>>>(state);
  ThresholdCountKernel<<<tiles, kThreads, 0, stream>>>(x, residual_in, n, tau_key, residual_out,
                                                       counts, state);
  ThresholdScanKernel<<<1, kScanThreads, 0, stream>>>(tiles, capacity, counts, offsets, state,
                                                      packed);
  ThresholdWriteKernel<<<tiles, kThreads, 0, stream>>>(n, tau, tau_key, capacity, counts, offsets,
                                                       state, packed + 1, residual_out);
  ThresholdZeroTailKernel<<<GridFor(capacity, kThreads), kThreads, 0, stream>>>(state, capacity,
                                                                                packed + 1);
  return cudaGetLastError();
}

size_t ThresholdDecompressScratchBytes() { return AlignUp(sizeof(uint32_t)); }

cudaError_t ThresholdDecompress(const uint32_t* packed, int64_t words, int64_t n, float tau,
                                float* x_hat, void* scratch, cudaStream_t stream) {
  auto* bad = static_cast<uint32_t*>(scratch);
  cudaMemsetAsync(bad, 0, sizeof(uint32_t), stream);
  cudaMemsetAsync(x_hat, 0, n * sizeof(float), stream);
  ThresholdScatterKernel<false>
      <<<GridFor(words, kThreads), kThreads, 0, stream>>>(packed, words, n, tau, x_hat, bad);
  return PoisonIfBad(bad, x_hat, n, stream);
}

cudaError_t ThresholdDecompressAccumulate(const uint32_t* packed, int64_t words, int64_t n,
                                          float tau, float* x_hat, void* scratch,
                                          cudaStream_t stream) {
  auto* bad = static_cast<uint32_t*>(scratch);
  cudaMemsetAsync(bad, 0, sizeof(uint32_t), stream);
  ThresholdScatterKernel<true>
      <<<GridFor(words, kThreads), kThreads, 0, stream>>>(packed, words, n, tau, x_hat, bad);
  return PoisonIfBad(bad, x_hat, n, stream);
}

// ---- entries of the quantized allreduce (kernels/cuda_quantizer_table.h) -----------------
namespace {

// OneBit and Threshold always read a residual. A null residual_in becomes residual_out
// zero-filled, as the CPU substitutes a zero vector (acc = x + 0.0f on both); their kernels
// read each residual element before the same thread writes it, so the aliasing is safe.
cudaError_t ZeroResidualIfNull(const float** residual_in, int64_t n, float* residual_out,
                               cudaStream_t stream) {
  if (*residual_in != nullptr) return cudaSuccess;
  *residual_in = residual_out;
  return cudaMemsetAsync(residual_out, 0, sizeof(float) * n, stream);
}

cudaError_t OneBitQuantizeSlice(const QuantizerSpec& spec, const float* x, const float* residual_in,
                                int64_t n, uint32_t* packed, float* residual_out, void*,
                                cudaStream_t stream) {
  if (cudaError_t e = ZeroResidualIfNull(&residual_in, n, residual_out, stream); e != cudaSuccess) {
    return e;
  }
  return OneBitCompress(x, residual_in, n, spec.column_size, spec.sample_size, packed, residual_out,
                        stream);
}

cudaError_t OneBitDequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed,
                                       int64_t words, int64_t n, float* out, void*,
                                       cudaStream_t stream) {
  return OneBitDecompressAccumulate(packed, words, n, spec.column_size, out, stream);
}

cudaError_t ThresholdQuantizeSlice(const QuantizerSpec& spec, const float* x,
                                   const float* residual_in, int64_t n, uint32_t* packed,
                                   float* residual_out, void* scratch, cudaStream_t stream) {
  if (cudaError_t e = ZeroResidualIfNull(&residual_in, n, residual_out, stream); e != cudaSuccess) {
    return e;
  }
  // Capacity in entries: the CPU entry's packed words minus the header.
  return ThresholdCompress(x, residual_in, n, spec.tau, QuantizedPackedWords(spec, n) - 1, packed,
                           residual_out, scratch, stream);
}

cudaError_t ThresholdDequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed,
                                          int64_t words, int64_t n, float* out, void* scratch,
                                          cudaStream_t stream) {
  return ThresholdDecompressAccumulate(packed, words, n, spec.tau, out, scratch, stream);
}

}  // namespace

const CudaQuantizer kOneBitCudaQuantizer = {
    kOneBitKind,
    [](const QuantizerSpec&, int64_t) -> size_t { return 0; },
    [](const QuantizerSpec&) -> size_t { return 0; },
    OneBitQuantizeSlice,
    OneBitDequantizeAccumulate,
};

const CudaQuantizer kThresholdCudaQuantizer = {
    kThresholdKind,
    [](const QuantizerSpec&, int64_t n) { return ThresholdScratchBytes(n); },
    [](const QuantizerSpec&) { return ThresholdDecompressScratchBytes(); },
    ThresholdQuantizeSlice,
    ThresholdDequantizeAccumulate,
};

}  // namespace jaxcomm::kernels::cuda
