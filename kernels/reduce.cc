#include "kernels/reduce.h"

namespace jaxcomm::kernels {

__attribute__((target_clones("avx2", "default"))) void AddInto(float* __restrict dst,
                                                               const float* __restrict src,
                                                               int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void ScatterAdd(float* dst, const int32_t* indices, const float* values, int64_t k) {
  for (int64_t j = 0; j < k; ++j) dst[indices[j]] += values[j];
}

}  // namespace jaxcomm::kernels
