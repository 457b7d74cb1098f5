// The quantizer table (kernels/quantizer_table.h), entry by entry: what the shared code of
// kernels/quantized_slices.cc and the FFI handlers rely on of every quantizer, so that a new
// entry is checked here without a test of its own. In CUDA builds also the CUDA table
// (kernels/cuda_quantizer_table.h): lookups only, no GPU needed.
#include "kernels/quantizer_table.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "kernels/quantized_slices.h"
#include "kernels/tests/test_util.h"

#if JAXCOMM_WITH_CUDA
#include "kernels/cuda_quantizer_table.h"
#endif

namespace jaxcomm::kernels {
namespace {

// A spec every quantizer of the table accepts: each reads the fields it has (column_size 64 is a
// multiple of 32 for one-bit, a column for adaptive, a block for BlockQuant).
QuantizerSpec UsableSpec(const Quantizer& q) {
  QuantizerSpec spec;
  spec.kind = q.kind;
  spec.column_size = 64;
  spec.sample_size = 0;
  spec.proportion = 4.0;
  spec.tau = 0.5f;
  spec.max_density = 0.25;
  spec.bits = 8;
  return spec;
}

// A spec no quantizer accepts: every field any of them reads is out of its range.
QuantizerSpec UnusableSpec(const Quantizer& q) {
  QuantizerSpec spec;
  spec.kind = q.kind;
  spec.column_size = 0;
  spec.sample_size = -1;
  spec.proportion = 0.5;
  spec.tau = std::numeric_limits<float>::quiet_NaN();
  spec.max_density = 0.0;
  spec.bits = 5;
  return spec;
}

bool IsIdentifier(const std::string& name) {
  if (name.empty()) return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  return true;
}

TEST(QuantizerTable, EveryEntryIsCompleteAndFoundByItsKind) {
  ASSERT_GT(Quantizers().count, 0u);
  std::set<int64_t> kinds;
  std::set<std::string> names;
  for (const Quantizer* q : Quantizers()) {
    ASSERT_NE(q, nullptr);
    ASSERT_NE(q->name, nullptr);
    const std::string name = q->name;
    // The name is a Python module, a metrics label and a JSON key (jaxcomm_quantizers_json).
    EXPECT_TRUE(IsIdentifier(name)) << "'" << name << "' is not a lower-case identifier";
    EXPECT_TRUE(names.insert(name).second) << "two entries are named " << name;
    EXPECT_TRUE(kinds.insert(static_cast<int64_t>(q->kind)).second)
        << name << " has the kind number of another entry";
    EXPECT_GE(static_cast<int64_t>(q->kind), 0) << name;
    EXPECT_NE(q->check, nullptr) << name;
    EXPECT_NE(q->slice_unit, nullptr) << name;
    EXPECT_NE(q->packed_words, nullptr) << name;
    EXPECT_NE(q->quantize, nullptr) << name;
    EXPECT_NE(q->dequantize_accumulate, nullptr) << name;
    EXPECT_EQ(FindQuantizer(q->kind), q) << name;
  }
}

TEST(QuantizerTable, ChecksAcceptAUsableSpecAndRejectABadOne) {
  for (const Quantizer* q : Quantizers()) {
    EXPECT_EQ(q->check(UsableSpec(*q)), "") << q->name;
    EXPECT_EQ(CheckQuantizerSpec(UsableSpec(*q)), "") << q->name;
    EXPECT_NE(q->check(UnusableSpec(*q)), "") << q->name << " accepted a spec with every field bad";
    EXPECT_NE(CheckQuantizerSpec(UnusableSpec(*q)), "") << q->name;
    EXPECT_GE(SliceUnit(UsableSpec(*q)), 1) << q->name;
  }
}

TEST(QuantizerTable, AnUnknownKindIsAnErrorNotACrash) {
  // A spec whose kind was never set names no quantizer (rather than silently one of them).
  EXPECT_EQ(QuantizerSpec{}.kind, kNoQuantizerKind);
  EXPECT_EQ(FindQuantizer(kNoQuantizerKind), nullptr);
  EXPECT_NE(CheckQuantizerSpec(QuantizerSpec{}).find("unknown quantizer kind -1"),
            std::string::npos);
  QuantizerSpec spec;
  spec.kind = static_cast<QuantizerKind>(1000);
  EXPECT_EQ(FindQuantizer(spec.kind), nullptr);
  EXPECT_NE(CheckQuantizerSpec(spec).find("unknown quantizer kind 1000"), std::string::npos);
  EXPECT_EQ(SliceUnit(spec), 1);
  const uint32_t message[1] = {1u};
  std::vector<float> out(4, 0.0f), scratch;
  EXPECT_NE(DequantizeAccumulate(spec, message, 1, 4, out.data(), &scratch), "");
}

// packed_words is the capacity the collectives allocate per slice: quantize never writes beyond
// it and its header (used) stays within it; the message decodes through the table to what
// error feedback left out (x = decoded + residual up to rounding).
TEST(QuantizerTable, PackedWordsBoundQuantizeAndTheMessageRoundTrips) {
  constexpr uint32_t kGuard = 0xdeadbeefu;
  for (const Quantizer* q : Quantizers()) {
    for (int64_t bits : {8, 4}) {
      QuantizerSpec spec = UsableSpec(*q);
      spec.bits = bits;
      for (int64_t n : {1, 31, 64, 65, 1000, 4099}) {
        SCOPED_TRACE(std::string(q->name) + " bits " + std::to_string(bits) + " n " +
                     std::to_string(n));
        const int64_t words = QuantizedPackedWords(spec, n);
        ASSERT_EQ(words, q->packed_words(spec, n));
        ASSERT_GE(words, 1);
        const std::vector<float> x = RandomVector(n, static_cast<uint32_t>(n));
        std::vector<uint32_t> packed(static_cast<size_t>(words) + 8, kGuard);
        std::vector<float> residual(static_cast<size_t>(n), 0.0f);
        const QuantizeStatus status =
            QuantizeSlice(spec, x.data(), nullptr, n, packed.data(), residual.data());
        ASSERT_TRUE(status.ok());
        for (size_t i = static_cast<size_t>(words); i < packed.size(); ++i) {
          ASSERT_EQ(packed[i], kGuard) << "quantize wrote word " << i << " past packed_words";
        }
        const int64_t used = packed[0];
        ASSERT_GE(used, 1);
        ASSERT_LE(used, words);
        std::vector<float> out(static_cast<size_t>(n), 0.0f), scratch;
        ASSERT_EQ(DequantizeAccumulate(spec, packed.data(), used, n, out.data(), &scratch), "");
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_NEAR(out[i] + residual[i], x[i], 1e-5f * (1.0f + std::fabs(x[i]))) << i;
        }
      }
    }
  }
}

TEST(QuantizerTable, AnEmptySliceIsOneWordForEveryQuantizer) {
  for (const Quantizer* q : Quantizers()) {
    const QuantizerSpec spec = UsableSpec(*q);
    EXPECT_EQ(QuantizedPackedWords(spec, 0), 1) << q->name;
    uint32_t word = 0;
    EXPECT_TRUE(QuantizeSlice(spec, nullptr, nullptr, 0, &word, nullptr).ok()) << q->name;
    EXPECT_EQ(word, 1u) << q->name;
    std::vector<float> scratch;
    EXPECT_EQ(DequantizeAccumulate(spec, &word, 1, 0, nullptr, &scratch), "") << q->name;
  }
}

#if JAXCOMM_WITH_CUDA
TEST(CudaQuantizerTable, EveryQuantizerHasACompleteCudaEntry) {
  std::set<int64_t> kinds;
  for (const cuda::CudaQuantizer* c : cuda::CudaQuantizers()) {
    ASSERT_NE(c, nullptr);
    EXPECT_TRUE(kinds.insert(static_cast<int64_t>(c->kind)).second);
    EXPECT_NE(FindQuantizer(c->kind), nullptr) << "a CUDA entry without a CPU entry";
    EXPECT_NE(c->quantize_scratch_bytes, nullptr);
    EXPECT_NE(c->decode_scratch_bytes, nullptr);
    EXPECT_NE(c->quantize, nullptr);
    EXPECT_NE(c->dequantize_accumulate, nullptr);
  }
  for (const Quantizer* q : Quantizers()) {
    const cuda::CudaQuantizer* c = cuda::FindCudaQuantizer(q->kind);
    ASSERT_NE(c, nullptr) << q->name << " has no CUDA entry (kernels/cuda_quantizer_table.cu)";
    EXPECT_EQ(c->kind, q->kind);
  }
}
#endif

}  // namespace
}  // namespace jaxcomm::kernels
