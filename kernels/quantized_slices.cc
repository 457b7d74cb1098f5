#include "kernels/quantized_slices.h"

#include <algorithm>
#include <cmath>

#include "kernels/adaptive.h"
#include "kernels/blockquant.h"
#include "kernels/onebit.h"
#include "kernels/reduce.h"
#include "kernels/threshold.h"
#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

// Same expression as Threshold.capacity in jaxcomm/compressors.py.
int64_t ThresholdCapacity(double max_density, int64_t n) {
  return std::min<int64_t>(n,
                           std::max<int64_t>(1, static_cast<int64_t>(std::ceil(max_density * n))));
}

BlockQuantParams BlockParams(const QuantizerSpec& spec) {
  BlockQuantParams p;
  p.block = spec.column_size;
  p.bits = spec.bits;
  p.stochastic = spec.stochastic;
  p.seed = spec.seed;
  p.step = spec.step;
  p.stream = spec.stream;
  p.first_index = spec.first_index;
  return p;
}

}  // namespace

std::string CheckQuantizerSpec(const QuantizerSpec& spec) {
  switch (spec.kind) {
    case QuantizerKind::kOneBit:
      if (spec.column_size < 32 || spec.column_size % 32 != 0) {
        return "OneBit column_size must be a positive multiple of 32, got " +
               std::to_string(spec.column_size);
      }
      if (spec.sample_size < 0) return "sample_size must be >= 0";
      return "";
    case QuantizerKind::kThreshold:
      if (!std::isfinite(spec.tau) || spec.tau <= 0.0f) {
        return "Threshold tau must be finite and > 0, got " + std::to_string(spec.tau);
      }
      if (!(spec.max_density > 0.0 && spec.max_density <= 1.0)) {
        return "Threshold max_density must be in (0, 1], got " + std::to_string(spec.max_density);
      }
      return "";
    case QuantizerKind::kAdaptive:
      if (!std::isfinite(spec.proportion) || spec.proportion < 1.0) {
        return "Adaptive proportion must be finite and >= 1, got " +
               std::to_string(spec.proportion);
      }
      if (spec.column_size < 1) return "Adaptive column_size must be >= 1";
      if (spec.sample_size < 0) return "sample_size must be >= 0";
      return "";
    case QuantizerKind::kBlockQuant:
      return CheckBlockQuantParams(BlockParams(spec));
  }
  return "unknown quantizer kind " + std::to_string(static_cast<int64_t>(spec.kind));
}

int64_t SliceUnit(const QuantizerSpec& spec) {
  return spec.kind == QuantizerKind::kThreshold ? 1 : spec.column_size;
}

Range SliceRange(int64_t n, int parts, int slice, int64_t unit) {
  const int64_t units = (n + unit - 1) / unit;
  auto unit_begin = [&](int64_t s) {
    return s * (units / parts) + std::min<int64_t>(s, units % parts);
  };
  return {std::min(n, unit_begin(slice) * unit), std::min(n, unit_begin(slice + 1) * unit)};
}

int64_t QuantizedPackedWords(const QuantizerSpec& spec, int64_t n) {
  if (n == 0) return wire::kHeaderWords;
  switch (spec.kind) {
    case QuantizerKind::kOneBit:
      return OneBitPackedWords(n, spec.column_size);
    case QuantizerKind::kThreshold:
      return wire::kHeaderWords + ThresholdCapacity(spec.max_density, n);
    case QuantizerKind::kAdaptive:
      return AdaptiveLayout{n, spec.column_size, spec.proportion}.PackedWords();
    case QuantizerKind::kBlockQuant:
      return BlockQuantPackedWords(n, spec.column_size, spec.bits);
  }
  return 0;
}

QuantizeStatus QuantizeSlice(const QuantizerSpec& spec, const float* x, const float* residual_in,
                             int64_t n, uint32_t* packed, float* residual_out,
                             const TaskRunner& run) {
  QuantizeStatus status;
  if (n == 0) {
    packed[0] = static_cast<uint32_t>(wire::kHeaderWords);
    return status;
  }
  switch (spec.kind) {
    case QuantizerKind::kOneBit:
    case QuantizerKind::kThreshold: {
      // These two kernels always read a residual; acc = x + 0.0f equals x (a -0 becomes +0,
      // which both encode like +0), so a zero residual stands in for "none".
      thread_local std::vector<float> zeros;
      if (residual_in == nullptr) {
        zeros.assign(static_cast<size_t>(n), 0.0f);
        residual_in = zeros.data();
      }
      if (spec.kind == QuantizerKind::kOneBit) {
        return OneBitCompress(x, residual_in, n, OneBitParams{spec.column_size, spec.sample_size},
                              packed, residual_out, run);
      }
      return ThresholdCompress(x, residual_in, n,
                               ThresholdParams{spec.tau, ThresholdCapacity(spec.max_density, n)},
                               packed, residual_out, run);
    }
    case QuantizerKind::kAdaptive:
      status.nonfinite_index =
          AdaptiveCompress(x, residual_in, AdaptiveLayout{n, spec.column_size, spec.proportion},
                           spec.sample_size, packed, residual_out, run);
      return status;
    case QuantizerKind::kBlockQuant:
      return BlockQuantCompress(x, residual_in, n, BlockParams(spec), packed, residual_out, run);
  }
  return status;
}

std::string DequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed, int64_t words,
                                 int64_t n, float* out, std::vector<float>* scratch) {
  if (words < 1) return "an empty message (no header word)";
  const int64_t used = packed[0];
  if (used != words) {
    return "the message has " + std::to_string(words) + " words but its header says " +
           std::to_string(used);
  }
  const int64_t capacity = QuantizedPackedWords(spec, n);
  if (used > capacity) {
    return "the message has " + std::to_string(used) + " words, more than the " +
           std::to_string(capacity) + " of a slice of " + std::to_string(n) + " elements";
  }
  if (n == 0) return used == 1 ? "" : "a message for an empty slice must be one word";
  switch (spec.kind) {
    case QuantizerKind::kOneBit: {
      if (used != capacity)
        return "a one-bit message must be exactly " + std::to_string(capacity) + " words";
      scratch->resize(static_cast<size_t>(n));
      OneBitDecompress(packed, n, OneBitParams{spec.column_size, spec.sample_size},
                       scratch->data());
      AddInto(out, scratch->data(), n);
      return "";
    }
    case QuantizerKind::kThreshold: {
      // Sparse: check every entry first so a bad message leaves the partial sum untouched.
      const uint32_t* entries = packed + wire::kHeaderWords;
      const int64_t m = used - wire::kHeaderWords;
      int64_t previous = -1;
      for (int64_t j = 0; j < m; ++j) {
        const int64_t index = wire::EntryIndex(entries[j]);
        if (index >= n || index <= previous) {
          return "entry " + std::to_string(j) + " has index " + std::to_string(index) +
                 " (out of range or not ascending)";
        }
        previous = index;
      }
      for (int64_t j = 0; j < m; ++j) {
        out[wire::EntryIndex(entries[j])] += wire::EntryPositive(entries[j]) ? spec.tau : -spec.tau;
      }
      return "";
    }
    case QuantizerKind::kAdaptive:
      return AdaptiveDecompress(packed, words, AdaptiveLayout{n, spec.column_size, spec.proportion},
                                out, /*accumulate=*/true);
    case QuantizerKind::kBlockQuant:
      return BlockQuantDecompress(packed, words, n, BlockParams(spec), out, /*accumulate=*/true);
  }
  return "unknown quantizer kind";
}

}  // namespace jaxcomm::kernels
