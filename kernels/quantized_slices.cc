#include "kernels/quantized_slices.h"

#include <algorithm>
#include <string>

#include "kernels/quantizer_table.h"
#include "kernels/wire.h"

// Every quantizer-specific step goes through the quantizer's entry (kernels/quantizer_table.h);
// what is left here is what all of them share: slicing, the empty slice and the checks of a
// message's header.
namespace jaxcomm::kernels {
namespace {

std::string UnknownKind(const QuantizerSpec& spec) {
  return "unknown quantizer kind " + std::to_string(static_cast<int64_t>(spec.kind));
}

}  // namespace

std::string CheckQuantizerSpec(const QuantizerSpec& spec) {
  const Quantizer* q = FindQuantizer(spec.kind);
  return q == nullptr ? UnknownKind(spec) : q->check(spec);
}

int64_t SliceUnit(const QuantizerSpec& spec) {
  // 1 for an unknown kind (which CheckQuantizerSpec rejects): never a zero divisor.
  const Quantizer* q = FindQuantizer(spec.kind);
  return q == nullptr ? 1 : q->slice_unit(spec);
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
  const Quantizer* q = FindQuantizer(spec.kind);
  return q == nullptr ? 0 : q->packed_words(spec, n);
}

QuantizeStatus QuantizeSlice(const QuantizerSpec& spec, const float* x, const float* residual_in,
                             int64_t n, uint32_t* packed, float* residual_out,
                             const TaskRunner& run) {
  if (n == 0) {
    packed[0] = static_cast<uint32_t>(wire::kHeaderWords);
    return QuantizeStatus{};
  }
  const Quantizer* q = FindQuantizer(spec.kind);
  if (q == nullptr) return QuantizeStatus{};  // CheckQuantizerSpec rejects the spec first
  return q->quantize(spec, x, residual_in, n, packed, residual_out, run);
}

std::string DequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed, int64_t words,
                                 int64_t n, float* out, std::vector<float>* scratch) {
  const Quantizer* q = FindQuantizer(spec.kind);
  if (q == nullptr) return UnknownKind(spec);
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
  return q->dequantize_accumulate(spec, packed, words, n, out, scratch);
}

}  // namespace jaxcomm::kernels
