#include "kernels/onebit.h"

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

CompressOutput Compress(const std::vector<float>& x, const std::vector<float>& r,
                        OneBitParams params, const TaskRunner& run = RunTasksSerially) {
  const int64_t n = static_cast<int64_t>(x.size());
  CompressOutput out{std::vector<uint32_t>(OneBitPackedWords(n, params.column_size), 0xdeadbeefu),
                     std::vector<float>(n, std::nanf("")),
                     {}};
  out.status =
      OneBitCompress(x.data(), r.data(), n, params, out.packed.data(), out.residual.data(), run);
  return out;
}

float Mean(uint32_t bits) { return wire::BitsFloat(bits); }

// Column means computed the obvious way (serial, in double), to compare with the kernel's
// lane-wise sums up to float rounding.
void ReferenceMeans(const std::vector<float>& acc, int64_t begin, int64_t end, float* nonneg,
                    float* neg) {
  double s[2] = {0, 0};
  int64_t c[2] = {0, 0};
  for (int64_t i = begin; i < end; ++i) {
    const int k = acc[i] >= 0.0f ? 0 : 1;
    s[k] += acc[i];
    ++c[k];
  }
  *nonneg = c[0] ? static_cast<float>(s[0] / c[0]) : 0.0f;
  *neg = c[1] ? static_cast<float>(s[1] / c[1]) : 0.0f;
}

TEST(OneBit, PackedWords) {
  EXPECT_EQ(OneBitPackedWords(1024, 1024), 35);  // matches the OneBit docstring
  EXPECT_EQ(OneBitPackedWords(1, 32), 1 + 2 + 1);
  EXPECT_EQ(OneBitPackedWords(65, 32), 1 + 2 * 3 + 3);
}

TEST(OneBit, HandComputedColumn) {
  // acc = {1, -2, 3, -4, 0}: non-negative {1, 3, 0} -> 4/3, negative {-2, -4} -> -3.
  const std::vector<float> x = {0.5f, -2.0f, 3.0f, -3.0f, 0.0f};
  const std::vector<float> r = {0.5f, 0.0f, 0.0f, -1.0f, 0.0f};
  const CompressOutput out = Compress(x, r, {32, 0});
  ASSERT_TRUE(out.status.ok());
  ASSERT_EQ(out.packed.size(), 4u);
  EXPECT_EQ(out.packed[0], 4u);
  EXPECT_EQ(Mean(out.packed[1]), static_cast<float>(4.0 / 3.0));
  EXPECT_EQ(Mean(out.packed[2]), -3.0f);
  EXPECT_EQ(out.packed[3], 0b10101u);
  const float m = static_cast<float>(4.0 / 3.0);
  const std::vector<float> expected = {1.0f - m, 1.0f, 3.0f - m, -1.0f, 0.0f - m};
  EXPECT_EQ(out.residual, expected);
}

TEST(OneBit, NegativeZeroEncodesAsNonNegative) {
  const std::vector<float> x = {-0.0f, -1.0f};
  const CompressOutput out = Compress(x, {0.0f, 0.0f}, {32, 0});
  EXPECT_EQ(out.packed[3], 0b01u);  // -0.0 >= 0
}

TEST(OneBit, SingleElementAndEmptySign) {
  const CompressOutput pos = Compress({2.5f}, {0.0f}, {32, 0});
  ASSERT_TRUE(pos.status.ok());
  EXPECT_EQ(pos.packed, (std::vector<uint32_t>{4u, wire::FloatBits(2.5f), 0u, 1u}));
  EXPECT_EQ(pos.residual[0], 0.0f);

  const CompressOutput neg = Compress({-2.5f}, {0.0f}, {32, 0});
  EXPECT_EQ(neg.packed, (std::vector<uint32_t>{4u, 0u, wire::FloatBits(-2.5f), 0u}));
}

TEST(OneBit, AllEqualValuesDecodeExactly) {
  const std::vector<float> x(100, 0.125f);
  const CompressOutput out = Compress(x, std::vector<float>(100, 0.0f), {64, 0});
  for (int c = 0; c < 2; ++c) {
    EXPECT_EQ(Mean(out.packed[1 + 2 * c]), 0.125f);
    EXPECT_EQ(Mean(out.packed[2 + 2 * c]), 0.0f);
  }
  for (float v : out.residual) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(out.packed[5], 0xffffffffu);
  EXPECT_EQ(out.packed[8], 0xfu);  // 100 = 3 * 32 + 4: only 4 bits in the last word
}

