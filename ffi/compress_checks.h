// Static argument checks and bindings of the compression ops, shared by the CPU handlers
// (ffi/*.cc) and the CUDA handlers (ffi/cuda/compress.cc): one definition of each op's name,
// arguments, rules and messages, so both platforms bind the same call and accept or reject it
// with the same words.
//
// Every check looks at sizes and attributes only, never at buffer contents (the GPU handlers
// cannot read device memory without synchronizing), and returns ffi::Error::Success() or an
// InvalidArgument prefixed with the op's Python name. Checks of the data itself (a NaN, a
// corrupt packed buffer) stay with each platform's kernel: an error on the CPU, NaN in the
// outputs on the GPU (kernels/cuda_kernels.h).
//
// The CPU handlers (ffi/onebit.cc, threshold.cc, adaptive.cc, topk.cc, sparse_merge.cc) are
// defined inside this namespace, so they use its op names and checks by their plain names.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "ffi/common.h"
#include "kernels/adaptive.h"
#include "kernels/onebit.h"
#include "kernels/wire.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::compress_checks {

namespace ffi = xla::ffi;
using ffi_common::CheckElementCount;
using ffi_common::InvalidArgument;
using ffi_common::NumElements;
using kernels::wire::kMaxElements;

constexpr char kTopKAbsOp[] = "jaxcomm.ops.topk_abs";
constexpr char kTopKCompressOp[] = "jaxcomm.ops.compress(TopK)";
constexpr char kTopKDecompressOp[] = "jaxcomm.ops.decompress(TopK)";
constexpr char kSparseMergeOp[] = "jaxcomm.ops.sparse_merge";
constexpr char kOneBitCompressOp[] = "jaxcomm.ops.compress(OneBit)";
constexpr char kOneBitDecompressOp[] = "jaxcomm.ops.decompress(OneBit)";
constexpr char kThresholdCompressOp[] = "jaxcomm.ops.compress(Threshold)";
constexpr char kThresholdDecompressOp[] = "jaxcomm.ops.decompress(Threshold)";
constexpr char kAdaptiveCompressOp[] = "jaxcomm.ops.compress(Adaptive)";
constexpr char kAdaptiveDecompressOp[] = "jaxcomm.ops.decompress(Adaptive)";

// Every compress op: residual and new_residual have x's n elements.
inline ffi::Error ResidualShape(const char* op, int64_t n, int64_t residual, int64_t new_residual) {
  if (residual != n || new_residual != n)
    return InvalidArgument(op, "residual must have x's shape");
  return ffi::Error::Success();
}

// ---- TopK ---------------------------------------------------------------------------------

// topk_abs: k = values' size, indices of the same size.
inline ffi::Error TopKAbs(int64_t n, int64_t k, int64_t indices) {
  JAXCOMM_RETURN_IF_ERROR(CheckElementCount(kTopKAbsOp, n));
  if (k < 1 || k > n) return InvalidArgument(kTopKAbsOp, "k must be in [1, x.size]");
  if (indices != k) return InvalidArgument(kTopKAbsOp, "values/indices size mismatch");
  return ffi::Error::Success();
}

// A TopK packed buffer of n elements: 1 + 2k words with 1 <= k <= n.
inline ffi::Error TopKPacked(const char* op, int64_t n, int64_t words) {
  const int64_t k = (words - 1) / 2;
  if (words % 2 != 1 || k < 1 || k > n) return InvalidArgument(op, "bad packed size");
  return ffi::Error::Success();
}

inline ffi::Error TopKCompress(int64_t n, int64_t residual, int64_t new_residual, int64_t words) {
  JAXCOMM_RETURN_IF_ERROR(ResidualShape(kTopKCompressOp, n, residual, new_residual));
  JAXCOMM_RETURN_IF_ERROR(CheckElementCount(kTopKCompressOp, n));
  return TopKPacked(kTopKCompressOp, n, words);
}

inline ffi::Error TopKDecompress(int64_t n, int64_t words) {
  return TopKPacked(kTopKDecompressOp, n, words);
}

// ---- sparse merge -------------------------------------------------------------------------

