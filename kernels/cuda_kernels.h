// CUDA versions of the compression kernels (plain CUDA over device pointers, no JAX).
//
// Every function enqueues its work on `stream` and returns at once: nothing here synchronizes
// the stream or allocates device memory. Working memory comes from the caller (XLA's
// ScratchAllocator in ffi/cuda/) and is sized by the matching *ScratchBytes function.
//
// Outputs are bit-identical to the CPU kernels of the same name (kernels/*.h): same wire format,
// same tie-breaking toward the lower index, same float operations in the same order (the
// OneBit exact means replay the CPU's 8-lane double summation).
//
// Data errors (a NaN/Inf that a quantizer cannot encode, a corrupt packed buffer) cannot be
// reported to the host without synchronizing, so the GPU versions make them visible in the
// data instead:
// - compress: packed[0] = 0, a header no decompress accepts (the CPU decompress raises, the GPU
//   one decodes it to all-NaN); residual_out is then unspecified, as on the CPU.
// - decompress / sparse merge: the float outputs are filled with NaN.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace jaxcomm::kernels::cuda {

// The quantizers' entries of the CUDA quantizer table (kernels/cuda_quantizer_table.h), each
// declared in its quantizer's section below and defined beside its kernels.
struct CudaQuantizer;

// Pieces carved out of one block of scratch memory start at multiples of 256 bytes (what
// cudaMalloc and XLA's ScratchAllocator return): `bytes` rounded up to that.
inline size_t AlignUp(size_t bytes) { return (bytes + 255) & ~size_t{255}; }

// *dst = value, enqueued (for headers whose value the host knows). Source of this and of
// PoisonIfBad: kernels/cuda_common.cu.
cudaError_t WriteWord(uint32_t* dst, uint32_t value, cudaStream_t stream);

// dense[0, n) = NaN when *bad != 0: the GPU form of a CPU data error (a corrupt message, an
// index out of range), which cannot reach the host without synchronizing.
cudaError_t PoisonIfBad(const uint32_t* bad, float* dense, int64_t n, cudaStream_t stream);

// ---- magnitude top-k (kernels/topk.h) ---------------------------------------------------
// Same contract as kernels::TopKAbs: the k entries of largest MagnitudeKey(acc), acc = x +
// residual_in (or x when residual_in is null), ties toward the lower index, indices ascending,
// residual_out (may alias residual_in, may be null) = acc with the selected entries zeroed.
// Exact radix select over the 31-bit keys (three histogram passes), then a stable compaction.
// Requires 1 <= k <= n < 2^31.
size_t TopKScratchBytes(int64_t n);
cudaError_t TopKAbs(const float* x, const float* residual_in, int64_t n, int64_t k,
                    int32_t* indices, float* values, float* residual_out, void* scratch,
                    cudaStream_t stream);

// x_hat = scatter-add of a TopK packed buffer of `words` = 1 + 2k words. All-NaN when
// packed[0] != words or an index is outside [0, n).
size_t TopKDecompressScratchBytes();
cudaError_t TopKDecompress(const uint32_t* packed, int64_t words, int64_t n, float* x_hat,
                           void* scratch, cudaStream_t stream);

// ---- the ⊤ merge of gTop-k (kernels/sparse_merge.h) --------------------------------------
// Same contract as kernels::SparseMergeTopK for valid inputs (the caller checks
// 1 <= k <= max(ka, kb)). Inputs with a negative or non-ascending index give NaN values.
// out_* may alias the inputs: everything is read into scratch first.
size_t SparseMergeScratchBytes(int64_t ka, int64_t kb);
cudaError_t SparseMergeTopK(const int32_t* idx_a, const float* val_a, int64_t ka,
                            const int32_t* idx_b, const float* val_b, int64_t kb, int64_t k,
                            int32_t* out_idx, float* out_val, void* scratch, cudaStream_t stream);

// ---- one-bit quantization (kernels/onebit.h) ---------------------------------------------
// No scratch: a failure is written into packed[0] by the column that finds it.
cudaError_t OneBitCompress(const float* x, const float* residual_in, int64_t n, int64_t column_size,
                           int64_t sample_size, uint32_t* packed, float* residual_out,
                           cudaStream_t stream);
cudaError_t OneBitDecompress(const uint32_t* packed, int64_t words, int64_t n, int64_t column_size,
                             float* x_hat, cudaStream_t stream);