TEST(OneBit, ColumnTailsMatchReference) {
  for (int64_t n : {1, 7, 31, 32, 33, 100, 1000, 4097}) {
    for (int64_t column_size : {32, 64, 1024}) {
      const auto x = RandomVector(n, 1 + n);
      const auto r = RandomVector(n, 2 + n, 0.1f);
      const CompressOutput out = Compress(x, r, {column_size, 0});
      ASSERT_TRUE(out.status.ok());
      const int64_t ncols = OneBitNumColumns(n, column_size);
      ASSERT_EQ(out.packed[0], out.packed.size());
      std::vector<float> acc(n);
      for (int64_t i = 0; i < n; ++i) acc[i] = x[i] + r[i];
      for (int64_t c = 0; c < ncols; ++c) {
        float nonneg, neg;
        ReferenceMeans(acc, c * column_size, std::min(n, (c + 1) * column_size), &nonneg, &neg);
        EXPECT_FLOAT_EQ(Mean(out.packed[1 + 2 * c]), nonneg) << n << " " << c;
        EXPECT_FLOAT_EQ(Mean(out.packed[2 + 2 * c]), neg) << n << " " << c;
      }
      const uint32_t* bits = out.packed.data() + 1 + 2 * ncols;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ((bits[i / 32] >> (i % 32)) & 1u, acc[i] >= 0.0f ? 1u : 0u) << i;
      }
      if (n % 32) EXPECT_EQ(bits[n / 32] >> (n % 32), 0u) << "padding bits must be zero";
    }
  }
}

TEST(OneBit, ErrorFeedbackIdentity) {
  const int64_t n = 5000;
  const auto x = RandomVector(n, 7);
  const auto r = RandomVector(n, 8, 0.3f);
  for (int64_t sample_size : {0, 16}) {
    const OneBitParams params{256, sample_size};
    const CompressOutput out = Compress(x, r, params);
    std::vector<float> x_hat(n);
    OneBitDecompress(out.packed.data(), n, params, x_hat.data());
    for (int64_t i = 0; i < n; ++i) {
      const float acc = x[i] + r[i];
      // residual = acc - decoded rounds once; adding decoded back rounds once more.
      EXPECT_NEAR(x_hat[i] + out.residual[i], acc, 2e-7f * (std::fabs(acc) + std::fabs(x_hat[i])))
          << i;
      EXPECT_EQ(out.residual[i], acc - x_hat[i]) << i;
    }
  }
}

TEST(OneBit, SampledMeansUseDocumentedPositions) {
  const int64_t n = 1000, column_size = 256, sample_size = 40;
  const auto x = RandomVector(n, 11);
  const std::vector<float> r(n, 0.0f);
  const CompressOutput out = Compress(x, r, {column_size, sample_size});
  for (int64_t c = 0; c < OneBitNumColumns(n, column_size); ++c) {
    const int64_t begin = c * column_size;
    const int64_t len = std::min(column_size, n - begin);
    double s[2] = {0, 0};
    int64_t k[2] = {0, 0};
    for (int64_t j = 0; j < sample_size; ++j) {
      const float a = x[begin + wire::SamplePosition(c, j, len)];
      const int sign = a >= 0.0f ? 0 : 1;
      s[sign] += a;
      ++k[sign];
    }
    // Same order of additions as the kernel: equal bits.
    EXPECT_EQ(Mean(out.packed[1 + 2 * c]), k[0] ? static_cast<float>(s[0] / k[0]) : 0.0f);
    EXPECT_EQ(Mean(out.packed[2 + 2 * c]), k[1] ? static_cast<float>(s[1] / k[1]) : 0.0f);
  }
}

TEST(OneBit, SampleMissingASignDecodesItToZero) {
  // One negative value among 1024 positives: a sample of 4 almost surely misses it, and then
  // it decodes to 0 and stays whole in the residual.
  std::vector<float> x(1024, 1.0f);
  int64_t missed = -1;
  for (int64_t i = 0; i < 1024 && missed < 0; ++i) {
    bool hit = false;
    for (int64_t j = 0; j < 4; ++j) hit |= wire::SamplePosition(0, j, 1024) == i;
    if (!hit) missed = i;
  }
  x[missed] = -5.0f;
  const CompressOutput out = Compress(x, std::vector<float>(1024, 0.0f), {1024, 4});
  EXPECT_EQ(Mean(out.packed[1]), 1.0f);
  EXPECT_EQ(Mean(out.packed[2]), 0.0f);
  EXPECT_EQ(out.residual[missed], -5.0f);
}

