#include "kernels/adaptive.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/tests/test_util.h"
#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

struct Result {
  std::vector<uint32_t> packed;
  std::vector<float> residual;
  int64_t bad;
};

Result Compress(const std::vector<float>& x, const std::vector<float>& r, AdaptiveLayout layout,
                int64_t sample_size, const TaskRunner& run = RunTasksSerially) {
  Result out{std::vector<uint32_t>(layout.PackedWords(), 0xdeadbeefu), std::vector<float>(x.size()),
             -1};
  out.bad = AdaptiveCompress(x.data(), r.empty() ? nullptr : r.data(), layout, sample_size,
                             out.packed.data(), out.residual.data(), run);
  return out;
}

std::vector<float> Decode(const std::vector<uint32_t>& packed, AdaptiveLayout layout) {
  std::vector<float> out(layout.n, 123.0f);
  const std::string error =
      AdaptiveDecompress(packed.data(), static_cast<int64_t>(packed.size()), layout, out.data());
  EXPECT_EQ(error, "");
  return out;
}

float MeanBits(const std::vector<uint32_t>& packed, int64_t column, bool positive) {
  return wire::BitsFloat(packed[1 + 2 * column + (positive ? 0 : 1)]);
}

// Entries of the packed buffer, split per column and sign as flat indices.
struct ColumnEntries {
  std::vector<int64_t> pos;
  std::vector<int64_t> neg;
};
std::vector<ColumnEntries> SplitEntries(const std::vector<uint32_t>& packed,
                                        const AdaptiveLayout& layout) {
  std::vector<ColumnEntries> cols(layout.NumColumns());
  for (int64_t j = layout.HeaderWords(); j < packed[0]; ++j) {
    const int64_t index = wire::EntryIndex(packed[j]);
    auto& col = cols[index / layout.column_size];
    (wire::EntryPositive(packed[j]) ? col.pos : col.neg).push_back(index);
  }
  return cols;
}

void ExpectErrorFeedback(const std::vector<float>& x, const std::vector<float>& r,
                         const Result& result, const AdaptiveLayout& layout) {
  const std::vector<float> decoded = Decode(result.packed, layout);
  for (int64_t i = 0; i < layout.n; ++i) {
    const float acc = r.empty() ? x[i] : x[i] + r[i];
    ASSERT_NEAR(decoded[i] + result.residual[i], acc, 1e-6f * (1.0f + std::fabs(acc)))
        << "at " << i;
  }
}

TEST(AdaptiveLayoutTest, MatchesPythonCapacities) {
  // Adaptive(64).capacity(1024) == 34 and packed_words in jaxcomm/algorithms/adaptive.py.
  EXPECT_EQ((AdaptiveLayout{1024, 1024, 64.0}).Capacity(), 34);
  EXPECT_EQ((AdaptiveLayout{1024, 1024, 64.0}).PackedWords(), 1 + 2 + 34);
  // 2500 = 2 full columns + a tail of 452: 2 * 34 + (2 * ceil(452 / 64) + 2 = 18).
  const AdaptiveLayout tail{2500, 1024, 64.0};
  EXPECT_EQ(tail.NumColumns(), 3);
  EXPECT_EQ(tail.ColumnLength(2), 452);
  EXPECT_EQ(tail.Capacity(), 2 * 34 + 18);
  // Small columns are capped by their length.
  EXPECT_EQ((AdaptiveLayout{7, 3, 1.0}).Capacity(), 3 + 3 + 1);
  EXPECT_EQ(AdaptiveKeep(0, 2.5), 0);
  EXPECT_EQ(AdaptiveKeep(5, 2.5), 2);
  EXPECT_EQ(AdaptiveKeep(6, 2.5), 3);
  // Zeros count toward both signs' k; a sign never sends more values than it has.
  EXPECT_EQ(AdaptiveSignKeep(5, 0, 2.5), 2);
  EXPECT_EQ(AdaptiveSignKeep(2, 98, 64.0), 2);
  EXPECT_EQ(AdaptiveSignKeep(40, 984, 64.0), 16);
  EXPECT_EQ(AdaptiveSignKeep(0, 1024, 64.0), 0);
}

