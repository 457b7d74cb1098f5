#include "kernels/reduce.h"

#include <gtest/gtest.h>

#include <vector>

namespace jaxcomm::kernels {
namespace {

TEST(AddInto, AddsElementwiseIncludingTails) {
  for (int64_t n : {0, 1, 7, 8, 33, 1000}) {
    std::vector<float> dst(n), src(n);
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = static_cast<float>(i);
      src[i] = 0.5f * static_cast<float>(i) - 3.0f;
    }
    AddInto(dst.data(), src.data(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(dst[i], 1.5f * static_cast<float>(i) - 3.0f);
  }
}

TEST(Add, SumsTwoInputsIntoAThirdIncludingTails) {
  for (int64_t n : {0, 1, 7, 8, 33, 1000}) {
    std::vector<float> a(n), b(n), dst(n, -1.0f);
    for (int64_t i = 0; i < n; ++i) {
      a[i] = static_cast<float>(i);
      b[i] = 0.25f * static_cast<float>(i) + 1.0f;
    }
    Add(dst.data(), a.data(), b.data(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(dst[i], a[i] + b[i]);
  }
}

TEST(AddTwice, WritesTheSameSumToBothIncludingTails) {
  for (int64_t n : {0, 1, 7, 8, 33, 1000}) {
    std::vector<float> a(n), b(n), dst(n, -1.0f), copy(n, -2.0f);
    for (int64_t i = 0; i < n; ++i) {
      a[i] = 0.1f * static_cast<float>(i);
      b[i] = 3.0f - 0.7f * static_cast<float>(i);
    }
    AddTwice(dst.data(), copy.data(), a.data(), b.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(dst[i], a[i] + b[i]);
      EXPECT_EQ(copy[i], a[i] + b[i]);
    }
  }
}

TEST(AdviseHugePages, LeavesTheDataAsItWas) {
  std::vector<float> data(3 << 20, 2.0f);  // 12 MiB: at least one aligned 2 MiB page inside
  AdviseHugePages(data.data(), data.size() * sizeof(float));
  AdviseHugePages(data.data(), 10);  // no aligned page inside: nothing to do
  for (float v : data) ASSERT_EQ(v, 2.0f);
}

TEST(ScatterAdd, AccumulatesRepeatedIndices) {
  std::vector<float> dst(5, 1.0f);
  const std::vector<int32_t> indices = {4, 0, 4};
  const std::vector<float> values = {2.0f, -1.0f, 3.0f};
  ScatterAdd(dst.data(), indices.data(), values.data(), 3);
  EXPECT_EQ(dst, (std::vector<float>{0.0f, 1.0f, 1.0f, 1.0f, 6.0f}));
}

}  // namespace
}  // namespace jaxcomm::kernels
