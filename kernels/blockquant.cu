// Block-wise int8/int4 quantization on the GPU, byte-identical to kernels/blockquant.cc: the
// same scale (absmax / qmax), inverse (1 / scale), products and roundings, each an explicitly
// rounded IEEE operation (__fmul_rn, __fadd_rn: nvcc would otherwise contract a * b + c into
// an FMA, which rounds once where the CPU rounds twice). rintf is round-half-even like the
// CPU's magic-number rounding; the stochastic floor is the CPU's trunc((t + u) + 256) - 256.
#include <cfloat>
#include <cub/block/block_reduce.cuh>

#include "kernels/blockquant.h"
#include "kernels/cuda_common.cuh"
#include "kernels/cuda_kernels.h"
#include "kernels/cuda_quantizer_table.h"
#include "kernels/quantized_slices.h"

namespace jaxcomm::kernels::cuda {
namespace {

using detail::GridFor;
using detail::kNonFiniteKey;
using detail::MagnitudeKey;

constexpr int kThreads = 256;

struct MaxOp {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
};

__device__ __forceinline__ float Acc(const float* x, const float* r, int64_t i) {
  return r != nullptr ? __fadd_rn(x[i], r[i]) : x[i];
}

// One thread block per quantization block: its scale (0 below FLT_MIN), or packed[0] = 0 when
// it holds a NaN/Inf (the GPU form of the CPU's error, kernels/cuda_kernels.h).
__global__ void __launch_bounds__(kThreads)
    ScaleKernel(const float* x, const float* r, int64_t n, int64_t block, float qmax,
                uint32_t* packed) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t b = blockIdx.x;
  const int64_t begin = b * block;
  const int64_t len = min(block, n - begin);
  uint32_t max_key = 0;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    max_key = max(max_key, MagnitudeKey(Acc(x, r, begin + i)));
  }
  max_key = Reduce(temp).Reduce(max_key, MaxOp());
  if (threadIdx.x != 0) return;
  if (max_key >= kNonFiniteKey) {
    packed[0] = 0;
    return;
  }
  float scale = __fdiv_rn(__uint_as_float(max_key), qmax);
  if (!(scale >= FLT_MIN)) scale = 0.0f;
  packed[wire::kHeaderWords + b] = __float_as_uint(scale);
}

// The code of element i (scales written by ScaleKernel) and its residual.
__device__ __forceinline__ int EncodeOne(const float* x, const float* r, int64_t i, int64_t block,
                                         const uint32_t* scales, float qmax, bool stochastic,
                                         uint32_t key, int64_t first_index, float* residual_out) {
  const float a = Acc(x, r, i);
  const float scale = __uint_as_float(scales[i / block]);
  const float inv = scale == 0.0f ? 0.0f : __fdiv_rn(1.0f, scale);
  const float t = __fmul_rn(a, inv);
  float q;
  if (stochastic) {
    // The CPU's floor: trunc((t + u) + 256) - 256, each operation rounded alike.
    const float y = __fadd_rn(t, BlockQuantUniform(key, static_cast<uint32_t>(first_index + i)));
    q = __fsub_rn(static_cast<float>(__float2int_rz(__fadd_rn(y, 256.0f))), 256.0f);
  } else {
    q = __fadd_rn(rintf(t), 0.0f);  // -0 -> +0, as the CPU's t + M - M gives
  }
  q = fminf(fmaxf(q, -qmax), qmax);
  if (residual_out != nullptr) residual_out[i] = __fsub_rn(a, __fmul_rn(q, scale));
  return static_cast<int>(q);
}

// One thread per code byte: element i (int8) or elements 2j, 2j + 1 (int4). residual_out may
// alias r: each element is read and written by the same thread.
__global__ void EncodeKernel(const float* x, const float* r, int64_t n, int64_t block, int64_t bits,
                             float qmax, bool stochastic, uint32_t seed, uint32_t step,
                             const int32_t* device_step, uint32_t stream, int64_t first_index,
                             uint32_t* packed, float* residual_out) {
  const uint32_t key = BlockQuantKey(
      seed, device_step != nullptr ? static_cast<uint32_t>(*device_step) : step, stream);
  const uint32_t* scales = packed + wire::kHeaderWords;
  uint8_t* bytes =
      reinterpret_cast<uint8_t*>(packed + wire::kHeaderWords + (n + block - 1) / block);
  const int64_t count = bits == 8 ? n : (n + 1) / 2;
  JAXCOMM_GRID_STRIDE(j, count) {
    if (bits == 8) {
      bytes[j] = static_cast<uint8_t>(static_cast<int8_t>(
          EncodeOne(x, r, j, block, scales, qmax, stochastic, key, first_index, residual_out)));
    } else {
      const int lo =
          EncodeOne(x, r, 2 * j, block, scales, qmax, stochastic, key, first_index, residual_out);
      const int hi = 2 * j + 1 < n ? EncodeOne(x, r, 2 * j + 1, block, scales, qmax, stochastic,
                                               key, first_index, residual_out)
                                   : 0;
      bytes[j] = static_cast<uint8_t>((lo & 0x0f) | ((hi & 0x0f) << 4));
    }
  }
}

