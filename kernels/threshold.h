// Threshold quantization (Strom 2015; Dryden et al. 2016 §3.2) with fused error feedback.
//
// Packed layout (jaxcomm/ops/compress.py, Threshold), capacity = packed words - 1:
//   [used = 1 + m] [m entries, ascending index] [zeros up to 1 + capacity]
// entry = sign << 31 | index; sign 1 encodes acc > tau (decodes to +tau), sign 0 encodes
// acc < -tau (decodes to -tau). Entries with |acc| <= tau are not sent. When more than
// `capacity` entries pass, the lowest indices are sent and the others stay whole in the residual.
#pragma once

#include <cstdint>

#include "kernels/parallel.h"
#include "kernels/quantize_status.h"
#include "kernels/quantized_slices.h"

namespace jaxcomm::kernels {

struct ThresholdParams {
  float tau = 0.0f;      // finite, > 0
  int64_t capacity = 1;  // entries the packed buffer holds, 1 <= capacity <= n
};

// Quantizes acc = x + residual_in into `packed` (1 + capacity words; word 0 = 1 + m) and writes
// residual_out = acc - decoded(acc): acc -/+ tau for sent entries, acc itself for the rest.
// residual_out may alias residual_in.
//
// Two passes over index ranges run in parallel: the first writes acc to residual_out and counts
// the entries of each 64-element block; the second revisits only blocks with entries and
// writes them at the range's prefix offset (no per-entry allocation, so high densities stay
// cheap). The split depends on n only, so the bytes never depend on the runner. On a
// non-finite acc the status names its flat index; packed and residual_out are then
// unspecified. Requires 1 <= n < 2^31 (the caller validates).
QuantizeStatus ThresholdCompress(const float* x, const float* residual_in, int64_t n,
                                 const ThresholdParams& params, uint32_t* packed,
                                 float* residual_out, const TaskRunner& run = RunTasksSerially);

// Decodes `words` packed words (the caller checked 1 <= packed[0] <= words) into n floats.
// Returns -1, or the position (in entries, from 0) of the first entry whose index is >= n or
// not above the previous one; x_hat is then unspecified.
int64_t ThresholdDecompress(const uint32_t* packed, int64_t n, float tau, float* x_hat);

// Threshold's kind number in the quantized allreduce's table (kernels/quantizer_table.h): what
// the "quantizer" FFI attribute carries for it. Its entries (CPU and CUDA) take it from here; no
// other quantizer may have it (kernels/tests/quantizer_table_test.cc checks).
inline constexpr QuantizerKind kThresholdKind{1};

// Threshold's entry of the quantized allreduce's table (kernels/quantizer_table.h).
struct Quantizer;
extern const Quantizer kThresholdQuantizer;

}  // namespace jaxcomm::kernels