TEST(AdaptiveTest, HandCheckedColumn) {
  const std::vector<float> x = {3, -1, 2, 0, -5, 4, 1, -2};
  const AdaptiveLayout layout{8, 8, 2.0};
  const Result res = Compress(x, {}, layout, 0);
  ASSERT_EQ(res.bad, -1);
  ASSERT_EQ(res.packed.size(), 1u + 2 + 8);
  // Positives 3,2,4,1 and one zero: 5 non-negative values keep min(4, ceil(5/2)) = 3: 4, 3, 2.
  // Negatives -1,-5,-2 and the zero: 4 non-positive values keep min(3, ceil(4/2)) = 2: -5, -2.
  EXPECT_EQ(res.packed[0], 8u);
  EXPECT_FLOAT_EQ(MeanBits(res.packed, 0, true), 3.0f);
  EXPECT_FLOAT_EQ(MeanBits(res.packed, 0, false), -3.5f);
  const std::vector<uint32_t> entries(res.packed.begin() + 3, res.packed.begin() + 8);
  EXPECT_EQ(entries, (std::vector<uint32_t>{wire::Entry(true, 0), wire::Entry(true, 2),
                                            wire::Entry(false, 4), wire::Entry(true, 5),
                                            wire::Entry(false, 7)}));
  for (size_t j = 8; j < res.packed.size(); ++j) EXPECT_EQ(res.packed[j], 0u);
  EXPECT_EQ(res.residual, (std::vector<float>{0, -1, -1, 0, -1.5f, 1, 1, 1.5f}));
  EXPECT_EQ(Decode(res.packed, layout), (std::vector<float>{3, 0, 3, 0, -3.5f, 3, 0, -3.5f}));
}

TEST(AdaptiveTest, TiesGoToLowerIndex) {
  const std::vector<float> x = {1, -2, 1, -2, 1, -2, 1, 0.5f};
  const Result res = Compress(x, {}, {8, 8, 2.0}, 0);
  // Positives 1,1,1,1,0.5 keep 3 -> the 1s at 0, 2, 4; negatives keep 2 of three -2s: 1, 3.
  EXPECT_EQ(res.packed[0], 1u + 2 + 5);
  const std::vector<uint32_t> entries(res.packed.begin() + 3, res.packed.begin() + 8);
  EXPECT_EQ(entries, (std::vector<uint32_t>{wire::Entry(true, 0), wire::Entry(false, 1),
                                            wire::Entry(true, 2), wire::Entry(false, 3),
                                            wire::Entry(true, 4)}));
  EXPECT_EQ(res.residual, (std::vector<float>{0, 0, 0, 0, 0, -2, 1, 0.5f}));
}

TEST(AdaptiveTest, ZerosAreNeverSent) {
  const std::vector<float> x = {0.0f, -0.0f, 0.0f, 2.0f, 0.0f};
  const std::vector<float> r = {0.0f, 0.0f, -0.0f, -2.0f, 0.0f};
  for (int64_t sample : {0, 16}) {
    const Result res = Compress(x, r, {5, 5, 1.0}, sample);
    EXPECT_EQ(res.packed[0], 3u) << sample;
    EXPECT_EQ(MeanBits(res.packed, 0, true), 0.0f);
    EXPECT_EQ(MeanBits(res.packed, 0, false), 0.0f);
    for (float v : res.residual) EXPECT_EQ(v, 0.0f);
  }
}

TEST(AdaptiveTest, ProportionOneSendsEveryNonzero) {
  const std::vector<float> x = {1.5f, -2.0f, 0.0f, 3.0f, -1.0f};
  const Result res = Compress(x, {}, {5, 2, 1.0}, 0);
  EXPECT_EQ(res.packed[0], 1u + 6 + 4);
  const std::vector<float> decoded = Decode(res.packed, {5, 2, 1.0});
  EXPECT_EQ(decoded, (std::vector<float>{1.5f, -2.0f, 0.0f, 3.0f, -1.0f}));
  for (float v : res.residual) EXPECT_EQ(v, 0.0f);
}

