#include "kernels/onebit.h"

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/quantizer_table.h"
#include "kernels/reduce.h"
#include "kernels/wire.h"

#if JAXCOMM_QUANTIZERS_X86
#include <immintrin.h>
#endif

namespace jaxcomm::kernels {
namespace {

struct SignSums {
  double nonneg = 0.0;
  double neg = 0.0;
  int64_t count_nonneg = 0;
  int64_t count_neg = 0;

  // Branch-free: sampled values arrive in random sign order. Adding 0.0 leaves a sum as it is.
  void Add(float a) {
    const bool is_nonneg = a >= 0.0f;
    nonneg += is_nonneg ? static_cast<double>(a) : 0.0;
    neg += is_nonneg ? 0.0 : static_cast<double>(a);
    count_nonneg += is_nonneg;
    count_neg += !is_nonneg;
  }
  float MeanNonneg() const {
    return count_nonneg ? static_cast<float>(nonneg / static_cast<double>(count_nonneg)) : 0.0f;
  }
  float MeanNeg() const {
    return count_neg ? static_cast<float>(neg / static_cast<double>(count_neg)) : 0.0f;
  }
};

// Lanes of the exact sums: element i of every 8-element group adds into lane i % 8, each lane
// in double. The AVX2 path and the portable path perform the very same IEEE operations in the
// same order, so the means never depend on the machine or the thread count.
constexpr int kLanes = 8;

struct LaneSums {
  double nonneg[kLanes] = {};
  double neg[kLanes] = {};
  int64_t count_nonneg = 0;
};

// Pass 1 over the first len8 (a multiple of kLanes) elements of a column: acc = x + r into the
// cached scratch column, per-lane sign sums when kExactSums, and the largest magnitude key
// (for the non-finite check). Writing acc to scratch rather than to residual_out keeps
// residual_in (which residual_out may alias) intact until pass 2 and the stores non-aliasing.
template <bool kExactSums>
uint32_t AccumulatePortable(const float* x, const float* r, int64_t len8, float* __restrict acc,
                            LaneSums* lanes) {
  uint32_t max_key = 0;
  for (int64_t i = 0; i < len8; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float a = x[i + l] + r[i + l];
      acc[i + l] = a;
      max_key = std::max(max_key, wire::FloatBits(a) & wire::kIndexMask);
      if (kExactSums) {
        const bool nonneg = a >= 0.0f;
        lanes->nonneg[l] += nonneg ? static_cast<double>(a) : 0.0;
        lanes->neg[l] += nonneg ? 0.0 : static_cast<double>(a);
        lanes->count_nonneg += nonneg;
      }
    }
  }
  return max_key;
}

// One packed word from acc[0, count), count <= 32: bit k set when acc[k] >= 0 (bits past count
// stay 0), and residual_out[k] = acc[k] - the mean of its sign.
inline uint32_t EncodeWord(const float* __restrict acc, int64_t count, float mean_nonneg,
                           float mean_neg, float* __restrict residual_out) {
  uint32_t word = 0;
  for (int64_t k = 0; k < count; ++k) {
    const float a = acc[k];
    const bool nonneg = a >= 0.0f;
    word |= static_cast<uint32_t>(nonneg) << k;
    residual_out[k] = a - (nonneg ? mean_nonneg : mean_neg);
  }
  return word;
}

// Pass 2 over whole 32-element groups of the cached column: bits and residual_out =
// acc - decoded.
void EncodePortable(const float* __restrict acc, int64_t len32, float mean_nonneg, float mean_neg,
                    uint32_t* __restrict bits, float* __restrict residual_out) {
  for (int64_t base = 0; base < len32; base += 32) {
    bits[base / 32] = EncodeWord(acc + base, 32, mean_nonneg, mean_neg, residual_out + base);
  }
}

void DecodePortable(const uint32_t* bits, int64_t len32, float mean_nonneg, float mean_neg,
                    float* __restrict x_hat) {
  for (int64_t base = 0; base < len32; base += 32) {
    const uint32_t word = bits[base / 32];
    for (int k = 0; k < 32; ++k) x_hat[base + k] = (word >> k) & 1u ? mean_nonneg : mean_neg;
  }
}

#if JAXCOMM_QUANTIZERS_X86
// GCC and Clang do not vectorize the portable loops well (the double lanes, the bit packing),
// and the library is built for baseline x86-64, so the hot loops carry an AVX2 version picked
// at run time.
template <bool kExactSums>
__attribute__((target("avx2"))) uint32_t AccumulateAvx2(const float* x, const float* r,
                                                        int64_t len8, float* __restrict acc,
                                                        LaneSums* lanes) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256 zero = _mm256_setzero_ps();
  const __m256d zero_d = _mm256_setzero_pd();
  __m256i max_key = _mm256_setzero_si256();
  __m256d nonneg_lo = _mm256_loadu_pd(lanes->nonneg),
          nonneg_hi = _mm256_loadu_pd(lanes->nonneg + 4);
  __m256d neg_lo = _mm256_loadu_pd(lanes->neg), neg_hi = _mm256_loadu_pd(lanes->neg + 4);
  __m256i count = _mm256_setzero_si256();  // minus the count: compare masks are -1
  for (int64_t i = 0; i < len8; i += kLanes) {
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(r + i));
    _mm256_storeu_ps(acc + i, a);
    max_key = _mm256_max_epu32(max_key, _mm256_and_si256(_mm256_castps_si256(a), abs_mask));
    if (kExactSums) {
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
      const __m256d lo_nonneg = _mm256_cmp_pd(lo, zero_d, _CMP_GE_OQ);
      const __m256d hi_nonneg = _mm256_cmp_pd(hi, zero_d, _CMP_GE_OQ);
      nonneg_lo = _mm256_add_pd(nonneg_lo, _mm256_and_pd(lo_nonneg, lo));
      nonneg_hi = _mm256_add_pd(nonneg_hi, _mm256_and_pd(hi_nonneg, hi));
      neg_lo = _mm256_add_pd(neg_lo, _mm256_andnot_pd(lo_nonneg, lo));
      neg_hi = _mm256_add_pd(neg_hi, _mm256_andnot_pd(hi_nonneg, hi));
      count = _mm256_add_epi32(count, _mm256_castps_si256(_mm256_cmp_ps(a, zero, _CMP_GE_OQ)));
    }
  }
  _mm256_storeu_pd(lanes->nonneg, nonneg_lo);
  _mm256_storeu_pd(lanes->nonneg + 4, nonneg_hi);
  _mm256_storeu_pd(lanes->neg, neg_lo);
  _mm256_storeu_pd(lanes->neg + 4, neg_hi);
  alignas(32) int32_t counts[kLanes];
  alignas(32) uint32_t keys[kLanes];
  _mm256_store_si256(reinterpret_cast<__m256i*>(counts), count);
  _mm256_store_si256(reinterpret_cast<__m256i*>(keys), max_key);
  uint32_t result = 0;
  for (int l = 0; l < kLanes; ++l) {
    lanes->count_nonneg -= counts[l];
    result = std::max(result, keys[l]);
  }
  return result;
}

