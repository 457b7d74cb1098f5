// Outcome of a quantizer call. Quantizers cannot encode NaN or Inf (a single one would poison
// its column's reconstruction values or hide in the residual forever), so they report where
// the first one is and let the caller turn that into an error of its own kind.
#pragma once

#include <cstdint>
#include <vector>

// 1 where the quantizers' AVX2 loops are compiled (x86-64 with GCC or Clang); whether they run is
// QuantizersUseAvx2().
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JAXCOMM_QUANTIZERS_X86 1
#else
#define JAXCOMM_QUANTIZERS_X86 0
#endif

namespace jaxcomm::kernels {

struct QuantizeStatus {
  // Smallest flat index i with a non-finite x[i] + residual_in[i], or -1 when all are finite.
  int64_t nonfinite_index = -1;

  bool ok() const { return nonfinite_index < 0; }
};

// The status of a compress run as tasks over ascending index ranges, from each task's first
// non-finite index (-1 when it found none): the first task's hit is the least index.
QuantizeStatus FirstNonFiniteOfTasks(const std::vector<int64_t>& first_bad);

// Bits of |v| compare like |v| for finite floats; every non-finite value has a key at or
// above kNonFiniteKey (Inf exactly, NaN above), so one integer max detects both.
constexpr uint32_t kNonFiniteKey = 0x7f800000u;

// Whether the quantizers may take their AVX2 loops (the CPU has AVX2 and no test forced the
// portable ones). Both paths perform the same float operations in the same order, so the bytes
// they produce are equal; the switch exists so that tests can check exactly that.
bool QuantizersUseAvx2();
void ForcePortableQuantizersForTesting(bool portable);

}  // namespace jaxcomm::kernels
