// Block-wise integer quantization (int8 or packed int4, one float scale per block) with fused
// error feedback: the compressor of DeepSpeed ZeRO++ qgZ, EQuARX and INTELLECT-1.
//
// Packed layout (jaxcomm/ops/compress.py, BlockQuant), nblocks = ceil(n / block):
//   [used = 1 + nblocks + ceil(n * bits / 32)] [nblocks x scale f32 bits] [codes]
// The codes are n two's-complement integers of `bits` bits, element i at byte i (int8) or at
// nibble i (int4: the low nibble of byte i / 2 for even i, the high one for odd i), bytes in
// little-endian order inside their words. Blocks are `block` consecutive elements; the last one
// may be shorter.
//
// Encoding of a block (symmetric absmax scaling), qmax = 2^(bits-1) - 1 (127 or 7):
//   scale = absmax / qmax (float32); inv = 1 / scale (float32);
//   t = acc[i] * inv; q = round(t) clamped to [-qmax, qmax]; decoded = float(q) * scale.
// A block whose scale is below FLT_MIN (all zeros, or only tiny values) is sent as scale 0
// and codes 0: 1 / scale would overflow, and error feedback keeps such values.
// round() is nearest (ties to even, the FPU's mode) or stochastic: floor(t + u) with u in
// [0, 1) from BlockQuantUniform(key, index), a counter-based hash of (seed, step, stream) and
// the element's index, so every run, rank and the NumPy reference draw the same u. The floor
// is computed as trunc((t + u) + 256) - 256 in float32 (positive, so truncation is floor; it
// vectorizes where a compare-and-correct floor does not): the extra rounding of the + 256
// moves a sum within 2^-16 below an integer up to it, a bias far below the scale's.
// Concretely, with float32 operations in this order:
//   nearest:    q = rint(t)
//   stochastic: q = trunc((t + u) + 256) - 256
// residual_out = acc - decoded, from the very floats that were encoded.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/parallel.h"
#include "kernels/quantize_status.h"
#include "kernels/quantized_slices.h"

#if defined(__CUDACC__)
#define JAXCOMM_BQ_HOST_DEVICE __host__ __device__
#else
#define JAXCOMM_BQ_HOST_DEVICE
#endif

namespace jaxcomm::kernels {

struct BlockQuantParams {
  int64_t block = 256;      // values per scale, >= 1
  int64_t bits = 8;         // 8 or 4
  bool stochastic = false;  // rounding: nearest (false) or stochastic
  // The stochastic rounding's counter: u of element i is BlockQuantUniform(key, first_index + i)
  // with key = BlockQuantKey(seed, step, stream).
  uint32_t seed = 0;
  uint32_t step = 0;
  uint32_t stream = 0;
  int64_t first_index = 0;
};

// Empty when usable, else what is wrong (for an error message naming the fix).
std::string CheckBlockQuantParams(const BlockQuantParams& params);

int64_t BlockQuantNumBlocks(int64_t n, int64_t block);

// Length in uint32 words of the packed buffer for n >= 1 elements (also the value of word 0).
int64_t BlockQuantPackedWords(int64_t n, int64_t block, int64_t bits);

// lowbias32 (Chris Wellons' integer hash): a bijection of uint32 with good avalanche, and
// cheap in SIMD (two 32-bit multiplies).
JAXCOMM_BQ_HOST_DEVICE inline uint32_t BlockQuantHash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The key of one (seed, step, stream): the stream separates the ranks' contributions and an
// owner's requantized sum within one step.
JAXCOMM_BQ_HOST_DEVICE inline uint32_t BlockQuantKey(uint32_t seed, uint32_t step,
                                                     uint32_t stream) {
  return BlockQuantHash(BlockQuantHash(BlockQuantHash(seed) ^ step) + 0x9e3779b9u * stream);
}

// u in [0, 1), a multiple of 2^-24 (exact in float32), of element `index` under `key`.
JAXCOMM_BQ_HOST_DEVICE inline float BlockQuantUniform(uint32_t key, uint32_t index) {
  // Through int32 (exact: < 2^24), which vectorizes where uint32 -> float does not.
  return static_cast<float>(
             static_cast<int32_t>(BlockQuantHash(BlockQuantHash(index ^ key) + key) >> 8)) *
         5.9604644775390625e-8f;  // 2^-24
}

// Quantizes acc = x + residual_in (residual_in may be null: acc = x) of 1 <= n < 2^31 elements
// into packed (BlockQuantPackedWords words) and, when residual_out is not null, writes
// residual_out = acc - decoded (may alias residual_in, not x). On a non-finite acc the status
// names its index (packed and residual_out are then unspecified). Valid params required.
QuantizeStatus BlockQuantCompress(const float* x, const float* residual_in, int64_t n,
                                  const BlockQuantParams& params, uint32_t* packed,
                                  float* residual_out, const TaskRunner& run = RunTasksSerially);

// Decodes a packed buffer of `words` words for n elements into out (out = decoded, or out +=
// decoded with accumulate: the reduce step of the quantized allreduce). Checks the header
// (used == words == BlockQuantPackedWords) and that every scale is finite and >= 0 before
// touching out; returns an empty string, or what is wrong with the message.
std::string BlockQuantDecompress(const uint32_t* packed, int64_t words, int64_t n,
                                 const BlockQuantParams& params, float* out, bool accumulate,
                                 const TaskRunner& run = RunTasksSerially);

// BlockQuant's kind number in the quantized allreduce's table (kernels/quantizer_table.h): what
// the "quantizer" FFI attribute carries for it. Its entries (CPU and CUDA) take it from here; no
// other quantizer may have it (kernels/tests/quantizer_table_test.cc checks).
inline constexpr QuantizerKind kBlockQuantKind{3};

// BlockQuant's entry of the quantized allreduce's table (kernels/quantizer_table.h).
struct Quantizer;
extern const Quantizer kBlockQuantizer;

}  // namespace jaxcomm::kernels
