// Adaptive quantization on the GPU, byte-identical to kernels/adaptive.cc (same wire format, same
// selection, same float and double operations in the same order).
//
// What the CPU kernel computes per column (the hints and partial sorts there only decide how
// much work is done, never the result):
// - acc = x + r (float), stored into residual_out; counts of acc > 0 and acc < 0.
// - per sign, a cut (tau, ties): exact mode keeps q = AdaptiveSignKeep(count, zeros) values of the
//   sign: tau is the q-th largest positive (q-th smallest negative) value and ties = q - the
//   number of values beyond tau, so the ties taken are the first ones by index. q == count
//   takes every value of the sign (tau = +-0.0), q == 0 none (tau = +-inf). Sampled mode takes
//   tau at rank AdaptiveSignKeep(s, s0) among the s sampled values of the sign (s0 sampled zeros)
//   and takes every tie.
// - one pass in index order sends an entry for each value beyond its sign's cut (or a tie still
//   to take), stopping at the column's capacity; the means are double sums of the sent values,
//   each sign in index order, divided by the count and rounded to float once.
//
// Here one block per column does all of that: a radix select over the 31-bit magnitude keys
// (4 passes of 8 bits, both signs at once) finds each tau and its ties exactly, a block scan
// emits the entries in index order into a per-column slot of scratch, and thread 0 replays the
// sequential double sums. A one-block scan over the column counts then gives each column's
// offset in packed, and the slots are copied there.
#include <algorithm>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/adaptive.h"
#include "kernels/cuda_common.cuh"
#include "kernels/cuda_kernels.h"
#include "kernels/cuda_quantizer_table.h"
#include "kernels/quantized_slices.h"