// Exact mode on random data: per column, the sent count of each sign is ceil(k/π), every sent
// value is at least as large in magnitude as every unsent one of its sign, and the means are
// the means of the sent values.
void CheckExactSelection(int64_t n, int64_t column_size, double proportion, uint32_t seed,
                         bool varying_scale = false) {
  SCOPED_TRACE(testing::Message() << "n=" << n << " col=" << column_size << " pi=" << proportion);
  std::vector<float> x = RandomVector(n, seed);
  std::vector<float> r = RandomVector(n, seed + 1);
  for (int64_t i = 0; i < n; i += 7) x[i] = -r[i];  // some exact zeros
  if (varying_scale) {
    // Columns alternate between tiny and huge values, so a bound learned from one column
    // never fits the next one.
    for (int64_t i = 0; i < n; ++i) {
      const float scale =
          (i / column_size) % 3 == 0 ? 1e-3f : ((i / column_size) % 3 == 1 ? 1e3f : 1.0f);
      x[i] *= scale;
      r[i] *= scale;
    }
  }
  const AdaptiveLayout layout{n, column_size, proportion};
  const Result res = Compress(x, r, layout, 0, ThreadedRunner(2));
  ASSERT_EQ(res.bad, -1);
  EXPECT_EQ(static_cast<int64_t>(res.packed[0]), AdaptiveExactUsed(layout, x.data(), r.data()));
  const auto cols = SplitEntries(res.packed, layout);
  for (int64_t c = 0; c < layout.NumColumns(); ++c) {
    const int64_t begin = layout.ColumnBegin(c);
    std::vector<float> acc(layout.ColumnLength(c));
    int64_t kp = 0, kn = 0;
    for (size_t i = 0; i < acc.size(); ++i) {
      acc[i] = x[begin + i] + r[begin + i];
      kp += acc[i] > 0;
      kn += acc[i] < 0;
    }
    const int64_t kz = static_cast<int64_t>(acc.size()) - kp - kn;
    ASSERT_EQ(static_cast<int64_t>(cols[c].pos.size()), AdaptiveSignKeep(kp, kz, proportion)) << c;
    ASSERT_EQ(static_cast<int64_t>(cols[c].neg.size()), AdaptiveSignKeep(kn, kz, proportion)) << c;
    float min_sent = std::numeric_limits<float>::infinity();
    double sum = 0;
    std::vector<bool> sent(acc.size(), false);
    for (int64_t i : cols[c].pos) {
      ASSERT_GT(acc[i - begin], 0.0f);
      min_sent = std::min(min_sent, acc[i - begin]);
      sum += acc[i - begin];
      sent[i - begin] = true;
    }
    for (size_t i = 0; i < acc.size(); ++i) {
      if (!sent[i] && acc[i] > 0) ASSERT_LE(acc[i], min_sent) << c;
    }
    if (!cols[c].pos.empty()) {
      EXPECT_FLOAT_EQ(MeanBits(res.packed, c, true), static_cast<float>(sum / cols[c].pos.size()));
    }
  }
  ExpectErrorFeedback(x, r, res, layout);
}

TEST(AdaptiveTest, ExactCountsPerColumn) {
  CheckExactSelection(1000, 1024, 64.0, 1);
  CheckExactSelection(1000, 7, 2.0, 2);
  CheckExactSelection(10007, 1000, 3.7, 3);  // tail column of 7
  CheckExactSelection(300001, 1024, 64.0, 4);
  CheckExactSelection(5000, 5000, 1000.0, 5);
  CheckExactSelection(1, 1, 1.0, 6);
  CheckExactSelection(100000, 1024, 64.0, 7, true);
  CheckExactSelection(100000, 512, 2.0, 8, true);
}

