#include "kernels/blockquant.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/tests/test_util.h"
#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

BlockQuantParams Params(int64_t bits, int64_t block, bool stochastic = false) {
  BlockQuantParams p;
  p.bits = bits;
  p.block = block;
  p.stochastic = stochastic;
  p.seed = 7;
  p.step = 3;
  return p;
}

CompressOutput Compress(const std::vector<float>& x, const std::vector<float>* residual,
                        const BlockQuantParams& p, const TaskRunner& run = RunTasksSerially) {
  const int64_t n = static_cast<int64_t>(x.size());
  CompressOutput out;
  out.packed.assign(BlockQuantPackedWords(n, p.block, p.bits), 0xdeadbeefu);
  out.residual.assign(x.size(), 0.0f);
  out.status = BlockQuantCompress(x.data(), residual ? residual->data() : nullptr, n, p,
                                  out.packed.data(), out.residual.data(), run);
  return out;
}

std::vector<float> Decode(const std::vector<uint32_t>& packed, int64_t n,
                          const BlockQuantParams& p) {
  std::vector<float> out(n, 0.0f);
  EXPECT_EQ(BlockQuantDecompress(packed.data(), static_cast<int64_t>(packed.size()), n, p,
                                 out.data(), /*accumulate=*/false),
            "");
  return out;
}

int Code(const std::vector<uint32_t>& packed, int64_t n, const BlockQuantParams& p, int64_t i) {
  const auto* bytes =
      reinterpret_cast<const uint8_t*>(packed.data() + 1 + BlockQuantNumBlocks(n, p.block));
  if (p.bits == 8) return static_cast<int8_t>(bytes[i]);
  const uint8_t b = bytes[i / 2];
  return i % 2 ? static_cast<int8_t>(b) >> 4 : static_cast<int8_t>(b << 4) >> 4;
}

TEST(BlockQuant, PackedWordsCountHeaderScalesAndCodes) {
  EXPECT_EQ(BlockQuantPackedWords(1, 256, 8), 1 + 1 + 1);
  EXPECT_EQ(BlockQuantPackedWords(1000, 256, 8), 1 + 4 + 250);
  EXPECT_EQ(BlockQuantPackedWords(1000, 256, 4), 1 + 4 + 125);
  EXPECT_EQ(BlockQuantPackedWords(7, 3, 4), 1 + 3 + 1);
}

TEST(BlockQuant, CheckRejectsBadBitsAndBlock) {
  EXPECT_EQ(CheckBlockQuantParams(Params(8, 256)), "");
  EXPECT_EQ(CheckBlockQuantParams(Params(4, 1)), "");
  EXPECT_NE(CheckBlockQuantParams(Params(2, 256)).find("bits must be 8 or 4"), std::string::npos);
  EXPECT_NE(CheckBlockQuantParams(Params(8, 0)).find("block must be >= 1"), std::string::npos);
}

TEST(BlockQuant, HandComputedInt8Block) {
  // absmax 1: scale = 1/127, inv = 127; -63.5 rounds to even (-64), 31.75 to 32.
  const std::vector<float> x = {1.0f, -0.5f, 0.25f, 0.0f};
  const BlockQuantParams p = Params(8, 4);
  const CompressOutput out = Compress(x, nullptr, p);
  ASSERT_TRUE(out.status.ok());
  EXPECT_EQ(out.packed[0], 3u);
  EXPECT_EQ(wire::BitsFloat(out.packed[1]), 1.0f / 127.0f);
  EXPECT_EQ(Code(out.packed, 4, p, 0), 127);
  EXPECT_EQ(Code(out.packed, 4, p, 1), -64);
  EXPECT_EQ(Code(out.packed, 4, p, 2), 32);
  EXPECT_EQ(Code(out.packed, 4, p, 3), 0);
  const std::vector<float> decoded = Decode(out.packed, 4, p);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out.residual[i], x[i] - decoded[i]) << i;
}