namespace jaxcomm::kernels::cuda {
namespace {

using detail::BlockExclusiveScan;
using detail::GridFor;
using detail::kIndexMask;
using detail::kSignBit;

constexpr int kThreads = 256;  // per column block; also the number of radix bins
constexpr int kRadixBits = 8;
constexpr int kBins = 1 << kRadixBits;
constexpr int kPasses = 4;  // 32-bit keys, high digit first (bit 31 of a key is always 0)
static_assert(kBins == kThreads, "one radix bin per thread");
constexpr int64_t kStage = 4096;  // columns (and samples) up to this length live in shared memory
constexpr int kScanThreads = 1024;
constexpr uint32_t kExponentMask = 0x7f800000u;
constexpr uint32_t kAllTies = 0xffffffffu;  // more than any column holds
constexpr uint32_t kPositiveInf = 0x7f800000u;
constexpr uint32_t kNegativeInf = 0xff800000u;

// kernels::AdaptiveSignKeep, the same double expression: min(count, ceil((count + zeros) / π)).
__device__ int64_t Keep(int64_t count, int64_t zeros, double proportion) {
  return min(count, static_cast<int64_t>(ceil(static_cast<double>(count + zeros) / proportion)));
}

struct ColumnParams {
  int64_t n;
  int64_t column_size;
  int64_t ncols;
  int64_t sample_size;
  double proportion;
  int64_t cap_full;  // AdaptiveLayout::ColumnCapacity of a full column (and its slot stride)
  int64_t cap_last;  // ... of the last column
  int64_t stage;     // columns up to this length are copied into shared memory (0: none)
  int64_t aux;       // words of the second shared buffer: the sample, then the entries
};

struct CompressState {
  uint32_t bad;    // nonzero when some acc is NaN or Inf
  uint32_t total;  // entries over all columns
};

using Reduce64 = cub::BlockReduce<uint64_t, kThreads>;
using Scan64 = cub::BlockScan<uint64_t, kThreads>;
using Scan32 = cub::BlockScan<uint32_t, kThreads>;

struct ColumnShared {
  union {
    typename Reduce64::TempStorage reduce;
    typename Scan64::TempStorage scan64;
    typename Scan32::TempStorage scan32;
  } temp;
  uint32_t hist[2][kBins];  // [0]: positive values, [1]: negative values
  uint32_t prefix[2];       // key digits fixed so far (the k-th key after the last pass)
  uint32_t remaining[2];    // values still to take among keys matching prefix
  uint64_t signs;           // positives | negatives << 32 (of the column or its sample)
  float tau[2];
  uint32_t ties[2];
  float means[2];
};

// Both signs' k-th keys: the want_pos-th largest MagnitudeKey among the values > 0 of at(0 ..
// count) and the want_neg-th largest among those < 0 (want == 0 skips a sign). Leaves the key
// in sh.prefix and, in sh.remaining, how many values equal to it the first `want` include.
// Called by every thread of the block; every step counts integers, so the result is exact.
template <class At>
__device__ void SelectBoth(At at, int64_t count, uint32_t want_pos, uint32_t want_neg,
                           ColumnShared& sh) {
  if (threadIdx.x == 0) {
    sh.prefix[0] = sh.prefix[1] = 0u;
    sh.remaining[0] = want_pos;
    sh.remaining[1] = want_neg;
  }
  for (int pass = 0; pass < kPasses; ++pass) {
    const int shift = kRadixBits * (kPasses - 1 - pass);
    // Key bits above this digit; the shift by 32 of pass 0 is avoided (undefined in C++).
    const uint32_t fixed = pass == 0 ? 0u : ~0u << (shift + kRadixBits);
    sh.hist[0][threadIdx.x] = 0u;
    sh.hist[1][threadIdx.x] = 0u;
    __syncthreads();  // zeroed bins; prefix and remaining of the previous pass are visible
    const uint32_t prefix_pos = sh.prefix[0];
    const uint32_t prefix_neg = sh.prefix[1];
    for (int64_t j = threadIdx.x; j < count; j += kThreads) {
      const float v = at(j);
      const uint32_t key = __float_as_uint(v) & kIndexMask;
      const uint32_t digit = (key >> shift) & (kBins - 1);
      if (want_pos != 0 && v > 0.0f && (key & fixed) == prefix_pos) {
        atomicAdd(&sh.hist[0][digit], 1u);
      }
      if (want_neg != 0 && v < 0.0f && (key & fixed) == prefix_neg) {
        atomicAdd(&sh.hist[1][digit], 1u);
      }
    }
    __syncthreads();
    // Thread t owns bin kBins - 1 - t, so the exclusive scan counts the keys above its bin.
    // Both signs in one scan: each half sums to at most count < 2^31, so none carries over.
    const int bin = kBins - 1 - static_cast<int>(threadIdx.x);
    const uint32_t count_pos = sh.hist[0][bin];
    const uint32_t count_neg = sh.hist[1][bin];
    const uint32_t remaining_pos = sh.remaining[0];
    const uint32_t remaining_neg = sh.remaining[1];
    uint64_t above;
    Scan64(sh.temp.scan64).ExclusiveSum(count_pos | uint64_t{count_neg} << 32, above);
    const uint32_t above_pos = static_cast<uint32_t>(above);
    const uint32_t above_neg = static_cast<uint32_t>(above >> 32);
    __syncthreads();  // every thread has read prefix and remaining before one rewrites them
    if (above_pos < remaining_pos && remaining_pos <= above_pos + count_pos) {
      sh.prefix[0] = prefix_pos | static_cast<uint32_t>(bin) << shift;
      sh.remaining[0] = remaining_pos - above_pos;
    }
    if (above_neg < remaining_neg && remaining_neg <= above_neg + count_neg) {
      sh.prefix[1] = prefix_neg | static_cast<uint32_t>(bin) << shift;
      sh.remaining[1] = remaining_neg - above_neg;
    }
  }
  __syncthreads();
}

// Per-thread sign counts of at(0 .. count), summed over the block into sh.signs.
template <class At>
__device__ void CountSigns(At at, int64_t count, ColumnShared& sh) {
  uint32_t positives = 0, negatives = 0;
  for (int64_t j = threadIdx.x; j < count; j += kThreads) {
    const float v = at(j);
    positives += v > 0.0f;
    negatives += v < 0.0f;
  }
  const uint64_t total = Reduce64(sh.temp.reduce).Sum(positives | uint64_t{negatives} << 32);
  if (threadIdx.x == 0) sh.signs = total;
  __syncthreads();
}

// One block per column: acc, cuts, entries (into the column's slot of `slots`), means (into
// packed), residual, and the column's entry count.
__global__ void __launch_bounds__(kThreads)
    AdaptiveColumnKernel(const float* x, const float* r, ColumnParams p, uint32_t* packed,
                         float* out, uint32_t* slots, uint32_t* counts, CompressState* state) {
  extern __shared__ uint32_t stage_words[];  // [p.stage floats: acc][p.aux words]
  __shared__ ColumnShared sh;
  const int64_t c = blockIdx.x;
  const int64_t begin = c * p.column_size;
  const int64_t len = min(p.column_size, p.n - begin);
  float* acc = out + begin;  // residual_out of the column; holds acc until the entries leave
  const bool staged = len <= p.stage;
  float* vals = staged ? reinterpret_cast<float*>(stage_words) : acc;  // acc, read back
  uint32_t* aux = stage_words + p.stage;

  // acc = x + r into residual_out (which may alias r: each element is read before it is
  // written, by the same thread), signs and non-finite values in the same pass.
  uint32_t positives = 0, negatives = 0;
  int bad = 0;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) {
    const float a = r ? x[begin + i] + r[begin + i] : x[begin + i];
    acc[i] = a;
    if (staged) vals[i] = a;
    positives += a > 0.0f;
    negatives += a < 0.0f;
    bad |= (__float_as_uint(a) & kExponentMask) == kExponentMask;
  }
  if (__syncthreads_or(bad)) {  // also publishes acc to the whole block
    if (threadIdx.x == 0) {
      atomicOr(&state->bad, 1u);
      counts[c] = 0u;
    }
    return;
  }

