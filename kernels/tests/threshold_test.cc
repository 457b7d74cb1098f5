#include "kernels/threshold.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/tests/test_util.h"
#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

CompressOutput Compress(const std::vector<float>& x, const std::vector<float>& r, float tau,
                        int64_t capacity, const TaskRunner& run = RunTasksSerially) {
  const int64_t n = static_cast<int64_t>(x.size());
  CompressOutput out{std::vector<uint32_t>(1 + capacity, 0xdeadbeefu), std::vector<float>(n), {}};
  out.status = ThresholdCompress(x.data(), r.data(), n, {tau, capacity}, out.packed.data(),
                                 out.residual.data(), run);
  return out;
}

// The quantizer written out element by element, as the paper describes it.
CompressOutput Reference(const std::vector<float>& x, const std::vector<float>& r, float tau,
                         int64_t capacity) {
  const int64_t n = static_cast<int64_t>(x.size());
  CompressOutput out{std::vector<uint32_t>(1 + capacity, 0u), std::vector<float>(n), {}};
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float acc = x[i] + r[i];
    out.residual[i] = acc;
    if (m == capacity) continue;
    if (acc > tau) {
      out.packed[1 + m++] = wire::kSignBit | static_cast<uint32_t>(i);
      out.residual[i] = acc - tau;
    } else if (acc < -tau) {
      out.packed[1 + m++] = static_cast<uint32_t>(i);
      out.residual[i] = acc + tau;
    }
  }
  out.packed[0] = static_cast<uint32_t>(1 + m);
  return out;
}

TEST(Threshold, HandComputed) {
  const std::vector<float> x = {0.5f, 2.0f, -3.0f, 1.0f, -1.0f, -1.5f};
  const std::vector<float> r(6, 0.0f);
  const CompressOutput out = Compress(x, r, 1.0f, 6);
  ASSERT_TRUE(out.status.ok());
  // |acc| == tau is not sent; only 2.0, -3.0, -1.5 are.
  EXPECT_EQ(out.packed, (std::vector<uint32_t>{4u, 0x80000001u, 2u, 5u, 0u, 0u, 0u}));
  EXPECT_EQ(out.residual, (std::vector<float>{0.5f, 1.0f, -2.0f, 1.0f, -1.0f, -0.5f}));
}

TEST(Threshold, CapacityOverflowKeepsLowestIndices) {
  const std::vector<float> x = {0.5f, 2.0f, -3.0f, 1.0f, -1.0f, -1.5f};
  const CompressOutput out = Compress(x, std::vector<float>(6, 0.0f), 1.0f, 2);
  EXPECT_EQ(out.packed, (std::vector<uint32_t>{3u, 0x80000001u, 2u}));
  EXPECT_EQ(out.residual[5], -1.5f) << "an entry that did not fit stays whole";
}

TEST(Threshold, NothingPassesAndSingleElement) {
  const CompressOutput none = Compress({0.1f, -0.2f}, {0.0f, 0.0f}, 0.5f, 2);
  EXPECT_EQ(none.packed, (std::vector<uint32_t>{1u, 0u, 0u}));
  EXPECT_EQ(none.residual, (std::vector<float>{0.1f, -0.2f}));

  const CompressOutput one = Compress({-0.75f}, {-0.5f}, 1.0f, 1);
  EXPECT_EQ(one.packed, (std::vector<uint32_t>{2u, 0u}));
  EXPECT_EQ(one.residual, (std::vector<float>{-0.25f}));
}

TEST(Threshold, MatchesReferenceAcrossSizes) {
  for (int64_t n : {1, 7, 63, 64, 65, 1000, 100003}) {
    const auto x = RandomVector(n, 3 + n);
    const auto r = RandomVector(n, 4 + n, 0.5f);
    for (int64_t capacity : {int64_t{1}, (n + 9) / 10, n}) {
      const CompressOutput out = Compress(x, r, 1.2f, capacity);
      const CompressOutput ref = Reference(x, r, 1.2f, capacity);
      ASSERT_TRUE(out.status.ok());
      EXPECT_EQ(out.packed, ref.packed) << n << " " << capacity;
      EXPECT_EQ(std::memcmp(out.residual.data(), ref.residual.data(), n * sizeof(float)), 0);
    }
  }
}

