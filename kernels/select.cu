// Exact magnitude top-k on the GPU (TopKAbs, TopK decompress) and the ⊤ merge of gTop-k.
//
// Selection is a radix select, not a sort: three histogram passes over the 32-bit keys (digits
// of 11, 11 and 10 bits, each pass counting only keys that match the digits already fixed) find
// the k-th largest key `kth` and how many entries equal to it still have to be taken
// (`remaining`). Then every tile of kTile elements counts its entries above kth and equal to
// kth, one block scans those counts, and a stable compaction writes the chosen entries in
// index order: all keys > kth, and the first `remaining` keys == kth by index. That is exactly
// the CPU's tie-break toward the lower index, and every step counts integers, so the result
// does not depend on scheduling. All decisions are made on the device: the host only enqueues.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda_common.cuh"
#include "kernels/cuda_kernels.h"

namespace jaxcomm::kernels::cuda {
namespace {

using detail::GridFor;
using detail::LowerBound;
using detail::MagnitudeKey;

constexpr int kThreads = 256;
constexpr int kItems = 16;  // per thread in the tiled kernels
constexpr int64_t kTile = kThreads * kItems;
constexpr int kBins = 2048;
constexpr int kPasses = 3;
// Digits of the 32-bit key, high to low: bits 31..21, 20..10, 9..0.
__host__ __device__ constexpr int Shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
__host__ __device__ constexpr int Bits(int pass) { return pass == 2 ? 10 : 11; }
constexpr int kScanThreads = 1024;

struct SelectState {
  uint32_t prefix;     // digits of kth fixed so far
  uint32_t remaining;  // entries still to take among keys matching prefix (ties at the end)
  uint32_t bad;        // nonzero when an input was invalid (sparse merge)
  uint32_t pad;
};

// Scratch layout shared by top-k and the merge.
struct SelectScratch {
  SelectState* state;
  uint32_t* hist;        // kPasses * kBins
  uint32_t* greater;     // per tile: keys > kth
  uint32_t* ties;        // per tile: keys == kth
  uint32_t* tie_before;  // per tile: keys == kth in earlier tiles
  uint32_t* out_base;    // per tile: output position of its first chosen entry

  static size_t Bytes(int64_t n) {
    const size_t tiles = static_cast<size_t>((n + kTile - 1) / kTile);
    return AlignUp(sizeof(SelectState)) + AlignUp(kPasses * kBins * sizeof(uint32_t)) +
           4 * AlignUp(tiles * sizeof(uint32_t));
  }
  static SelectScratch Carve(void* base, int64_t n) {
    const size_t tiles = static_cast<size_t>((n + kTile - 1) / kTile);
    char* p = static_cast<char*>(base);
    SelectScratch s;
    s.state = reinterpret_cast<SelectState*>(p);
    p += AlignUp(sizeof(SelectState));
    s.hist = reinterpret_cast<uint32_t*>(p);
    p += AlignUp(kPasses * kBins * sizeof(uint32_t));
    uint32_t** arrays[4] = {&s.greater, &s.ties, &s.tie_before, &s.out_base};
    for (uint32_t** a : arrays) {
      *a = reinterpret_cast<uint32_t*>(p);
      p += AlignUp(tiles * sizeof(uint32_t));
    }
    return s;
  }
};

// Keys of acc = x + r (r may be null). The first pass also stores acc into `store` (the
// residual output, which may alias r: each element is read before it is written, by the same
// thread); later passes read acc back from there.
struct AccSource {
  const float* x;
  const float* r;
  float* store;
  __device__ float Value(int64_t i) const { return r ? x[i] + r[i] : x[i]; }
  __device__ uint32_t Key(int64_t i) const {
    const float a = Value(i);
    if (store) store[i] = a;
    return MagnitudeKey(a);
  }
};

// Keys precomputed into an array (the merge: MagnitudeKey + 1, 0 for holes).
struct KeySource {
  const uint32_t* keys;
  __device__ uint32_t Key(int64_t i) const { return keys[i]; }
};

__global__ void InitKernel(SelectState* state, uint32_t* hist, uint32_t k) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *state = SelectState{0u, k, 0u, 0u};
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < kPasses * kBins;
       b += blockDim.x * gridDim.x) {
    hist[b] = 0;
  }
}