  // ---- the cuts ----
  if (p.sample_size == 0) {
    const uint64_t signs = Reduce64(sh.temp.reduce).Sum(positives | uint64_t{negatives} << 32);
    if (threadIdx.x == 0) sh.signs = signs;
    __syncthreads();
    const int64_t column_pos = static_cast<uint32_t>(sh.signs);
    const int64_t column_neg = static_cast<uint32_t>(sh.signs >> 32);
    const int64_t zeros = len - column_pos - column_neg;
    const int64_t keep_pos = Keep(column_pos, zeros, p.proportion);
    const int64_t keep_neg = Keep(column_neg, zeros, p.proportion);
    // Keeping every value of a sign (or none) needs no selection: the cut sits at 0 (or inf).
    const bool select_pos = keep_pos > 0 && keep_pos < column_pos;
    const bool select_neg = keep_neg > 0 && keep_neg < column_neg;
    if (select_pos || select_neg) {
      SelectBoth([vals](int64_t j) { return vals[j]; }, len,
                 select_pos ? static_cast<uint32_t>(keep_pos) : 0u,
                 select_neg ? static_cast<uint32_t>(keep_neg) : 0u, sh);
    }
    if (threadIdx.x == 0) {
      sh.tau[0] = select_pos     ? __uint_as_float(sh.prefix[0])
                  : keep_pos > 0 ? 0.0f
                                 : __uint_as_float(kPositiveInf);
      sh.ties[0] = select_pos ? sh.remaining[0] : 0u;
      sh.tau[1] = select_neg     ? __uint_as_float(sh.prefix[1] | kSignBit)
                  : keep_neg > 0 ? -0.0f
                                 : __uint_as_float(kNegativeInf);
      sh.ties[1] = select_neg ? sh.remaining[1] : 0u;
    }
  } else {
    // The sample: acc at wire::SamplePosition(c, j, len), j < sample_size, in shared memory
    // when it fits, else recomputed (a hash) whenever it is read.
    const int64_t samples = p.sample_size;
    const bool sample_staged = samples <= p.aux;
    if (sample_staged) {
      for (int64_t j = threadIdx.x; j < samples; j += kThreads) {
        aux[j] = __float_as_uint(vals[detail::SamplePosition(c, j, len)]);
      }
      __syncthreads();
    }
    auto at = [=](int64_t j) {
      return sample_staged ? __uint_as_float(aux[j]) : vals[detail::SamplePosition(c, j, len)];
    };
    CountSigns(at, samples, sh);
    const int64_t sampled_pos = static_cast<uint32_t>(sh.signs);
    const int64_t sampled_neg = static_cast<uint32_t>(sh.signs >> 32);
    const int64_t sampled_zeros = samples - sampled_pos - sampled_neg;
    const int64_t keep_pos = Keep(sampled_pos, sampled_zeros, p.proportion);
    const int64_t keep_neg = Keep(sampled_neg, sampled_zeros, p.proportion);
    if (keep_pos > 0 || keep_neg > 0) {
      SelectBoth(at, samples, static_cast<uint32_t>(keep_pos), static_cast<uint32_t>(keep_neg), sh);
    }
    if (threadIdx.x == 0) {
      sh.tau[0] = keep_pos > 0 ? __uint_as_float(sh.prefix[0]) : __uint_as_float(kPositiveInf);
      sh.tau[1] =
          keep_neg > 0 ? __uint_as_float(sh.prefix[1] | kSignBit) : __uint_as_float(kNegativeInf);
      sh.ties[0] = sh.ties[1] = kAllTies;
    }
  }
  __syncthreads();

