// Static argument checks of the compression ops, shared by the CPU handlers (ffi/*.cc) and the
// CUDA handlers (ffi/cuda/compress.cc): one definition of each op's name, rules and messages,
// so both platforms accept the same calls and reject the others with the same words.
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

}  // namespace jaxcomm::compress_checks