__attribute__((target("avx2"))) void EncodeAvx2(const float* __restrict acc, int64_t len32,
                                                float mean_nonneg, float mean_neg,
                                                uint32_t* __restrict bits,
                                                float* __restrict residual_out) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 vnonneg = _mm256_set1_ps(mean_nonneg);
  const __m256 vneg = _mm256_set1_ps(mean_neg);
  for (int64_t base = 0; base < len32; base += 32) {
    uint32_t word = 0;
    for (int q = 0; q < 4; ++q) {
      const __m256 a = _mm256_loadu_ps(acc + base + 8 * q);
      const __m256 nonneg = _mm256_cmp_ps(a, zero, _CMP_GE_OQ);
      word |= static_cast<uint32_t>(_mm256_movemask_ps(nonneg)) << (8 * q);
      _mm256_storeu_ps(residual_out + base + 8 * q,
                       _mm256_sub_ps(a, _mm256_blendv_ps(vneg, vnonneg, nonneg)));
    }
    bits[base / 32] = word;
  }
}

__attribute__((target("avx2"))) void DecodeAvx2(const uint32_t* bits, int64_t len32,
                                                float mean_nonneg, float mean_neg,
                                                float* __restrict x_hat) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 vnonneg = _mm256_set1_ps(mean_nonneg);
  const __m256 vneg = _mm256_set1_ps(mean_neg);
  for (int64_t base = 0; base < len32; base += 32) {
    const uint32_t word = bits[base / 32];
    for (int q = 0; q < 4; ++q) {
      const __m256i byte = _mm256_set1_epi32(static_cast<int>((word >> (8 * q)) & 0xffu));
      const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), lane_bit);
      _mm256_storeu_ps(x_hat + base + 8 * q,
                       _mm256_blendv_ps(vneg, vnonneg, _mm256_castsi256_ps(set)));
    }
  }
}

#endif