  // ---- the entries, in index order, up to the column's capacity ----
  // A value is sent when it lies beyond its sign's tau, or equals it while ties remain (the
  // first `ties` equal values by index: their rank comes from a scan). tau is >= +0.0 for
  // positives and <= -0.0 for negatives, so no value can pass the other sign's test, and zeros
  // (and the padding past len) pass none.
  const float pos_tau = sh.tau[0];
  const float neg_tau = sh.tau[1];
  const int64_t pos_ties = sh.ties[0];
  const int64_t neg_ties = sh.ties[1];
  const int64_t capacity = c == p.ncols - 1 ? p.cap_last : p.cap_full;
  uint32_t* slot = slots + c * p.cap_full;
  uint32_t* entries = staged ? aux : slot;  // capacity <= len <= p.stage <= p.aux when staged
  int64_t taken = 0;
  int64_t pos_ties_seen = 0;
  int64_t neg_ties_seen = 0;
  for (int64_t base = 0; base < len && taken < capacity; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const float a = i < len ? vals[i] : 0.0f;
    const bool pos_tie = a == pos_tau && a > 0.0f;
    const bool neg_tie = a == neg_tau && a < 0.0f;
    uint64_t tie_rank, tie_total;
    Scan64(sh.temp.scan64)
        .ExclusiveSum(uint64_t{pos_tie} | uint64_t{neg_tie} << 32, tie_rank, tie_total);
    const bool take_pos =
        a > pos_tau ||
        (pos_tie &&
         pos_ties_seen + static_cast<int64_t>(static_cast<uint32_t>(tie_rank)) < pos_ties);
    const bool take_neg =
        !take_pos && (a < neg_tau ||
                      (neg_tie && neg_ties_seen + static_cast<int64_t>(tie_rank >> 32) < neg_ties));
    const bool take = take_pos || take_neg;
    __syncthreads();  // the scan storage is reused
    uint32_t rank, total;
    Scan32(sh.temp.scan32).ExclusiveSum(static_cast<uint32_t>(take), rank, total);
    if (take && taken + rank < capacity) entries[taken + rank] = detail::Entry(take_pos, begin + i);
    taken += total;
    pos_ties_seen += static_cast<uint32_t>(tie_total);
    neg_ties_seen += static_cast<int64_t>(tie_total >> 32);
    __syncthreads();
  }
  const int64_t count = min(taken, capacity);