// Histogram of digit `pass` over the keys whose higher digits equal state->prefix.
template <class Source>
__global__ void __launch_bounds__(kThreads)
    HistogramKernel(Source source, int64_t n, int pass, const SelectState* state, uint32_t* hist) {
  __shared__ uint32_t local[kBins];
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const int shift = Shift(pass);
  const uint32_t digit_mask = (1u << Bits(pass)) - 1u;
  // Bits above this digit; the shift by 32 for pass 0 is avoided (undefined in C++).
  const uint32_t fixed_mask = pass == 0 ? 0u : ~((1u << (shift + Bits(pass))) - 1u);
  const uint32_t prefix = state->prefix;
  auto count = [&](uint32_t key) {
    if ((key & fixed_mask) == prefix) atomicAdd(&local[(key >> shift) & digit_mask], 1u);
  };
  // kUnroll keys are loaded before any is counted, so each thread has kUnroll loads in flight:
  // with one (a plain grid-stride loop) the pass reached 40 % of an H200's memory throughput
  // (ncu), bound by latency rather than bandwidth. Counts are integers: the order is free.
  constexpr int kUnroll = 4;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint32_t keys[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) keys[u] = source.Key(i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) count(keys[u]);
  }
  for (; i < n; i += stride) count(source.Key(i));
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
    if (local[b]) atomicAdd(&hist[pass * kBins + b], local[b]);
  }
}

// One block: finds the digit of the k-th largest key among those matching the prefix.
__global__ void __launch_bounds__(kScanThreads)
    SelectDigitKernel(int pass, SelectState* state, const uint32_t* hist) {
  using Scan = cub::BlockScan<uint32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  constexpr int kPer = kBins / kScanThreads;
  const uint32_t remaining = state->remaining;
  const uint32_t prefix = state->prefix;
  // Thread t owns bins in descending order, so the exclusive scan counts the keys above a bin.
  uint32_t counts[kPer];
  int bins[kPer];
  for (int j = 0; j < kPer; ++j) {
    bins[j] = kBins - 1 - (threadIdx.x * kPer + j);
    counts[j] = hist[pass * kBins + bins[j]];
  }
  uint32_t above[kPer];
  Scan(temp).ExclusiveSum(counts, above);
  __syncthreads();  // every thread has read state before one of them rewrites it
  for (int j = 0; j < kPer; ++j) {
    if (above[j] < remaining && remaining <= above[j] + counts[j]) {
      state->prefix = prefix | (static_cast<uint32_t>(bins[j]) << Shift(pass));
      state->remaining = remaining - above[j];
    }
  }
}

// Per tile: how many keys are above kth and equal to it.
template <class Source>
__global__ void __launch_bounds__(kThreads)
    CountKernel(Source source, int64_t n, const SelectState* state, uint32_t* greater,
                uint32_t* ties) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp_g;
  __shared__ typename Reduce::TempStorage temp_t;
  const uint32_t kth = state->prefix;
  const int64_t begin = blockIdx.x * kTile;
  uint32_t g = 0, t = 0;
  for (int j = 0; j < kItems; ++j) {
    const int64_t i = begin + j * kThreads + threadIdx.x;  // coalesced
    if (i < n) {
      const uint32_t key = source.Key(i);
      g += key > kth;
      t += key == kth;
    }
  }
  g = Reduce(temp_g).Sum(g);
  t = Reduce(temp_t).Sum(t);
  if (threadIdx.x == 0) {
    greater[blockIdx.x] = g;
    ties[blockIdx.x] = t;
  }
}

