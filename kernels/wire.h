// The packed wire format shared by every compressor (documented in jaxcomm/ops/compress.py).
//
// A packed buffer is an array of uint32 words. Word 0 holds `used`, the number of meaningful
// words including word 0; collectives send words [0, used). Floats travel as their bits.
#pragma once

#include <cstdint>
#include <cstring>

// The encodings below that need no std::memcpy are compiled for the GPU too (under nvcc), so the
// CUDA kernels draw the same samples and write the same entries as the CPU ones.
#if defined(__CUDACC__)
#define JAXCOMM_HOST_DEVICE __host__ __device__
#else
#define JAXCOMM_HOST_DEVICE
#endif

namespace jaxcomm::kernels::wire {

constexpr int64_t kHeaderWords = 1;
constexpr uint32_t kSignBit = 0x80000000u;
constexpr uint32_t kIndexMask = 0x7fffffffu;
// The most elements a kernel takes: indices travel in 31 bits (wire entries, int32 top-k
// indices), so n <= 2**31 - 1.
constexpr int64_t kMaxElements = int64_t{kIndexMask};

inline uint32_t FloatBits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}

inline float BitsFloat(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Sparse quantized entry: 1 sign bit (1 = positive reconstruction) + 31 index bits.
JAXCOMM_HOST_DEVICE inline uint32_t Entry(bool positive, int64_t index) {
  return (positive ? kSignBit : 0u) | (static_cast<uint32_t>(index) & kIndexMask);
}
JAXCOMM_HOST_DEVICE inline bool EntryPositive(uint32_t entry) { return (entry & kSignBit) != 0; }
JAXCOMM_HOST_DEVICE inline int64_t EntryIndex(uint32_t entry) { return entry & kIndexMask; }

// splitmix64: the deterministic hash behind every sampled estimate, so the NumPy references
// in tests/ can reproduce the sample exactly.
JAXCOMM_HOST_DEVICE inline uint64_t Mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Position of the j-th sample (with replacement) inside column `column` of `length` elements.
JAXCOMM_HOST_DEVICE inline int64_t SamplePosition(int64_t column, int64_t j, int64_t length) {
  return static_cast<int64_t>(
      Mix((static_cast<uint64_t>(column) << 32) | static_cast<uint64_t>(j)) %
      static_cast<uint64_t>(length));
}

}  // namespace jaxcomm::kernels::wire
