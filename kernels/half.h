// 16-bit floating-point formats on the wire: bfloat16 and IEEE half, stored as uint16_t words.
//
// The dense allreduce of bf16/f16 arrays sends 2 bytes per element but adds in float32:
// contributions are widened, summed in float32 and rounded once (round to nearest even), so
// the only rounding of a sum is the final one (see ffi/allreduce_half.cc).
#pragma once

#include <cstdint>

namespace jaxcomm::kernels {

enum class HalfFormat { kBFloat16, kFloat16 };

// out[i] = float(in[i]).
void HalfToFloat(HalfFormat format, const uint16_t* in, float* out, int64_t n);

// acc[i] += float(in[i]).
void AddHalfInto(HalfFormat format, float* acc, const uint16_t* in, int64_t n);

// out[i] = in[i] rounded to nearest even (NaN stays NaN, overflow becomes +-Inf).
void FloatToHalf(HalfFormat format, const float* in, uint16_t* out, int64_t n);

}  // namespace jaxcomm::kernels