template <bool kExactSums>
uint32_t AccumulateColumn(const float* x, const float* r, int64_t len, float* __restrict acc,
                          SignSums* sums) {
  const int64_t len8 = len - len % kLanes;
  LaneSums lanes;
  uint32_t max_key;
#if JAXCOMM_QUANTIZERS_X86
  if (QuantizersUseAvx2()) {
    max_key = AccumulateAvx2<kExactSums>(x, r, len8, acc, &lanes);
  } else {
    max_key = AccumulatePortable<kExactSums>(x, r, len8, acc, &lanes);
  }
#else
  max_key = AccumulatePortable<kExactSums>(x, r, len8, acc, &lanes);
#endif
  if (kExactSums) {
    for (int l = 0; l < kLanes; ++l) {
      sums->nonneg += lanes.nonneg[l];
      sums->neg += lanes.neg[l];
    }
    sums->count_nonneg = lanes.count_nonneg;
    sums->count_neg = len8 - lanes.count_nonneg;
  }
  for (int64_t i = len8; i < len; ++i) {
    const float a = x[i] + r[i];
    acc[i] = a;
    max_key = std::max(max_key, wire::FloatBits(a) & wire::kIndexMask);
    if (kExactSums) sums->Add(a);
  }
  return max_key;
}

void EncodeColumn(const float* __restrict acc, int64_t len, float mean_nonneg, float mean_neg,
                  uint32_t* __restrict bits, float* __restrict residual_out) {
  const int64_t len32 = len - len % 32;
#if JAXCOMM_QUANTIZERS_X86
  if (QuantizersUseAvx2()) {
    EncodeAvx2(acc, len32, mean_nonneg, mean_neg, bits, residual_out);
  } else {
    EncodePortable(acc, len32, mean_nonneg, mean_neg, bits, residual_out);
  }
#else
  EncodePortable(acc, len32, mean_nonneg, mean_neg, bits, residual_out);
#endif
  if (len32 < len) {
    bits[len32 / 32] =
        EncodeWord(acc + len32, len - len32, mean_nonneg, mean_neg, residual_out + len32);
  }
}

void DecodeColumn(const uint32_t* bits, int64_t len, float mean_nonneg, float mean_neg,
                  float* __restrict x_hat) {
  const int64_t len32 = len - len % 32;
#if JAXCOMM_QUANTIZERS_X86
  if (QuantizersUseAvx2()) {
    DecodeAvx2(bits, len32, mean_nonneg, mean_neg, x_hat);
  } else {
    DecodePortable(bits, len32, mean_nonneg, mean_neg, x_hat);
  }
#else
  DecodePortable(bits, len32, mean_nonneg, mean_neg, x_hat);
#endif
  for (int64_t i = len32; i < len; ++i) {
    x_hat[i] = (bits[i / 32] >> (i % 32)) & 1u ? mean_nonneg : mean_neg;
  }
}

// Columns [first, last) of one task. Returns the first non-finite flat index or -1; stops there
// because the caller reports the error and discards the outputs.
int64_t CompressColumns(const float* x, const float* r, int64_t n, const OneBitParams& params,
                        int64_t first, int64_t last, uint32_t* packed, float* residual_out) {
  const int64_t ncols = OneBitNumColumns(n, params.column_size);
  uint32_t* means = packed + wire::kHeaderWords;
  uint32_t* bits = means + 2 * ncols;
  std::vector<float> scratch(std::min(params.column_size, n - first * params.column_size));
  for (int64_t c = first; c < last; ++c) {
    const int64_t begin = c * params.column_size;
    const int64_t len = std::min(params.column_size, n - begin);
    SignSums sums;
    uint32_t max_key;
    if (params.sample_size == 0) {
      max_key = AccumulateColumn<true>(x + begin, r + begin, len, scratch.data(), &sums);
    } else {
      max_key = AccumulateColumn<false>(x + begin, r + begin, len, scratch.data(), &sums);
      for (int64_t j = 0; j < params.sample_size; ++j) {
        sums.Add(scratch[wire::SamplePosition(c, j, len)]);
      }
    }
    if (max_key >= kNonFiniteKey) {
      for (int64_t i = 0; i < len; ++i) {
        if ((wire::FloatBits(scratch[i]) & wire::kIndexMask) >= kNonFiniteKey) return begin + i;
      }
    }
    const float mean_nonneg = sums.MeanNonneg();
    const float mean_neg = sums.MeanNeg();
    means[2 * c] = wire::FloatBits(mean_nonneg);
    means[2 * c + 1] = wire::FloatBits(mean_neg);
    EncodeColumn(scratch.data(), len, mean_nonneg, mean_neg, bits + begin / 32,
                 residual_out + begin);
  }
  return -1;
}

