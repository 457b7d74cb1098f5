#include "kernels/quantizer_table.h"

#include <iterator>

#include "kernels/adaptive.h"
#include "kernels/blockquant.h"
#include "kernels/onebit.h"
#include "kernels/threshold.h"

namespace jaxcomm::kernels {
namespace {

// Every quantizer of the quantized allreduce: one line each (the entries are defined beside
// their kernels and declared in their headers). Kind numbers and names must be unique
// (kernels/tests/quantizer_table_test.cc checks).
const Quantizer* const kTable[] = {
    &kOneBitQuantizer,
    &kThresholdQuantizer,
    &kAdaptiveQuantizer,
    &kBlockQuantizer,
};

}  // namespace

QuantizerList Quantizers() { return {kTable, std::size(kTable)}; }

const float* ResidualOrZeros(const float* residual_in, int64_t n) {
  if (residual_in != nullptr) return residual_in;
  thread_local std::vector<float> zeros;
  zeros.assign(static_cast<size_t>(n), 0.0f);
  return zeros.data();
}

}  // namespace jaxcomm::kernels
