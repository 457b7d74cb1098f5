#include "kernels/threshold.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/quantizer_table.h"
#include "kernels/wire.h"

#if JAXCOMM_QUANTIZERS_X86
#include <immintrin.h>
#endif

namespace jaxcomm::kernels {
namespace {

constexpr int64_t kBlock = 64;

// acc for one block into a local buffer: stores never alias x/residual_in, so the loop
// vectorizes without runtime alias checks even when residual_out aliases residual_in.
uint32_t BlockAccPortable(const float* x, const float* r, float* __restrict acc) {
  uint32_t max_key = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    acc[j] = x[j] + r[j];
    max_key = std::max(max_key, wire::FloatBits(acc[j]) & wire::kIndexMask);
  }
  return max_key;
}

#if JAXCOMM_QUANTIZERS_X86
// The library is built for baseline x86-64; the scan is the whole cost of the kernel, so it
// carries an AVX2 version picked at run time (same IEEE adds, same result).
__attribute__((target("avx2"))) uint32_t BlockAccAvx2(const float* x, const float* r,
                                                      float* __restrict acc) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i max_key = _mm256_setzero_si256();
  for (int64_t j = 0; j < kBlock; j += 8) {
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(r + j));
    _mm256_storeu_ps(acc + j, a);
    max_key = _mm256_max_epu32(max_key, _mm256_and_si256(_mm256_castps_si256(a), abs_mask));
  }
  max_key = _mm256_max_epu32(max_key, _mm256_permute2x128_si256(max_key, max_key, 1));
  max_key = _mm256_max_epu32(max_key, _mm256_shuffle_epi32(max_key, 0x4e));
  max_key = _mm256_max_epu32(max_key, _mm256_shuffle_epi32(max_key, 0xb1));
  return static_cast<uint32_t>(_mm256_cvtsi256_si32(max_key));
}

uint32_t BlockAcc(const float* x, const float* r, float* __restrict acc) {
  return QuantizersUseAvx2() ? BlockAccAvx2(x, r, acc) : BlockAccPortable(x, r, acc);
}
#else
uint32_t BlockAcc(const float* x, const float* r, float* __restrict acc) {
  return BlockAccPortable(x, r, acc);
}
#endif

// Bit j of the mask is set when |acc[j]| > tau, for a block of finite values: for finite a,
// key(a) > key(tau) <=> |a| > tau <=> a > tau or a < -tau.
uint64_t PassMaskPortable(const float* acc, int64_t len, uint32_t tau_key) {
  uint64_t mask = 0;
  for (int64_t j = 0; j < len; ++j) {
    mask |= static_cast<uint64_t>((wire::FloatBits(acc[j]) & wire::kIndexMask) > tau_key) << j;
  }
  return mask;
}

#if JAXCOMM_QUANTIZERS_X86
__attribute__((target("avx2"))) uint64_t PassMaskAvx2(const float* acc, uint32_t tau_key) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i tau = _mm256_set1_epi32(static_cast<int32_t>(tau_key));
  uint64_t mask = 0;
  for (int64_t j = 0; j < kBlock; j += 8) {
    // Keys are below 2^31, so the signed compare orders them correctly.
    const __m256i key =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + j)), abs_mask);
    const int bits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(key, tau)));
    mask |= static_cast<uint64_t>(bits) << j;
  }
  return mask;
}
#endif

uint64_t PassMask(const float* acc, int64_t len, uint32_t tau_key) {
#if JAXCOMM_QUANTIZERS_X86
  if (len == kBlock && QuantizersUseAvx2()) return PassMaskAvx2(acc, tau_key);
#endif
  return PassMaskPortable(acc, len, tau_key);
}

