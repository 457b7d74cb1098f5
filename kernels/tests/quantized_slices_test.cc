#include "kernels/quantized_slices.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/adaptive.h"
#include "kernels/onebit.h"
#include "kernels/threshold.h"

namespace jaxcomm::kernels {
namespace {

QuantizerSpec OneBitSpec() { return QuantizerSpec{kOneBitKind, 64, 0, 1.0, 1.0f, 1.0}; }
QuantizerSpec ThresholdSpec() { return QuantizerSpec{kThresholdKind, 1, 0, 1.0, 0.5f, 1.0}; }
QuantizerSpec AdaptiveSpec() { return QuantizerSpec{kAdaptiveKind, 100, 0, 4.0, 1.0f, 1.0}; }

std::vector<float> Gaussian(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(SliceRange, CoversTheVectorInUnitAlignedSlices) {
  for (int64_t n : {0, 1, 63, 64, 65, 1000, 4097}) {
    for (int parts : {1, 2, 3, 6}) {
      for (int64_t unit : {1, 64, 1024}) {
        int64_t expected_begin = 0;
        for (int s = 0; s < parts; ++s) {
          const Range r = SliceRange(n, parts, s, unit);
          EXPECT_EQ(r.begin, expected_begin);
          EXPECT_LE(r.begin, r.end);
          if (r.begin < n) EXPECT_EQ(r.begin % unit, 0) << "a column would straddle slices";
          expected_begin = r.end;
        }
        EXPECT_EQ(expected_begin, n);
      }
    }
  }
  // Units are shared out evenly: 5 columns over 2 slices -> 3 + 2.
  EXPECT_EQ(SliceRange(5 * 64, 2, 0, 64).end, 3 * 64);
  EXPECT_EQ(SliceRange(5 * 64 - 10, 2, 1, 64).end, 5 * 64 - 10);
}

TEST(CheckQuantizerSpec, RejectsBadParameters) {
  EXPECT_EQ(CheckQuantizerSpec(OneBitSpec()), "");
  QuantizerSpec bad = OneBitSpec();
  bad.column_size = 48;
  EXPECT_NE(CheckQuantizerSpec(bad), "");
  bad = ThresholdSpec();
  bad.tau = 0.0f;
  EXPECT_NE(CheckQuantizerSpec(bad), "");
  bad.tau = NAN;
  EXPECT_NE(CheckQuantizerSpec(bad), "");
  bad = AdaptiveSpec();
  bad.proportion = 0.5;
  EXPECT_NE(CheckQuantizerSpec(bad), "");
}

// Quantize, then decode into a running sum: sum + decoded + residual == sum + acc.
TEST(QuantizeSlice, ErrorFeedbackAndAccumulateAgree) {
  for (const QuantizerSpec& spec : {OneBitSpec(), ThresholdSpec(), AdaptiveSpec()}) {
    for (int64_t n : {1, 7, 1000, 4099}) {
      const std::vector<float> x = Gaussian(n, 1);
      const std::vector<float> r = Gaussian(n, 2);
      std::vector<uint32_t> packed(QuantizedPackedWords(spec, n));
      std::vector<float> residual(n), sum(n, 1.0f), scratch;
      ASSERT_TRUE(QuantizeSlice(spec, x.data(), r.data(), n, packed.data(), residual.data()).ok());
      ASSERT_LE(packed[0], packed.size());
      // Only `used` words travel.
      EXPECT_EQ(DequantizeAccumulate(spec, packed.data(), packed[0], n, sum.data(), &scratch), "");
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_NEAR(sum[i] - 1.0f + residual[i], x[i] + r[i], 1e-5f) << i;
      }
      // A null residual means zero: the same encoding as an explicit zero vector.
      const std::vector<float> acc = [&] {
        std::vector<float> a(n);
        for (int64_t i = 0; i < n; ++i) a[i] = x[i] + r[i];
        return a;
      }();
      const std::vector<float> zeros(n, 0.0f);
      std::vector<uint32_t> packed_null(packed.size()), packed_zero(packed.size());
      std::vector<float> res_null(n), res_zero(n);
      ASSERT_TRUE(
          QuantizeSlice(spec, acc.data(), nullptr, n, packed_null.data(), res_null.data()).ok());
      ASSERT_TRUE(
          QuantizeSlice(spec, acc.data(), zeros.data(), n, packed_zero.data(), res_zero.data())
              .ok());
      EXPECT_EQ(packed_null, packed_zero);
      EXPECT_EQ(res_null, res_zero);
    }
  }
}

TEST(QuantizeSlice, EmptySliceIsOneWord) {
  for (const QuantizerSpec& spec : {OneBitSpec(), ThresholdSpec(), AdaptiveSpec()}) {
    EXPECT_EQ(QuantizedPackedWords(spec, 0), 1);
    uint32_t packed = 99;
    EXPECT_TRUE(QuantizeSlice(spec, nullptr, nullptr, 0, &packed, nullptr).ok());
    EXPECT_EQ(packed, 1u);
    std::vector<float> scratch;
    EXPECT_EQ(DequantizeAccumulate(spec, &packed, 1, 0, nullptr, &scratch), "");
  }
}

TEST(QuantizeSlice, ReportsNonFinite) {
  std::vector<float> x(300, 1.0f);
  x[123] = INFINITY;
  std::vector<uint32_t> packed(QuantizedPackedWords(AdaptiveSpec(), 300));
  std::vector<float> residual(300);
  for (const QuantizerSpec& spec : {OneBitSpec(), ThresholdSpec(), AdaptiveSpec()}) {
    packed.resize(QuantizedPackedWords(spec, 300));
    EXPECT_EQ(
        QuantizeSlice(spec, x.data(), nullptr, 300, packed.data(), residual.data()).nonfinite_index,
        123);
  }
}

TEST(DequantizeAccumulate, RejectsMalformedMessagesWithoutTouchingTheSum) {
  const int64_t n = 500;
  const std::vector<float> x = Gaussian(n, 3);
  std::vector<float> scratch, residual(n);
  for (const QuantizerSpec& spec : {OneBitSpec(), ThresholdSpec(), AdaptiveSpec()}) {
    std::vector<uint32_t> packed(QuantizedPackedWords(spec, n));
    ASSERT_TRUE(QuantizeSlice(spec, x.data(), nullptr, n, packed.data(), residual.data()).ok());
    std::vector<float> sum(n, 2.0f);
    // Truncated message: fewer words than its header claims.
    EXPECT_NE(DequantizeAccumulate(spec, packed.data(), packed[0] - 1, n, sum.data(), &scratch),
              "");
    // Header beyond the slice's capacity.
    std::vector<uint32_t> big(packed.size() + 8, 0);
    big[0] = static_cast<uint32_t>(big.size());
    EXPECT_NE(DequantizeAccumulate(spec, big.data(), big.size(), n, sum.data(), &scratch), "");
    EXPECT_EQ(sum, std::vector<float>(n, 2.0f));
  }
  // A threshold entry out of range.
  const QuantizerSpec spec = ThresholdSpec();
  const std::vector<uint32_t> message = {3, 5, 900};
  std::vector<float> sum(n, 2.0f);
  EXPECT_NE(DequantizeAccumulate(spec, message.data(), 3, n, sum.data(), &scratch), "");
  EXPECT_EQ(sum, std::vector<float>(n, 2.0f));
}

}  // namespace
}  // namespace jaxcomm::kernels