  // ---- the means: the CPU's sequential double sums, each sign in index order ----
  if (threadIdx.x == 0) {
    double pos_sum = 0.0, neg_sum = 0.0;
    int64_t pos_sent = 0, neg_sent = 0;
    for (int64_t j = 0; j < count; ++j) {
      const uint32_t e = entries[j];
      const float a = vals[static_cast<int64_t>(e & kIndexMask) - begin];
      if (e & kSignBit) {
        pos_sum += a;
        ++pos_sent;
      } else {
        neg_sum += a;
        ++neg_sent;
      }
    }
    const float pos_mean =
        pos_sent ? static_cast<float>(pos_sum / static_cast<double>(pos_sent)) : 0.0f;
    const float neg_mean =
        neg_sent ? static_cast<float>(neg_sum / static_cast<double>(neg_sent)) : 0.0f;
    sh.means[0] = pos_mean;
    sh.means[1] = neg_mean;
    packed[1 + 2 * c] = __float_as_uint(pos_mean);
    packed[2 + 2 * c] = __float_as_uint(neg_mean);
    counts[c] = static_cast<uint32_t>(count);
  }
  __syncthreads();

  // ---- the residual of the sent values (acc - mean, as the CPU's acc -= mean) ----
  const float pos_mean = sh.means[0];
  const float neg_mean = sh.means[1];
  for (int64_t j = threadIdx.x; j < count; j += kThreads) {
    const uint32_t e = entries[j];
    const int64_t local = static_cast<int64_t>(e & kIndexMask) - begin;
    acc[local] = vals[local] - ((e & kSignBit) ? pos_mean : neg_mean);
    if (staged) slot[j] = e;
  }
}

// One block: each column's offset among the entries (exclusive prefix sums) and the header.
__global__ void __launch_bounds__(kScanThreads)
    AdaptiveScanKernel(int64_t ncols, int64_t header, const uint32_t* counts, uint32_t* offsets,
                       CompressState* state, uint32_t* packed) {
  const uint32_t carry = BlockExclusiveScan<kScanThreads>(counts, ncols, offsets);
  if (threadIdx.x == 0) {
    state->total = carry;
    packed[0] = state->bad ? 0u : static_cast<uint32_t>(header + carry);
  }
}

// One warp per column copies its slot to its offset in packed.
__global__ void AdaptivePlaceKernel(int64_t ncols, int64_t header, int64_t cap_full,
                                    const uint32_t* counts, const uint32_t* offsets,
                                    const uint32_t* slots, uint32_t* packed) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       c < ncols; c += warps) {
    const uint32_t* src = slots + c * cap_full;
    uint32_t* dst = packed + header + offsets[c];
    const int64_t count = counts[c];
    for (int64_t j = lane; j < count; j += 32) dst[j] = src[j];
  }
}

__global__ void AdaptiveZeroTailKernel(const CompressState* state, int64_t header, int64_t words,
                                       uint32_t* packed) {
  for (int64_t j =
           header + state->total + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       j < words; j += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    packed[j] = 0u;
  }
}

// ---- decompress ---------------------------------------------------------------------------

struct DecodeParams {
  int64_t words;
  int64_t n;
  int64_t column_size;
  int64_t header;
  int64_t ncols;
  int64_t cap_full;
  int64_t cap_last;
};

