#include "kernels/reduce.h"

#include <sys/mman.h>

namespace jaxcomm::kernels {

__attribute__((target_clones("avx2", "default"))) void AddInto(float* __restrict dst,
                                                               const float* __restrict src,
                                                               int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

__attribute__((target_clones("avx2", "default"))) void Add(float* __restrict dst,
                                                           const float* __restrict a,
                                                           const float* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
}

__attribute__((target_clones("avx2", "default"))) void AddTwice(float* __restrict dst,
                                                                float* __restrict copy,
                                                                const float* __restrict a,
                                                                const float* __restrict b,
                                                                int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = copy[i] = a[i] + b[i];
}

void ScatterAdd(float* dst, const int32_t* indices, const float* values, int64_t k) {
  for (int64_t j = 0; j < k; ++j) dst[indices[j]] += values[j];
}

void AdviseHugePages(void* data, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const auto end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace jaxcomm::kernels