// *bad = 1 when the header is not `words` or a scale is not finite and >= 0.
__global__ void CheckKernel(const uint32_t* packed, int64_t words, int64_t nblocks, uint32_t* bad) {
  JAXCOMM_GRID_STRIDE(b, nblocks) {
    const float s = __uint_as_float(packed[wire::kHeaderWords + b]);
    if (!(s >= 0.0f && s <= FLT_MAX)) *bad = 1;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && packed[0] != static_cast<uint32_t>(words)) *bad = 1;
}

__global__ void DecodeKernel(const uint32_t* packed, int64_t n, int64_t block, int64_t bits,
                             float* out, bool accumulate) {
  const uint32_t* scales = packed + wire::kHeaderWords;
  const uint8_t* bytes =
      reinterpret_cast<const uint8_t*>(packed + wire::kHeaderWords + (n + block - 1) / block);
  JAXCOMM_GRID_STRIDE(i, n) {
    int code;
    if (bits == 8) {
      code = static_cast<int8_t>(bytes[i]);
    } else {
      const uint8_t b = bytes[i / 2];
      code = i % 2 ? static_cast<int8_t>(b) >> 4 : static_cast<int8_t>(b << 4) >> 4;
    }
    const float d = __fmul_rn(static_cast<float>(code), __uint_as_float(scales[i / block]));
    out[i] = accumulate ? __fadd_rn(out[i], d) : d;
  }
}

}  // namespace

size_t BlockQuantDecompressScratchBytes() { return AlignUp(sizeof(uint32_t)); }

cudaError_t BlockQuantCompress(const float* x, const float* residual_in, int64_t n, int64_t block,
                               int64_t bits, bool stochastic, uint32_t seed, uint32_t step,
                               const int32_t* device_step, uint32_t stream_id, int64_t first_index,
                               uint32_t* packed, float* residual_out, cudaStream_t stream) {
  const int64_t words = BlockQuantPackedWords(n, block, bits);
  const int64_t nblocks = BlockQuantNumBlocks(n, block);
  const float qmax = bits == 8 ? 127.0f : 7.0f;
  if (cudaError_t e = WriteWord(packed, static_cast<uint32_t>(words), stream); e != cudaSuccess) {
    return e;
  }
  // The last code word's unused bytes are zero (int4 pairs write whole bytes, int8 not).
  if (cudaError_t e = cudaMemsetAsync(packed + words - 1, 0, sizeof(uint32_t), stream);
      e != cudaSuccess) {
    return e;
  }
  ScaleKernel<<<static_cast<unsigned>(nblocks), kThreads, 0, stream>>>(x, residual_in, n, block,
                                                                       qmax, packed);
  const int64_t count = bits == 8 ? n : (n + 1) / 2;
  EncodeKernel<<<GridFor(count, kThreads), kThreads, 0, stream>>>(
      x, residual_in, n, block, bits, qmax, stochastic, seed, step, device_step, stream_id,
      first_index, packed, residual_out);
  return cudaGetLastError();
}

cudaError_t BlockQuantDecompress(const uint32_t* packed, int64_t words, int64_t n, int64_t block,
                                 int64_t bits, float* x_hat, bool accumulate, void* scratch,
                                 cudaStream_t stream) {
  uint32_t* bad = static_cast<uint32_t*>(scratch);
  const int64_t nblocks = BlockQuantNumBlocks(n, block);
  if (cudaError_t e = cudaMemsetAsync(bad, 0, sizeof(uint32_t), stream); e != cudaSuccess) {
    return e;
  }
  const bool size_ok = words == BlockQuantPackedWords(n, block, bits);
  if (!size_ok) {
    if (cudaError_t e = WriteWord(bad, 1u, stream); e != cudaSuccess) return e;
  } else {
    CheckKernel<<<GridFor(nblocks, kThreads), kThreads, 0, stream>>>(packed, words, nblocks, bad);
    DecodeKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(packed, n, block, bits, x_hat,
                                                                accumulate);
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return PoisonIfBad(bad, x_hat, n, stream);
}

// ---- entry of the quantized allreduce (kernels/cuda_quantizer_table.h) -------------------
namespace {

// The spec's column_size is the block; step or device_step, stream and first_index are the
// stochastic rounding's counter. Takes a null residual_in itself (acc = x).
cudaError_t BlockQuantQuantizeSlice(const QuantizerSpec& spec, const float* x,
                                    const float* residual_in, int64_t n, uint32_t* packed,
                                    float* residual_out, void*, cudaStream_t stream) {
  return BlockQuantCompress(x, residual_in, n, spec.column_size, spec.bits, spec.stochastic,
                            spec.seed, spec.step, spec.device_step, spec.stream, spec.first_index,
                            packed, residual_out, stream);
}

cudaError_t BlockQuantDequantizeAccumulate(const QuantizerSpec& spec, const uint32_t* packed,
                                           int64_t words, int64_t n, float* out, void* scratch,
                                           cudaStream_t stream) {
  return BlockQuantDecompress(packed, words, n, spec.column_size, spec.bits, out,
                              /*accumulate=*/true, scratch, stream);
}

}  // namespace

const CudaQuantizer kBlockCudaQuantizer = {
    kBlockQuantKind,
    [](const QuantizerSpec&, int64_t) -> size_t { return 0; },
    [](const QuantizerSpec&) { return BlockQuantDecompressScratchBytes(); },
    BlockQuantQuantizeSlice,
    BlockQuantDequantizeAccumulate,
};

}  // namespace jaxcomm::kernels::cuda
