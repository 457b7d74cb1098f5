#include "kernels/topk.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/tests/test_util.h"

namespace jaxcomm::kernels {
namespace {

// Reference: stable sort of indices by descending |v| (stable = lower index first on ties),
// first k, then ascending.
std::vector<int32_t> ReferenceTopK(const std::vector<float>& acc, int64_t k) {
  std::vector<int32_t> order(acc.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return MagnitudeKey(acc[a]) > MagnitudeKey(acc[b]);
  });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

struct Selection {
  std::vector<int32_t> indices;
  std::vector<float> values;
  std::vector<float> residual;
};

Selection Select(const std::vector<float>& x, const std::vector<float>* residual, int64_t k,
                 const TaskRunner& run = RunTasksSerially) {
  Selection out{std::vector<int32_t>(k), std::vector<float>(k), {}};
  const int64_t n = static_cast<int64_t>(x.size());
  float* residual_out = nullptr;
  if (residual) {
    out.residual.resize(n);
    residual_out = out.residual.data();
  }
  TopKAbs(x.data(), residual ? residual->data() : nullptr, n, k, out.indices.data(),
          out.values.data(), residual_out, run);
  return out;
}

TEST(TopKAbs, HandPickedCase) {
  const std::vector<float> x = {0.1f, -3.0f, 2.0f, 0.5f, -2.0f};
  const Selection s = Select(x, nullptr, 3);
  EXPECT_EQ(s.indices, (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(s.values, (std::vector<float>{-3.0f, 2.0f, -2.0f}));
}

TEST(TopKAbs, TiesBreakTowardLowerIndex) {
  const std::vector<float> x(1000, 1.5f);
  const Selection s = Select(x, nullptr, 7);
  EXPECT_EQ(s.indices, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
  // Equal magnitude, opposite sign, is a tie too.
  const Selection mixed = Select({-1.0f, 1.0f, -1.0f, 1.0f}, nullptr, 2);
  EXPECT_EQ(mixed.indices, (std::vector<int32_t>{0, 1}));
}

TEST(TopKAbs, SingleElementAndKEqualsN) {
  EXPECT_EQ(Select({-4.0f}, nullptr, 1).values, (std::vector<float>{-4.0f}));
  const std::vector<float> x = RandomVector(37, 1);
  const Selection s = Select(x, nullptr, 37);
  std::vector<int32_t> all(37);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(s.indices, all);
  EXPECT_EQ(s.values, x);
}

TEST(TopKAbs, MatchesReferenceOnRandomInputs) {
  for (int64_t n : {1, 7, 64, 65, 1000, 100003, (1 << 20) + 3}) {
    const std::vector<float> x = RandomVector(n, static_cast<uint32_t>(n));
    for (int64_t k :
         {int64_t{1}, std::max<int64_t>(1, n / 1000), std::max<int64_t>(1, n / 10), n}) {
      const Selection s = Select(x, nullptr, k);
      EXPECT_EQ(s.indices, ReferenceTopK(x, k)) << "n=" << n << " k=" << k;
      for (int64_t j = 0; j < k; ++j) EXPECT_EQ(s.values[j], x[s.indices[j]]);
    }
  }
}

TEST(TopKAbs, HeavyTiesAcrossTheThreshold) {
  // Many equal magnitudes straddling the k-th position: the lower indices must win.
  std::vector<float> x(200000, 0.0f);
  for (int64_t i = 0; i < 200000; i += 3) x[i] = (i % 2) ? 1.0f : -1.0f;
  x[199999] = 5.0f;
  const Selection s = Select(x, nullptr, 1000);
  EXPECT_EQ(s.indices, ReferenceTopK(x, 1000));
}

TEST(TopKAbs, NonFiniteValuesRankFirst) {
  std::vector<float> x = RandomVector(5000, 3);
  x[4000] = std::numeric_limits<float>::quiet_NaN();
  x[10] = -std::numeric_limits<float>::infinity();
  const Selection s = Select(x, nullptr, 2);
  EXPECT_EQ(s.indices, (std::vector<int32_t>{10, 4000}));
  EXPECT_TRUE(std::isinf(s.values[0]));
  EXPECT_TRUE(std::isnan(s.values[1]));
}

TEST(TopKAbs, ErrorFeedbackIdentityIsExact) {
  const int64_t n = 300001;
  const std::vector<float> x = RandomVector(n, 5);
  const std::vector<float> r = RandomVector(n, 6, 0.1f);
  const Selection s = Select(x, &r, 301);
  EXPECT_EQ(s.indices, ReferenceTopK(
                           [&] {
                             std::vector<float> acc(n);
                             for (int64_t i = 0; i < n; ++i) acc[i] = x[i] + r[i];
                             return acc;
                           }(),
                           301));
  std::vector<float> applied(n, 0.0f);
  for (size_t j = 0; j < s.indices.size(); ++j) applied[s.indices[j]] = s.values[j];
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x[i] + r[i], applied[i] + s.residual[i]) << i;
}

TEST(TopKAbs, ResidualMayAliasInput) {
  const int64_t n = 50000;
  const std::vector<float> x = RandomVector(n, 7);
  std::vector<float> r = RandomVector(n, 8);
  const std::vector<float> r_copy = r;
  std::vector<int32_t> indices(50);
  std::vector<float> values(50);
  TopKAbs(x.data(), r.data(), n, 50, indices.data(), values.data(), r.data());
  const Selection expected = Select(x, &r_copy, 50);
  EXPECT_EQ(indices, expected.indices);
  EXPECT_EQ(r, expected.residual);
}

TEST(TopKAbs, ThreadCountDoesNotChangeTheResult) {
  const int64_t n = (1 << 21) + 17;
  const std::vector<float> x = RandomVector(n, 9);
  const std::vector<float> r = RandomVector(n, 10, 0.5f);
  const Selection serial = Select(x, &r, 2000);
  const Selection threaded = Select(x, &r, 2000, ThreadedRunner(4));
  EXPECT_EQ(serial.indices, threaded.indices);
  EXPECT_EQ(serial.values, threaded.values);
  EXPECT_EQ(serial.residual, threaded.residual);
}

TEST(TopKAbs, AdversarialSampleMissFallsBackToExact) {
  // The largest values sit only where the sampler never looks at scale: a tiny dense
  // cluster of large values. The result must still be exact.
  const int64_t n = 1 << 20;
  std::vector<float> x(n, 1.0f);
  for (int64_t i = 500000; i < 500000 + 4096; ++i) x[i] = 2.0f + static_cast<float>(i % 7);
  const Selection s = Select(x, nullptr, 5000);
  EXPECT_EQ(s.indices, ReferenceTopK(x, 5000));
}

}  // namespace
}  // namespace jaxcomm::kernels