// One block: exclusive prefix sums over the tiles; out_base = greater before the tile + the
// ties before it that are still taken.
__global__ void __launch_bounds__(kScanThreads)
    TileScanKernel(int64_t tiles, const SelectState* state, const uint32_t* greater,
                   const uint32_t* ties, uint32_t* tie_before, uint32_t* out_base) {
  using Scan = cub::BlockScan<uint32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ uint32_t carry_g, carry_t;
  const uint32_t remaining = state->remaining;
  if (threadIdx.x == 0) carry_g = carry_t = 0;
  __syncthreads();
  for (int64_t base = 0; base < tiles; base += kScanThreads) {
    const int64_t b = base + threadIdx.x;
    const uint32_t g = b < tiles ? greater[b] : 0u;
    const uint32_t t = b < tiles ? ties[b] : 0u;
    uint32_t g_before, t_before, g_total, t_total;
    Scan(temp).ExclusiveSum(g, g_before, g_total);
    __syncthreads();
    Scan(temp).ExclusiveSum(t, t_before, t_total);
    if (b < tiles) {
      const uint32_t tb = carry_t + t_before;
      tie_before[b] = tb;
      out_base[b] = carry_g + g_before + min(tb, remaining);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry_g += g_total;
      carry_t += t_total;
    }
    __syncthreads();
  }
}

// Stable compaction of one tile: thread t owns kItems consecutive elements so that the block
// scans run in index order. Tiles with nothing chosen (almost all when k << n) leave at once.
template <class Source, class Sink>
__global__ void __launch_bounds__(kThreads)
    CompactKernel(Source source, int64_t n, const SelectState* state, const uint32_t* greater,
                  const uint32_t* ties, const uint32_t* tie_before, const uint32_t* out_base,
                  Sink sink) {
  const uint32_t remaining = state->remaining;
  const uint32_t tb = tie_before[blockIdx.x];
  if (greater[blockIdx.x] == 0 && (ties[blockIdx.x] == 0 || tb >= remaining)) return;
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const uint32_t kth = state->prefix;
  const int64_t first = blockIdx.x * kTile + static_cast<int64_t>(threadIdx.x) * kItems;
  uint32_t keys[kItems];
  uint32_t my_ties = 0;
  for (int j = 0; j < kItems; ++j) {
    keys[j] = first + j < n ? source.Key(first + j) : 0u;
    my_ties += first + j < n && keys[j] == kth;
  }
  uint32_t tie_rank;
  Scan(temp).ExclusiveSum(my_ties, tie_rank);
  tie_rank += tb;
  uint32_t chosen = 0;
  uint32_t take = 0;  // bit j: element first + j is chosen
  for (int j = 0; j < kItems; ++j) {
    if (first + j >= n) break;
    bool pick = keys[j] > kth;
    if (keys[j] == kth) pick = tie_rank++ < remaining;
    take |= static_cast<uint32_t>(pick) << j;
    chosen += pick;
  }
  __syncthreads();
  uint32_t pos;
  Scan(temp).ExclusiveSum(chosen, pos);
  pos += out_base[blockIdx.x];
  for (int j = 0; j < kItems; ++j) {
    if (take >> j & 1u) sink.Emit(pos++, first + j);
  }
}

// Top-k output: index, acc value, and the zero left in the residual.
struct TopKSink {
  AccSource acc;  // reads acc back (from the residual output when there is one)
  int32_t* indices;
  float* values;
  float* residual_out;
  __device__ void Emit(uint32_t pos, int64_t i) const {
    indices[pos] = static_cast<int32_t>(i);
    values[pos] = acc.Value(i);
    if (residual_out) residual_out[i] = 0.0f;
  }
};

struct MergeSink {
  const int32_t* idx;
  const float* val;
  int32_t* out_idx;
  float* out_val;
  __device__ void Emit(uint32_t pos, int64_t i) const {
    out_idx[pos] = idx[i];
    out_val[pos] = val[i];
  }
};

// Enqueues the reset of the selection state for the k largest keys (state->bad included).
void StartSelect(const SelectScratch& s, int64_t k, cudaStream_t stream) {
  InitKernel<<<(kPasses * kBins + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      s.state, s.hist, static_cast<uint32_t>(k));
}

