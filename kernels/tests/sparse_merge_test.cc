#include "kernels/sparse_merge.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "kernels/topk.h"

namespace jaxcomm::kernels {
namespace {

struct Sparse {
  std::vector<int32_t> idx;
  std::vector<float> val;
};

struct Merged {
  SparseMergeStatus status;
  Sparse out;
};

Merged Merge(const Sparse& a, const Sparse& b, int64_t k) {
  Merged r;
  r.out.idx.assign(std::max<int64_t>(k, 0), -7);
  r.out.val.assign(std::max<int64_t>(k, 0), -7.0f);
  r.status = SparseMergeTopK(a.idx.data(), a.val.data(), static_cast<int64_t>(a.idx.size()),
                             b.idx.data(), b.val.data(), static_cast<int64_t>(b.idx.size()), k,
                             r.out.idx.data(), r.out.val.data());
  return r;
}

// Definition 1 of the paper, densely: scatter-add both inputs, rank every index of the union
// by (|sum| descending, index ascending), keep k, report them in index order.
Sparse Reference(const Sparse& a, const Sparse& b, int64_t k) {
  std::map<int32_t, float> sum;
  for (size_t p = 0; p < a.idx.size(); ++p) sum[a.idx[p]] = a.val[p];
  for (size_t p = 0; p < b.idx.size(); ++p) {
    auto it = sum.find(b.idx[p]);
    if (it == sum.end()) {
      sum[b.idx[p]] = b.val[p];
    } else {
      it->second = it->second + b.val[p];
    }
  }
  std::vector<std::pair<int32_t, float>> entries(sum.begin(), sum.end());
  std::stable_sort(entries.begin(), entries.end(), [](const auto& x, const auto& y) {
    return MagnitudeKey(x.second) > MagnitudeKey(y.second);
  });
  entries.resize(k);
  std::sort(entries.begin(), entries.end());
  Sparse r;
  for (const auto& [i, v] : entries) {
    r.idx.push_back(i);
    r.val.push_back(v);
  }
  return r;
}

void ExpectSparseEq(const Sparse& got, const Sparse& want) {
  ASSERT_EQ(got.idx, want.idx);
  ASSERT_EQ(got.val.size(), want.val.size());
  for (size_t p = 0; p < want.val.size(); ++p) {
    // Bitwise: the sum is a single float addition on both sides.
    EXPECT_EQ(MagnitudeKey(got.val[p]), MagnitudeKey(want.val[p])) << "position " << p;
    if (!std::isnan(want.val[p])) EXPECT_EQ(got.val[p], want.val[p]) << "position " << p;
  }
}

void ExpectMerge(const Sparse& a, const Sparse& b, int64_t k, const Sparse& want) {
  const Merged r = Merge(a, b, k);
  ASSERT_TRUE(r.status.ok()) << r.status.message;
  ExpectSparseEq(r.out, want);
  ExpectSparseEq(r.out, Reference(a, b, k));
}

TEST(SparseMerge, DisjointSets) {
  const Sparse a{{1, 5, 9}, {3.0f, -1.0f, 0.5f}};
  const Sparse b{{0, 4, 10}, {-2.0f, 4.0f, 0.25f}};
  // Nothing coincides: the top 3 of the six values by magnitude.
  ExpectMerge(a, b, 3, Sparse{{0, 1, 4}, {-2.0f, 3.0f, 4.0f}});
}

TEST(SparseMerge, FullOverlapSumsValues) {
  const Sparse a{{2, 3, 7}, {1.0f, -2.0f, 0.5f}};
  const Sparse b{{2, 3, 7}, {1.0f, 0.5f, 4.0f}};
  // Sums: 2 -> 2, 3 -> -1.5, 7 -> 4.5.
  ExpectMerge(a, b, 2, Sparse{{2, 7}, {2.0f, 4.5f}});
  ExpectMerge(a, b, 3, Sparse{{2, 3, 7}, {2.0f, -1.5f, 4.5f}});
}

TEST(SparseMerge, CancellationDropsTheEntry) {
  const Sparse a{{1, 3}, {2.0f, 5.0f}};
  const Sparse b{{1, 3, 8}, {-2.0f, 1.0f, 0.125f}};
  // Index 1 cancels to exactly 0 and ranks below the small but non-zero entry at 8.
  ExpectMerge(a, b, 2, Sparse{{3, 8}, {6.0f, 0.125f}});
}

TEST(SparseMerge, CancelledEntriesFillKWhenNothingElseIsLeft) {
  const Sparse a{{0, 5, 6}, {1.0f, -1.0f, 3.0f}};
  const Sparse b{{0, 5, 6}, {-1.0f, 1.0f, -3.0f}};
  // Everything cancels: exactly k entries still come back, zeros, lowest indices first.
  ExpectMerge(a, b, 2, Sparse{{0, 5}, {0.0f, 0.0f}});
}

TEST(SparseMerge, TiesBreakTowardTheLowerIndex) {
  const Sparse a{{2, 4, 6}, {1.0f, -1.0f, 1.0f}};
  const Sparse b{{1, 9}, {-1.0f, 1.0f}};
  ExpectMerge(a, b, 2, Sparse{{1, 2}, {-1.0f, 1.0f}});
  ExpectMerge(a, b, 3, Sparse{{1, 2, 4}, {-1.0f, 1.0f, -1.0f}});
  // A larger entry beyond the ties is taken first; the remaining slot goes to index 1.
  const Sparse c{{20}, {-8.0f}};
  ExpectMerge(a, c, 2, Sparse{{2, 20}, {1.0f, -8.0f}});
}

TEST(SparseMerge, KEqualsOne) {
  const Sparse a{{0, 1, 2}, {1.0f, 2.0f, 3.0f}};
  const Sparse b{{1, 4}, {2.5f, -3.0f}};
  ExpectMerge(a, b, 1, Sparse{{1}, {4.5f}});
}

TEST(SparseMerge, KEqualsMaxOfSizes) {
  const Sparse a{{0, 1, 2, 3}, {1.0f, 2.0f, 3.0f, 4.0f}};
  const Sparse b{{3, 9}, {-10.0f, 2.5f}};
  ExpectMerge(a, b, 4, Sparse{{1, 2, 3, 9}, {2.0f, 3.0f, -6.0f, 2.5f}});
}

TEST(SparseMerge, UnequalSizesEitherWay) {
  const Sparse small{{5}, {-9.0f}};
  const Sparse large{{0, 5, 10, 15, 20}, {1.0f, 2.0f, 3.0f, 4.0f, 5.0f}};
  ExpectMerge(small, large, 3, Sparse{{5, 15, 20}, {-7.0f, 4.0f, 5.0f}});
  ExpectMerge(large, small, 3, Sparse{{5, 15, 20}, {-7.0f, 4.0f, 5.0f}});
}

TEST(SparseMerge, OneEmptyInput) {
  const Sparse empty;
  const Sparse b{{3, 4, 8}, {1.0f, -5.0f, 2.0f}};
  ExpectMerge(empty, b, 3, b);
  ExpectMerge(b, empty, 2, Sparse{{4, 8}, {-5.0f, 2.0f}});
}

TEST(SparseMerge, NonFiniteRankLikeTopK) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Sparse a{{0, 1, 2}, {1e30f, -inf, 3.0f}};
  const Sparse b{{2, 3}, {nan, 2.0f}};
  // NaN (index 2) > Inf (index 1) > 1e30 (index 0) > 2.
  ExpectMerge(a, b, 2, Sparse{{1, 2}, {-inf, nan}});
  ExpectMerge(a, b, 3, Sparse{{0, 1, 2}, {1e30f, -inf, nan}});
}

TEST(SparseMerge, OutputMayAliasAnInput) {
  Sparse a{{1, 4, 6, 9}, {1.0f, -4.0f, 2.0f, 0.5f}};
  const Sparse b{{0, 6, 9}, {3.0f, 2.0f, -8.0f}};
  const Sparse want = Reference(a, b, 4);
  const SparseMergeStatus status = SparseMergeTopK(a.idx.data(), a.val.data(), 4, b.idx.data(),
                                                   b.val.data(), 3, 4, a.idx.data(), a.val.data());
  ASSERT_TRUE(status.ok()) << status.message;
  ExpectSparseEq(a, want);
}

TEST(SparseMerge, CallerScratchIsReusedAcrossRounds) {
  // A gTop-k style chain: fold 8 random sparse sets into one, on one scratch.
  const int64_t k = 64;
  std::mt19937 rng(3);
  std::vector<int32_t> s_idx(2 * k);
  std::vector<float> s_val(2 * k);
  std::vector<uint32_t> s_key(2 * k);
  const SparseMergeScratch scratch{s_idx.data(), s_val.data(), s_key.data(), 2 * k};
  auto random_set = [&] {
    std::vector<int32_t> pool(500);
    for (int32_t p = 0; p < 500; ++p) pool[p] = p;
    std::shuffle(pool.begin(), pool.end(), rng);
    pool.resize(k);
    std::sort(pool.begin(), pool.end());
    std::normal_distribution<float> normal;
    Sparse s{pool, {}};
    for (int64_t p = 0; p < k; ++p) s.val.push_back(normal(rng));
    return s;
  };
  Sparse acc = random_set();
  for (int round = 0; round < 7; ++round) {
    const Sparse next = random_set();
    const Sparse want = Reference(acc, next, k);
    Sparse got{std::vector<int32_t>(k), std::vector<float>(k)};
    const SparseMergeStatus status =
        SparseMergeTopK(acc.idx.data(), acc.val.data(), k, next.idx.data(), next.val.data(), k, k,
                        got.idx.data(), got.val.data(), scratch);
    ASSERT_TRUE(status.ok()) << status.message;
    ExpectSparseEq(got, want);
    acc = got;
  }
}

TEST(SparseMerge, RejectsUnsortedInput) {
  const Sparse a{{1, 5, 3}, {1.0f, 1.0f, 1.0f}};
  const Sparse b{{0}, {1.0f}};
  const Merged r = Merge(a, b, 2);
  EXPECT_EQ(r.status.code, SparseMergeStatus::Code::kNotAscending);
  EXPECT_EQ(r.status.input, 'a');
  EXPECT_EQ(r.status.position, 2);
  EXPECT_NE(r.status.message.find("idx_a is not strictly ascending at position 2"),
            std::string::npos)
      << r.status.message;
  // Nothing was written.
  EXPECT_EQ(r.out.idx, std::vector<int32_t>(2, -7));
}

TEST(SparseMerge, RejectsDuplicateIndex) {
  const Sparse a{{0, 1}, {1.0f, 1.0f}};
  const Sparse b{{2, 4, 4, 8}, {1.0f, 1.0f, 1.0f, 1.0f}};
  const Merged r = Merge(a, b, 2);
  EXPECT_EQ(r.status.code, SparseMergeStatus::Code::kNotAscending);
  EXPECT_EQ(r.status.input, 'b');
  EXPECT_EQ(r.status.position, 2);
}

TEST(SparseMerge, RejectsNegativeIndex) {
  const Sparse a{{0, 1}, {1.0f, 1.0f}};
  const Sparse b{{-3, 4}, {1.0f, 1.0f}};
  const Merged r = Merge(a, b, 1);
  EXPECT_EQ(r.status.code, SparseMergeStatus::Code::kNegativeIndex);
  EXPECT_EQ(r.status.input, 'b');
  EXPECT_EQ(r.status.position, 0);
  EXPECT_NE(r.status.message.find("idx_b[0] = -3"), std::string::npos) << r.status.message;
}

TEST(SparseMerge, RejectsKOutOfRange) {
  const Sparse a{{0, 1}, {1.0f, 1.0f}};
  const Sparse b{{0, 1, 2}, {1.0f, 1.0f, 1.0f}};
  EXPECT_EQ(Merge(a, b, 0).status.code, SparseMergeStatus::Code::kBadK);
  EXPECT_EQ(Merge(a, b, 4).status.code, SparseMergeStatus::Code::kBadK);
  EXPECT_TRUE(Merge(a, b, 3).status.ok());
  EXPECT_EQ(Merge(Sparse{}, Sparse{}, 1).status.code, SparseMergeStatus::Code::kBadK);
}

TEST(SparseMerge, RejectsSmallScratch) {
  const Sparse a{{0, 1}, {1.0f, 1.0f}};
  std::vector<int32_t> s_idx(3), out_idx(2);
  std::vector<float> s_val(3), out_val(2);
  std::vector<uint32_t> s_key(3);
  const SparseMergeScratch scratch{s_idx.data(), s_val.data(), s_key.data(), 3};
  const SparseMergeStatus status =
      SparseMergeTopK(a.idx.data(), a.val.data(), 2, a.idx.data(), a.val.data(), 2, 2,
                      out_idx.data(), out_val.data(), scratch);
  EXPECT_EQ(status.code, SparseMergeStatus::Code::kScratchTooSmall);
}

// Random sets over a small index range (many coincidences), with values drawn from a small
// set (many exact ties and cancellations), against the dense reference.
TEST(SparseMerge, RandomMatchesDenseReference) {
  std::mt19937 rng(12345);
  const float levels[] = {-2.0f, -1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 2.0f, 3.0f};
  for (int trial = 0; trial < 600; ++trial) {
    const int32_t range = 1 + static_cast<int32_t>(rng() % 300);
    auto random_set = [&](int64_t size) {
      std::vector<int32_t> pool(range);
      for (int32_t p = 0; p < range; ++p) pool[p] = p * 3 + 1;  // sparse, non-zero start
      std::shuffle(pool.begin(), pool.end(), rng);
      pool.resize(size);
      std::sort(pool.begin(), pool.end());
      Sparse s{pool, {}};
      const bool discrete = trial % 2 == 0;
      std::normal_distribution<float> normal;
      for (int64_t p = 0; p < size; ++p) {
        s.val.push_back(discrete ? levels[rng() % 8] : normal(rng));
      }
      return s;
    };
    const Sparse a = random_set(rng() % (range + 1));
    const Sparse b = random_set(rng() % (range + 1));
    const int64_t max_k = static_cast<int64_t>(std::max(a.idx.size(), b.idx.size()));
    if (max_k == 0) continue;
    const int64_t k = 1 + static_cast<int64_t>(rng() % max_k);
    const Merged r = Merge(a, b, k);
    ASSERT_TRUE(r.status.ok()) << r.status.message;
    SCOPED_TRACE("trial " + std::to_string(trial) + " k " + std::to_string(k));
    ExpectSparseEq(r.out, Reference(a, b, k));
  }
}

}  // namespace
}  // namespace jaxcomm::kernels
