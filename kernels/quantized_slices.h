// One interface over the quantizers (one-bit, threshold, adaptive, block int8/int4) for the
// quantized allreduce (Dryden et al. 2016 §3.4): slice a vector so no column straddles two slices,
// quantize a slice with error feedback, and decode a received slice into a running sum. Each
// function dispatches through the quantizer table (kernels/quantizer_table.h) on spec.kind.
//
// Slices. The vector of n elements is cut into P slices whose boundaries are multiples of
// SliceUnit(spec) (the compressor's column_size, BlockQuant's block; 1 for threshold, which has
// no columns):
// the ncols = ceil(n / unit) units are split as evenly as possible, the first ncols % P slices
// getting one more unit. A slice is quantized as a vector of its own (indices, column numbers
// and sample positions are slice-relative), so its columns are exactly the columns the whole
// vector would have, and a slice can be empty when n < P * unit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/quantize_status.h"

namespace jaxcomm::kernels {

// The kind number of an entry of the quantizer table (kernels/quantizer_table.h): what the
// "quantizer" FFI attribute carries. A strong type with no named values: each quantizer declares
// its own number in its own header, beside its table entry (kOneBitKind in kernels/onebit.h:
// `inline constexpr QuantizerKind kOneBitKind{0};`), so a new quantizer adds no line here.
// kernels/tests/quantizer_table_test.cc checks that the table's numbers are unique; Python reads
// them from the table (jaxcomm._ffi.quantizer_kinds). Nothing switches on them.
enum class QuantizerKind : int64_t {};

// The kind of a spec that names no quantizer: no entry has it, so CheckQuantizerSpec rejects it.
inline constexpr QuantizerKind kNoQuantizerKind{-1};

struct QuantizerSpec {
  // A kind of the table (kernels/quantizer_table.h), which the caller sets.
  QuantizerKind kind = kNoQuantizerKind;
  int64_t column_size = 1024;  // one-bit (multiple of 32) and adaptive (>= 1)
  int64_t sample_size = 0;     // one-bit and adaptive
  double proportion = 64.0;    // adaptive, >= 1
  float tau = 0.0f;            // threshold, finite and > 0
  double max_density = 1.0;    // threshold, in (0, 1]
  // Block quantization (kernels/blockquant.h): column_size is its block.
  int64_t bits = 8;            // 8 or 4
  bool stochastic = false;     // rounding
  bool error_feedback = true;  // false: the collectives ignore the residual and return zeros
  uint32_t seed = 0;           // the stochastic rounding's counter (BlockQuantParams)
  uint32_t step = 0;
  // Set per message by the quantized allreduce: which rank's contribution (or the owner's
  // sum) and the index of the slice's first element, so each element draws its own u.
  uint32_t stream = 0;
  int64_t first_index = 0;
  // GPU handlers: the step operand in device memory (an int32 scalar), which the CUDA kernels
  // read instead of `step` (the host never sees a traced step without synchronizing).
  const int32_t* device_step = nullptr;
};

// Empty when `spec` is usable, else what is wrong with it (for an error message).
std::string CheckQuantizerSpec(const QuantizerSpec& spec);

// Slice boundaries are multiples of this many elements.
int64_t SliceUnit(const QuantizerSpec& spec);

// [begin, end) of slice `slice` out of `parts` over n elements (see the header comment).
Range SliceRange(int64_t n, int parts, int slice, int64_t unit);

// Words of the packed buffer of n elements (what jaxcomm.ops.compress returns; 1 for n = 0:
// an empty slice travels as the single word `used = 1`).
int64_t QuantizedPackedWords(const QuantizerSpec& spec, int64_t n);

// Quantizes acc = x + residual_in (residual_in may be null: acc = x) of n >= 0 elements into
// packed (QuantizedPackedWords words) and writes residual_out = acc - decoded (may alias
// residual_in, not x). On a non-finite acc the status names its index.
QuantizeStatus QuantizeSlice(const QuantizerSpec& spec, const float* x, const float* residual_in,
                             int64_t n, uint32_t* packed, float* residual_out,
                             const TaskRunner& run = RunTasksSerially);

// out[i] += decoded[i] for the packed message of n elements, of which `words` words arrived.
// Validates the message (used, header, indices) before touching `out` and returns an empty
// string, or what is wrong with it. `scratch` is reused across calls (one-bit decodes densely).
std::string DequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed, int64_t words,
                                 int64_t n, float* out, std::vector<float>* scratch);

}  // namespace jaxcomm::kernels
