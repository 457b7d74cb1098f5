#include "kernels/threshold.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

constexpr int64_t kMinElementsPerTask = 1 << 18;
constexpr int kMaxTasks = 64;
constexpr int64_t kBlock = 64;

struct RangeOutput {
  std::vector<uint32_t> entries;
  // acc of each kept entry, to restore it exactly into the residual if the entry does not fit
  // in the global capacity after the ranges are concatenated.
  std::vector<float> acc;
  int64_t first_bad = -1;
};

// acc for one block into a local buffer: stores never alias x/residual_in, so the loop
// vectorizes without runtime alias checks even when residual_out aliases residual_in.
inline uint32_t BlockAcc(const float* x, const float* r, float* __restrict acc) {
  uint32_t max_key = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    acc[j] = x[j] + r[j];
    max_key = std::max(max_key, wire::FloatBits(acc[j]) & wire::kIndexMask);
  }
  return max_key;
}

// Scans [begin, end). Blocks whose largest |acc| is <= tau (nearly all of them at useful
// densities) cost one vectorized pass; the others are re-read element by element.
void ScanRange(const float* x, const float* r, int64_t begin, int64_t end, float tau,
               int64_t capacity, float* residual_out, RangeOutput* out) {
  const uint32_t tau_key = wire::FloatBits(tau);
  float acc[kBlock];
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
    if (max_key <= tau_key) continue;
    for (int64_t j = 0; j < len; ++j) {
      const float a = acc[j];
      const uint32_t key = wire::FloatBits(a) & wire::kIndexMask;
      if (key >= kNonFiniteKey) {
        out->first_bad = i + j;
        return;
      }
      // For finite a, key > tau_key <=> |a| > tau <=> a > tau or a < -tau.
      if (key <= tau_key || static_cast<int64_t>(out->entries.size()) >= capacity) continue;
      const bool positive = a > 0.0f;
      out->entries.push_back(wire::Entry(positive, i + j));
      out->acc.push_back(a);
      residual_out[i + j] = a - (positive ? tau : -tau);
    }
  }
}

}  // namespace

QuantizeStatus ThresholdCompress(const float* x, const float* residual_in, int64_t n,
                                 const ThresholdParams& params, uint32_t* packed,
                                 float* residual_out, const TaskRunner& run) {
  const int num_tasks = NumTasksFor(n, kMinElementsPerTask, kMaxTasks);
  std::vector<RangeOutput> parts(num_tasks);
  run(num_tasks, [&](int task) {
    const Range range = TaskRange(n, num_tasks, task, kBlock);
    ScanRange(x, residual_in, range.begin, range.end, params.tau, params.capacity, residual_out,
              &parts[task]);
  });
  QuantizeStatus status;
  for (const RangeOutput& part : parts) {
    if (part.first_bad >= 0) {
      status.nonfinite_index = part.first_bad;  // ranges ascend: the first hit is the least
      return status;
    }
  }
  // Concatenate in range order (ascending index) up to capacity; entries past it go back to
  // the residual as the acc they were.
  int64_t m = 0;
  for (const RangeOutput& part : parts) {
    const int64_t count = static_cast<int64_t>(part.entries.size());
    const int64_t take = std::min(count, params.capacity - m);
    std::copy(part.entries.begin(), part.entries.begin() + take, packed + wire::kHeaderWords + m);
    for (int64_t j = take; j < count; ++j) {
      residual_out[wire::EntryIndex(part.entries[j])] = part.acc[j];
    }
    m += take;
  }
  packed[0] = static_cast<uint32_t>(wire::kHeaderWords + m);
  std::fill(packed + wire::kHeaderWords + m, packed + wire::kHeaderWords + params.capacity, 0u);
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

}  // namespace jaxcomm::kernels