// Enqueues the selection after StartSelect: the histogram passes, then the counted, stable
// compaction into `sink`. `first` computes the keys in pass 0 (and may store acc); `again`
// rereads them in the later passes.
template <class First, class Again, class Sink>
cudaError_t SelectStarted(First first, Again again, int64_t n, const SelectScratch& s, Sink sink,
                          cudaStream_t stream) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  const unsigned grid = GridFor(n, kThreads, 2048);
  HistogramKernel<<<grid, kThreads, 0, stream>>>(first, n, 0, s.state, s.hist);
  SelectDigitKernel<<<1, kScanThreads, 0, stream>>>(0, s.state, s.hist);
  for (int pass = 1; pass < kPasses; ++pass) {
    HistogramKernel<<<grid, kThreads, 0, stream>>>(again, n, pass, s.state, s.hist);
    SelectDigitKernel<<<1, kScanThreads, 0, stream>>>(pass, s.state, s.hist);
  }
  CountKernel<<<tiles, kThreads, 0, stream>>>(again, n, s.state, s.greater, s.ties);
  TileScanKernel<<<1, kScanThreads, 0, stream>>>(tiles, s.state, s.greater, s.ties, s.tie_before,
                                                 s.out_base);
  CompactKernel<<<tiles, kThreads, 0, stream>>>(again, n, s.state, s.greater, s.ties, s.tie_before,
                                                s.out_base, sink);
  return cudaGetLastError();
}

// The whole selection of the k largest keys.
template <class First, class Again, class Sink>
cudaError_t RadixSelect(First first, Again again, int64_t n, int64_t k, const SelectScratch& s,
                        Sink sink, cudaStream_t stream) {
  StartSelect(s, k, stream);
  return SelectStarted(first, again, n, s, sink, stream);
}

// ---- TopK decompress ----------------------------------------------------------------------

__global__ void TopKScatterKernel(const uint32_t* packed, int64_t words, int64_t n, float* x_hat,
                                  uint32_t* bad) {
  const int64_t k = (words - 1) / 2;
  const bool header_ok = packed[0] == static_cast<uint32_t>(words);
  JAXCOMM_GRID_STRIDE(j, k) {
    const int32_t index = static_cast<int32_t>(packed[1 + j]);
    if (!header_ok || index < 0 || index >= n) {
      *bad = 1;
      continue;
    }
    // Valid buffers have distinct indices, so the order of these adds never matters; the CPU
    // adds too, so a buffer with repeated indices decodes to the same sum (up to order).
    atomicAdd(&x_hat[index], __uint_as_float(packed[1 + k + j]));
  }
}

// ---- sparse merge -------------------------------------------------------------------------

// First position p in ascending a[0, n) with a[p] > v (std::upper_bound).
__device__ int64_t UpperBound(const int32_t* a, int64_t n, int32_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a[mid] <= v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Merge path of the two ascending inputs into ka + kb slots: a[i] goes to i + lower_bound(b),
// b[j] to j + upper_bound(a), so equal indices land side by side, a's first. The a slot gets
// the sum (val_a + val_b, the CPU's order); the b slot becomes a hole of key 0, which is never
// chosen because every real entry has key MagnitudeKey + 1 >= 1 and the union holds >= k.
__global__ void MergeKernel(const int32_t* idx_a, const float* val_a, int64_t ka,
                            const int32_t* idx_b, const float* val_b, int64_t kb, int32_t* idx,
                            float* val, uint32_t* keys, SelectState* state) {
  JAXCOMM_GRID_STRIDE(t, ka + kb) {
    const bool from_a = t < ka;
    const int64_t p = from_a ? t : t - ka;
    const int32_t* own = from_a ? idx_a : idx_b;
    const int64_t own_n = from_a ? ka : kb;
    const int32_t index = own[p];
    if (index < 0 || (p > 0 && own[p - 1] >= index)) state->bad = 1;
    if (p + 1 < own_n && own[p + 1] <= index) state->bad = 1;  // also catches the last pair
    if (from_a) {
      const int64_t lb = LowerBound(idx_b, kb, index);
      float v = val_a[p];
      if (lb < kb && idx_b[lb] == index) v = v + val_b[lb];
      const int64_t slot = p + lb;
      idx[slot] = index;
      val[slot] = v;
      keys[slot] = MagnitudeKey(v) + 1u;
    } else {
      const int64_t ub = UpperBound(idx_a, ka, index);
      const int64_t slot = p + ub;
      if (ub > 0 && idx_a[ub - 1] == index) {
        keys[slot] = 0u;
        idx[slot] = index;
        val[slot] = 0.0f;
      } else {
        idx[slot] = index;
        val[slot] = val_b[p];
        keys[slot] = MagnitudeKey(val_b[p]) + 1u;
      }
    }
  }
}

}  // namespace