// Pass 1 over [begin, end): residual_out = acc, and how many entries pass in each block (kept
// per block so that pass 2 revisits only those blocks). Returns the first non-finite index or
// -1; stops there because the caller reports the error and discards the outputs.
int64_t CountRange(const float* x, const float* r, int64_t begin, int64_t end, uint32_t tau_key,
                   float* residual_out, uint8_t* block_counts, int64_t* total) {
  float acc[kBlock];
  int64_t count = 0;
  for (int64_t i = begin; i < end; i += kBlock) {
    const int64_t len = std::min(kBlock, end - i);
    uint32_t max_key = 0;
    if (len == kBlock) {
      max_key = BlockAcc(x + i, r + i, acc);
    } else {
      for (int64_t j = 0; j < len; ++j) {
        acc[j] = x[i + j] + r[i + j];
        max_key = std::max(max_key, wire::FloatBits(acc[j]) & wire::kIndexMask);
      }
    }
    std::memcpy(residual_out + i, acc, len * sizeof(float));
    uint8_t block_count = 0;
    if (max_key > tau_key) {
      if (max_key >= kNonFiniteKey) {
        for (int64_t j = 0;; ++j) {
          if ((wire::FloatBits(acc[j]) & wire::kIndexMask) >= kNonFiniteKey) return i + j;
        }
      }
      block_count = static_cast<uint8_t>(__builtin_popcountll(PassMask(acc, len, tau_key)));
    }
    block_counts[i / kBlock] = block_count;
    count += block_count;
  }
  *total = count;
  return -1;
}

// Pass 2 over the blocks of [begin, end) that hold entries: writes entries from packed word
// `offset` on (while below capacity) and subtracts the decoded value from the residual, which
// holds acc. Entries past capacity are left alone, so they stay whole in the residual.
void WriteRange(int64_t begin, int64_t end, float tau, uint32_t tau_key, int64_t offset,
                int64_t capacity, const uint8_t* block_counts, uint32_t* entries,
                float* residual_out) {
  for (int64_t i = begin; i < end && offset < capacity; i += kBlock) {
    if (block_counts[i / kBlock] == 0) continue;
    const int64_t len = std::min(kBlock, end - i);
    for (uint64_t mask = PassMask(residual_out + i, len, tau_key); mask && offset < capacity;
         mask &= mask - 1) {
      const int64_t index = i + __builtin_ctzll(mask);
      const float a = residual_out[index];
      const bool positive = a > 0.0f;
      entries[offset++] = wire::Entry(positive, index);
      residual_out[index] = a - (positive ? tau : -tau);
    }
  }
}

}  // namespace

QuantizeStatus ThresholdCompress(const float* x, const float* residual_in, int64_t n,
                                 const ThresholdParams& params, uint32_t* packed,
                                 float* residual_out, const TaskRunner& run) {
  const uint32_t tau_key = wire::FloatBits(params.tau);
  const int num_tasks = NumTasksFor(n, kMinElementsPerTask, kMaxTasks);
  std::vector<uint8_t> block_counts((n + kBlock - 1) / kBlock);
  std::vector<int64_t> totals(num_tasks, 0);
  std::vector<int64_t> first_bad(num_tasks, -1);
  run(num_tasks, [&](int task) {
    const Range range = TaskRange(n, num_tasks, task, kBlock);
    first_bad[task] = CountRange(x, residual_in, range.begin, range.end, tau_key, residual_out,
                                 block_counts.data(), &totals[task]);
  });
  const QuantizeStatus status = FirstNonFiniteOfTasks(first_bad);
  if (!status.ok()) return status;
  // Ranges write at prefix offsets, so the entries come out in ascending index order and the
  // lowest indices win when more than capacity pass.
  std::vector<int64_t> offsets(num_tasks + 1, 0);
  for (int t = 0; t < num_tasks; ++t) offsets[t + 1] = offsets[t] + totals[t];
  const int64_t m = std::min(offsets[num_tasks], params.capacity);
  uint32_t* entries = packed + wire::kHeaderWords;
  run(num_tasks, [&](int task) {
    if (offsets[task] >= params.capacity || totals[task] == 0) return;
    const Range range = TaskRange(n, num_tasks, task, kBlock);
    WriteRange(range.begin, range.end, params.tau, tau_key, offsets[task], params.capacity,
               block_counts.data(), entries, residual_out);
  });
  packed[0] = static_cast<uint32_t>(wire::kHeaderWords + m);
  std::fill(entries + m, entries + params.capacity, 0u);
  return status;
}

