// Exact magnitude top-k selection with fused error feedback.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/parallel.h"
#include "kernels/wire.h"

namespace jaxcomm::kernels {

// Orders floats by magnitude: the float's bits with the sign cleared compare like |v| for
// finite values, and put +-Inf above every finite value and NaN above Inf. Non-finite values
// therefore are always selected first and propagate to the result instead of hiding in a
// residual.
inline uint32_t MagnitudeKey(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7fffffffu;
}

// Selects the k entries of largest |acc|, acc = x + residual_in (or x when residual_in is
// null), in O(n) expected time: a sampled threshold keeps ~1.5k candidates from one pass
// over memory, then an exact selection runs over the candidates only.
//
// Ties in |acc| break toward the lower index, so the selected set is a pure function of the
// input. Output `indices` (k entries) are ascending; `values` holds acc at those indices.
// When residual_out is non-null it receives acc with the selected entries zeroed (it may alias
// residual_in), so that x + residual_in == scatter(indices, values) + residual_out exactly.
//
// Requires 1 <= k <= n < 2^31 (the caller validates).
void TopKAbs(const float* x, const float* residual_in, int64_t n, int64_t k, int32_t* indices,
             float* values, float* residual_out, const TaskRunner& run = RunTasksSerially);

}  // namespace jaxcomm::kernels