// Value arrays as long as their index arrays, idx/val outputs of k, 1 <= k <= max(ka, kb) (the
// same message as kernels::SparseMergeTopK, which checks k again).
inline ffi::Error SparseMerge(int64_t ka, int64_t val_a, int64_t kb, int64_t val_b, int64_t k,
                              int64_t val) {
  if (val_a != ka) {
    return InvalidArgument(kSparseMergeOp, "val_a has " + std::to_string(val_a) +
                                               " elements but idx_a has " + std::to_string(ka));
  }
  if (val_b != kb) {
    return InvalidArgument(kSparseMergeOp, "val_b has " + std::to_string(val_b) +
                                               " elements but idx_b has " + std::to_string(kb));
  }
  if (val != k) return InvalidArgument(kSparseMergeOp, "idx/val size mismatch");
  if (k < 1 || k > std::max(ka, kb)) {
    return InvalidArgument(kSparseMergeOp,
                           "k = " + std::to_string(k) + " must be in [1, max(ka, kb)] = [1, " +
                               std::to_string(std::max(ka, kb)) +
                               "] so that the union of the inputs always holds k entries");
  }
  return ffi::Error::Success();
}

// The opening of both sparse merge handlers: the input lengths ka, kb and the output length k
// (not an attribute: the length of the buffers the caller asked for), checked by SparseMerge.
struct SparseMergeSizes {
  int64_t ka = 0, kb = 0, k = 0;
};
inline ffi::Error CheckSparseMerge(const ffi::Buffer<ffi::S32>& idx_a,
                                   const ffi::Buffer<ffi::F32>& val_a,
                                   const ffi::Buffer<ffi::S32>& idx_b,
                                   const ffi::Buffer<ffi::F32>& val_b,
                                   ffi::ResultBuffer<ffi::S32> idx, ffi::ResultBuffer<ffi::F32> val,
                                   SparseMergeSizes* sizes) {
  *sizes = {NumElements(idx_a), NumElements(idx_b), NumElements(*idx)};
  return SparseMerge(sizes->ka, NumElements(val_a), sizes->kb, NumElements(val_b), sizes->k,
                     NumElements(*val));
}

// GPU only: the CUDA merge counts the union in 32-bit integers.
inline ffi::Error SparseMergeDeviceLimit(int64_t ka, int64_t kb) {
  if (ka + kb > kMaxElements) return InvalidArgument(kSparseMergeOp, "ka + kb must be below 2**31");
  return ffi::Error::Success();
}

// ---- OneBit -------------------------------------------------------------------------------

inline ffi::Error OneBitParams(const char* op, int64_t n, int64_t column_size,
                               int64_t sample_size) {
  JAXCOMM_RETURN_IF_ERROR(CheckElementCount(op, n, 1));
  if (column_size < 32 || column_size % 32 != 0) {
    return InvalidArgument(
        op, "column_size must be a positive multiple of 32, got " + std::to_string(column_size));
  }
  if (sample_size < 0) {
    return InvalidArgument(op, "sample_size must be >= 0, got " + std::to_string(sample_size));
  }
  return ffi::Error::Success();
}

// Requires OneBitParams to have passed.
inline ffi::Error OneBitPacked(const char* op, int64_t words, int64_t n, int64_t column_size) {
  const int64_t expected = kernels::OneBitPackedWords(n, column_size);
  if (words != expected) {
    return InvalidArgument(op, "packed has " + std::to_string(words) + " words, OneBit(" +
                                   std::to_string(column_size) + ") packs " + std::to_string(n) +
                                   " elements into " + std::to_string(expected));
  }
  return ffi::Error::Success();
}

inline ffi::Error OneBitCompress(int64_t n, int64_t column_size, int64_t sample_size,
                                 int64_t residual, int64_t new_residual, int64_t words) {
  JAXCOMM_RETURN_IF_ERROR(OneBitParams(kOneBitCompressOp, n, column_size, sample_size));
  JAXCOMM_RETURN_IF_ERROR(ResidualShape(kOneBitCompressOp, n, residual, new_residual));
  return OneBitPacked(kOneBitCompressOp, words, n, column_size);
}

inline ffi::Error OneBitDecompress(int64_t n, int64_t column_size, int64_t sample_size,
                                   int64_t words) {
  JAXCOMM_RETURN_IF_ERROR(OneBitParams(kOneBitDecompressOp, n, column_size, sample_size));
  return OneBitPacked(kOneBitDecompressOp, words, n, column_size);
}

// ---- Threshold ----------------------------------------------------------------------------

