#include "kernels/quantize_status.h"

#include <atomic>

namespace jaxcomm::kernels {
namespace {

std::atomic<bool> force_portable{false};

bool CpuHasAvx2() {
#if JAXCOMM_QUANTIZERS_X86
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  return has_avx2;
#else
  return false;
#endif
}

}  // namespace

QuantizeStatus FirstNonFiniteOfTasks(const std::vector<int64_t>& first_bad) {
  QuantizeStatus status;
  for (int64_t bad : first_bad) {
    if (bad >= 0) {
      status.nonfinite_index = bad;
      break;
    }
  }
  return status;
}

bool QuantizersUseAvx2() { return CpuHasAvx2() && !force_portable.load(std::memory_order_relaxed); }

void ForcePortableQuantizersForTesting(bool portable) {
  force_portable.store(portable, std::memory_order_relaxed);
}

}  // namespace jaxcomm::kernels