// Splits the columns into tasks of at least kMinElementsPerTask elements. The split depends on
// n and column_size only, and each column's output on that column only, so the bytes never
// depend on the runner.
template <typename Fn>
void ForColumnRanges(int64_t n, int64_t column_size, const TaskRunner& run, Fn&& fn) {
  const int num_tasks = NumTasksFor(n, std::max(kMinElementsPerTask, column_size), kMaxTasks);
  run(num_tasks, [&](int task) {
    const Range range = TaskRange(n, num_tasks, task, column_size);
    if (range.begin >= range.end) return;
    fn(task, range.begin / column_size, (range.end + column_size - 1) / column_size);
  });
}

}  // namespace

int64_t OneBitNumColumns(int64_t n, int64_t column_size) {
  return (n + column_size - 1) / column_size;
}

int64_t OneBitPackedWords(int64_t n, int64_t column_size) {
  return wire::kHeaderWords + 2 * OneBitNumColumns(n, column_size) + (n + 31) / 32;
}

QuantizeStatus OneBitCompress(const float* x, const float* residual_in, int64_t n,
                              const OneBitParams& params, uint32_t* packed, float* residual_out,
                              const TaskRunner& run) {
  packed[0] = static_cast<uint32_t>(OneBitPackedWords(n, params.column_size));
  std::vector<int64_t> first_bad(kMaxTasks, -1);
  ForColumnRanges(n, params.column_size, run, [&](int task, int64_t first, int64_t last) {
    first_bad[task] = CompressColumns(x, residual_in, n, params, first, last, packed, residual_out);
  });
  return FirstNonFiniteOfTasks(first_bad);
}

void OneBitDecompress(const uint32_t* packed, int64_t n, const OneBitParams& params, float* x_hat,
                      const TaskRunner& run) {
  const int64_t ncols = OneBitNumColumns(n, params.column_size);
  const uint32_t* means = packed + wire::kHeaderWords;
  const uint32_t* bits = means + 2 * ncols;
  ForColumnRanges(n, params.column_size, run, [&](int, int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const float mean_nonneg = wire::BitsFloat(means[2 * c]);
      const float mean_neg = wire::BitsFloat(means[2 * c + 1]);
      const int64_t begin = c * params.column_size;
      const int64_t len = std::min(params.column_size, n - begin);
      DecodeColumn(bits + begin / 32, len, mean_nonneg, mean_neg, x_hat + begin);
    }
  });
}

// ---- entry of the quantized allreduce (kernels/quantizer_table.h) ------------------------
namespace {

OneBitParams OneBitParamsOf(const QuantizerSpec& spec) {
  return OneBitParams{spec.column_size, spec.sample_size};
}

std::string OneBitCheckSpec(const QuantizerSpec& spec) {
  if (spec.column_size < 32 || spec.column_size % 32 != 0) {
    return "OneBit column_size must be a positive multiple of 32, got " +
           std::to_string(spec.column_size);
  }
  if (spec.sample_size < 0) return "sample_size must be >= 0";
  return "";
}

int64_t OneBitSliceUnit(const QuantizerSpec& spec) { return spec.column_size; }

int64_t OneBitSliceWords(const QuantizerSpec& spec, int64_t n) {
  return OneBitPackedWords(n, spec.column_size);
}

QuantizeStatus OneBitQuantizeSlice(const QuantizerSpec& spec, const float* x,
                                   const float* residual_in, int64_t n, uint32_t* packed,
                                   float* residual_out, const TaskRunner& run) {
  // OneBitCompress always reads a residual.
  return OneBitCompress(x, ResidualOrZeros(residual_in, n), n, OneBitParamsOf(spec), packed,
                        residual_out, run);
}

// Decodes densely into scratch, then adds: OneBitDecompress writes every element.
std::string OneBitDequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed,
                                       int64_t words, int64_t n, float* out,
                                       std::vector<float>* scratch) {
  const int64_t capacity = OneBitPackedWords(n, spec.column_size);
  if (words != capacity) {
    return "a one-bit message must be exactly " + std::to_string(capacity) + " words";
  }
  scratch->resize(static_cast<size_t>(n));
  OneBitDecompress(packed, n, OneBitParamsOf(spec), scratch->data());
  AddInto(out, scratch->data(), n);
  return "";
}

}  // namespace

const Quantizer kOneBitQuantizer = {
    kOneBitKind,
    "onebit",
    OneBitCheckSpec,
    OneBitSliceUnit,
    OneBitSliceWords,
    OneBitQuantizeSlice,
    OneBitDequantizeAccumulate,
};

}  // namespace jaxcomm::kernels