// n, tau and the packed length (1 + capacity, 1 <= capacity <= n) of both directions.
inline ffi::Error Threshold(const char* op, int64_t n, float tau, int64_t words) {
  JAXCOMM_RETURN_IF_ERROR(CheckElementCount(op, n, 1));
  if (!(std::isfinite(tau) && tau > 0.0f)) {
    return InvalidArgument(op, "tau must be finite and > 0, got " + std::to_string(tau));
  }
  if (words < 2 || words - 1 > n) {
    return InvalidArgument(op, "packed must hold 1 + capacity words with 1 <= capacity <= " +
                                   std::to_string(n) + ", got " + std::to_string(words));
  }
  return ffi::Error::Success();
}

inline ffi::Error ThresholdCompress(int64_t n, float tau, int64_t words, int64_t residual,
                                    int64_t new_residual) {
  JAXCOMM_RETURN_IF_ERROR(Threshold(kThresholdCompressOp, n, tau, words));
  return ResidualShape(kThresholdCompressOp, n, residual, new_residual);
}

inline ffi::Error ThresholdDecompress(int64_t n, float tau, int64_t words) {
  return Threshold(kThresholdDecompressOp, n, tau, words);
}

// ---- Adaptive -----------------------------------------------------------------------------

// The parameters and the packed length shared by both directions; on success fills `layout`.
// Indices travel in 31 bits and `used` in one word, which bounds n and the length.
inline ffi::Error AdaptiveLayout(const char* op, int64_t n, double proportion, int64_t column_size,
                                 int64_t packed_words, kernels::AdaptiveLayout* layout) {
  JAXCOMM_RETURN_IF_ERROR(CheckElementCount(op, n, 1));
  if (!std::isfinite(proportion) || proportion < 1.0) {
    return InvalidArgument(op,
                           "proportion must be finite and >= 1, got " + std::to_string(proportion));
  }
  if (column_size < 1) {
    return InvalidArgument(op, "column_size must be >= 1, got " + std::to_string(column_size));
  }
  *layout = kernels::AdaptiveLayout{n, column_size, proportion};
  const int64_t expected = layout->PackedWords();
  if (expected > int64_t{std::numeric_limits<uint32_t>::max()}) {
    return InvalidArgument(op, "the packed buffer would need " + std::to_string(expected) +
                                   " words, more than word 0 can count; use a larger "
                                   "column_size or proportion");
  }
  if (packed_words != expected) {
    return InvalidArgument(
        op, "packed has " + std::to_string(packed_words) + " words but Adaptive(proportion=" +
                std::to_string(proportion) + ", column_size=" + std::to_string(column_size) +
                ") packs " + std::to_string(n) + " elements into " + std::to_string(expected));
  }
  return ffi::Error::Success();
}

inline ffi::Error AdaptiveCompress(int64_t n, int64_t residual, int64_t new_residual,
                                   double proportion, int64_t column_size, int64_t sample_size,
                                   int64_t packed_words, kernels::AdaptiveLayout* layout) {
  JAXCOMM_RETURN_IF_ERROR(ResidualShape(kAdaptiveCompressOp, n, residual, new_residual));
  if (sample_size < 0) {
    return InvalidArgument(kAdaptiveCompressOp,
                           "sample_size must be >= 0, got " + std::to_string(sample_size));
  }
  return AdaptiveLayout(kAdaptiveCompressOp, n, proportion, column_size, packed_words, layout);
}

inline ffi::Error AdaptiveDecompress(int64_t n, double proportion, int64_t column_size,
                                     int64_t packed_words, kernels::AdaptiveLayout* layout) {
  return AdaptiveLayout(kAdaptiveDecompressOp, n, proportion, column_size, packed_words, layout);
}

// GPU only: the CUDA kernel counts a column's sample in 32-bit integers. (The CPU kernel
// allocates sample_size floats per task instead, and reports running out of memory.)
inline ffi::Error AdaptiveDeviceSampleLimit(int64_t sample_size) {
  if (sample_size > kMaxElements) {
    return InvalidArgument(kAdaptiveCompressOp, "sample_size must be below 2**31 on the GPU, got " +
                                                    std::to_string(sample_size));
  }
  return ffi::Error::Success();
}