TEST(Threshold, ErrorFeedbackIdentity) {
  const int64_t n = 20000;
  const auto x = RandomVector(n, 5);
  const auto r = RandomVector(n, 6, 0.5f);
  const CompressOutput out = Compress(x, r, 0.8f, n / 4);
  std::vector<float> x_hat(n);
  ASSERT_EQ(ThresholdDecompress(out.packed.data(), n, 0.8f, x_hat.data()), -1);
  int64_t sent = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float acc = x[i] + r[i];
    EXPECT_EQ(out.residual[i], acc - x_hat[i]) << i;
    EXPECT_NEAR(x_hat[i] + out.residual[i], acc, 1.2e-7f * std::fabs(acc)) << i;
    sent += x_hat[i] != 0.0f;
  }
  EXPECT_EQ(sent, static_cast<int64_t>(out.packed[0]) - 1);
}

TEST(Threshold, ThreadCountDoesNotChangeBytes) {
  const int64_t n = (1 << 21) + 13;
  const auto x = RandomVector(n, 9);
  const auto r = RandomVector(n, 10, 0.5f);
  // Generous capacity, and one that overflows inside the first of several ranges.
  for (int64_t capacity : {n / 2, int64_t{5000}}) {
    const CompressOutput serial = Compress(x, r, 1.5f, capacity, RunTasksSerially);
    const CompressOutput threaded = Compress(x, r, 1.5f, capacity, ThreadedRunner(4));
    const CompressOutput ref = Reference(x, r, 1.5f, capacity);
    EXPECT_EQ(serial.packed, ref.packed);
    EXPECT_EQ(threaded.packed, ref.packed);
    EXPECT_EQ(std::memcmp(serial.residual.data(), ref.residual.data(), n * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(threaded.residual.data(), ref.residual.data(), n * sizeof(float)), 0);
  }
}

TEST(Threshold, ResidualMayAliasInput) {
  const int64_t n = 700000;
  const auto x = RandomVector(n, 12);
  auto r = RandomVector(n, 13, 0.5f);
  const CompressOutput ref = Reference(x, r, 1.0f, 1000);
  std::vector<uint32_t> packed(1001);
  ASSERT_TRUE(ThresholdCompress(x.data(), r.data(), n, {1.0f, 1000}, packed.data(), r.data(),
                                ThreadedRunner(2))
                  .ok());
  EXPECT_EQ(packed, ref.packed);
  EXPECT_EQ(std::memcmp(r.data(), ref.residual.data(), n * sizeof(float)), 0);
}

TEST(Threshold, ReportsFirstNonFiniteIndex) {
  const int64_t n = (1 << 20) + 3;
  auto x = RandomVector(n, 14, 0.01f);  // nothing passes tau: the NaN must still be found
  std::vector<float> r(n, 0.0f);
  x[1000000] = std::nanf("");
  x[600000] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(Compress(x, r, 1.0f, 10, ThreadedRunner(4)).status.nonfinite_index, 600000);
  EXPECT_EQ(Compress(x, r, 1.0f, 10, RunTasksSerially).status.nonfinite_index, 600000);
  EXPECT_EQ(Compress({0.0f, 3e38f}, {0.0f, 3e38f}, 1.0f, 1).status.nonfinite_index, 1);
}

TEST(Threshold, DecompressRejectsBadEntries) {
  std::vector<float> x_hat(10);
  const std::vector<uint32_t> good = {3u, 0x80000002u, 7u, 0u};
  ASSERT_EQ(ThresholdDecompress(good.data(), 10, 0.5f, x_hat.data()), -1);
  EXPECT_EQ(x_hat, (std::vector<float>{0, 0, 0.5f, 0, 0, 0, 0, -0.5f, 0, 0}));
  const std::vector<uint32_t> out_of_range = {3u, 1u, 10u};
  EXPECT_EQ(ThresholdDecompress(out_of_range.data(), 10, 0.5f, x_hat.data()), 1);
  const std::vector<uint32_t> not_ascending = {3u, 0x80000004u, 4u};
  EXPECT_EQ(ThresholdDecompress(not_ascending.data(), 10, 0.5f, x_hat.data()), 1);
}

TEST(Threshold, PortableLoopsMatchReference) {
  // The AVX2 loops are checked against Reference above; the portable ones (taken on CPUs
  // without AVX2) must give the same bytes.
  ForcePortableQuantizersForTesting(true);
  for (int64_t n : {1, 65, 100003}) {
    const auto x = RandomVector(n, 61 + n);
    const auto r = RandomVector(n, 62 + n, 0.5f);
    for (int64_t capacity : {int64_t{3}, n}) {
      const CompressOutput out = Compress(x, r, 1.0f, capacity);
      const CompressOutput ref = Reference(x, r, 1.0f, capacity);
      EXPECT_EQ(out.packed, ref.packed) << n << " " << capacity;
      EXPECT_EQ(std::memcmp(out.residual.data(), ref.residual.data(), n * sizeof(float)), 0);
    }
  }
  ForcePortableQuantizersForTesting(false);
}

}  // namespace
}  // namespace jaxcomm::kernels