// Validates what kernels::AdaptiveDecompress validates, entry by entry, and decodes the valid
// ones; any failure sets *bad (and the poison kernel then overwrites every output). Entries
// are strictly ascending in a valid message, so a column holds more than `cap` entries exactly
// when some entry has an entry of its own column `cap` places before it.
__global__ void AdaptiveDecodeKernel(const uint32_t* packed, DecodeParams p, float* out,
                                     bool accumulate, uint32_t* bad) {
  const int64_t used = p.words >= 1 ? static_cast<int64_t>(packed[0]) : 0;
  if (used < p.header || used > p.words) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *bad = 1u;
    return;
  }
  const uint32_t* entries = packed + p.header;
  const int64_t m = used - p.header;
  JAXCOMM_GRID_STRIDE(j, m) {
    const uint32_t e = entries[j];
    const int64_t index = e & kIndexMask;
    const int64_t column = index / p.column_size;
    bool ok = index < p.n && (j == 0 || static_cast<int64_t>(entries[j - 1] & kIndexMask) < index);
    if (ok) {
      const int64_t cap = column == p.ncols - 1 ? p.cap_last : p.cap_full;
      ok = j < cap || static_cast<int64_t>(entries[j - cap] & kIndexMask) / p.column_size != column;
    }
    if (!ok) {
      *bad = 1u;
      continue;
    }
    const float mean = __uint_as_float(packed[1 + 2 * column + ((e & kSignBit) ? 0 : 1)]);
    // The CPU fills 0 and adds (0.0f + mean), or adds to what out holds.
    out[index] = (accumulate ? out[index] : 0.0f) + mean;
  }
}

struct CompressScratch {
  CompressState* state;
  uint32_t* counts;   // ncols
  uint32_t* offsets;  // ncols
  uint32_t* slots;    // (ncols - 1) * cap_full + cap_last == layout.Capacity()

  static size_t Bytes(const AdaptiveLayout& layout) {
    const size_t ncols = static_cast<size_t>(layout.NumColumns());
    return AlignUp(sizeof(CompressState)) + 2 * AlignUp(ncols * sizeof(uint32_t)) +
           AlignUp(static_cast<size_t>(layout.Capacity()) * sizeof(uint32_t));
  }
  static CompressScratch Carve(void* base, const AdaptiveLayout& layout) {
    const size_t ncols = static_cast<size_t>(layout.NumColumns());
    char* p = static_cast<char*>(base);
    CompressScratch s;
    s.state = reinterpret_cast<CompressState*>(p);
    p += AlignUp(sizeof(CompressState));
    s.counts = reinterpret_cast<uint32_t*>(p);
    p += AlignUp(ncols * sizeof(uint32_t));
    s.offsets = reinterpret_cast<uint32_t*>(p);
    p += AlignUp(ncols * sizeof(uint32_t));
    s.slots = reinterpret_cast<uint32_t*>(p);
    return s;
  }
};

}  // namespace

size_t AdaptiveCompressScratchBytes(int64_t n, int64_t column_size, double proportion,
                                    int64_t /*sample_size: the sample is staged or recomputed*/) {
  return CompressScratch::Bytes(AdaptiveLayout{n, column_size, proportion});
}