// ---- Bindings -----------------------------------------------------------------------------
// Each op's arguments, attributes and results in the order both its handlers take them,
// appended to `binding`, which holds the platform's context (CPU: the intra-op thread pool where
// the kernel splits its work; CUDA: XLA's stream, and scratch memory where the kernel needs it).
// XLA's bindings cannot be copied or moved into a parameter, only extended, hence the
// references.

// x and residual in: every compress op's data.
template <typename Binding>
auto BindCompressInputs(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // x: any shape, n elements
      .template Arg<ffi::Buffer<ffi::F32>>();  // residual: x's shape
}
// The packed words and the new residual out: every compress op's results.
template <typename Binding>
auto BindCompressResults(Binding&& binding) {
  return std::move(binding)
      .template Ret<ffi::Buffer<ffi::U32>>()   // packed words
      .template Ret<ffi::Buffer<ffi::F32>>();  // new_residual: aliased to residual
}
// The packed words in: every decompress op's data.
template <typename Binding>
auto BindPacked(Binding&& binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::U32>>();
}
// x_hat out (n elements, the decoded values): every decompress op's result.
template <typename Binding>
auto BindDecoded(Binding&& binding) {
  return std::move(binding).template Ret<ffi::Buffer<ffi::F32>>();
}

// topk_abs: x in; the top k by magnitude out (k: the results' length).
template <typename Binding>
auto BindTopKAbs(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()   // x: n-vector
      .template Ret<ffi::Buffer<ffi::F32>>()   // values: k, accumulated order
      .template Ret<ffi::Buffer<ffi::S32>>();  // indices: k, ascending
}
// TopK: no attributes (k follows from the packed length, 1 + 2k words).
template <typename Binding>
auto BindTopKCompress(Binding&& binding) {
  return BindCompressResults(BindCompressInputs(std::move(binding)));
}
template <typename Binding>
auto BindTopKDecompress(Binding&& binding) {
  return BindDecoded(BindPacked(std::move(binding)));
}

// OneBit: the column size (a multiple of 32) and the sample size (0 = exact column means),
// before the results.
template <typename Binding>
auto BindOneBitAttributes(Binding&& binding) {
  return std::move(binding)
      .template Attr<int64_t>("column_size")
      .template Attr<int64_t>("sample_size");
}
template <typename Binding>
auto BindOneBitCompress(Binding&& binding) {
  return BindCompressResults(BindOneBitAttributes(BindCompressInputs(std::move(binding))));
}
template <typename Binding>
auto BindOneBitDecompress(Binding&& binding) {
  return BindDecoded(BindOneBitAttributes(BindPacked(std::move(binding))));
}

// Threshold: tau (the threshold and the reconstruction magnitude), before the results.
template <typename Binding>
auto BindThresholdCompress(Binding&& binding) {
  return BindCompressResults(BindCompressInputs(std::move(binding)).template Attr<float>("tau"));
}
template <typename Binding>
auto BindThresholdDecompress(Binding&& binding) {
  return BindDecoded(BindPacked(std::move(binding)).template Attr<float>("tau"));
}

// Adaptive: after the results, π (f64, so counts match Python's), the column size and, for
// compress, the sample size (0 = exact selection).
template <typename Binding>
auto BindAdaptiveCompress(Binding&& binding) {
  return BindCompressResults(BindCompressInputs(std::move(binding)))
      .template Attr<double>("proportion")
      .template Attr<int64_t>("column_size")
      .template Attr<int64_t>("sample_size");
}
template <typename Binding>
auto BindAdaptiveDecompress(Binding&& binding) {
  return BindDecoded(BindPacked(std::move(binding)))
      .template Attr<double>("proportion")
      .template Attr<int64_t>("column_size");
}

// idx_a, val_a, idx_b, val_b in (the index arrays ascending); the top k of their sum out.
template <typename Binding>
auto BindSparseMerge(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()   // idx_a: ka, ascending
      .template Arg<ffi::Buffer<ffi::F32>>()   // val_a: ka
      .template Arg<ffi::Buffer<ffi::S32>>()   // idx_b: kb, ascending
      .template Arg<ffi::Buffer<ffi::F32>>()   // val_b: kb
      .template Ret<ffi::Buffer<ffi::S32>>()   // idx: k, ascending
      .template Ret<ffi::Buffer<ffi::F32>>();  // val: k, sums at idx
}

}  // namespace jaxcomm::compress_checks