TEST(AdaptiveTest, SignOnlyColumns) {
  std::vector<float> x = RandomVector(2048, 9);
  for (int64_t i = 0; i < 1024; ++i) x[i] = std::fabs(x[i]) + 0.01f;
  for (int64_t i = 1024; i < 2048; ++i) x[i] = -std::fabs(x[i]) - 0.01f;
  const AdaptiveLayout layout{2048, 1024, 64.0};
  for (int64_t sample : {0, 256}) {
    const Result res = Compress(x, {}, layout, sample);
    const auto cols = SplitEntries(res.packed, layout);
    EXPECT_TRUE(cols[0].neg.empty());
    EXPECT_TRUE(cols[1].pos.empty());
    EXPECT_EQ(MeanBits(res.packed, 0, false), 0.0f);
    EXPECT_EQ(MeanBits(res.packed, 1, true), 0.0f);
    if (sample == 0) {
      EXPECT_EQ(cols[0].pos.size(), 16u);
      EXPECT_EQ(cols[1].neg.size(), 16u);
    } else {
      EXPECT_FALSE(cols[0].pos.empty());
      EXPECT_FALSE(cols[1].neg.empty());
    }
    ExpectErrorFeedback(x, {}, res, layout);
  }
}

// Sampled mode checked against thresholds recomputed here from wire::SamplePosition.
TEST(AdaptiveTest, SampledModeFollowsSampleThresholds) {
  const int64_t n = 5000, column_size = 1024, sample = 100;
  const double proportion = 8.0;
  const std::vector<float> x = RandomVector(n, 11);
  const AdaptiveLayout layout{n, column_size, proportion};
  const Result res = Compress(x, {}, layout, sample);
  const auto cols = SplitEntries(res.packed, layout);
  for (int64_t c = 0; c < layout.NumColumns(); ++c) {
    const int64_t begin = layout.ColumnBegin(c), len = layout.ColumnLength(c);
    std::vector<float> pos, neg;
    for (int64_t j = 0; j < sample; ++j) {
      const float a = x[begin + wire::SamplePosition(c, j, len)];
      if (a > 0) pos.push_back(a);
      if (a < 0) neg.push_back(a);
    }
    std::sort(pos.rbegin(), pos.rend());
    std::sort(neg.begin(), neg.end());
    const int64_t zeros = sample - static_cast<int64_t>(pos.size() + neg.size());
    const float tau_pos = pos[AdaptiveSignKeep(pos.size(), zeros, proportion) - 1];
    const float tau_neg = neg[AdaptiveSignKeep(neg.size(), zeros, proportion) - 1];
    std::vector<int64_t> want_pos, want_neg;
    int64_t taken = 0;
    for (int64_t i = begin; i < begin + len && taken < layout.ColumnCapacity(c); ++i) {
      if (x[i] >= tau_pos) want_pos.push_back(i), ++taken;
      if (x[i] <= tau_neg) want_neg.push_back(i), ++taken;
    }
    EXPECT_EQ(cols[c].pos, want_pos) << c;
    EXPECT_EQ(cols[c].neg, want_neg) << c;
  }
  ExpectErrorFeedback(x, {}, res, layout);
}

TEST(AdaptiveTest, SampledModeKeepsLowestIndicesWithinCapacity) {
  // All-equal columns: every value reaches the sampled threshold, capacity decides.
  const AdaptiveLayout layout{2000, 1000, 64.0};
  std::vector<float> x(2000, 0.25f);
  std::fill(x.begin() + 1000, x.end(), -0.5f);
  const Result res = Compress(x, {}, layout, 32);
  const int64_t cap = 2 * 16 + 2;
  ASSERT_EQ(res.packed[0], static_cast<uint32_t>(layout.HeaderWords() + 2 * cap));
  const auto cols = SplitEntries(res.packed, layout);
  for (int64_t j = 0; j < cap; ++j) {
    EXPECT_EQ(cols[0].pos[j], j);
    EXPECT_EQ(cols[1].neg[j], 1000 + j);
  }
  EXPECT_EQ(MeanBits(res.packed, 0, true), 0.25f);
  EXPECT_EQ(MeanBits(res.packed, 1, false), -0.5f);
  EXPECT_EQ(res.residual[cap - 1], 0.0f);
  EXPECT_EQ(res.residual[cap], 0.25f);
}

