#include "kernels/half.h"

#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

constexpr HalfFormat kFormats[] = {HalfFormat::kBFloat16, HalfFormat::kFloat16};

// FloatToHalf of the float with these bits, through a vector long enough for the vectorized
// loop, the value placed last (in the scalar tail).
uint16_t Round(HalfFormat format, uint32_t bits) {
  std::vector<float> in(37, 1.0f);
  in.back() = wire::BitsFloat(bits);
  std::vector<uint16_t> out(in.size());
  FloatToHalf(format, in.data(), out.data(), static_cast<int64_t>(in.size()));
  return out.back();
}

TEST(FloatToHalf, Bf16RoundsToNearestEvenAndKeepsSpecials) {
  const std::pair<uint32_t, uint16_t> cases[] = {
      {0x3f800000u, 0x3f80u},  // 1
      {0x3f808000u, 0x3f80u},  // halfway, even below: down
      {0x3f818000u, 0x3f82u},  // halfway, odd below: up
      {0x3f808001u, 0x3f81u},  // above halfway: up
      {0x80000000u, 0x8000u},  // -0 stays -0
      {0x7f800000u, 0x7f80u},  // +inf
      {0x7f7fffffu, 0x7f80u},  // FLT_MAX rounds to +inf
      {0x7f800001u, 0x7fc0u},  // signalling NaN becomes a quiet NaN
      {0xffc00000u, 0xffc0u},  // quiet NaN keeps its sign
  };
  for (const auto& [bits, expected] : cases) {
    EXPECT_EQ(Round(HalfFormat::kBFloat16, bits), expected) << std::hex << bits;
  }
}

TEST(FloatToHalf, F16RoundsToNearestEvenAndKeepsSpecials) {
  const std::pair<float, uint16_t> cases[] = {
      {1.0f, 0x3c00u},
      {65504.0f, 0x7bffu},               // largest finite
      {65520.0f, 0x7c00u},               // halfway to the next power: rounds to +inf
      {std::ldexp(1.0f, -24), 0x0001u},  // smallest subnormal
      {std::ldexp(1.0f, -25), 0x0000u},  // halfway to it: rounds to even (0)
      {std::ldexp(1.5f, -25), 0x0001u},  // above halfway
      {-0.0f, 0x8000u},
  };
  for (const auto& [value, expected] : cases) {
    EXPECT_EQ(Round(HalfFormat::kFloat16, wire::FloatBits(value)), expected) << value;
  }
  const uint16_t nan = Round(HalfFormat::kFloat16, 0x7fc00000u);
  EXPECT_EQ(nan & 0x7c00u, 0x7c00u);
  EXPECT_NE(nan & 0x03ffu, 0u);
}

TEST(HalfToFloat, EveryWordWidensExactlyAndRoundsBackToItself) {
  std::vector<uint16_t> words(1 << 16);
  for (size_t i = 0; i < words.size(); ++i) words[i] = static_cast<uint16_t>(i);
  const int64_t n = static_cast<int64_t>(words.size());
  for (HalfFormat format : kFormats) {
    std::vector<float> wide(words.size());
    std::vector<uint16_t> back(words.size());
    HalfToFloat(format, words.data(), wide.data(), n);
    FloatToHalf(format, wide.data(), back.data(), n);
    for (size_t i = 0; i < words.size(); ++i) {
      if (std::isnan(wide[i])) {  // a NaN word comes back a NaN of the same sign
        const uint16_t exponent = format == HalfFormat::kBFloat16 ? 0x7f80u : 0x7c00u;
        EXPECT_EQ(back[i] & (0x8000u | exponent), words[i] & (0x8000u | exponent)) << i;
        EXPECT_NE(back[i] & static_cast<uint16_t>(~(0x8000u | exponent)), 0u) << i;
        continue;
      }
      ASSERT_EQ(back[i], words[i]) << "format " << static_cast<int>(format) << " word " << i;
    }
    // bf16 is the top half of a float32.
    if (format == HalfFormat::kBFloat16) {
      EXPECT_EQ(wire::FloatBits(wide[0x4049]), 0x40490000u);
    }
  }
}

TEST(AddHalfInto, AddsWidenedWordsIncludingTails) {
  for (HalfFormat format : kFormats) {
    for (int64_t n : {0, 1, 7, 8, 33, 1000}) {
      std::vector<float> values(n), acc(n);
      for (int64_t i = 0; i < n; ++i) {
        values[i] = 0.25f * static_cast<float>(i % 64) - 4.0f;  // exact in both formats
        acc[i] = static_cast<float>(i);
      }
      std::vector<uint16_t> words(n);
      FloatToHalf(format, values.data(), words.data(), n);
      AddHalfInto(format, acc.data(), words.data(), n);
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(acc[i], static_cast<float>(i) + values[i]);
    }
  }
}

}  // namespace
}  // namespace jaxcomm::kernels