TEST(BlockQuant, Int4PacksNibblesOfOddLengths) {
  // Block 3 over 7 elements: blocks [0, 3), [3, 6), [6, 7); odd block boundaries inside bytes.
  const std::vector<float> x = {7.0f, -7.0f, 1.0f, -3.5f, 2.0f, 0.5f, -1.0f};
  const BlockQuantParams p = Params(4, 3);
  const CompressOutput out = Compress(x, nullptr, p);
  ASSERT_TRUE(out.status.ok());
  const int expected[] = {7, -7, 1, -7, 4, 1, -7};  // scales 1, 0.5 and 1/7
  for (int i = 0; i < 7; ++i) EXPECT_EQ(Code(out.packed, 7, p, i), expected[i]) << i;
  EXPECT_EQ(out.packed.back() >> 28, 0u) << "the padding nibble is zero";
  const std::vector<float> decoded = Decode(out.packed, 7, p);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(out.residual[i] + decoded[i], x[i]) << i;
}

TEST(BlockQuant, ErrorIsAtMostHalfAStepAndResidualIsExact) {
  for (int64_t bits : {8, 4}) {
    for (int64_t block : {1, 32, 100, 256, 5000}) {
      const std::vector<float> x = RandomVector(20011, 1 + block, 1.0f);
      const std::vector<float> r = RandomVector(20011, 2 + block, 0.1f);
      const BlockQuantParams p = Params(bits, block);
      const CompressOutput out = Compress(x, &r, p);
      ASSERT_TRUE(out.status.ok());
      const std::vector<float> decoded = Decode(out.packed, 20011, p);
      for (int64_t i = 0; i < 20011; ++i) {
        const float acc = x[i] + r[i];
        const float scale = wire::BitsFloat(out.packed[1 + i / block]);
        ASSERT_LE(std::fabs(acc - decoded[i]), 0.5f * scale * 1.0001f + FLT_MIN) << i;
        ASSERT_EQ(out.residual[i], acc - decoded[i]) << i;
      }
    }
  }
}

TEST(BlockQuant, ZeroAndTinyBlocksAreSentAsZero) {
  std::vector<float> x(64, 0.0f);
  x[40] = 1e-44f;  // a subnormal: its scale would underflow, 1 / scale overflow
  const BlockQuantParams p = Params(8, 32);
  const CompressOutput out = Compress(x, nullptr, p);
  ASSERT_TRUE(out.status.ok());
  EXPECT_EQ(out.packed[1], 0u);
  EXPECT_EQ(out.packed[2], 0u);
  EXPECT_EQ(out.residual[40], 1e-44f);  // kept for error feedback
  for (float v : Decode(out.packed, 64, p)) EXPECT_EQ(v, 0.0f);
}

TEST(BlockQuant, StochasticRoundingIsDeterministicAndUnbiased) {
  const std::vector<float> x = RandomVector(4096, 5, 1.0f);
  BlockQuantParams p = Params(4, 64, /*stochastic=*/true);
  const CompressOutput a = Compress(x, nullptr, p);
  const CompressOutput b = Compress(x, nullptr, p);
  EXPECT_EQ(a.packed, b.packed) << "same seed and step: same bytes";
  p.step += 1;
  EXPECT_NE(Compress(x, nullptr, p).packed, a.packed) << "another step draws other bits";
  // Mean over many steps of the decoded value approaches x (unbiased), unlike nearest.
  std::vector<double> mean(x.size(), 0.0);
  const int steps = 400;
  for (int s = 0; s < steps; ++s) {
    p.step = s;
    const std::vector<float> d = Decode(Compress(x, nullptr, p).packed, 4096, p);
    for (size_t i = 0; i < x.size(); ++i) mean[i] += d[i] / steps;
  }
  double bias = 0.0;
  for (size_t i = 0; i < x.size(); ++i) bias += std::fabs(mean[i] - x[i]);
  const float scale = wire::BitsFloat(a.packed[1]);
  EXPECT_LT(bias / x.size(), 0.1 * scale);
}