int64_t ThresholdDecompress(const uint32_t* packed, int64_t n, float tau, float* x_hat) {
  const int64_t m = static_cast<int64_t>(packed[0]) - wire::kHeaderWords;
  std::fill(x_hat, x_hat + n, 0.0f);
  int64_t previous = -1;
  for (int64_t j = 0; j < m; ++j) {
    const uint32_t entry = packed[wire::kHeaderWords + j];
    const int64_t index = wire::EntryIndex(entry);
    if (index >= n || index <= previous) return j;
    x_hat[index] = wire::EntryPositive(entry) ? tau : -tau;
    previous = index;
  }
  return -1;
}

// ---- entry of the quantized allreduce (kernels/quantizer_table.h) ------------------------
namespace {

// Entries a slice of n elements can send. Same expression as Threshold.capacity in
// jaxcomm/ops/compress.py.
int64_t ThresholdCapacity(double max_density, int64_t n) {
  return std::min<int64_t>(n,
                           std::max<int64_t>(1, static_cast<int64_t>(std::ceil(max_density * n))));
}

std::string ThresholdCheckSpec(const QuantizerSpec& spec) {
  if (!std::isfinite(spec.tau) || spec.tau <= 0.0f) {
    return "Threshold tau must be finite and > 0, got " + std::to_string(spec.tau);
  }
  if (!(spec.max_density > 0.0 && spec.max_density <= 1.0)) {
    return "Threshold max_density must be in (0, 1], got " + std::to_string(spec.max_density);
  }
  return "";
}

// Threshold has no columns: a slice may end at any element.
int64_t ThresholdSliceUnit(const QuantizerSpec&) { return 1; }

int64_t ThresholdSliceWords(const QuantizerSpec& spec, int64_t n) {
  return wire::kHeaderWords + ThresholdCapacity(spec.max_density, n);
}

QuantizeStatus ThresholdQuantizeSlice(const QuantizerSpec& spec, const float* x,
                                      const float* residual_in, int64_t n, uint32_t* packed,
                                      float* residual_out, const TaskRunner& run) {
  // ThresholdCompress always reads a residual.
  return ThresholdCompress(x, ResidualOrZeros(residual_in, n), n,
                           ThresholdParams{spec.tau, ThresholdCapacity(spec.max_density, n)},
                           packed, residual_out, run);
}

// Sparse: every entry is checked first so a bad message leaves the partial sum untouched.
std::string ThresholdDequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed,
                                          int64_t words, int64_t n, float* out,
                                          std::vector<float>*) {
  const uint32_t* entries = packed + wire::kHeaderWords;
  const int64_t m = words - wire::kHeaderWords;
  int64_t previous = -1;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t index = wire::EntryIndex(entries[j]);
    if (index >= n || index <= previous) {
      return "entry " + std::to_string(j) + " has index " + std::to_string(index) +
             " (out of range or not ascending)";
    }
    previous = index;
  }
  for (int64_t j = 0; j < m; ++j) {
    out[wire::EntryIndex(entries[j])] += wire::EntryPositive(entries[j]) ? spec.tau : -spec.tau;
  }
  return "";
}

}  // namespace

const Quantizer kThresholdQuantizer = {
    kThresholdKind,
    "threshold",
    ThresholdCheckSpec,
    ThresholdSliceUnit,
    ThresholdSliceWords,
    ThresholdQuantizeSlice,
    ThresholdDequantizeAccumulate,
};

}  // namespace jaxcomm::kernels
