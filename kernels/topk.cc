#include "kernels/topk.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace jaxcomm::kernels {
namespace {

constexpr int64_t kSampleSize = 16384;
constexpr int64_t kBlock = 64;

inline float Acc(const float* x, const float* r, int64_t i) { return r ? x[i] + r[i] : x[i]; }

// Lowest key a candidate may have so that about 1.5k + slack elements pass: the rank of k in
// a sample, inflated by four standard deviations so that fewer than k pass only rarely (then
// the caller retries with threshold 0).
uint32_t EstimateThreshold(const float* x, const float* r, int64_t n, int64_t k) {
  const int64_t s = std::min(n, kSampleSize);
  const double expected = static_cast<double>(s) * static_cast<double>(k) / static_cast<double>(n);
  const int64_t rank =
      static_cast<int64_t>(std::ceil(1.5 * expected + 4.0 * std::sqrt(expected) + 8));
  if (rank >= s) return 0;
  std::vector<uint32_t> keys(s);
  const int64_t stride = n / s;
  for (int64_t j = 0; j < s; ++j) {
    const int64_t pos =
        j * stride + static_cast<int64_t>(wire::Mix(j) % static_cast<uint64_t>(stride));
    keys[j] = MagnitudeKey(Acc(x, r, pos));
  }
  std::nth_element(keys.begin(), keys.begin() + (rank - 1), keys.end(), std::greater<uint32_t>());
  return keys[rank - 1];
}

struct Candidates {
  std::vector<uint32_t> keys;
  std::vector<int32_t> indices;
  std::vector<float> values;
  void Push(uint32_t key, int64_t index, float value) {
    keys.push_back(key);
    indices.push_back(static_cast<int32_t>(index));
    values.push_back(value);
  }
};

// One pass over [begin, end): writes acc into residual_out and keeps entries with key >= t0.
// Blocks whose largest key is below t0 (almost all of them) take the branch-free path that
// the compiler vectorizes.
__attribute__((target_clones("avx2", "default"))) void ScanRange(const float* x, const float* r,
                                                                 float* residual_out, int64_t begin,
                                                                 int64_t end, uint32_t t0,
                                                                 Candidates* out) {
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    uint32_t block_max = 0;
    if (residual_out) {
      for (int64_t j = i; j < i + kBlock; ++j) {
        const float a = r ? x[j] + r[j] : x[j];
        residual_out[j] = a;
        block_max = std::max(block_max, MagnitudeKey(a));
      }
    } else if (r) {
      for (int64_t j = i; j < i + kBlock; ++j)
        block_max = std::max(block_max, MagnitudeKey(x[j] + r[j]));
    } else {
      for (int64_t j = i; j < i + kBlock; ++j) block_max = std::max(block_max, MagnitudeKey(x[j]));
    }
    if (block_max < t0) continue;
    for (int64_t j = i; j < i + kBlock; ++j) {
      // residual_out already holds acc (and may alias r, so x + r would add r twice).
      const float a = residual_out ? residual_out[j] : Acc(x, r, j);
      const uint32_t key = MagnitudeKey(a);
      if (key >= t0) out->Push(key, j, a);
    }
  }
  for (; i < end; ++i) {
    const float a = Acc(x, r, i);
    if (residual_out) residual_out[i] = a;
    const uint32_t key = MagnitudeKey(a);
    if (key >= t0) out->Push(key, i, a);
  }
}

}  // namespace

void TopKAbs(const float* x, const float* residual_in, int64_t n, int64_t k, int32_t* indices,
             float* values, float* residual_out, const TaskRunner& run) {
  uint32_t t0 = EstimateThreshold(x, residual_in, n, k);
  const int num_tasks = NumTasksFor(n, kMinElementsPerTask, kMaxTasks);
  std::vector<Candidates> parts(num_tasks);
  for (;;) {
    run(num_tasks, [&](int task) {
      const Range range = TaskRange(n, num_tasks, task, kBlock);
      parts[task] = Candidates();
      ScanRange(x, residual_in, residual_out, range.begin, range.end, t0, &parts[task]);
    });
    int64_t found = 0;
    for (const auto& part : parts) found += static_cast<int64_t>(part.keys.size());
    if (found >= k || t0 == 0) break;
    // The sample was unlucky: fewer than k entries reached t0. Every entry reaches 0. A
    // residual_out that aliases residual_in already holds acc, so read it instead.
    if (residual_out && residual_in == residual_out) {
      x = residual_out;
      residual_in = nullptr;
    }
    t0 = 0;
  }

  // Concatenating the parts in task order keeps candidates in ascending index order.
  Candidates all;
  if (num_tasks == 1) {
    all = std::move(parts[0]);
  } else {
    for (auto& part : parts) {
      all.keys.insert(all.keys.end(), part.keys.begin(), part.keys.end());
      all.indices.insert(all.indices.end(), part.indices.begin(), part.indices.end());
      all.values.insert(all.values.end(), part.values.begin(), part.values.end());
    }
  }
  const int64_t m = static_cast<int64_t>(all.keys.size());

  // Exact k-th largest key among candidates, then how many entries equal to it to take.
  std::vector<uint32_t> keys = all.keys;
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  const uint32_t kth = keys[k - 1];
  int64_t above = 0;
  for (int64_t j = 0; j < m; ++j) above += all.keys[j] > kth;
  int64_t ties_left = k - above;

  int64_t out = 0;
  for (int64_t j = 0; j < m; ++j) {
    const uint32_t key = all.keys[j];
    if (key > kth || (key == kth && ties_left > 0)) {
      if (key == kth) --ties_left;
      indices[out] = all.indices[j];
      values[out] = all.values[j];
      if (residual_out) residual_out[all.indices[j]] = 0.0f;
      ++out;
    }
  }
}

}  // namespace jaxcomm::kernels