cudaError_t AdaptiveCompress(const float* x, const float* residual_in, int64_t n,
                             int64_t column_size, double proportion, int64_t sample_size,
                             uint32_t* packed, float* residual_out, void* scratch,
                             cudaStream_t stream) {
  const AdaptiveLayout layout{n, column_size, proportion};
  const int64_t ncols = layout.NumColumns();
  const int64_t header = layout.HeaderWords();
  const CompressScratch s = CompressScratch::Carve(scratch, layout);
  ColumnParams p;
  p.n = n;
  p.column_size = column_size;
  p.ncols = ncols;
  p.sample_size = sample_size;
  p.proportion = proportion;
  p.cap_full = layout.ColumnCapacity(0);
  p.cap_last = layout.ColumnCapacity(ncols - 1);
  const int64_t longest = std::min(column_size, n);
  p.stage = longest <= kStage ? longest : 0;
  p.aux = std::max(p.stage, sample_size <= kStage ? sample_size : int64_t{0});
  const size_t shared_bytes = static_cast<size_t>(p.stage + p.aux) * sizeof(uint32_t);

  if (cudaError_t error = cudaMemsetAsync(s.state, 0, sizeof(CompressState), stream);
      error != cudaSuccess) {
    return error;
  }
  AdaptiveColumnKernel<<<static_cast<unsigned>(ncols), kThreads, shared_bytes, stream>>>(
      x, residual_in, p, packed, residual_out, s.slots, s.counts, s.state);
  AdaptiveScanKernel<<<1, kScanThreads, 0, stream>>>(ncols, header, s.counts, s.offsets, s.state,
                                                     packed);
  AdaptivePlaceKernel<<<GridFor(ncols, kThreads / 32), kThreads, 0, stream>>>(
      ncols, header, p.cap_full, s.counts, s.offsets, s.slots, packed);
  AdaptiveZeroTailKernel<<<GridFor(layout.Capacity(), kThreads), kThreads, 0, stream>>>(
      s.state, header, layout.PackedWords(), packed);
  return cudaGetLastError();
}

size_t AdaptiveDecompressScratchBytes() { return AlignUp(sizeof(uint32_t)); }

cudaError_t AdaptiveDecompress(const uint32_t* packed, int64_t words, int64_t n,
                               int64_t column_size, double proportion, float* x_hat,
                               bool accumulate, void* scratch, cudaStream_t stream) {
  const AdaptiveLayout layout{n, column_size, proportion};
  DecodeParams p;
  p.words = words;
  p.n = n;
  p.column_size = column_size;
  p.header = layout.HeaderWords();
  p.ncols = layout.NumColumns();
  p.cap_full = layout.ColumnCapacity(0);
  p.cap_last = layout.ColumnCapacity(p.ncols - 1);
  auto* bad = static_cast<uint32_t*>(scratch);
  if (cudaError_t error = cudaMemsetAsync(bad, 0, sizeof(uint32_t), stream); error != cudaSuccess) {
    return error;
  }
  if (!accumulate) {
    if (cudaError_t error = cudaMemsetAsync(x_hat, 0, n * sizeof(float), stream);
        error != cudaSuccess) {
      return error;
    }
  }
  const int64_t max_entries = std::max<int64_t>(words - p.header, 1);
  AdaptiveDecodeKernel<<<GridFor(max_entries, kThreads), kThreads, 0, stream>>>(packed, p, x_hat,
                                                                                accumulate, bad);
  return PoisonIfBad(bad, x_hat, n, stream);
}

// ---- entry of the quantized allreduce (kernels/cuda_quantizer_table.h) -------------------
namespace {

cudaError_t AdaptiveQuantizeSlice(const QuantizerSpec& spec, const float* x,
                                  const float* residual_in, int64_t n, uint32_t* packed,
                                  float* residual_out, void* scratch, cudaStream_t stream) {
  // Takes a null residual_in itself (acc = x), as the CPU kernel does.
  return AdaptiveCompress(x, residual_in, n, spec.column_size, spec.proportion, spec.sample_size,
                          packed, residual_out, scratch, stream);
}

cudaError_t AdaptiveDequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed,
                                         int64_t words, int64_t n, float* out, void* scratch,
                                         cudaStream_t stream) {
  return AdaptiveDecompress(packed, words, n, spec.column_size, spec.proportion, out,
                            /*accumulate=*/true, scratch, stream);
}

}  // namespace

const CudaQuantizer kAdaptiveCudaQuantizer = {
    kAdaptiveKind,
    [](const QuantizerSpec& spec, int64_t n) {
      return AdaptiveCompressScratchBytes(n, spec.column_size, spec.proportion, spec.sample_size);
    },
    [](const QuantizerSpec&) { return AdaptiveDecompressScratchBytes(); },
    AdaptiveQuantizeSlice,
    AdaptiveDequantizeAccumulate,
};

}  // namespace jaxcomm::kernels::cuda
