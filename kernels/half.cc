#include "kernels/half.h"

#include <cstring>

#include "kernels/wire.h"

namespace jaxcomm::kernels {
namespace {

inline float Bf16ToFloat(uint16_t h) { return wire::BitsFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  const uint32_t bits = wire::FloatBits(f);
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit, then truncate.
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x0040u;  // NaN: keep it a (quiet) NaN
  // A select rather than an early return, so that FloatToHalf's loop vectorizes (2x).
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// IEEE binary16 through the compiler's _Float16 (GCC >= 12 and Clang on x86-64 and AArch64),
// whose conversions round to nearest even. Without F16C (x86-64 baseline) they are libgcc
// calls of ~7 ns per element, so the loops below have an x86-64-v3 clone (AVX2, F16C): 10x
// faster, and the same bits for every float and every 16-bit word (checked exhaustively).
inline float F16ToFloat(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, sizeof(v));
  return static_cast<float>(v);
}

inline uint16_t FloatToF16(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, sizeof(h));
  return h;
}

// The formats' conversions as types, so that each loop below is compiled once per format with
// its conversion inlined (and vectorized in the x86-64-v3 clone).
struct Bf16 {
  static float ToFloat(uint16_t h) { return Bf16ToFloat(h); }
  static uint16_t FromFloat(float f) { return FloatToBf16(f); }
};
struct F16 {
  static float ToFloat(uint16_t h) { return F16ToFloat(h); }
  static uint16_t FromFloat(float f) { return FloatToF16(f); }
};

// Runs element(i, Bf16{}) or element(i, F16{}) for every i < n: one branch per call, none per
// element. Inlined into each clone below, so that the loop is compiled (and vectorized) for
// that clone's instruction set.
template <typename Element>
__attribute__((always_inline)) inline void ForEach(HalfFormat format, int64_t n, Element element) {
  if (format == HalfFormat::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) element(i, Bf16{});
  } else {
    for (int64_t i = 0; i < n; ++i) element(i, F16{});
  }
}

}  // namespace

// Each conversion has an x86-64-v3 clone (AVX2, F16C): see F16ToFloat.
#define JAXCOMM_HALF_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define JAXCOMM_INLINE __attribute__((always_inline))

JAXCOMM_HALF_CLONES void HalfToFloat(HalfFormat format, const uint16_t* in, float* out, int64_t n) {
  ForEach(format, n, [&](int64_t i, auto codec) JAXCOMM_INLINE { out[i] = codec.ToFloat(in[i]); });
}

JAXCOMM_HALF_CLONES void AddHalfInto(HalfFormat format, float* __restrict acc,
                                     const uint16_t* __restrict in, int64_t n) {
  ForEach(format, n, [&](int64_t i, auto codec) JAXCOMM_INLINE { acc[i] += codec.ToFloat(in[i]); });
}

JAXCOMM_HALF_CLONES void FloatToHalf(HalfFormat format, const float* in, uint16_t* out, int64_t n) {
  ForEach(format, n,
          [&](int64_t i, auto codec) JAXCOMM_INLINE { out[i] = codec.FromFloat(in[i]); });
}

}  // namespace jaxcomm::kernels
