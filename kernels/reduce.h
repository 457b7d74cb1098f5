// Local reductions the collectives apply to received data.
#pragma once

#include <cstdint>

namespace jaxcomm::kernels {

// dst[i] += src[i] for i < n.
void AddInto(float* dst, const float* src, int64_t n);

// dst[indices[j]] += values[j] for j < k (indices in [0, n), as validated by the caller).
void ScatterAdd(float* dst, const int32_t* indices, const float* values, int64_t k);

}  // namespace jaxcomm::kernels