TEST(AdaptiveTest, ThreadCountIndependent) {
  const int64_t n = (1 << 20) + 77;
  const std::vector<float> x = RandomVector(n, 21);
  const std::vector<float> r = RandomVector(n, 22);
  for (int64_t sample : {0, 256}) {
    const AdaptiveLayout layout{n, 1000, 64.0};
    const Result serial = Compress(x, r, layout, sample, RunTasksSerially);
    const Result threaded = Compress(x, r, layout, sample, ThreadedRunner(4));
    EXPECT_EQ(serial.packed, threaded.packed) << sample;
    EXPECT_EQ(0, std::memcmp(serial.residual.data(), threaded.residual.data(), n * sizeof(float)));
    // residual_out aliasing residual_in gives the same bytes.
    std::vector<float> in_place = r;
    std::vector<uint32_t> packed(layout.PackedWords());
    ASSERT_EQ(-1, AdaptiveCompress(x.data(), in_place.data(), layout, sample, packed.data(),
                                   in_place.data(), ThreadedRunner(3)));
    EXPECT_EQ(packed, serial.packed);
    EXPECT_EQ(0, std::memcmp(in_place.data(), serial.residual.data(), n * sizeof(float)));
  }
}

TEST(AdaptiveTest, ReportsFirstNonFinite) {
  const int64_t n = 1 << 20;
  std::vector<float> x = RandomVector(n, 31);
  x[700000] = std::numeric_limits<float>::infinity();
  x[5000] = std::numeric_limits<float>::quiet_NaN();
  for (const TaskRunner& run : {TaskRunner(RunTasksSerially), ThreadedRunner(4)}) {
    EXPECT_EQ(Compress(x, {}, {n, 1024, 64.0}, 0, run).bad, 5000);
    EXPECT_EQ(Compress(x, {}, {n, 1024, 64.0}, 64, run).bad, 5000);
  }
  x[5000] = 1.0f;
  std::vector<float> r(n, 0.0f);
  r[3] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(Compress(x, r, {n, 1024, 64.0}, 0, ThreadedRunner(4)).bad, 3);
}

TEST(AdaptiveTest, DecompressAccumulates) {
  const std::vector<float> x = {3, -1, 2, 0, -5, 4, 1, -2};
  const AdaptiveLayout layout{8, 8, 2.0};
  const Result res = Compress(x, {}, layout, 0);
  std::vector<float> out(8, 1.0f);
  ASSERT_EQ("", AdaptiveDecompress(res.packed.data(), res.packed[0], layout, out.data(), true));
  // HandCheckedColumn's decoding (3, 0, 3, 0, -3.5, 3, 0, -3.5) added to ones.
  EXPECT_EQ(out, (std::vector<float>{4, 1, 4, 1, -2.5f, 4, 1, -2.5f}));
}

TEST(AdaptiveTest, DecompressRejectsBadMessages) {
  const std::vector<float> x = {3, -1, 2, 0, -5, 4, 1, -2};
  const AdaptiveLayout layout{8, 8, 2.0};
  const Result good = Compress(x, {}, layout, 0);
  std::vector<float> out(8, 7.0f);
  auto decode = [&](std::vector<uint32_t> packed) {
    return AdaptiveDecompress(packed.data(), static_cast<int64_t>(packed.size()), layout,
                              out.data());
  };
  auto with = [&](int64_t word, uint32_t value) {
    std::vector<uint32_t> p = good.packed;
    p[word] = value;
    return p;
  };
  EXPECT_NE(decode(with(0, 2)), "");                      // used below the header
  EXPECT_NE(decode(with(0, 100)), "");                    // used beyond the buffer
  EXPECT_NE(decode(with(4, wire::Entry(false, 8))), "");  // index out of range
  EXPECT_NE(decode(with(4, wire::Entry(false, 0))), "");  // not ascending
  EXPECT_NE(decode({1}), "");                             // shorter than the header
  for (float v : out) EXPECT_EQ(v, 7.0f);                 // nothing written on error
  // More entries in a column than its capacity (1 for a column of one element).
  const AdaptiveLayout ones{2, 1, 1.0};
  const std::vector<uint32_t> crowded = {
      7, 0, 0, 0, 0, wire::Entry(true, 0), wire::Entry(false, 0)};
  EXPECT_NE(AdaptiveDecompress(crowded.data(), 7, ones, out.data()), "");
}

}  // namespace
}  // namespace jaxcomm::kernels
