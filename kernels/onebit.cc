#include "kernels/onebit.h"

#include <algorithm>
#include <vector>

#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

constexpr int64_t kMinElementsPerTask = 1 << 18;
constexpr int kMaxTasks = 64;
// Independent partial sums per sign: they break the add latency chain and let the compiler
// vectorize without reassociating, so the sum is the same on every machine and thread count.
constexpr int kLanes = 8;

struct SignSums {
  double nonneg = 0.0;
  double neg = 0.0;
  int64_t count_nonneg = 0;
  int64_t count_neg = 0;

  void Add(float a) {
    if (a >= 0.0f) {
      nonneg += a;
      ++count_nonneg;
    } else {
      neg += a;
      ++count_neg;
    }
  }
  float MeanNonneg() const {
    return count_nonneg ? static_cast<float>(nonneg / static_cast<double>(count_nonneg)) : 0.0f;
  }
  float MeanNeg() const {
    return count_neg ? static_cast<float>(neg / static_cast<double>(count_neg)) : 0.0f;
  }
};

// Pass 1 over a column: acc = x + r into the cached scratch column, the largest magnitude key
// (for the non-finite check) and, when kExactSums, the per-sign sums. Writing acc to scratch
// rather than to residual_out keeps residual_in (which residual_out may alias) intact until
// pass 2 and gives the compiler non-aliasing stores.
template <bool kExactSums>
uint32_t AccumulateColumn(const float* x, const float* r, int64_t len, float* __restrict acc,
                          SignSums* sums) {
  uint32_t max_key = 0;
  double lane_nonneg[kLanes] = {};
  double lane_neg[kLanes] = {};
  int64_t lane_count[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float a = x[i + l] + r[i + l];
      acc[i + l] = a;
      max_key = std::max(max_key, wire::FloatBits(a) & wire::kIndexMask);
      if (kExactSums) {
        const bool nonneg = a >= 0.0f;
        lane_nonneg[l] += nonneg ? static_cast<double>(a) : 0.0;
        lane_neg[l] += nonneg ? 0.0 : static_cast<double>(a);
        lane_count[l] += nonneg;
      }
    }
  }
  if (kExactSums) {
    for (int l = 0; l < kLanes; ++l) {
      sums->nonneg += lane_nonneg[l];
      sums->neg += lane_neg[l];
      sums->count_nonneg += lane_count[l];
    }
    sums->count_neg = i - sums->count_nonneg;
  }
  for (; i < len; ++i) {
    const float a = x[i] + r[i];
    acc[i] = a;
    max_key = std::max(max_key, wire::FloatBits(a) & wire::kIndexMask);
    if (kExactSums) sums->Add(a);
  }
  return max_key;
}

// Pass 2 over the cached column: bits and residual_out = acc - decoded.
void EncodeColumn(const float* __restrict acc, int64_t len, float mean_nonneg, float mean_neg,
                  uint32_t* __restrict bits, float* __restrict residual_out) {
  int64_t base = 0;
  for (; base + 32 <= len; base += 32) {
    uint32_t word = 0;
    for (int k = 0; k < 32; ++k) {
      const float a = acc[base + k];
      const bool nonneg = a >= 0.0f;
      word |= static_cast<uint32_t>(nonneg) << k;
      residual_out[base + k] = a - (nonneg ? mean_nonneg : mean_neg);
    }
    bits[base / 32] = word;
  }
  if (base < len) {
    uint32_t word = 0;  // bits past the last element stay 0
    for (int k = 0; base + k < len; ++k) {
      const float a = acc[base + k];
      const bool nonneg = a >= 0.0f;
      word |= static_cast<uint32_t>(nonneg) << k;
      residual_out[base + k] = a - (nonneg ? mean_nonneg : mean_neg);
    }
    bits[base / 32] = word;
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
  QuantizeStatus status;
  for (int64_t bad : first_bad) {
    if (bad >= 0) {
      status.nonfinite_index = bad;  // tasks cover ascending ranges: the first hit is the least
      break;
    }
  }
  return status;
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
      const int64_t end = std::min(n, begin + params.column_size);
      for (int64_t i = begin; i < end; ++i) {
        const bool nonneg = (bits[i / 32] >> (i % 32)) & 1u;
        x_hat[i] = nonneg ? mean_nonneg : mean_neg;
      }
    }
  });
}

}  // namespace jaxcomm::kernels
