// One-bit quantization (Seide et al.; Dryden et al. 2016 §3.1) with fused error feedback.
//
// Packed layout (jaxcomm/ops/compress.py, OneBit), ncols = ceil(n / column_size):
//   [used = 1 + 2*ncols + ceil(n/32)] [ncols x (mean_nonneg f32 bits, mean_neg f32 bits)] [bits]
// Bit i % 32 of bit word i / 32 is 1 when acc[i] >= 0 (decodes to its column's mean_nonneg),
// 0 otherwise (decodes to mean_neg). Columns are column_size consecutive flat elements; the
// last one may be shorter. column_size is a multiple of 32, so columns start on a bit word.
//
// Means:
// - sample_size == 0: exact means over the whole column, summed in double (the summation order
//   is fixed by the kernel, never by the thread count).
// - sample_size > 0: means over acc at wire::SamplePosition(column, j, length) for
//   j = 0 .. sample_size - 1 (with replacement, even when sample_size >= length), so every rank
//   and the NumPy reference draw the same sample.
// - A sign with no values (in the column, or in its sample) has mean 0.0: its elements, if
//   any, decode to 0 and stay whole in the residual, where error feedback sends them later.
#pragma once

#include <cstdint>

#include "kernels/parallel.h"
#include "kernels/quantize_status.h"
#include "kernels/quantized_slices.h"

namespace jaxcomm::kernels {

struct OneBitParams {
  int64_t column_size = 1024;  // positive multiple of 32
  int64_t sample_size = 0;     // 0 = exact means
};

int64_t OneBitNumColumns(int64_t n, int64_t column_size);

// Length in uint32 words of the packed buffer for n elements (also the value of word 0).
int64_t OneBitPackedWords(int64_t n, int64_t column_size);

// Quantizes acc = x + residual_in into `packed` (OneBitPackedWords words) and writes
// residual_out = acc - decoded(acc), computed from the very float acc that was encoded, so
// acc == decoded + residual_out up to one rounding. residual_out may alias residual_in.
//
// On a non-finite acc the status names its flat index; packed and residual_out are then
// unspecified. Requires 1 <= n < 2^31 and valid params (the caller validates).
QuantizeStatus OneBitCompress(const float* x, const float* residual_in, int64_t n,
                              const OneBitParams& params, uint32_t* packed, float* residual_out,
                              const TaskRunner& run = RunTasksSerially);

// Decodes a packed buffer of n elements into x_hat. The caller checks the buffer's length
// and header (packed[0] == OneBitPackedWords); any bit pattern then decodes safely.
void OneBitDecompress(const uint32_t* packed, int64_t n, const OneBitParams& params, float* x_hat,
                      const TaskRunner& run = RunTasksSerially);

// One-bit's kind number in the quantized allreduce's table (kernels/quantizer_table.h): what
// the "quantizer" FFI attribute carries for it. Its entries (CPU and CUDA) take it from here; no
// other quantizer may have it (kernels/tests/quantizer_table_test.cc checks).
inline constexpr QuantizerKind kOneBitKind{0};

// One-bit's entry of the quantized allreduce's table (kernels/quantizer_table.h).
struct Quantizer;
extern const Quantizer kOneBitQuantizer;

}  // namespace jaxcomm::kernels