TEST(OneBit, ResidualMayAliasInput) {
  const int64_t n = 3000;
  const auto x = RandomVector(n, 21);
  auto r = RandomVector(n, 22, 0.5f);
  const CompressOutput separate = Compress(x, r, {128, 0});
  std::vector<uint32_t> packed(separate.packed.size());
  ASSERT_TRUE(OneBitCompress(x.data(), r.data(), n, {128, 0}, packed.data(), r.data()).ok());
  EXPECT_EQ(packed, separate.packed);
  EXPECT_EQ(std::memcmp(r.data(), separate.residual.data(), n * sizeof(float)), 0);
}

TEST(OneBit, ThreadCountDoesNotChangeBytes) {
  const int64_t n = (1 << 21) + 77;  // several tasks, a short last column
  const auto x = RandomVector(n, 31);
  const auto r = RandomVector(n, 32, 0.2f);
  for (int64_t sample_size : {0, 64}) {
    const OneBitParams params{1024, sample_size};
    const CompressOutput serial = Compress(x, r, params, RunTasksSerially);
    const CompressOutput threaded = Compress(x, r, params, ThreadedRunner(4));
    EXPECT_EQ(serial.packed, threaded.packed);
    EXPECT_EQ(std::memcmp(serial.residual.data(), threaded.residual.data(), n * sizeof(float)), 0);
    std::vector<float> a(n), b(n);
    OneBitDecompress(serial.packed.data(), n, params, a.data(), RunTasksSerially);
    OneBitDecompress(serial.packed.data(), n, params, b.data(), ThreadedRunner(4));
    EXPECT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(float)), 0);
  }
}

TEST(OneBit, ReportsFirstNonFiniteIndex) {
  const int64_t n = (1 << 20) + 5;
  auto x = RandomVector(n, 41);
  std::vector<float> r(n, 0.0f);
  x[900000] = std::numeric_limits<float>::infinity();
  x[700001] = std::nanf("");
  for (int64_t sample_size : {0, 8}) {
    EXPECT_EQ(Compress(x, r, {1024, sample_size}, ThreadedRunner(4)).status.nonfinite_index,
              700001);
  }
  // Overflow of a finite x + residual is caught too.
  const CompressOutput overflow = Compress({1.0f, 3e38f}, {0.0f, 3e38f}, {32, 0});
  EXPECT_EQ(overflow.status.nonfinite_index, 1);
  EXPECT_TRUE(Compress({1.0f, -1.0f}, {0.0f, 0.0f}, {32, 0}).status.ok());
}

TEST(OneBit, PortableAndAvx2LoopsGiveSameBytes) {
  if (!QuantizersUseAvx2()) GTEST_SKIP() << "this CPU has no AVX2: only the portable loops run";
  for (int64_t n : {1, 37, 1000, 300001}) {
    auto x = RandomVector(n, 51 + n);
    const auto r = RandomVector(n, 52 + n, 0.5f);
    for (int64_t i = 0; i < n; i += 7) x[i] = (i % 14) ? -r[i] : -0.0f;  // exact zeros, -0.0
    for (int64_t sample_size : {0, 16}) {
      const OneBitParams params{96, sample_size};
      const CompressOutput fast = Compress(x, r, params);
      std::vector<float> fast_hat(n), portable_hat(n);
      OneBitDecompress(fast.packed.data(), n, params, fast_hat.data());
      ForcePortableQuantizersForTesting(true);
      const CompressOutput portable = Compress(x, r, params);
      OneBitDecompress(fast.packed.data(), n, params, portable_hat.data());
      ForcePortableQuantizersForTesting(false);
      EXPECT_EQ(fast.packed, portable.packed) << n;
      EXPECT_EQ(std::memcmp(fast.residual.data(), portable.residual.data(), n * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(fast_hat.data(), portable_hat.data(), n * sizeof(float)), 0);
    }
  }
}

}  // namespace
}  // namespace jaxcomm::kernels
