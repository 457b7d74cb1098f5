// The CUDA half of the quantizer table (kernels/quantizer_table.h: read its comment first).
// Each quantizer defines one CudaQuantizer entry beside its CUDA kernels (kernels/quantize.cu,
// kernels/adaptive.cu, kernels/blockquant.cu) and declares it in kernels/cuda_kernels.h;
// kernels/cuda_quantizer_table.cu lists them. ffi/cuda/quantized_allreduce.cc dispatches
// through this table. CUDA builds only (JAXCOMM_WITH_CUDA).
//
// Every function enqueues on `stream` and returns at once (kernels/cuda_kernels.h): a data
// error becomes NaN in the results rather than an error code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/quantized_slices.h"
#include "kernels/quantizer_table.h"

namespace jaxcomm::kernels::cuda {

// One quantizer on the device: kernels::Quantizer's quantize and dequantize-accumulate, with
// the scratch they take. The shared code handles the empty slice, so n >= 1 here.
struct CudaQuantizer {
  // The entry's kernels::Quantizer::kind (the CPU table holds the name, checks and sizes).
  QuantizerKind kind;
  // Scratch bytes of `quantize` for a slice of n >= 1 elements.
  size_t (*quantize_scratch_bytes)(const QuantizerSpec& spec, int64_t n);
  // Scratch bytes of `dequantize_accumulate` (any n).
  size_t (*decode_scratch_bytes)(const QuantizerSpec& spec);
  // kernels::QuantizeSlice on the device, n >= 1: acc = x + residual_in (residual_in may be
  // null: acc = x) into packed (QuantizedPackedWords(spec, n) words) and residual_out = acc -
  // decoded (may alias residual_in, not x); byte-identical to the CPU entry's output. A
  // NaN/Inf in acc gives packed[0] = 0.
  cudaError_t (*quantize)(const QuantizerSpec& spec, const float* x, const float* residual_in,
                          int64_t n, uint32_t* packed, float* residual_out, void* scratch,
                          cudaStream_t stream);
  // kernels::DequantizeAccumulate on the device, n >= 1: out[i] += decoded[i] for a message
  // held in `words` words (its static capacity; the decoders read only `used` of them). A
  // malformed message makes all of out NaN.
  cudaError_t (*dequantize_accumulate)(const QuantizerSpec& spec, const uint32_t* packed,
                                       int64_t words, int64_t n, float* out, void* scratch,
                                       cudaStream_t stream);
};

using CudaQuantizerList = EntryList<CudaQuantizer>;
CudaQuantizerList CudaQuantizers();

// The CUDA entry of `kind`, or null when that quantizer has no CUDA kernels.
inline const CudaQuantizer* FindCudaQuantizer(QuantizerKind kind) {
  return CudaQuantizers().Find(kind);
}

}  // namespace jaxcomm::kernels::cuda
