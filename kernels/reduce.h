// Local reductions the collectives apply to received data.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jaxcomm::kernels {

// dst[i] += src[i] for i < n.
void AddInto(float* dst, const float* src, int64_t n);

// dst[i] = a[i] + b[i] for i < n, in one pass (no buffer may overlap another: AddInto covers
// dst == a).
void Add(float* dst, const float* a, const float* b, int64_t n);

// dst[i] = copy[i] = a[i] + b[i] for i < n, in one pass: a sum that must land in two places
// (the shared staging area peers read and this rank's output) without reading it back. No
// buffer may overlap another.
void AddTwice(float* dst, float* copy, const float* a, const float* b, int64_t n);

// dst[indices[j]] += values[j] for j < k (indices in [0, n), as validated by the caller).
void ScatterAdd(float* dst, const int32_t* indices, const float* values, int64_t k);

// Asks the kernel for transparent huge pages behind the 2 MiB-aligned interior of
// [data, data + bytes) (madvise MADV_HUGEPAGE). A collective's output is usually fresh memory
// that XLA just mapped: writing it first-touches one 4 KiB page at a time, several times
// slower than with huge pages. Only a hint: memory already mapped stays as it is, and
// failures are ignored.
void AdviseHugePages(void* data, size_t bytes);

}  // namespace jaxcomm::kernels