extern const CudaQuantizer kOneBitCudaQuantizer;  // kernels/quantize.cu

// ---- threshold quantization (kernels/threshold.h) ----------------------------------------
size_t ThresholdScratchBytes(int64_t n);
cudaError_t ThresholdCompress(const float* x, const float* residual_in, int64_t n, float tau,
                              int64_t capacity, uint32_t* packed, float* residual_out,
                              void* scratch, cudaStream_t stream);
size_t ThresholdDecompressScratchBytes();
cudaError_t ThresholdDecompress(const uint32_t* packed, int64_t words, int64_t n, float tau,
                                float* x_hat, void* scratch, cudaStream_t stream);
extern const CudaQuantizer kThresholdCudaQuantizer;  // kernels/quantize.cu

// ---- sparse collectives (ffi/cuda/topk_allgather.cc, ffi/cuda/gtopk.cc) ------------------
// The dense-side steps of TopK-allgather and gTop-k over sparse sets (k ascending indices, k
// values). One thread per entry and plain (non-atomic) read-modify-writes: the indices of one
// set are distinct, so each element is touched at most once per launch, and launches on one
// stream run in order, so the float operations per element happen in the CPU's order.
// Indices outside [0, n) are skipped (never written); the scatters also set *bad = 1 for them
// (the caller zeroes *bad and later calls PoisonIfBad, the GPU form of the CPU's error).
// Source: kernels/sparse_collectives.cu.

// dense[idx[j]] += val[j] for j < k (kernels::ScatterAdd, the CPU TopKAllgather's sum).
cudaError_t ScatterAddSparse(const int32_t* idx, const float* val, int64_t k, float* dense,
                             int64_t n, uint32_t* bad, cudaStream_t stream);

// dense[idx[j]] = val[j] for j < k (the CPU gTop-k's summed = global set).
cudaError_t ScatterSetSparse(const int32_t* idx, const float* val, int64_t k, float* dense,
                             int64_t n, uint32_t* bad, cudaStream_t stream);

// The entries of (a + b) that a ⊤ merge did not keep in `out` (CollectDropped of ffi/gtopk.cc),
// in ka + kb fixed slots: slot i < ka holds a[i] (value val_a[i] + val_b[j] when b has the
// same index at j: the sum exactly as SparseMergeTopK forms it), slot ka + j holds b[j] when a
// lacks its index. A slot gets index -1 when its entry is in `out` or is b's half of a shared
// index. All three sets ascending by index.
cudaError_t CollectDropped(const int32_t* idx_a, const float* val_a, int64_t ka,
                           const int32_t* idx_b, const float* val_b, int64_t kb,
                           const int32_t* out_idx, int64_t k_out, int32_t* dropped_idx,
                           float* dropped_val, cudaStream_t stream);

// Which entries AddBySet adds: those whose index is in the set, or those whose index is not.
enum class SetSide { kOutside, kInside };

// dense[idx[j]] += val[j] for each j < count whose index is (kInside) or is not (kOutside) in
// the ascending set `set_idx[set_k]`. gTop-k uses both: kOutside for Alg. 4 line 10 (local
// values outside the global set go back into the residual), kInside for one merge step's
// dropped partial sums at indices of the global set. Negative indices are empty slots and
// skipped.
cudaError_t AddBySet(SetSide side, const int32_t* idx, const float* val, int64_t count,
                     const int32_t* set_idx, int64_t set_k, float* dense, int64_t n,
                     cudaStream_t stream);

// ---- adaptive quantization (kernels/adaptive.h) ------------------------------------------
// Same contract as kernels::AdaptiveCompress with layout {n, column_size, proportion}: packed
// (AdaptiveLayout::PackedWords() words) and residual_out (may alias residual_in, not x) are
// bit-identical to the CPU kernel's, in exact (sample_size == 0) and sampled mode. residual_in
// may be null (acc = x). A NaN/Inf in acc gives packed[0] = 0 (the rest of packed and
// residual_out unspecified). One block per column selects each sign's threshold with a radix
// select over the column (or its sample), emits the entries in index order into scratch and
// replays the CPU's sequential double sums for the means; a scan over the columns then places
// the entries. Requires 1 <= n < 2^31, column_size >= 1, finite proportion >= 1,
// 0 <= sample_size < 2^31 and PackedWords() < 2^32 (what the FFI handlers check).
size_t AdaptiveCompressScratchBytes(int64_t n, int64_t column_size, double proportion,
                                    int64_t sample_size);