TEST(BlockQuant, UniformIsInUnitInterval) {
  for (uint32_t i = 0; i < 100000; ++i) {
    const float u = BlockQuantUniform(BlockQuantKey(1, 2, 3), i);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
  }
}

TEST(BlockQuant, BytesDoNotDependOnThreadsOrInstructionSet) {
  const std::vector<float> x = RandomVector(1 << 20, 9, 1.0f);
  const std::vector<float> r = RandomVector(1 << 20, 10, 0.1f);
  for (int64_t bits : {8, 4}) {
    for (bool stochastic : {false, true}) {
      const BlockQuantParams p = Params(bits, 77, stochastic);
      const CompressOutput serial = Compress(x, &r, p);
      const CompressOutput threaded = Compress(x, &r, p, ThreadedRunner(4));
      ForcePortableQuantizersForTesting(true);
      const CompressOutput portable = Compress(x, &r, p);
      std::vector<float> portable_decoded = Decode(serial.packed, 1 << 20, p);
      ForcePortableQuantizersForTesting(false);
      EXPECT_EQ(serial.packed, threaded.packed);
      EXPECT_EQ(serial.residual, threaded.residual);
      EXPECT_EQ(serial.packed, portable.packed);
      EXPECT_EQ(serial.residual, portable.residual);
      EXPECT_EQ(Decode(serial.packed, 1 << 20, p), portable_decoded);
    }
  }
}

TEST(BlockQuant, ResidualMayAliasAndMayBeOmitted) {
  const std::vector<float> x = RandomVector(3000, 11, 1.0f);
  std::vector<float> r = RandomVector(3000, 12, 0.1f);
  const BlockQuantParams p = Params(8, 128);
  const CompressOutput expected = Compress(x, &r, p);
  std::vector<uint32_t> packed(expected.packed.size());
  ASSERT_TRUE(BlockQuantCompress(x.data(), r.data(), 3000, p, packed.data(), r.data()).ok());
  EXPECT_EQ(packed, expected.packed);
  EXPECT_EQ(r, expected.residual);
  ASSERT_TRUE(BlockQuantCompress(x.data(), nullptr, 3000, p, packed.data(), nullptr).ok());
  EXPECT_EQ(packed, Compress(x, nullptr, p).packed);
}

TEST(BlockQuant, ReportsTheFirstNonFiniteIndex) {
  std::vector<float> x = RandomVector(1000, 13, 1.0f);
  x[517] = INFINITY;
  x[900] = NAN;
  EXPECT_EQ(Compress(x, nullptr, Params(8, 64)).status.nonfinite_index, 517);
}

TEST(BlockQuant, DecompressAccumulatesAndRejectsBadMessages) {
  const std::vector<float> x = RandomVector(1000, 14, 1.0f);
  const BlockQuantParams p = Params(8, 100);
  CompressOutput out = Compress(x, nullptr, p);
  const std::vector<float> decoded = Decode(out.packed, 1000, p);
  std::vector<float> sum(1000, 1.0f);
  ASSERT_EQ(BlockQuantDecompress(out.packed.data(), out.packed.size(), 1000, p, sum.data(), true),
            "");
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(sum[i], 1.0f + decoded[i]);
  EXPECT_NE(
      BlockQuantDecompress(out.packed.data(), out.packed.size() - 1, 1000, p, sum.data(), true),
      "");
  out.packed[3] = wire::FloatBits(NAN);
  const std::vector<float> before = sum;
  EXPECT_NE(BlockQuantDecompress(out.packed.data(), out.packed.size(), 1000, p, sum.data(), true)
                .find("scale"),
            std::string::npos);
  EXPECT_EQ(sum, before) << "a bad message leaves the sum untouched";
}

}  // namespace
}  // namespace jaxcomm::kernels
