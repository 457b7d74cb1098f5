#include <iterator>

#include "kernels/cuda_kernels.h"
#include "kernels/cuda_quantizer_table.h"

namespace jaxcomm::kernels::cuda {
namespace {

// Every quantizer with CUDA kernels: one line each (the entries are defined beside their
// kernels and declared in kernels/cuda_kernels.h). A kind of the CPU table that is missing here
// runs on CPU only: the GPU handlers refuse it (kernels/tests/quantizer_table_test.cc checks
// that every CPU entry has one).
const CudaQuantizer* const kTable[] = {
    &kOneBitCudaQuantizer,
    &kThresholdCudaQuantizer,
    &kAdaptiveCudaQuantizer,
    &kBlockCudaQuantizer,
};

}  // namespace

CudaQuantizerList CudaQuantizers() { return {kTable, std::size(kTable)}; }

}  // namespace jaxcomm::kernels::cuda