cudaError_t AdaptiveCompress(const float* x, const float* residual_in, int64_t n,
                             int64_t column_size, double proportion, int64_t sample_size,
                             uint32_t* packed, float* residual_out, void* scratch,
                             cudaStream_t stream);

// Decodes packed[0 .. used) of a buffer of `words` words into x_hat (n floats): entries get
// their column's mean of their sign, other elements 0; with accumulate, x_hat += decoded
// instead (the reduce step of a quantized allreduce). A message kernels::AdaptiveDecompress
// rejects (used outside [HeaderWords(), words], an index >= n or not ascending, a column over
// its capacity) makes all of x_hat NaN, with or without accumulate.
size_t AdaptiveDecompressScratchBytes();
cudaError_t AdaptiveDecompress(const uint32_t* packed, int64_t words, int64_t n,
                               int64_t column_size, double proportion, float* x_hat,
                               bool accumulate, void* scratch, cudaStream_t stream);
extern const CudaQuantizer kAdaptiveCudaQuantizer;  // kernels/adaptive.cu

// ---- block int8/int4 quantization (kernels/blockquant.h) ----------------------------------
// Same contract as kernels::BlockQuantCompress: packed (BlockQuantPackedWords words) and
// residual_out (may be null; may alias residual_in, not x) byte-identical to the CPU's.
// residual_in may be null (acc = x). The stochastic rounding's step is `step`, or, when
// `device_step` is not null, the int32 it points to in device memory (so a traced step needs
// no host round trip). A NaN/Inf in acc gives packed[0] = 0. No scratch.
cudaError_t BlockQuantCompress(const float* x, const float* residual_in, int64_t n, int64_t block,
                               int64_t bits, bool stochastic, uint32_t seed, uint32_t step,
                               const int32_t* device_step, uint32_t stream_id, int64_t first_index,
                               uint32_t* packed, float* residual_out, cudaStream_t stream);
// Decodes (x_hat = decoded) or accumulates (x_hat += decoded, the CPU's float add) a message
// of `words` words for n elements; a header other than BlockQuantPackedWords or a scale that
// is not finite and >= 0 makes all of x_hat NaN. Scratch of BlockQuantDecompressScratchBytes().
size_t BlockQuantDecompressScratchBytes();
cudaError_t BlockQuantDecompress(const uint32_t* packed, int64_t words, int64_t n, int64_t block,
                                 int64_t bits, float* x_hat, bool accumulate, void* scratch,
                                 cudaStream_t stream);
extern const CudaQuantizer kBlockCudaQuantizer;  // kernels/blockquant.cu

// ---- quantized allreduce building blocks (ffi/cuda/quantized_allreduce.cc) ----------------
// The reduce step of the quantized allreduce decodes a message INTO a running sum:
// x_hat[i] += decoded[i], the very float add of the CPU's kernels::DequantizeAccumulate
// (kernels/quantized_slices.cc), so sums accumulated in the same order are bit-identical.
// A malformed message (the same checks as the plain decompress above) makes all of x_hat NaN.

// OneBitDecompress with accumulate (CPU: OneBitDecompress into scratch, then AddInto).
cudaError_t OneBitDecompressAccumulate(const uint32_t* packed, int64_t words, int64_t n,
                                       int64_t column_size, float* x_hat, cudaStream_t stream);
// ThresholdDecompress with accumulate (CPU: out[index] += +-tau per entry); scratch of
// ThresholdDecompressScratchBytes().
cudaError_t ThresholdDecompressAccumulate(const uint32_t* packed, int64_t words, int64_t n,
                                          float tau, float* x_hat, void* scratch,
                                          cudaStream_t stream);

// dst[i] += src[i] for i < n (kernels::AddInto, kernels/reduce.h). No-op for n == 0.
cudaError_t AddInto(float* dst, const float* src, int64_t n, cudaStream_t stream);
// out[i] = a[i] + b[i] for i < n (the acc = x + residual of ffi/quantized_allreduce.cc's
// HierarchicalQuantizedImpl). out may alias a or b. No-op for n == 0.
cudaError_t AddVectors(const float* a, const float* b, int64_t n, float* out, cudaStream_t stream);

}  // namespace jaxcomm::kernels::cuda
