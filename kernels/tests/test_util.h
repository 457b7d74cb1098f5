// Helpers shared by the kernel unit tests (kernels/tests/*_test.cc).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/quantize_status.h"

namespace jaxcomm::kernels {

// n draws from a normal distribution with mean 0 and standard deviation `scale`; the same
// vector for the same seed, e.g. RandomVector(4096, 7, 0.01f).
inline std::vector<float> RandomVector(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& e : v) e = dist(gen);
  return v;
}

// What a quantizer's compress call produced: the packed buffer, the new residual and the status.
struct CompressOutput {
  std::vector<uint32_t> packed;
  std::vector<float> residual;
  QuantizeStatus status;
};

}  // namespace jaxcomm::kernels