size_t TopKScratchBytes(int64_t n) { return SelectScratch::Bytes(n); }

cudaError_t TopKAbs(const float* x, const float* residual_in, int64_t n, int64_t k,
                    int32_t* indices, float* values, float* residual_out, void* scratch,
                    cudaStream_t stream) {
  const SelectScratch s = SelectScratch::Carve(scratch, n);
  const AccSource first{x, residual_in, residual_out};
  // After pass 0 acc lives in residual_out when there is one (which may alias residual_in, so
  // x + residual_in must not be recomputed from it).
  const AccSource again =
      residual_out ? AccSource{residual_out, nullptr, nullptr} : AccSource{x, residual_in, nullptr};
  return RadixSelect(first, again, n, k, s, TopKSink{again, indices, values, residual_out}, stream);
}

size_t TopKDecompressScratchBytes() { return AlignUp(sizeof(uint32_t)); }

cudaError_t TopKDecompress(const uint32_t* packed, int64_t words, int64_t n, float* x_hat,
                           void* scratch, cudaStream_t stream) {
  auto* bad = static_cast<uint32_t*>(scratch);
  cudaMemsetAsync(bad, 0, sizeof(uint32_t), stream);
  cudaMemsetAsync(x_hat, 0, n * sizeof(float), stream);
  const int64_t k = (words - 1) / 2;
  TopKScatterKernel<<<GridFor(k, kThreads), kThreads, 0, stream>>>(packed, words, n, x_hat, bad);
  return PoisonIfBad(bad, x_hat, n, stream);
}

size_t SparseMergeScratchBytes(int64_t ka, int64_t kb) {
  const size_t m = static_cast<size_t>(ka + kb);
  return SelectScratch::Bytes(ka + kb) + AlignUp(m * sizeof(int32_t)) + AlignUp(m * sizeof(float)) +
         AlignUp(m * sizeof(uint32_t));
}

cudaError_t SparseMergeTopK(const int32_t* idx_a, const float* val_a, int64_t ka,
                            const int32_t* idx_b, const float* val_b, int64_t kb, int64_t k,
                            int32_t* out_idx, float* out_val, void* scratch, cudaStream_t stream) {
  const int64_t m = ka + kb;
  const SelectScratch s = SelectScratch::Carve(scratch, m);
  char* p = static_cast<char*>(scratch) + SelectScratch::Bytes(m);
  auto* idx = reinterpret_cast<int32_t*>(p);
  p += AlignUp(m * sizeof(int32_t));
  auto* val = reinterpret_cast<float*>(p);
  p += AlignUp(m * sizeof(float));
  auto* keys = reinterpret_cast<uint32_t*>(p);
  // StartSelect resets state->bad, so it runs before MergeKernel sets it.
  StartSelect(s, k, stream);
  MergeKernel<<<GridFor(m, kThreads), kThreads, 0, stream>>>(idx_a, val_a, ka, idx_b, val_b, kb,
                                                             idx, val, keys, s.state);
  const KeySource source{keys};
  if (cudaError_t error =
          SelectStarted(source, source, m, s, MergeSink{idx, val, out_idx, out_val}, stream);
      error != cudaSuccess) {
    return error;
  }
  return PoisonIfBad(&s.state->bad, out_val, k, stream);
}

}  // namespace jaxcomm::kernels::cuda
