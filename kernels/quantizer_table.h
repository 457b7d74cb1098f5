// The quantizers of the quantized allreduce as a plug-in table (CPU; the CUDA table is
// kernels/cuda_quantizer_table.h). Each quantizer defines one Quantizer entry beside its own
// kernels (kernels/onebit.cc, kernels/threshold.cc, ...) and declares it in its own header;
// kernels/quantizer_table.cc lists the entries. kernels/quantized_slices.cc and the FFI
// handlers dispatch through the table, and jaxcomm/_ffi.py reads every entry's name and kind
// from it, so a new quantizer is its kernels, its entry and its line in the table.
//
// Why a list rather than entries that register themselves at static initialization, as the FFI
// handlers do (ffi/registrations.h): the kernels are a static archive, and the linker only
// takes the objects of an archive that something references. A quantizer reached only through
// a self-registered entry (no FFI op of its own calls its kernels, and no GoogleTest that links
// the archive names it) would be dropped without a word and be an "unknown quantizer kind" at
// run time; making that robust takes whole-archive linking of every consumer. The list makes a
// missing entry a link error and fixes the table's order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/quantize_status.h"
#include "kernels/quantized_slices.h"

namespace jaxcomm::kernels {

// One quantizer: what kernels/quantized_slices.h needs of it. The shared functions there handle
// the empty slice (n == 0: the single word used = 1) and the checks every message gets, so the
// functions here see n >= 1 only.
struct Quantizer {
  // The number of the "quantizer" FFI attribute (QuantizerSpec::kind), declared in the
  // quantizer's own header beside the entry (kOneBitKind in kernels/onebit.h); unique in the table.
  QuantizerKind kind;
  // Its name in jaxcomm.algorithms (and its metrics label and jaxcomm.ops module), unique.
  const char* name;
  // Empty when `spec` is usable by this quantizer, else what is wrong with it.
  std::string (*check)(const QuantizerSpec& spec);
  // Slice boundaries are multiples of this many elements (its column, its block, 1).
  int64_t (*slice_unit)(const QuantizerSpec& spec);
  // Words of the packed buffer of n >= 1 elements (its static capacity; a message may use
  // fewer, as its header word says).
  int64_t (*packed_words)(const QuantizerSpec& spec, int64_t n);
  // kernels::QuantizeSlice for n >= 1 (residual_in may be null: acc = x).
  QuantizeStatus (*quantize)(const QuantizerSpec& spec, const float* x, const float* residual_in,
                             int64_t n, uint32_t* packed, float* residual_out,
                             const TaskRunner& run);
  // kernels::DequantizeAccumulate for n >= 1, called once the header says used == words and
  // words <= packed_words(spec, n): out[i] += decoded[i], or what is wrong with the message
  // (then `out` is untouched).
  std::string (*dequantize_accumulate)(const QuantizerSpec& spec, const uint32_t* packed,
                                       int64_t words, int64_t n, float* out,
                                       std::vector<float>* scratch);
};

// A quantizer table's entries (this table's, or the CUDA one's), in its order.
template <typename Entry>
struct EntryList {
  const Entry* const* first;
  size_t count;
  const Entry* const* begin() const { return first; }
  const Entry* const* end() const { return first + count; }
  // The entry of `kind`, or null when none has that number.
  const Entry* Find(QuantizerKind kind) const {
    for (const Entry* entry : *this) {
      if (entry->kind == kind) return entry;
    }
    return nullptr;
  }
};

using QuantizerList = EntryList<Quantizer>;
QuantizerList Quantizers();

// The entry of `kind`, or null when no quantizer has that number.
inline const Quantizer* FindQuantizer(QuantizerKind kind) { return Quantizers().Find(kind); }

// residual_in, or n zeros when it is null, for a quantize kernel that always reads a residual
// (one-bit, threshold): acc = x + 0.0f equals x (a -0 becomes +0, which both encode like +0).
// The zeros are the calling thread's and live until its next call.
const float* ResidualOrZeros(const float* residual_in, int64_t n);

}  // namespace jaxcomm::kernels
